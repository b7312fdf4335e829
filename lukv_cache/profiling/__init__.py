"""The offline LU-KV profiling pipeline (``docs/design.md``): oracle importance, solver, profiles, diagnostics.

>>> from lukv_cache.profiling import build_profile
>>> profile = build_profile(model, tokenizer, scorer="keydiff")  # doctest: +SKIP
>>> profile.save("keydiff.safetensors")  # doctest: +SKIP
"""

from __future__ import annotations

from ..errors import CalibrationFormatError
from .build import build_profile, build_profiles, default_cache_dir
from .calibration import load_calibration, shipped_calibrations
from .scores import prefill_scores
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
    "prefill_scores",
    "shipped_calibrations",
    "solve_evict_ratios",
]
