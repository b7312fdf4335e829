"""Which layer object stands at each index of a cache, learned once from the model.

* :mod:`.layout`: :class:`~.layout.Layout`, what the model's layers mean (compressed, sliding, linear
  attention, shared KV): it decides which layer stands at each index, and asks the cache to put it there;
* :mod:`.owner`: :class:`~.owner.LaidOutCache`, the cache as the layout sees it (a protocol: the cache
  alone writes its layers);
* :mod:`.factory`: every :class:`~lukv_cache.cache.storage.layer.LUKVLayer` a cache builds;
* :mod:`.hybrid`: linear-attention / SSM layers beside attention ones;
* :mod:`.parallel`: tensor parallelism, which KV heads this rank holds.
"""

from .layout import Layout

__all__ = ["Layout"]
