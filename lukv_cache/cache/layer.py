"""One layer's storage: a ragged compressed prefix plus a dense suffix.

* **Ragged store**: every kept token of every (batch row, KV head) back to back in one flat ``[N, D]``
  tensor for keys and one for values, with int64 segment ``offsets [B * H + 1]`` (segment ``b * H + h``)
  and each token's original position as int32 (for masks and ``crop``).
* **Dense suffix**: ``[B, H, S, D]``, the protected recent window and every token that arrives after
  compression, appended in place into a buffer that grows geometrically (no per-step copy of anything).

Lengths reported to transformers are *logical* (tokens seen), never the stored count: transformers
builds one mask per forward from them and indexes padding by absolute position.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ..allocation import AllocationRequest
from ..attention.cuda import (
    concat_ragged,
    flat_index_from_mask,
    gather_ragged,
    keep_mask_from_counts,
    offsets_from_counts,
    segment_ids_from_offsets,
)
from ..errors import IncompatibleAttentionError

if TYPE_CHECKING:
    from .cache import LUKVCache

_MIN_SUFFIX_CAPACITY = 16  # room to decode after compression before the buffer first grows
# A decoding suffix this long is folded into the ragged store: the store is rebuilt once per this many
# steps (amortised O(store / 256) per step) and the suffix buffer's slack stays bounded.
_FOLD_AT = 256


def _valid_from_mask(attention_mask: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
    """[B, length] bool: which of the last ``length`` key positions the last query may read (not padding)."""
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    row = attention_mask[:, 0, -1, -length:]
    if row.dtype != torch.bool:
        row = row > torch.finfo(row.dtype).min / 2
    return row.expand(batch, length).to(device)


class LUKVLayer(DynamicLayer):
    """A full-attention layer of :class:`~lukv_cache.LUKVCache` (see the module docstring)."""

    def __init__(self, cache: LUKVCache | None = None, layer_idx: int = 0):
        super().__init__()
        self._cache = cache
        self.layer_idx = layer_idx
        self.cumulative_length = 0
        self._clear_store()
        self._kbuf = self._vbuf = None
        self._suffix_len = 0
        self.compressed = False
        self._awaiting_attention = False
        # [B] sinks still to protect (a chunk of a chunked prefill may be all padding)
        self._sinks_left: torch.Tensor | None = None

    # ------------------------------------------------------------------ storage primitives
    def _clear_store(self) -> None:
        self.store_keys = self.store_values = self.store_positions = self.offsets = None
        self._offsets_list: list[int] | None = None

    @property
    def has_store(self) -> bool:
        return self.store_keys is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self._kbuf = key_states.new_empty((b, h, 0, d))
        self._vbuf = value_states.new_empty((b, h, 0, value_states.shape[-1]))
        self._suffix_len = 0
        self._sync_views()
        self.is_initialized = True

    def _sync_views(self) -> None:
        self.keys = self._kbuf[:, :, : self._suffix_len]
        self.values = self._vbuf[:, :, : self._suffix_len]

    def _set_suffix(self, keys: torch.Tensor, values: torch.Tensor, capacity: int | None = None) -> None:
        """Replace the dense suffix by fresh buffers (never views of a larger tensor: that would pin it)."""
        s = keys.shape[-2]
        cap = max(s, capacity or 0)
        self._kbuf = keys.new_empty((*keys.shape[:2], cap, keys.shape[-1]))
        self._vbuf = values.new_empty((*values.shape[:2], cap, values.shape[-1]))
        self._kbuf[:, :, :s] = keys
        self._vbuf[:, :, :s] = values
        self._suffix_len = s
        self._sync_views()

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        s, n = self._suffix_len, key_states.shape[-2]
        if s + n > self._kbuf.shape[-2]:
            if self.compressed and n == 1 and s >= _FOLD_AT:
                self.fold()
                s = 0
            else:
                # geometric growth once decoding (up to the fold size); exact size for a prefill
                grow = max(2 * (s + n), _MIN_SUFFIX_CAPACITY) if (self.compressed or n == 1) else 0
                if self.compressed and n == 1:
                    grow = min(grow, _FOLD_AT + 1)
                self._set_suffix(self.keys, self.values, capacity=max(s + n, grow))
        self._kbuf[:, :, s : s + n] = key_states
        self._vbuf[:, :, s : s + n] = value_states
        self._suffix_len = s + n
        self._sync_views()

    # ------------------------------------------------------------------ transformers' layer API
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._awaiting_attention and (self.compressed or self._cache_ratio() > 0):
            raise IncompatibleAttentionError(
                f"LUKVCache layer {self.layer_idx}: the previous forward's attention did not go through "
                "lukv_cache's attention (the model's attn_implementation cannot read a compressed cache). "
                "Load the model with attn_implementation='sdpa' or 'eager' (import lukv_cache first)."
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._append(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        self._awaiting_attention = True
        # Fresh tensor objects carry the tag, so nothing but this forward's attention call sees it.
        keys, values = self.keys.view(self.keys.shape), self.values.view(self.values.shape)
        keys._lukv_layer = self
        return keys, values

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def reset(self) -> None:
        self._clear_store()
        self._kbuf = self._vbuf = None
        self._suffix_len = 0
        self.keys = self.values = None
        self.cumulative_length = 0
        self.compressed = False
        self._awaiting_attention = False
        self._sinks_left = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` logical tokens (transformers passes a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead."
            )
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        n = min(n, self.cumulative_length)
        self.cumulative_length -= n
        if n <= self._suffix_len:
            self._suffix_len -= n
            self._sync_views()
            return
        self._suffix_len = 0
        self._sync_views()
        if self.has_store:
            self._filter_store(self.store_positions < self.cumulative_length)

    def _filter_store(self, keep: torch.Tensor) -> None:
        seg = self._segment_ids()
        counts = torch.bincount(seg[keep], minlength=len(self._offsets_list) - 1)
        self._set_store(self.store_keys[keep], self.store_values[keep], self.store_positions[keep], counts)

    def _segment_ids(self) -> torch.Tensor:
        return segment_ids_from_offsets(self.offsets, self.store_keys.shape[0])

    def _set_store(self, keys, values, positions, counts: torch.Tensor) -> None:
        self.store_keys, self.store_values, self.store_positions = keys, values, positions
        self.offsets = torch.zeros(counts.numel() + 1, dtype=torch.long, device=keys.device)
        torch.cumsum(counts, 0, out=self.offsets[1:])
        self._offsets_list = self.offsets.tolist()

    def _select_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` (any order, repeats allowed): beam reorder, repeat, select."""
        if not self.is_initialized:
            return
        rows = rows.to(self._kbuf.device)
        self._set_suffix(
            self.keys.index_select(0, rows),
            self.values.index_select(0, rows),
            capacity=self._kbuf.shape[-2] if self.compressed else None,
        )
        if self._sinks_left is not None:
            self._sinks_left = self._sinks_left[rows.to(self._sinks_left.device)]
        if self.has_store:
            h = self._kbuf.shape[1]
            old = (rows.view(-1, 1) * h + torch.arange(h, device=rows.device)).flatten()  # new seg -> old seg
            starts, counts = self.offsets[:-1][old], self.offsets.diff()[old]
            idx = torch.repeat_interleave(starts - torch.cumsum(counts, 0) + counts, counts)
            idx = idx + torch.arange(idx.numel(), device=idx.device)
            self._set_store(self.store_keys[idx], self.store_values[idx], self.store_positions[idx], counts)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(self._kbuf.shape[0]).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            rows = torch.arange(self._kbuf.shape[0])[
                indices.cpu() if isinstance(indices, torch.Tensor) else indices
            ]
            self._select_rows(rows)

    # ------------------------------------------------------------------ accounting
    def memory_bytes(self) -> int:
        """Bytes of every tensor this layer holds (store, positions, offsets, suffix buffers)."""
        tensors = [
            self.store_keys,
            self.store_values,
            self.store_positions,
            self.offsets,
            self._kbuf,
            self._vbuf,
            self._sinks_left,
        ]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def stored_counts(self) -> torch.Tensor:
        """int64 ``[B, H]``: tokens stored per (batch row, KV head), ragged store plus suffix."""
        if not self.is_initialized:
            return torch.zeros(0, 0, dtype=torch.long)
        b, h = self._kbuf.shape[:2]
        counts = torch.full((b, h), self._suffix_len, dtype=torch.long)
        if self.has_store:
            counts += self.offsets.diff().view(b, h).cpu()
        return counts

    def _cache_ratio(self) -> float:
        return self._cache.ratio if self._cache is not None else 0.0

    # ------------------------------------------------------------------ compression
    def wants_compression(self, query_length: int) -> bool:
        """Compress after a multi-token forward: always the first time, then whenever chunked prefill
        (``prefill_chunk_size``) has piled up that many uncompressed tokens."""
        if query_length <= 1 or self._cache is None:
            return False
        if not self.compressed:
            return True
        chunk = self._cache.prefill_chunk_size
        return chunk is not None and self._suffix_len - self._cache.window >= chunk

    def compress(self, queries: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Evict from the dense suffix (all but the protected window) into the ragged store.

        ``queries``: the post-RoPE queries of this forward ``[B, Hq, q, D]`` (the scorer reads its last
        ``n_queries``). Everything is batched per layer: one sort, one gather, no per-head loop.
        """
        cache = self._cache
        scorer = cache.scorer
        window = cache.window
        keys, values = self.keys, self.values
        b, h, s, _ = keys.shape
        region = max(s - window, 0)
        valid = _valid_from_mask(attention_mask, b, s, keys.device)[:, :region]
        # sinks: the first `sink` real tokens of each row, wherever they fall in a chunked prefill
        if self._sinks_left is None:
            self._sinks_left = torch.full((b,), cache.sink, dtype=torch.long, device=keys.device)
        sinks = valid & (valid.long().cumsum(-1) <= self._sinks_left.unsqueeze(-1))
        self._sinks_left = self._sinks_left - sinks.sum(-1)
        evictable = valid & ~sinks
        n_evictable = evictable.sum(-1)
        keep = sinks.unsqueeze(1).expand(b, h, region).clone()
        if region and bool(n_evictable.any()):
            n_q = scorer.n_queries
            q = queries[:, :, -n_q:] if n_q else None
            scores = scorer(keys, values, q).float()
            if cache._recorded_scores is not None:
                cache._recorded_scores[self.layer_idx] = scores
            scores = scores[..., :region]
            scores = scores.masked_fill(~evictable.unsqueeze(1), float("-inf"))
            request = AllocationRequest(
                scores, n_evictable.cpu(), cache.ratio, self.layer_idx, cache.num_layers, cache.min_keep
            )
            counts = cache.allocator(request).to(keys.device)  # [B, H]
            keep |= keep_mask_from_counts(scores, counts) & evictable.unsqueeze(1)
        self._absorb(keys[:, :, :region], values[:, :, :region], keep, self.cumulative_length - s)
        self._set_suffix(keys[:, :, region:], values[:, :, region:], capacity=window + _MIN_SUFFIX_CAPACITY)
        self.compressed = True

    def _absorb(self, keys, values, keep: torch.Tensor, start: int) -> None:
        """Move the kept tokens (``keep [B, H, R]``) of a dense block starting at logical ``start`` into
        the ragged store, merged segment by segment with what it already holds."""
        b, h, r = keep.shape
        counts = keep.sum(-1).flatten()
        flat = flat_index_from_mask(keep)  # segment-major, positions ascending: the store layout
        # gather straight from [B, H, R, D] (often a strided view): no copy of the whole block
        new_k, new_v = gather_ragged(keys, flat), gather_ragged(values, flat)
        new_pos = (flat % r + start).to(torch.int32)
        if not self.has_store:
            self._set_store(new_k, new_v, new_pos, counts)
            return
        new_offsets = offsets_from_counts(counts)
        merged_k, offsets = concat_ragged(self.store_keys, self.offsets, new_k, new_offsets)
        merged_v, _ = concat_ragged(self.store_values, self.offsets, new_v, new_offsets)
        merged_pos, _ = concat_ragged(self.store_positions, self.offsets, new_pos, new_offsets)
        self._set_store(merged_k, merged_v, merged_pos, offsets.diff())

    def fold(self) -> None:
        """Move the whole dense suffix into the ragged store (nothing evicted) and start an empty one."""
        s = self._suffix_len
        if not s:
            return
        b, h = self._kbuf.shape[:2]
        keep = torch.ones(b, h, s, dtype=torch.bool, device=self._kbuf.device)
        self._absorb(self.keys, self.values, keep, self.cumulative_length - s)
        self._set_suffix(self.keys[:, :, :0], self.values[:, :, :0], capacity=_FOLD_AT + 1)

    def to_sliding(self, sliding_window: int) -> DynamicSlidingWindowLayer:
        """The stock sliding layer holding what this (never compressed) layer holds."""
        layer = DynamicSlidingWindowLayer(sliding_window=sliding_window)
        if self._cache is not None and self._cache._record_past:
            layer.activate_past_recording()
        if self.is_initialized and self._suffix_len:
            layer.update(self.keys.clone(), self.values.clone())
        return layer
