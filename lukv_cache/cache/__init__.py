"""The cache: :class:`LUKVCache` and the parts it routes to, one subpackage per job.

* :mod:`.cache`: :class:`LUKVCache`, the ``DynamicCache`` subclass, a container that routes to its parts;
  :mod:`.pretrained`: ``LUKVCache.from_pretrained`` (budgets from a profile); :mod:`.save_load`: the public
  ``save_cache`` / ``load_cache``;
* :mod:`.storage`: what one layer holds and how (the layer, its ragged store and dense suffix, quantized
  rows, the bytes it reports);
* :mod:`.options`: what the user asked, declared and checked once (the policy, the memory budget);
* :mod:`.layers`: which layer object stands at each index (the layout, the factory, hybrid and
  tensor-parallel layers);
* :mod:`.compression`: deciding what each layer keeps and evicting the rest (the compressor, one eviction
  step, folds, the prefill);
* :mod:`.saved`: saved compressed contexts (the file, its layers' entries, its tag table).

The subpackages import one way, ``storage`` < ``options`` < ``layers`` < ``compression`` < ``saved`` <
the modules here (``tests/test_architecture.py`` checks it); docs/design.md draws the map.

``LUKVCache`` is registered with torch's pytree as a node without leaves (its tensors are not graph
inputs): ``torch.export`` then reaches the model's forward, where the first ``LUKVLayer.update`` raises
:class:`~lukv_cache.errors.UnsupportedOperationError` (instead of torch's ``Unsupported input type``), and
a ``tree_map`` over model outputs hands the very cache back.
"""

import torch.utils._pytree as _pytree

from .cache import LUKVCache
from .options.policy import CompressionPolicy
from .options.values import check_ratio
from .storage.layer import LUKVLayer
from .storage.ragged import RaggedStore
from .storage.report import kv_cache_bytes


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
