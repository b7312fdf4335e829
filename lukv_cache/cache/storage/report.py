"""What a cache reports about what it holds: bytes (:func:`kv_cache_bytes`, for any transformers cache),
and :class:`CacheReport`, the reporting methods of :class:`~lukv_cache.LUKVCache` (which tokens each head
keeps, how many, in how many bytes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

from ...errors import ConfigurationError
from .layer import LUKVLayer

if TYPE_CHECKING:
    from transformers.cache_utils import DynamicLayer


def kv_cache_bytes(cache: Any) -> int:
    """Bytes of every tensor a transformers cache holds: a LUKVCache's stores, positions, offsets and suffix
    buffers, the keys/values of stock layers (``DynamicCache``, sliding and indexed layers) and the
    conv / recurrent states of linear-attention and SSM layers.

    >>> kv_cache_bytes(DynamicCache())
    0
    """
    total = 0
    for layer in getattr(cache, "layers", []):
        if isinstance(layer, LUKVLayer):  # a LUKVHybridLayer counts its linear states itself
            total += layer.memory_bytes()
            continue
        tensors = []
        if getattr(layer, "is_initialized", False):
            tensors += [getattr(layer, name, None) for name in ("keys", "values", "indexer_keys")]
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            tensors += [*layer.conv_states.values(), *layer.recurrent_states.values()]
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


def stock_keys(layer: Any) -> torch.Tensor | None:
    """``[B, H, S, D]``: the keys a stock transformers layer holds, or ``None`` (not filled yet, or a layer
    without per-token keys: linear-attention, SSM and placeholder layers)."""
    keys = getattr(layer, "keys", None) if getattr(layer, "is_initialized", False) else None
    return keys if isinstance(keys, torch.Tensor) and keys.ndim == 4 else None


class CacheReport(DynamicCache):
    """The reporting methods of :class:`~lukv_cache.LUKVCache` (a base of it, holding nothing itself)."""

    @property
    def is_compressed(self) -> bool:
        """Whether any layer holds a compressed store."""
        return any(isinstance(layer, LUKVLayer) and layer.compressed for layer in self.layers)

    def kept_positions(self, layer_idx: int) -> torch.Tensor:
        """bool ``[batch, kv_heads, T]``: which logical positions (absolute columns of the input, ``T`` so
        far, padding included) each (row, KV head) of layer ``layer_idx`` still holds, in its ragged store
        or its dense suffix. Padding is never held by a compressed layer; transformers' own layers (e.g. a
        sliding window shorter than the prompt) report their last columns, as they hold them. A compressed
        sliding-window layer reports only the positions its window lets the next token read (older ones
        may stay stored until its next fold, unread). ``layer_idx`` out of range raises a
        :class:`~lukv_cache.errors.ConfigurationError`.

        >>> from lukv_cache import LUKVCache
        >>> cache = LUKVCache(ratio=0.0)
        >>> _ = cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
        >>> cache.kept_positions(0).int().tolist()
        [[[1, 1, 1], [1, 1, 1]]]
        """
        count = len(self.layers)
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not -count <= layer_idx < count:
            holds = (
                f"has {count} layers: pass 0 to {count - 1}" if count else "has no layers yet: run a forward"
            )
            raise ConfigurationError(
                f"kept_positions: layer {layer_idx!r} is out of range; this cache {holds}."
            )
        layer = self.layers[layer_idx]
        if not getattr(layer, "is_initialized", False):
            return torch.zeros(0, 0, 0, dtype=torch.bool)
        if isinstance(layer, LUKVLayer):
            kept = torch.zeros(layer.batch_size, layer.num_heads, layer.cumulative_length, dtype=torch.bool)
            for row in range(layer.batch_size):
                for head in range(layer.num_heads):
                    kept[row, head, layer.head_tokens(row, head)[0].cpu()] = True
            if layer.sliding_window is not None:  # the next token reads only its window: older ones are gone
                kept[..., : max(0, layer.cumulative_length - layer.sliding_window + 1)] = False
            return kept
        stock = cast("DynamicLayer", layer)  # transformers' own attention layer
        assert stock.keys is not None  # initialized
        b, h, s, _ = stock.keys.shape
        kept = torch.zeros(b, h, max(s, stock.get_seq_length()), dtype=torch.bool)
        kept[:, :, kept.shape[-1] - s :] = True
        return kept

    def memory_bytes(self) -> int:
        """Bytes held by every tensor of the cache (ragged stores, positions, offsets, suffix buffers,
        stock sliding layers, and with ``keep_scores=True`` the prompt's scores)."""
        scores = getattr(self, "prefill_scores", None) or {}  # LUKVCache's, kept with keep_scores=True
        return kv_cache_bytes(self) + sum(t.numel() * t.element_size() for t in scores.values())

    def stored_tokens(self) -> torch.Tensor:
        """int64 ``[layers, batch, kv_heads]``: tokens stored per (layer, row, KV head), one row per layer that
        holds keys (layers without per-token KV, such as linear-attention or SSM layers, have none); when
        layers have different KV-head counts, a layer's missing heads count 0."""
        rows = []
        for layer in self.layers:
            if isinstance(layer, LUKVLayer):
                if layer.is_initialized:
                    rows.append(layer.stored_counts())
                continue
            keys = stock_keys(layer)
            if keys is not None:
                b, h, s, _ = keys.shape
                rows.append(torch.full((b, h), s, dtype=torch.long))
        if not rows:
            return torch.zeros(0, 0, 0, dtype=torch.long)
        heads = max(row.shape[1] for row in rows)
        return torch.stack([torch.nn.functional.pad(row, (0, heads - row.shape[1])) for row in rows])
