"""Every :class:`~lukv_cache.cache.storage.layer.LUKVLayer` a cache builds, built by one :class:`LayerFactory` that
knows the cache's policy: what the policy fixes on a layer (the store's bits, when the dense suffix folds,
whether its buffer is bounded) is set once, when the layer is made, never rewritten afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..options.policy import CompressionPolicy
from ..storage.layer import FOLD_AT, LUKVLayer
from .hybrid import LUKVHybridLayer


@dataclass(frozen=True)
class LayerFactory:
    """Builds a cache's compressed layers with the settings its policy gives them.

    ``kv_bits``: the store's bits per key / value entry (``None``: the model's dtype); ``fold_at``: a
    decoding suffix this long folds into the store; ``bounded``: the suffix buffer never grows past
    ``fold_at + 1`` (eviction at fold time). Calling the factory with no argument makes a full-attention
    layer, which is what ``DynamicCache`` does with its ``layer_class_to_replicate``.

    >>> from lukv_cache import LUKVCache
    >>> factory = LayerFactory.for_policy(LUKVCache(decode_max_tokens=64, fold_interval=16, kv_bits=8).policy)
    >>> layer = factory()
    >>> layer.kv_bits, layer.fold_at, layer.bounded  # fold_interval plus the protected window
    (8, 17, True)
    >>> factory(sliding_window=4).sliding_window
    4
    """

    kv_bits: int | None = None
    fold_at: int = FOLD_AT
    bounded: bool = False

    @classmethod
    def for_policy(cls, policy: CompressionPolicy) -> LayerFactory:
        """The factory of a cache with ``policy``: with ``decode_max_tokens`` a layer folds after the
        protected window and ``fold_interval`` tokens, and its fold evicts (never a plain fold). Under
        ``memory=1.0`` nothing is compressed and the suffix grows by exactly what arrives, as a
        ``DynamicCache`` layer does."""
        if policy.keeps_whole:
            return cls(fold_at=1, bounded=True)
        if policy.decode_max_tokens is None:
            return cls(kv_bits=policy.kv_bits, fold_at=policy.fold_interval)
        return cls(kv_bits=policy.kv_bits, fold_at=policy.fold_interval + policy.window, bounded=True)

    def __call__(self, sliding_window: int | None = None) -> LUKVLayer:
        """A compressed layer (a sliding-window one compressed like a full one with ``sliding_window``)."""
        return LUKVLayer(sliding_window, kv_bits=self.kv_bits, fold_at=self.fold_at, bounded=self.bounded)

    def hybrid(self, number_of_states: int = 1) -> LUKVHybridLayer:
        """A layer holding a linear-attention state beside compressed attention KV."""
        return LUKVHybridLayer(
            number_of_states, kv_bits=self.kv_bits, fold_at=self.fold_at, bounded=self.bounded
        )
