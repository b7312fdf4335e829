"""Deciding what each layer keeps and evicting the rest.

* :mod:`.compressor`: :class:`~.compressor.Compressor`, the one object that owns a cache's compression
  (``cache.compressor``), and its observers;
* one eviction step: :mod:`.region` (what it decides, pure), :mod:`.evict` (running it over the layers),
  :mod:`.cap` (``max_tokens`` and a byte budget's tokens), :mod:`.kinds` (what a byte budget counts on each
  kind of layer: sliding windows, linear-attention states, layers left to transformers);
* folds while decoding: :mod:`.fold_plan` (what a fold decides, pure), :mod:`.fold` (running it);
* a forward: :mod:`.forward_state` (what a forward leaves pending), :mod:`.settle` (what ``update`` settles
  and checks first);
* a context: :mod:`.prefill` (``LUKVCache.prefill``, KVzip's passes) and :mod:`.prefill_inputs` (its checks);
  :mod:`.recorded` (one prefill recorded and replayed into many caches: benchmarks, memory tables);
* :mod:`.contract`: the cache as these modules see it (a protocol).
"""

from .compressor import Compressor

__all__ = ["Compressor"]
