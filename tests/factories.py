"""Tiny test profiles built from numpy arrays, shared by every tests folder (``from factories import ...``).

tests/conftest.py puts this folder on ``sys.path``. Every builder returns a plain ``Profile`` with
``model_id="org/tiny"`` and ``scorer="keydiff"`` unless told otherwise; other fields (``head_dim``,
``window``, a score-to-gain table, ...) pass through ``**fields`` unchanged, so each test still says
what it sets.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lukv_cache.profiles import Profile

MODEL_ID = "org/tiny"
SCORER = "keydiff"


def array_profile(grid, evict, model_id: str = MODEL_ID, scorer: str = SCORER, **fields) -> Profile:
    """A profile of exactly these curves: ``grid`` [G] and ``evict`` [G, L, H], both as float32."""
    grid = np.asarray(grid, dtype=np.float32)
    return Profile(grid, np.asarray(evict, dtype=np.float32), model_id=model_id, scorer=scorer, **fields)


def flat_profile(layers: int, heads: int, grid=(0.25, 0.5, 0.75), **fields) -> Profile:
    """Every head evicts the global ratio at every grid point (asks for exactly the uniform total)."""
    grid = np.asarray(grid, dtype=np.float32)
    return array_profile(grid, np.repeat(grid, layers * heads).reshape(-1, layers, heads), **fields)


def curve_profile(layers: int, heads: int, grid=(0.25, 0.5, 0.75), spread: float = 0.2, **fields) -> Profile:
    """Uneven heads: (layer, head) i of n evicts the global ratio plus ``linspace(-spread, spread, n)[i]``,
    clipped to [0, 1]."""
    grid = np.asarray(grid, dtype=np.float32)
    offsets = np.linspace(-spread, spread, layers * heads, dtype=np.float32).reshape(layers, heads)
    return array_profile(grid, np.clip(grid[:, None, None] + offsets[None], 0.0, 1.0), **fields)


def with_gains(profile: Profile, knots: int = 8) -> Profile:
    """``profile`` with a crafted score-to-gain table of its shape (format version 2): every head's knots span
    [-1, 1] and its gains rise with the score, steeper in later heads and layers (uneven heads), so the
    ``calibrated`` allocator can read it in any test that hands the profile family a profile."""
    layers, heads = profile.num_layers, profile.num_kv_heads
    scale = 1.0 + np.arange(layers * heads, dtype=np.float32).reshape(layers, heads, 1) / 2
    gain_scores = np.broadcast_to(np.linspace(-1.0, 1.0, knots, dtype=np.float32), (layers, heads, knots))
    gain_values = np.linspace(0.0, 1.0, knots, dtype=np.float32) * scale
    return dataclasses.replace(profile, gain_scores=gain_scores.copy(), gain_values=gain_values)
