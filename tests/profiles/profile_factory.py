"""The profile tests' default profile (a plain module: two conftest.py files clash); built by tests/factories.py."""

from __future__ import annotations

import numpy as np

from lukv_cache.profiles import Profile
from lukv_cache.testing import curve_profile

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
    return curve_profile(
        layers, kv_heads, grid=grid, spread=0.05, model_id=model_id, scorer=scorer, head_dim=16, **kw
    )
