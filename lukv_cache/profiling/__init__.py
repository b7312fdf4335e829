"""The offline LU-KV profiling pipeline (``docs/design.md``): oracle importance, solver, profiles, diagnostics.

>>> from lukv_cache.profiling import build_profile
>>> profile = build_profile(model, tokenizer, scorer="keydiff")  # doctest: +SKIP
>>> profile.save("keydiff.safetensors")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names

# public name -> the module of this package that defines it, imported on first access (PEP 562), so that
# the light ones (.kvzap_options, which the CLI's help reads) do not pull in torch and transformers
_LAZY = {
    "CalibrationFormatError": "..errors",
    "BuildSettings": ".build",
    "build_profile": ".build",
    "build_profiles": ".build",
    "default_cache_dir": ".result_store",
    "load_calibration": ".calibration",
    "shipped_calibrations": ".calibration",
    "add_memory_table": ".memory_table",
    "measure_memory_table": ".memory_table",
    "prefill_scores": ".scores",
    "DEFAULT_GRID": ".solver",
    "exact_keep_counts": ".solver",
    "greedy_keep_counts": ".solver",
    "pava": ".solver",
    "solve_evict_ratios": ".solver",
}
# the same names from the same modules, for type checkers and editors (kept equal: tests/test_lazy_names.py)
if TYPE_CHECKING:
    from ..errors import CalibrationFormatError
    from .build import BuildSettings, build_profile, build_profiles
    from .calibration import load_calibration, shipped_calibrations
    from .memory_table import add_memory_table, measure_memory_table
    from .result_store import default_cache_dir
    from .scores import prefill_scores
    from .solver import DEFAULT_GRID, exact_keep_counts, greedy_keep_counts, pava, solve_evict_ratios


__getattr__, __dir__ = lazy_names(__name__, _LAZY)


__all__ = [
    "DEFAULT_GRID",
    "BuildSettings",
    "CalibrationFormatError",
    "add_memory_table",
    "build_profile",
    "build_profiles",
    "default_cache_dir",
    "exact_keep_counts",
    "greedy_keep_counts",
    "load_calibration",
    "measure_memory_table",
    "pava",
    "prefill_scores",
    "shipped_calibrations",
    "solve_evict_ratios",
]
