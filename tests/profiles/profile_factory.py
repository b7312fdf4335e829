"""A valid profile factory shared by the profile tests (a plain module: two conftest.py files clash)."""

from __future__ import annotations

import numpy as np

from lukv_cache.profiles import Profile

MODEL_ID = "org/tiny-llama"


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
