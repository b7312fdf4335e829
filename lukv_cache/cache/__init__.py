"""The cache and its per-layer storage.

* :mod:`.cache`: :class:`LUKVCache`, the ``DynamicCache`` subclass; owns the policy and decides what to keep;
* :mod:`.compression`: one eviction step as pure functions (region, scores, keep mask) and the policy;
* :mod:`.layer`: :class:`LUKVLayer`, one layer's ragged store and dense suffix (storage only);
* :mod:`.ragged`: the ragged store's layout and its batched, sync-free operations.
"""

from .cache import LUKVCache, check_ratio, kv_cache_bytes
from .compression import CompressionPolicy
from .layer import LUKVLayer
from .ragged import RaggedStore

__all__ = ["CompressionPolicy", "LUKVCache", "LUKVLayer", "RaggedStore", "check_ratio", "kv_cache_bytes"]
