"""Test helpers: a tiny random Llama, a byte-level tokenizer built in code (no downloads), synthetic
articles and a tiny profile."""

from __future__ import annotations

import random

import numpy as np
import torch
from factories import array_profile

from lukv_cache.profiles import Profile
from lukv_cache.texts import Article

_WORDS = (
    "river",
    "mountain",
    "city",
    "people",
    "history",
    "language",
    "music",
    "science",
    "water",
    "light",
    "north",
    "south",
    "early",
    "later",
    "small",
    "large",
    "ancient",
    "modern",
    "famous",
    "common",
)


def byte_tokenizer():
    """Every byte is one token (GPT-2's byte alphabet, no merges) plus an end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    vocab["<|endoftext|>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


def tiny_llama(vocab_size: int = 257, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    model.config.name_or_path = "tests/tiny-llama"
    return model


def synthetic_articles(n: int = 6, paragraphs: int = 8, seed: int = 0) -> list[Article]:
    rng = random.Random(seed)
    articles = []
    for i in range(n):
        body = []
        for _ in range(paragraphs):
            sentences = [
                " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 12))).capitalize() + "."
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
