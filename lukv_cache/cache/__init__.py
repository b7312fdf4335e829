"""The cache and its per-layer storage."""

from .cache import LUKVCache, prefill_scores
from .layer import LUKVLayer

__all__ = ["LUKVCache", "LUKVLayer", "prefill_scores"]
