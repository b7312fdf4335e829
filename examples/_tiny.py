"""What the examples' ``--smoke`` runs use instead of SmolLM2 and real text (tests/test_examples.py runs them).

A tiny Llama with random weights (2 layers, 4 query / 2 KV heads), a byte-level tokenizer built in code,
synthetic prose, and a tiny keydiff profile in a temporary mirror named by ``$LUKV_PROFILE_DIR`` (standing
in for the SmolLM2 profiles shipped with lukv_cache). Nothing is downloaded. The answers are gibberish:
a smoke run checks that the code runs, not what it says.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import numpy as np

TINY_ID = "lukv-examples/tiny-llama"  # the tiny model's profiles are looked up under this id
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16


def tokenizer():
    """Every byte is one token (GPT-2's byte alphabet, no merges) plus an end-of-text token: 257 ids."""
    from lukv_cache.testing import byte_tokenizer

    return byte_tokenizer()


def model():
    """The tiny Llama, seeded (every call, and every tensor-parallel rank, gets the same weights)."""
    from lukv_cache.testing import BYTE_VOCAB, tiny_model

    # eos_token_id None (the factory's): random weights must not stop early
    return tiny_model(
        vocab_size=BYTE_VOCAB, max_position_embeddings=4096, pad_token_id=256, name_or_path=TINY_ID
    )


def load():
    """``(model, tokenizer)`` like ``lukv_cache.models.load_model("smollm2")``, with a tiny profile published."""
    publish_profile()
    return model(), tokenizer()


def text(chars: int = 1500, seed: int = 0) -> str:
    """Synthetic prose of about ``chars`` characters (one token a character with the byte tokenizer)."""
    from lukv_cache.testing import prose

    return prose(chars, seed)


def profile():
    """A keydiff profile for the tiny model whose evict ratio differs per (layer, KV head)."""
    from lukv_cache.testing import curve_profile

    grid = np.linspace(0.05, 0.95, 19, dtype=np.float32)
    return curve_profile(LAYERS, KV_HEADS, grid, spread=0.04, model_id=TINY_ID, head_dim=HEAD_DIM)


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
