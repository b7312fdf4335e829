"""The cache and its per-layer storage.

* :mod:`.cache`: :class:`LUKVCache`, the ``DynamicCache`` subclass; a container that routes to its parts:
  :mod:`.policy` (its arguments, checked into the policy), :mod:`.layout` (what the model's layers mean),
  :mod:`.hybrid` (learning the layout, linear-attention / SSM state calls), :mod:`.state` (what a forward
  leaves pending), :mod:`.compressor` (the object that owns compression, ``cache.compressor``, and its
  observers), :mod:`.factory` (the compressed layers, built with the policy's settings), :mod:`.contract`
  (the cache as the compression parts see it), :mod:`.forward` (what ``update`` settles and checks),
  :mod:`.eviction` (one eviction step), :mod:`.cap` (``max_tokens``), :mod:`.folding` (eviction at fold
  time), :mod:`.prefill` (``prefill``, KVzip's passes), :mod:`.pretrained` (``from_pretrained``),
  :mod:`.report` (what it holds);
* :mod:`.compression`: one eviction step as pure functions (region, scores, keep mask) and the policy;
* :mod:`.layer`: :class:`LUKVLayer`, one layer's ragged store and dense suffix (storage only);
* :mod:`.ragged`: the ragged store's layout and its batched, sync-free operations.

``LUKVCache`` is registered with torch's pytree as a node without leaves (its tensors are not graph
inputs): ``torch.export`` then reaches the model's forward, where the first ``LUKVLayer.update`` raises
:class:`~lukv_cache.errors.UnsupportedOperationError` (instead of torch's ``Unsupported input type``), and
a ``tree_map`` over model outputs hands the very cache back.
"""

import torch.utils._pytree as _pytree

from .cache import LUKVCache, kv_cache_bytes
from .compression import CompressionPolicy
from .layer import LUKVLayer
from .policy import check_ratio
from .ragged import RaggedStore


def _flatten(cache: LUKVCache) -> tuple[list, LUKVCache]:
    return [], cache


def _unflatten(_leaves, cache: LUKVCache) -> LUKVCache:
    return cache


if LUKVCache not in _pytree.SUPPORTED_NODES:
    _pytree.register_pytree_node(
        LUKVCache,
        _flatten,
        _unflatten,
        flatten_with_keys_fn=lambda cache: ([], cache),
    )

__all__ = ["CompressionPolicy", "LUKVCache", "LUKVLayer", "RaggedStore", "check_ratio", "kv_cache_bytes"]
