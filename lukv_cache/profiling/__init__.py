"""The offline LU-KV profiling pipeline (DESIGN.md §1): oracle importance, solver, profiles, diagnostics.

>>> from lukv_cache.profiling import build_profile
>>> profile = build_profile(model, tokenizer, scorer="keydiff")  # doctest: +SKIP
>>> profile.save("keydiff.safetensors")  # doctest: +SKIP
"""

from __future__ import annotations

from .build import build_profile, build_profiles, default_cache_dir
from .calibration import CalibrationFormatError, load_calibration, shipped_calibrations
from .solver import DEFAULT_GRID, exact_keep_counts, greedy_keep_counts, pava, solve_evict_ratios

__all__ = [
    "DEFAULT_GRID",
    "CalibrationFormatError",
    "build_profile",
    "build_profiles",
    "default_cache_dir",
    "exact_keep_counts",
    "greedy_keep_counts",
    "load_calibration",
    "pava",
    "shipped_calibrations",
    "solve_evict_ratios",
]
