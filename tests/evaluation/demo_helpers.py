"""The evaluation tests' tiny Llama, synthetic articles and tiny profile, from ``lukv_cache.testing``."""

from __future__ import annotations

import random

import numpy as np

from lukv_cache.profiles import Profile
from lukv_cache.testing import BYTE_VOCAB, WORDS, array_profile, byte_tokenizer, tiny_model
from lukv_cache.texts import Article

__all__ = ["byte_tokenizer", "synthetic_articles", "tiny_llama", "tiny_profile"]


def tiny_llama(vocab_size: int = BYTE_VOCAB, layers: int = 2):
    """The tiny Llama the evaluation tests run, sized for the byte tokenizer by default."""
    return tiny_model(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        max_position_embeddings=2048,
        name_or_path="tests/tiny-llama",
    )


def synthetic_articles(n: int = 6, paragraphs: int = 8, seed: int = 0) -> list[Article]:
    """``n`` articles of ``paragraphs`` paragraphs of six seeded sentences (6-12 of ``WORDS`` each)."""
    rng = random.Random(seed)
    articles = []
    for i in range(n):
        body = []
        for _ in range(paragraphs):
            sentences = [
                " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 12))).capitalize() + "."
                for _ in range(6)
            ]
            body.append(" ".join(sentences))
        articles.append(Article(f"Synthetic {i}", "\n\n".join(body)))
    return articles


def tiny_profile(model, scorer: str = "keydiff") -> Profile:
    """A profile for the tiny model whose budgets differ from uniform."""
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    grid = np.array([0.1, 0.5, 0.9], dtype=np.float32)
    # Head 0 of every layer gives up more than head 1: budgets that differ from uniform.
    tilt = np.array([1.2, 0.8], dtype=np.float32)[:heads]
    evict = np.stack([np.clip(np.tile(g * tilt, (layers, 1)), 0, 0.99) for g in grid]).astype(np.float32)
    return array_profile(grid, evict, model_id=model.config.name_or_path, scorer=scorer, head_dim=16)
