"""The ways to hold a context that the evaluation compares: the full cache, or allocator x scorer x ratio.

Light on purpose (torch and transformers load in :func:`make_cache`): the ``lukv`` command line reads the
defaults below for its help.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "continuation")  # made by .tasks
ALLOCATORS = ("uniform", "pyramid", "adakv", "profile")
SCORERS = ("keydiff", "snapkv", "expected_attention", "knorm")
RATIOS = (0.25, 0.5, 0.8, 0.9)
# `lukv check`'s defaults: the allocators a user is likely to choose between, at the ratios worth deploying
CHECK_ALLOCATORS = ("uniform", "adakv", "profile")
CHECK_RATIOS = (0.5, 0.8, 0.9)
CHECK_SCORER = "keydiff"
FULL = "full"
PROFILE_ALLOCATORS = (
    "profile",
    "hybrid",
    "hybrid_global",
    "threshold",
)  # allocators whose budgets come from the model's profile (threshold: a kvzap profile's thresholds)


@dataclass(frozen=True)
class Method:
    """One way to hold the context: the full cache, or an allocator + scorer at a compression ratio.

    >>> Method("uniform", "keydiff", 0.8).name
    'uniform/keydiff@0.8'
    >>> Method(FULL).name
    'full'
    """

    allocator: str
    scorer: str | None = None
    ratio: float | None = None

    @property
    def is_full(self) -> bool:
        return self.allocator == FULL

    @property
    def name(self) -> str:
        return FULL if self.is_full else f"{self.allocator}/{self.scorer}@{self.ratio:g}"


def build_methods(
    allocators: Sequence[str], scorers: Sequence[str], ratios: Sequence[float], *, full: bool = True
) -> list[Method]:
    """The grid: the full cache (first) and every allocator x scorer x ratio.

    >>> [m.name for m in build_methods(["uniform"], ["keydiff"], [0.5])]
    ['full', 'uniform/keydiff@0.5']
    """
    grid = [Method(a, s, float(r)) for a in allocators for s in scorers for r in ratios]
    return ([Method(FULL)] if full else []) + grid


def make_cache(
    method: Method, model: Any, profiles_dir: str | os.PathLike[str] | None = None, *, hub: bool = False
) -> Any:
    """A fresh, empty cache for ``method``. ``profile`` and ``hybrid`` read the model's profile for the
    scorer (``profiles_dir`` first, the Hub only when ``hub=True``, then the profiles shipped with
    lukv_cache); a missing profile raises a ``ProfileError``.

    >>> make_cache(Method("adakv", "keydiff", 0.8), model).allocator_name
    'adakv'
    """
    if method.is_full:
        from transformers import DynamicCache

        return DynamicCache()
    from ..cache import LUKVCache

    if method.allocator not in PROFILE_ALLOCATORS and method.scorer != "kvzap":
        return LUKVCache(method.ratio, method.scorer, method.allocator, config=model.config)
    # the model's profile: the budgets, or (kvzap) the surrogate whatever the allocator
    return LUKVCache.from_pretrained(
        model,
        method.ratio,
        method.scorer,
        allocator=method.allocator,
        local_dir=profiles_dir,
        local_files_only=not hub,
    )
