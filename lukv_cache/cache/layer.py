"""One full-attention layer's storage: a ragged compressed prefix plus a dense suffix.

* **Ragged store** (:class:`~lukv_cache.cache.ragged.RaggedStore`): every kept token of every (batch row,
  KV head) back to back in one flat ``[N, D]`` tensor for keys and one for values, with segment offsets
  and each token's original position (for masks and ``crop``).
* **Dense suffix**: ``[B, H, S, D]``, the protected recent window and every token that arrives after
  compression, appended in place into a buffer that grows geometrically (no per-step copy of anything).

The layer owns its tensors and knows nothing of eviction policy: the cache decides what to keep and calls
:meth:`LUKVLayer.evict`. Lengths reported to transformers are *logical* (tokens seen), never the stored
count: transformers builds one mask per forward from them and indexes padding by absolute position.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ..errors import BatchMismatchError
from .ragged import RaggedStore, flat_index_from_mask, gather_ragged

_MIN_SUFFIX_CAPACITY = 16  # room to decode after compression before the buffer first grows
# A decoding suffix this long is folded into the ragged store: the store is rebuilt once per this many
# steps (amortised O(store / 256) per step) and the suffix buffer's slack stays bounded. The default of
# LUKVLayer.fold_at (LUKVCache(fold_interval=...) sets it).
FOLD_AT = 256


class LUKVLayer(DynamicLayer):
    """A full-attention layer of :class:`~lukv_cache.LUKVCache` (see the module docstring).

    >>> layer = LUKVLayer()
    >>> keys, values = layer.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4))
    >>> layer.get_seq_length(), layer.store is None
    (5, True)
    """

    def __init__(self) -> None:
        super().__init__()
        self.cumulative_length = 0
        self.store: RaggedStore | None = None
        self._kbuf = self._vbuf = None
        self._suffix_len = 0
        self.compressed = False
        # [B] sinks still to protect per row (a chunk of a chunked prefill may be all padding); the cache's
        # eviction reads and updates it, batch operations keep it aligned with the rows
        self.sinks_left: torch.Tensor | None = None
        self.fold_at = FOLD_AT  # fold a decoding suffix this long into the store
        self.bounded = False  # the suffix buffer never grows past fold_at + 1 (eviction at fold time)
        # logical length at the last eviction or fold: eviction at fold time counts the tokens since then
        self.settled_length = 0
        # [B, H_q, W, D]: the last post-RoPE queries, kept while they may score a fold (record_queries)
        self.queries: torch.Tensor | None = None

    # ------------------------------------------------------------------ the dense suffix
    @property
    def batch_size(self) -> int:
        return 0 if self._kbuf is None else int(self._kbuf.shape[0])

    @property
    def num_heads(self) -> int:
        return 0 if self._kbuf is None else int(self._kbuf.shape[1])

    @property
    def suffix_length(self) -> int:
        return self._suffix_len

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
            if self.compressed and n == 1 and s >= self.fold_at:
                self.fold()
                s = 0
            else:
                # geometric growth once decoding (up to the fold size); exact size for a prefill
                grow = max(2 * (s + n), _MIN_SUFFIX_CAPACITY) if (self.compressed or n == 1) else 0
                if self.compressed and n == 1 or self.bounded:
                    grow = min(grow, self.fold_at + 1)
                self._set_suffix(self.keys, self.values, capacity=max(s + n, grow))
        self._kbuf[:, :, s : s + n] = key_states
        self._vbuf[:, :, s : s + n] = value_states
        self._suffix_len = s + n
        self._sync_views()

    # ------------------------------------------------------------------ transformers' layer API
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.batch_size or key_states.shape[1] != self.num_heads:
            raise BatchMismatchError(
                f"LUKVCache holds a batch of {self.batch_size} rows x {self.num_heads} KV heads but this forward "
                f"brings {key_states.shape[0]} rows x {key_states.shape[1]} KV heads; the cache is unchanged. "
                "Use the same batch for the whole generation (or cache.batch_select_indices / "
                "batch_repeat_interleave to change it), or start a fresh cache.",
                expected=self.batch_size,
                got=int(key_states.shape[0]),
            )
        self._append(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def reset(self) -> None:
        self.store = None
        self._kbuf = self._vbuf = None
        self._suffix_len = 0
        self.keys = self.values = None
        self.cumulative_length = 0
        self.compressed = False
        self.sinks_left = None
        self.settled_length = 0
        self.queries = None
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
        self.settled_length = min(self.settled_length, self.cumulative_length)
        self.queries = None
        if n <= self._suffix_len:
            self._suffix_len -= n
            self._sync_views()
            return
        self._suffix_len = 0
        self._sync_views()
        if self.store is not None:
            self.store = self.store.select(self.store.positions < self.cumulative_length)

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
        if self.sinks_left is not None:
            self.sinks_left = self.sinks_left[rows.to(self.sinks_left.device)]
        if self.queries is not None:
            self.queries = self.queries.index_select(0, rows.to(self.queries.device))
        if self.store is not None:
            self.store = self.store.select_rows(rows)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(self.batch_size).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            rows = torch.arange(self.batch_size)[
                indices.cpu() if isinstance(indices, torch.Tensor) else indices
            ]
            self._select_rows(rows)

    # ------------------------------------------------------------------ accounting
    def memory_bytes(self) -> int:
        """Bytes of every tensor this layer holds (store, positions, offsets, suffix buffers)."""
        tensors = [self._kbuf, self._vbuf, self.sinks_left, self.queries]
        total = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        return total + (self.store.memory_bytes() if self.store is not None else 0)

    def stored_counts(self) -> torch.Tensor:
        """int64 ``[B, H]``: tokens stored per (batch row, KV head), ragged store plus suffix."""
        if not self.is_initialized:
            return torch.zeros(0, 0, dtype=torch.long)
        b, h = self.batch_size, self.num_heads
        counts = torch.full((b, h), self._suffix_len, dtype=torch.long)
        if self.store is not None:
            counts += self.store.counts().view(b, h).cpu()
        return counts

    # ------------------------------------------------------------------ eviction
    def evict(self, keep: torch.Tensor, scores: torch.Tensor | None = None) -> None:
        """Move the kept tokens of the suffix's first ``R`` tokens (``keep [B, H, R]``) into the ragged store
        and drop the rest; the suffix then holds its last ``S - R`` tokens (the protected window), with room
        for 16 more before it grows: the buffer is sized by the tokens it holds, never by a setting.
        ``scores [B, H, R]``: stored with the kept tokens (eviction at fold time reuses them)."""
        r = keep.shape[-1]
        start = self.cumulative_length - self._suffix_len
        self._absorb(self.keys[:, :, :r], self.values[:, :, :r], keep, start, scores)
        kept = self._suffix_len - r
        self._set_suffix(self.keys[:, :, r:], self.values[:, :, r:], capacity=kept + _MIN_SUFFIX_CAPACITY)
        self.compressed = True
        self.settled_length = self.cumulative_length
        self.queries = None

    def _absorb(
        self, keys, values, keep: torch.Tensor, start: int, scores: torch.Tensor | None = None
    ) -> None:
        """Move the kept tokens (``keep [B, H, R]``) of a dense block starting at logical ``start`` into
        the ragged store, merged segment by segment with what it already holds (``scores [B, H, R]`` with
        them, if given)."""
        b, h, r = keep.shape
        counts = keep.sum(-1).flatten()
        flat = flat_index_from_mask(keep)  # segment-major, positions ascending: the store layout
        # gather straight from [B, H, R, D] (often a strided view): no copy of the whole block
        new_k, new_v = gather_ragged(keys, flat), gather_ragged(values, flat)
        new_pos = (flat % r + start).to(torch.int32)
        new_s = None if scores is None else scores.reshape(-1)[flat.to(scores.device)].to(new_k.device)
        if self.store is None:
            self.store = RaggedStore.build(new_k, new_v, new_pos, counts, num_heads=h, scores=new_s)
        else:
            self.store = self.store.extend(new_k, new_v, new_pos, counts, new_s)

    def fold(self) -> None:
        """Move the whole dense suffix into the ragged store (nothing evicted) and start an empty one."""
        s = self._suffix_len
        if not s:
            return
        keep = torch.ones(self.batch_size, self.num_heads, s, dtype=torch.bool, device=self._kbuf.device)
        self._absorb(self.keys, self.values, keep, self.cumulative_length - s)
        self._set_suffix(self.keys[:, :, :0], self.values[:, :, :0], capacity=self.fold_at + 1)

    def refold(
        self, source: torch.Tensor, counts: torch.Tensor, scores: torch.Tensor | None, capacity: int
    ) -> None:
        """Rebuild the store from what the layer holds and empty the suffix (eviction at fold time).

        ``source``: int64 ``[K]``, the kept tokens in store layout (segment-major, positions ascending),
        each a row of the store (``< N``) or a suffix token (``N +`` its flat index into ``[B, H, S]``);
        ``counts [B * H]``: kept tokens per segment; ``scores [K]``: stored with them (or ``None``);
        ``capacity``: the new suffix buffer's, in tokens."""
        n = 0 if self.store is None else self.store.num_tokens
        from_store = source < n
        in_suffix = source[~from_store] - n
        start = self.cumulative_length - self._suffix_len
        suffix_pos = (in_suffix % max(self._suffix_len, 1) + start).to(torch.int32)

        def pick(stored: torch.Tensor | None, from_suffix: torch.Tensor) -> torch.Tensor:
            out = from_suffix.new_empty((source.shape[0], *from_suffix.shape[1:]))
            out[~from_store] = from_suffix
            if stored is not None:
                out[from_store] = stored[source[from_store]]
            return out

        store = self.store if n else None
        keys = pick(None if store is None else store.keys, gather_ragged(self.keys, in_suffix))
        values = pick(None if store is None else store.values, gather_ragged(self.values, in_suffix))
        positions = pick(None if store is None else store.positions, suffix_pos)
        self.store = RaggedStore.build(
            keys, values, positions, counts.to(keys.device), num_heads=self.num_heads, scores=scores
        )
        self._set_suffix(self.keys[:, :, :0], self.values[:, :, :0], capacity=capacity)
        self.compressed = True
        self.settled_length = self.cumulative_length
        self.queries = None

    def record_queries(self, query: torch.Tensor, count: int) -> None:
        """Keep this forward's post-RoPE ``query [B, H_q, q, D]`` after the ones kept before, the last
        ``count`` of them (a scorer that reads queries ranks the tokens at the next fold with them)."""
        recent = query[:, :, -count:]
        if self.queries is not None and self.queries.shape[0] == recent.shape[0]:
            recent = torch.cat([self.queries, recent], dim=2)[:, :, -count:]
        self.queries = recent.clone()  # never a view: it would pin the forward's queries

    def to_sliding(self, sliding_window: int, *, record_past: bool = False) -> DynamicSlidingWindowLayer:
        """The stock sliding layer holding what this (never compressed) layer holds."""
        layer = DynamicSlidingWindowLayer(sliding_window=sliding_window)
        if record_past:
            layer.activate_past_recording()
        if self.is_initialized and self._suffix_len:
            layer.update(self.keys.clone(), self.values.clone())
        return layer
