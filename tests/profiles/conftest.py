"""Fixtures for the profile tests: a Hub-protocol server on 127.0.0.1 and small profiles."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hub_server import HubServer  # noqa: E402

from lukv_cache.profiles import Profile  # noqa: E402

MODEL_ID = "org/tiny-llama"


@pytest.fixture
def hub():
    """A fresh in-memory Hub on a free port; the real huggingface_hub client talks to ``hub.url``."""
    server = HubServer().start()
    yield server
    server.stop()


@pytest.fixture
def hf_cache(tmp_path):
    """A private huggingface_hub cache folder (never the user's)."""
    path = tmp_path / "hf-cache"
    path.mkdir()
    return path


def _make_profile(
    layers: int = 2,
    kv_heads: int = 2,
    grid_size: int = 5,
    model_id: str = MODEL_ID,
    scorer: str = "keydiff",
    **kw,
) -> Profile:
    """A valid profile whose evict ratio grows with rho and differs per (layer, head)."""
    grid = np.linspace(0.1, 0.9, grid_size, dtype=np.float32)
    offsets = np.linspace(-0.05, 0.05, layers * kv_heads, dtype=np.float32).reshape(layers, kv_heads)
    ratios = np.clip(grid[:, None, None] + offsets[None], 0.0, 1.0).astype(np.float32)
    return Profile(grid=grid, evict_ratio=ratios, model_id=model_id, scorer=scorer, head_dim=16, **kw)


@pytest.fixture
def make_profile():
    """``make_profile(layers=2, kv_heads=2, grid_size=5, model_id=..., scorer="keydiff", **fields)``."""
    return _make_profile


@pytest.fixture
def profile() -> Profile:
    return _make_profile()
