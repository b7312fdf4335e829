"""One full-attention layer's storage: a ragged compressed prefix plus a dense suffix.

* **Ragged store** (:class:`~lukv_cache.cache.ragged.RaggedStore`): every kept token of every (batch row,
  KV head) back to back in one flat ``[N, D]`` tensor for keys and one for values, with segment offsets
  and each token's original position (for masks and ``crop``).
* **Dense suffix**: ``[B, H, S, D]``, the protected recent window and every token that arrives after
  compression, appended in place into a buffer that grows geometrically (no per-step copy of anything).

The layer owns its tensors and knows nothing of eviction policy: the cache decides what to keep and calls
:meth:`LUKVLayer.evict`. Lengths reported to transformers are *logical* (tokens seen), never the stored
count: transformers builds one mask per forward from them and indexes padding by absolute position.

``suffix_keys`` / ``suffix_values`` are the dense suffix (what :meth:`LUKVLayer.update` returns, and what
attention reads beside the store). ``keys`` / ``values`` are what a ``DynamicLayer`` holds, the *logical*
content ``[B, H, T, D]`` (T = ``cumulative_length``, column = absolute position), built on each read (never
on the forward path), when the layer has one: every KV head of a row holds the same tokens and a row's held
tokens run unbroken up to T. Columns before a row's first held token are left padding, never stored, and
read as zeros (the attention mask hides them). Otherwise reading them raises
:class:`~lukv_cache.errors.RaggedCacheError`; :meth:`LUKVLayer.head_tokens` reads one (row, KV head).
"""

from __future__ import annotations

from typing import cast

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ..errors import (
    BatchIndexError,
    BatchMismatchError,
    ConfigurationError,
    RaggedCacheError,
    UnsupportedOperationError,
)
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
    >>> layer.keys.shape, layer.suffix_keys.shape  # logical content; the dense suffix
    (torch.Size([1, 2, 5, 4]), torch.Size([1, 2, 5, 4]))
    """

    def __init__(
        self,
        sliding_window: int | None = None,
        *,
        kv_bits: int | None = None,
        fold_at: int = FOLD_AT,
        bounded: bool = False,
    ) -> None:
        # kv_bits, fold_at, bounded: fixed at construction by the cache's policy (LayerFactory)
        self.suffix_keys: torch.Tensor | None = None
        self.suffix_values: torch.Tensor | None = None
        super().__init__()
        # a sliding-window layer compressed like a full one (its prompt fit the window): the mask hides what
        # is older than the window by position, and folds drop those tokens (:meth:`slide`)
        self.sliding_window = sliding_window
        self.keeps_past = False  # assisted decoding may crop back into the window: drop nothing
        if sliding_window is not None:
            self.is_sliding = True
            self._sliding_window_tensor = torch.tensor(sliding_window, dtype=torch.long)
        self.cumulative_length = 0
        self.store: RaggedStore | None = None
        self._kbuf: torch.Tensor | None = None  # the suffix buffers, [B, H, capacity, D]
        self._vbuf: torch.Tensor | None = None
        self._suffix_len = 0
        self.compressed = False
        # [B] sinks still to protect per row (a chunk of a chunked prefill may be all padding); the cache's
        # eviction reads and updates it, batch operations keep it aligned with the rows
        self.sinks_left: torch.Tensor | None = None
        self.fold_at = fold_at  # fold a decoding suffix this long into the store
        self.bounded = bounded  # the suffix buffer never grows past fold_at + 1 (eviction at fold time)
        # logical length at the last eviction or fold: eviction at fold time counts the tokens since then
        self.settled_length = 0
        # [B, H_q, W, D]: the last post-RoPE queries, kept while they may score a fold (record_queries)
        self.queries: torch.Tensor | None = None
        self.kv_bits = kv_bits  # the store's bits per key / value entry (None: the model's dtype)

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

    @property
    def suffix_buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole dense-suffix key and value buffers, ``[B, H, capacity, D]`` each (None before the first
        update): :attr:`suffix_keys` / :attr:`suffix_values` are views of their first :attr:`suffix_length`
        tokens, the rest is room to decode into. To read (memory accounting by storage), never to write."""
        return None if self._kbuf is None or self._vbuf is None else (self._kbuf, self._vbuf)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self._kbuf = key_states.new_empty((b, h, 0, d))
        self._vbuf = value_states.new_empty((b, h, 0, value_states.shape[-1]))
        self._suffix_len = 0
        self._sync_views()
        if self.sliding_window is not None:
            self._sliding_window_tensor = self._sliding_window_tensor.to(self.device)
        self.is_initialized = True

    def _sync_views(self) -> None:
        assert self._kbuf is not None and self._vbuf is not None  # initialized
        self.suffix_keys = self._kbuf[:, :, : self._suffix_len]
        self.suffix_values = self._vbuf[:, :, : self._suffix_len]

    # ------------------------------------------------------------------ reading the layer
    @property
    def keys(self) -> torch.Tensor | None:
        """``[B, H, T, D]``: the logical keys (see the module docstring), ``None`` before the first update;
        :class:`~lukv_cache.errors.RaggedCacheError` when the heads of a row hold different tokens."""
        return self._logical(values=False)

    @keys.setter
    def keys(self, value) -> None:
        self._assign("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """``[B, H, T, D]``: the logical values, as :attr:`keys`."""
        return self._logical(values=True)

    @values.setter
    def values(self, value) -> None:
        self._assign("values", value)

    def _assign(self, name: str, value) -> None:
        # transformers' CacheLayerMixin.__init__ (and DynamicLayer.reset) set keys/values to None
        if value is None and not getattr(self, "is_initialized", False):
            return
        raise UnsupportedOperationError(
            f"LUKVLayer.{name} cannot be assigned: it is computed from the layer's ragged store and dense suffix. "
            "Change a LUKVCache through its own methods (update, crop, reset, reorder_cache, "
            "batch_select_indices, batch_repeat_interleave), or copy its content into a DynamicCache."
        )

    def head_tokens(self, row: int, head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What KV head ``head`` of batch row ``row`` holds, oldest first: int64 positions ``[n]`` (the
        absolute column of each token), keys ``[n, D]`` and values ``[n, D]`` (store, then suffix).

        >>> layer = LUKVLayer()
        >>> _ = layer.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
        >>> positions, keys, values = layer.head_tokens(0, 1)
        >>> positions.tolist(), keys.shape
        ([0, 1, 2], torch.Size([3, 4]))
        """
        if not self.is_initialized:
            raise BatchIndexError(
                "head_tokens: the layer holds nothing yet; run a forward with the cache first.",
                index=row,
                batch=0,
            )
        if not (0 <= row < self.batch_size and 0 <= head < self.num_heads):
            raise BatchIndexError(
                f"head_tokens({row}, {head}): the layer holds {self.batch_size} rows x {self.num_heads} KV heads",
                index=row,
                batch=self.batch_size,
            )
        assert self._kbuf is not None and self._vbuf is not None  # initialized
        assert self.suffix_keys is not None and self.suffix_values is not None  # initialized
        s, t = self._suffix_len, self.cumulative_length
        device = self._kbuf.device
        suffix_pos = torch.arange(t - s, t, device=device)
        if self.store is None:
            return suffix_pos, self.suffix_keys[row, head], self.suffix_values[row, head]
        seg = row * self.num_heads + head
        a, b = self.store.offsets_list[seg], self.store.offsets_list[seg + 1]
        positions = torch.cat([self.store.positions[a:b].long().to(device), suffix_pos])
        stored_k, stored_v = self.store.dense(a, b)
        keys = torch.cat([stored_k.to(device), self.suffix_keys[row, head]])
        values = torch.cat([stored_v.to(device), self.suffix_values[row, head]])
        return positions, keys, values

    def _logical(self, *, values: bool) -> torch.Tensor | None:
        """The logical ``[B, H, T, D]`` keys (or values): store tokens at their positions, the suffix in
        the last S columns, zeros before each row's first held token (left padding). A sliding layer gives
        its last ``sliding_window - 1`` columns, what ``DynamicSlidingWindowLayer`` holds."""
        full = self._logical_full(values=values)
        w = self.sliding_window
        if full is None or w is None or full.shape[-2] <= w - 1:
            return full
        return full[:, :, full.shape[-2] - (w - 1) :]

    def _logical_full(self, *, values: bool) -> torch.Tensor | None:
        if not self.is_initialized:
            return None
        suffix = self.suffix_values if values else self.suffix_keys
        assert suffix is not None  # initialized
        b, h, s, d = suffix.shape
        t = self.cumulative_length
        if self.store is None and s == t:
            return suffix
        out = suffix.new_zeros((b, h, t, d))
        out[:, :, t - s :] = suffix
        if self.store is None or self.store.num_tokens == 0:
            return out
        store = self.store
        counts = store.counts().view(b, h).cpu()
        flat = store.dense()[1 if values else 0].to(out.device)
        for row in range(b):
            held = counts[row]
            a, n = store.offsets_list[row * h], int(held[0])
            if bool((held != n).any()):
                self._ragged(
                    f"KV heads hold different numbers of tokens (row {row}: {held.tolist()} per head)"
                )
            if n == 0:
                continue
            pos = store.positions[a : a + n * h].view(h, n).long()
            if not bool((pos == pos[:1]).all()):
                self._ragged(f"KV heads hold different tokens (row {row})")
            first = int(pos[0, 0])
            if first + n != t - s or int(pos[0, -1]) != t - s - 1:
                self._ragged(
                    f"row {row} holds {n + s} of its tokens from position {first} on, out of {t - first}: the "
                    "others were evicted"
                )
            out[row, :, first : t - s] = flat[a : a + n * h].view(h, n, d)
        return out

    def _ragged(self, why: str) -> None:
        raise RaggedCacheError(
            f"This LUKVCache layer has no dense [batch, kv_heads, tokens, head_dim] keys/values: {why}. "
            "layer.keys / layer.values and iterating the cache (what DynamicCache readers do) give the logical "
            "content only while every KV head of a row holds the same tokens, with none missing after the "
            "row's first (e.g. at ratio 0). Read a compressed layer as it is stored: "
            "layer.head_tokens(row, head) gives one (row, KV head)'s positions, keys and values; layer.store is "
            "the ragged store (store.keys / store.values [N, head_dim], every kept token of every (row, KV head) "
            "back to back, segment row * kv_heads + head at store.offsets[s]:store.offsets[s + 1], "
            "store.positions their original positions) and layer.suffix_keys / layer.suffix_values "
            "[batch, kv_heads, S, head_dim] the dense suffix, the layer's last S positions in every head; "
            "cache.stored_tokens() counts the tokens per (layer, row, KV head)."
        )

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
        assert self._kbuf is not None and self._vbuf is not None  # initialized
        assert self.suffix_keys is not None and self.suffix_values is not None  # initialized
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
                self._set_suffix(self.suffix_keys, self.suffix_values, capacity=max(s + n, grow))
        self._kbuf[:, :, s : s + n] = key_states
        self._vbuf[:, :, s : s + n] = value_states
        self._suffix_len = s + n
        self._sync_views()

    # ------------------------------------------------------------------ transformers' layer API
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens; returns the dense suffix (``suffix_keys``, ``suffix_values``): the very
        tensors lukv's attention matches the layer's announced call by."""
        if torch.compiler.is_exporting():
            raise UnsupportedOperationError(
                "torch.export does not support LUKVCache: its layers change shape and layout (eviction, a ragged "
                "store) in Python at every forward, which an exported graph cannot replay. Export the model "
                "with transformers' StaticCache (or without a cache), and use LUKVCache in eager PyTorch."
            )
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
        assert self.suffix_keys is not None and self.suffix_values is not None  # initialized
        return self.suffix_keys, self.suffix_values

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def reset(self) -> None:
        self.store = None
        self._kbuf = self._vbuf = None
        self._suffix_len = 0
        self.suffix_keys = self.suffix_values = None
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
        assert self._kbuf is not None and self._vbuf is not None  # initialized
        assert self.suffix_keys is not None and self.suffix_values is not None  # initialized
        rows = rows.to(self._kbuf.device)
        self._set_suffix(
            self.suffix_keys.index_select(0, rows),
            self.suffix_values.index_select(0, rows),
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

    def batch_select_indices(self, indices) -> None:
        """Keep the batch rows ``indices`` selects, as ``DynamicCache`` does (``keys[indices, ...]``): a
        tensor, tuple or list of row indices (negative ones count from the end) or a bool mask over the
        rows; out of range is a :class:`~lukv_cache.errors.BatchIndexError` (the cache is unchanged)."""
        if self.is_initialized:
            self._select_rows(select_rows(indices, self.batch_size))

    # ------------------------------------------------------------------ offloading (transformers' layer API)
    def offload(self) -> None:
        """Move every tensor the layer holds to the CPU (transformers' ``Cache(offloading=True)``)."""
        if self.is_initialized:
            self._move("cpu")

    def prefetch(self) -> None:
        """Move an offloaded layer back to its device."""
        if self.is_initialized and cast(torch.Tensor, self._kbuf).device != self.device:
            self._move(self.device)

    def _move(self, device) -> None:
        assert self._kbuf is not None and self._vbuf is not None  # initialized
        self._kbuf = self._kbuf.to(device, non_blocking=True)
        self._vbuf = self._vbuf.to(device, non_blocking=True)
        if self.sinks_left is not None:
            self.sinks_left = self.sinks_left.to(device, non_blocking=True)
        if self.queries is not None:
            self.queries = self.queries.to(device, non_blocking=True)
        if self.store is not None:
            self.store = self.store.to(device)
        self._sync_views()

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
        assert self.suffix_keys is not None and self.suffix_values is not None  # initialized
        r = keep.shape[-1]
        start = self.cumulative_length - self._suffix_len
        self._absorb(self.suffix_keys[:, :, :r], self.suffix_values[:, :, :r], keep, start, scores)
        kept = self._suffix_len - r
        self._set_suffix(
            self.suffix_keys[:, :, r:], self.suffix_values[:, :, r:], capacity=kept + _MIN_SUFFIX_CAPACITY
        )
        self.compressed = True
        self.settled_length = self.cumulative_length
        self.queries = None
        self.drop_out_of_window()

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
            self.store = RaggedStore.build(
                new_k, new_v, new_pos, counts, num_heads=h, scores=new_s, kv_bits=self.kv_bits
            )
        else:
            self.store = self.store.extend(new_k, new_v, new_pos, counts, new_s)

    def fold(self) -> None:
        """Move the whole dense suffix into the ragged store (nothing evicted) and start an empty one."""
        s = self._suffix_len
        if not s:
            return
        assert self._kbuf is not None and self._vbuf is not None  # initialized
        assert self.suffix_keys is not None and self.suffix_values is not None  # initialized
        keep = torch.ones(self.batch_size, self.num_heads, s, dtype=torch.bool, device=self._kbuf.device)
        self._absorb(self.suffix_keys, self.suffix_values, keep, self.cumulative_length - s)
        self._set_suffix(self.suffix_keys[:, :, :0], self.suffix_values[:, :, :0], capacity=self.fold_at + 1)
        self.slide()

    def activate_past_recording(self) -> None:
        """Assisted decoding crops rejected drafts: a sliding layer then keeps the tokens it could drop."""
        self.keeps_past = True

    @property
    def window_start(self) -> int | None:
        """A sliding layer: the oldest logical column a later query can read (the next token, at column
        ``cumulative_length``, reads columns after ``cumulative_length - sliding_window``, as transformers'
        sliding mask and ``DynamicSlidingWindowLayer``, which keeps the last ``sliding_window - 1``); ``None``
        for a full-attention layer."""
        return None if self.sliding_window is None else self.cumulative_length - self.sliding_window + 1

    def slide(self) -> None:
        """A sliding layer: drop the stored tokens no later query can attend (older than :attr:`window_start`)."""
        oldest = self.window_start
        if oldest is None or self.keeps_past or self.store is None or not self.store.num_tokens:
            return
        if oldest > 0 and int(self.store.positions.min()) < oldest:
            self.store = self.store.select(self.store.positions >= oldest)

    def drop_out_of_window(self) -> None:
        """A sliding layer: drop what no later query can attend from the dense suffix too (the prompt's
        tokens older than the window, once its forward attended them), so that a sliding layer never holds
        a long prompt whole while the rest of the prefill runs; nothing while it keeps its past."""
        oldest = self.window_start
        if oldest is None or self.keeps_past or not self._suffix_len:
            return
        assert self.suffix_keys is not None and self.suffix_values is not None  # initialized
        drop = oldest - (self.cumulative_length - self._suffix_len)  # suffix tokens before it
        if drop > 0:
            self._set_suffix(self.suffix_keys[:, :, drop:], self.suffix_values[:, :, drop:])
        self.slide()

    def refold(
        self, source: torch.Tensor, counts: torch.Tensor, scores: torch.Tensor | None, capacity: int
    ) -> None:
        """Rebuild the store from what the layer holds and empty the suffix (eviction at fold time).

        ``source``: int64 ``[K]``, the kept tokens in store layout (segment-major, positions ascending),
        each a row of the store (``< N``) or a suffix token (``N +`` its flat index into ``[B, H, S]``);
        ``counts [B * H]``: kept tokens per segment; ``scores [K]``: stored with them (or ``None``);
        ``capacity``: the new suffix buffer's, in tokens."""
        assert self.suffix_keys is not None and self.suffix_values is not None  # initialized
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
        new_k, new_v = (
            gather_ragged(self.suffix_keys, in_suffix),
            gather_ragged(self.suffix_values, in_suffix),
        )
        if self.store is not None and self.store.kv_bits is not None:
            # the suffix's kept tokens quantized as the store's (each row on its own): the stored rows'
            # codes are moved, never quantized again
            new_k, new_v = self.store.quantize_like(new_k, new_v)
            stored_k = None if store is None else store.keys
            stored_v = None if store is None else store.values
            keys = new_k.with_tensors(*(pick(a, b) for a, b in zip(_parts(stored_k), new_k.tensors())))
            values = new_v.with_tensors(*(pick(a, b) for a, b in zip(_parts(stored_v), new_v.tensors())))
        else:  # a full-precision store: its rows are tensors
            keys = pick(None if store is None else cast(torch.Tensor, store.keys), new_k)
            values = pick(None if store is None else cast(torch.Tensor, store.values), new_v)
        positions = pick(None if store is None else store.positions, suffix_pos)
        self.store = RaggedStore.build(
            keys,
            values,
            positions,
            counts.to(positions.device),
            num_heads=self.num_heads,
            scores=scores,
            kv_bits=self.kv_bits,
        )
        self._set_suffix(self.suffix_keys[:, :, :0], self.suffix_values[:, :, :0], capacity=capacity)
        self.compressed = True
        self.settled_length = self.cumulative_length
        self.queries = None
        self.slide()

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
            assert self.suffix_keys is not None and self.suffix_values is not None  # initialized
            layer.update(self.suffix_keys.clone(), self.suffix_values.clone())
        return layer


def _parts(rows) -> tuple:
    """A quantized store's codes, scales and zeros (three ``None`` without a store)."""
    return (None, None, None) if rows is None else rows.tensors()


def select_rows(indices, batch: int) -> torch.Tensor:
    """int64 row indices from what ``DynamicCache.batch_select_indices`` accepts (``keys[indices, ...]``):
    a tensor, tuple, list or range of indices (negative from the end), a bool mask of ``batch`` rows, a
    slice or an int. Out of range is a ``BatchIndexError``; a mask of another length, or float indices,
    a ``ConfigurationError``.

    >>> select_rows((0, 2), 3).tolist(), select_rows(torch.tensor([True, False, True]), 3).tolist()
    ([0, 2], [0, 2])
    """
    if isinstance(indices, slice):
        return torch.arange(batch)[indices]
    index = indices.detach().cpu() if isinstance(indices, torch.Tensor) else torch.as_tensor(indices)
    if index.dtype == torch.bool:
        if index.shape != (batch,):
            raise ConfigurationError(
                f"batch_select_indices: a bool mask must have one entry per row ({batch}), got shape "
                f"{list(index.shape)}."
            )
        return index.nonzero().flatten()
    if index.is_floating_point() or index.is_complex() or index.dim() > 1:
        raise ConfigurationError(
            f"batch_select_indices takes row indices (ints) or a bool mask over the {batch} rows, got "
            f"{index.dtype} of shape {list(index.shape)}."
        )
    index = index.long().reshape(-1)
    bad = (index < -batch) | (index >= batch)
    if bool(bad.any()):
        row = int(index[bad][0])
        raise BatchIndexError(
            f"batch_select_indices: row {row} is out of range for a batch of {batch} rows "
            f"(valid: {-batch}..{batch - 1}); the cache is unchanged.",
            index=row,
            batch=batch,
        )
    return index % batch if batch else index
