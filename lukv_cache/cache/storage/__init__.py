"""What one layer holds and how: the cache's storage, below everything that decides what to keep.

* :mod:`.layer`: :class:`~.layer.LUKVLayer`, one full-attention layer (transformers' layer contract over a
  ragged store and a dense suffix); its parts :mod:`.suffix` (the dense suffix), :mod:`.ragged` (the ragged
  store of kept tokens), :mod:`.quant` (its 8- and 4-bit rows), :mod:`.merge` (dense tokens into the store),
  :mod:`.logical` (the store read back as ``[B, H, T, D]``), :mod:`.window` (a sliding layer's window),
  :mod:`.rows` (batch rows and offloading); :mod:`.record`, the eviction record it carries for compression;
* :mod:`.layer_state` and :mod:`.state_check`: a layer's state as a saved context holds it, checked before use;
* :mod:`.report`: what a cache holds, in tokens and bytes.

Modules here import nothing of the cache above storage. Import them by module path (this face is for
readers outside the cache).
"""

from .layer import LUKVLayer
from .ragged import RaggedStore
from .report import kv_cache_bytes

__all__ = ["LUKVLayer", "RaggedStore", "kv_cache_bytes"]
