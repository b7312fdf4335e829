"""What the examples' ``--smoke`` runs use instead of SmolLM2 and real text (tests/test_examples.py runs them).

A tiny Llama with random weights (2 layers, 4 query / 2 KV heads), a byte-level tokenizer built in code,
synthetic prose, and a tiny keydiff profile in a temporary mirror named by ``$LUKV_PROFILE_DIR`` (standing
in for the SmolLM2 profiles shipped with lukv_cache). Nothing is downloaded. The answers are gibberish:
a smoke run checks that the code runs, not what it says.
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import tempfile

import numpy as np
import torch

TINY_ID = "lukv-examples/tiny-llama"  # the tiny model's profiles are looked up under this id
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16
_WORDS = "river city harbour ferry market north south early later small large ancient modern famous".split()


def tokenizer():
    """Every byte is one token (GPT-2's byte alphabet, no merges) plus an end-of-text token: 257 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


def model():
    """The tiny Llama, seeded (every call, and every tensor-parallel rank, gets the same weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=4096,
        eos_token_id=None,  # random weights must not stop early
        pad_token_id=256,
    )
    torch.manual_seed(0)
    tiny = LlamaForCausalLM(config).eval()
    tiny.set_attn_implementation("sdpa")
    tiny.config.name_or_path = TINY_ID
    tiny.generation_config.pad_token_id = 256
    return tiny


def load():
    """``(model, tokenizer)`` like ``lukv_cache.models.load_model("smollm2")``, with a tiny profile published."""
    publish_profile()
    return model(), tokenizer()


def text(chars: int = 1500, seed: int = 0) -> str:
    """Synthetic prose of about ``chars`` characters (one token a character with the byte tokenizer)."""
    rng = random.Random(seed)
    sentences = []
    while sum(map(len, sentences)) < chars:
        sentences.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 12))).capitalize() + ".")
    return " ".join(sentences)[:chars]


def profile():
    """A keydiff profile for the tiny model whose evict ratio differs per (layer, KV head)."""
    from lukv_cache import Profile

    grid = np.linspace(0.05, 0.95, 19, dtype=np.float32)
    spread = np.linspace(-0.04, 0.04, LAYERS * KV_HEADS, dtype=np.float32).reshape(LAYERS, KV_HEADS)
    ratios = np.clip(grid[:, None, None] + spread, 0.0, 0.99).astype(np.float32)
    return Profile(grid, ratios, model_id=TINY_ID, scorer="keydiff", head_dim=HEAD_DIM)


def publish_profile() -> str:
    """Write the tiny profile into a fresh temporary mirror and point ``$LUKV_PROFILE_DIR`` at it."""
    from lukv_cache.profiles import save_to_local_dir

    mirror = tempfile.mkdtemp(prefix="lukv-smoke-profiles-")
    atexit.register(shutil.rmtree, mirror, ignore_errors=True)
    save_to_local_dir(profile(), mirror)
    os.environ["LUKV_PROFILE_DIR"] = mirror
    return mirror


def save(folder: str) -> str:
    """Save the tiny model and its tokenizer into ``folder`` (what ``from_pretrained(folder)`` reads)."""
    model().save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder
