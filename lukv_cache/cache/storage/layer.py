"""One full-attention layer's storage: a ragged compressed prefix plus a dense suffix.

* **Ragged store** (:class:`~lukv_cache.cache.storage.ragged.RaggedStore`): every kept token of every (batch row,
  KV head) back to back in one flat ``[N, D]`` tensor for keys and one for values, with segment offsets
  and each token's original position (for masks and ``crop``).
* **Dense suffix**: ``[B, H, S, D]``, the protected recent window and every token that arrives after
  compression, appended in place into a buffer that grows geometrically (no per-step copy of anything).
* **Tail** (a quantized store on CPU, :class:`~lukv_cache.cache.storage.tail.StoreTail`): the rows folds that
  evict nothing appended in place beside the store since it was built; reading :attr:`LUKVLayer.store` joins it.

The layer owns its tensors and knows nothing of eviction policy: the cache decides what to keep and calls
:meth:`LUKVLayer.evict`. What compression keeps about the layer between its steps (the sinks each row has
left, the length at the last eviction, recorded queries) is compression's :class:`~.record.EvictionRecord`,
``layer.eviction``, which the layer only carries: its batch operations, device moves, ``crop`` and state
take it along. ``fold_at`` and ``bounded`` are storage settings (how far the dense suffix grows while
decoding, fixed when the layer is built), so they are the layer's. Lengths reported to transformers are *logical* (tokens seen), never the stored
count: transformers builds one mask per forward from them and indexes padding by absolute position.

``suffix_keys`` / ``suffix_values`` are the dense suffix (what :meth:`LUKVLayer.update` returns, and what
attention reads beside the store). ``keys`` / ``values`` are what a ``DynamicLayer`` holds, the *logical*
content ``[B, H, T, D]`` (T = ``cumulative_length``, column = absolute position), built on each read (never
on the forward path), when the layer has one: every KV head of a row holds the same tokens and a row's held
tokens run unbroken up to T. Columns before a row's first held token are left padding, never stored, and
read as zeros (the attention mask hides them). Otherwise reading them raises
:class:`~lukv_cache.errors.RaggedCacheError`; :meth:`LUKVLayer.head_tokens` reads one (row, KV head).

Its parts: the suffix (:mod:`.suffix`), the store's absorb and rebuild (:mod:`.merge`), its tail (:mod:`.tail`), the logical view
(:mod:`.logical`), the sliding window (:mod:`.window`), batch rows and offloading (:mod:`.rows`), its
state for saved contexts (:mod:`.layer_state`) and the eviction record it carries (:mod:`.record`).
"""

from __future__ import annotations

from typing import cast

import torch
from transformers.cache_utils import DynamicLayer

from ...errors import BatchIndexError, BatchMismatchError, UnsupportedOperationError
from .layer_state import LayerState
from .logical import head_tokens, logical_content
from .merge import absorb, append, rebuild
from .ragged import RaggedStore
from .record import EvictionRecord
from .rows import BatchRows
from .suffix import MIN_CAPACITY, DenseSuffix
from .tail import StoreTail, TailedStore
from .window import SlidingWindow

# A decoding suffix this long is folded into the ragged store: the store is rebuilt once per this many steps
# (amortised O(store / 256) per step), the buffer's slack stays bounded. A cache's LayerFactory sets fold_at.
FOLD_AT = 256


class LUKVLayer(SlidingWindow, BatchRows, LayerState, DynamicLayer):
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
        self.suffix: DenseSuffix | None = None  # the dense suffix (None before the first update)
        super().__init__()
        # a sliding-window layer compressed like a full one (its prompt fit the window): the mask hides what
        # is older than the window by position, and folds drop those tokens (:meth:`slide`)
        self.set_window(sliding_window)
        self.cumulative_length = 0
        self._store: RaggedStore | None = None
        # the rows decoding appended to a quantized store in place (an appending fold), not yet joined to it
        self.tail: StoreTail | None = None
        self.compressed = False
        # compression's bookkeeping of this layer (sinks left, settled length, recorded queries): compression
        # writes it, the layer carries it through its batch operations, device moves, crop and state
        self.eviction = EvictionRecord()
        # storage settings: how the dense suffix grows while decoding
        self.fold_at = fold_at  # fold a decoding suffix this long into the store
        self.bounded = bounded  # the suffix buffer never grows past fold_at + 1 (eviction at fold time)
        self.kv_bits = kv_bits  # the store's bits per key / value entry (None: the model's dtype)

    # ------------------------------------------------------------------ the ragged store
    @property
    def store(self) -> RaggedStore | None:
        """The ragged store (``None`` before compression), with any rows appended in place since it was built
        (:attr:`tail`) joined to it first."""
        if self.tail is not None:
            self._join_tail()
        return self._store

    @store.setter
    def store(self, value: RaggedStore | None) -> None:
        self._store, self.tail = value, None

    def _join_tail(self) -> RaggedStore | None:
        if self.tail is not None:
            assert self._store is not None  # a tail is only ever beside a store
            self._store, self.tail = self.tail.join(self._store), None
        return self._store

    def attended_store(self) -> RaggedStore | TailedStore | None:
        """What attention reads: the store, or a :class:`~.tail.TailedStore` over it and its pending tail (the
        CPU kernel reads both as they are; any other read joins them once)."""
        if self.tail is None or self._store is None:
            return self._store
        return TailedStore(self._store, self.tail, self._join_tail)  # type: ignore[arg-type]

    def store_parts(self) -> tuple[RaggedStore | None, StoreTail | None]:
        """The store and its pending tail as they are, without joining them (an evicting fold reads both and
        builds the next store from their rows: :class:`~lukv_cache.cache.compression.fold_plan.Held`)."""
        return self._store, self.tail

    def store_counts(self) -> torch.Tensor | None:
        """int64 ``[B * H]``: tokens per segment in the store and its tail (``None`` without a store), without
        joining them."""
        if self._store is None:
            return None
        counts = self._store.counts()
        return counts if self.tail is None else counts + self.tail.length

    # ------------------------------------------------------------------ the dense suffix
    @property
    def batch_size(self) -> int:
        return 0 if self.suffix is None else self.suffix.batch_size

    @property
    def num_heads(self) -> int:
        return 0 if self.suffix is None else self.suffix.num_heads

    @property
    def suffix_length(self) -> int:
        return 0 if self.suffix is None else self.suffix.length

    @property
    def suffix_keys(self) -> torch.Tensor | None:
        """``[B, H, S, D]``: the dense suffix's keys (the layer's last S positions), None before the first update."""
        return None if self.suffix is None else self.suffix.keys

    @property
    def suffix_values(self) -> torch.Tensor | None:
        """``[B, H, S, D]``: the dense suffix's values."""
        return None if self.suffix is None else self.suffix.values

    @property
    def suffix_buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole dense-suffix key and value buffers, ``[B, H, capacity, D]`` each (None before the first
        update): :attr:`suffix_keys` / :attr:`suffix_values` are views of their first :attr:`suffix_length`
        tokens, the rest is room to decode into. To read (memory accounting by storage), never to write."""
        return None if self.suffix is None else (self.suffix.key_buffer, self.suffix.value_buffer)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        empty = key_states.new_empty((b, h, 0, d)), value_states.new_empty((b, h, 0, value_states.shape[-1]))
        self.suffix = DenseSuffix(*empty)
        if self.sliding_window is not None:
            self._sliding_window_tensor = self._sliding_window_tensor.to(self.device)
        self.is_initialized = True

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        suffix = cast(DenseSuffix, self.suffix)  # initialized
        s, n = suffix.length, key_states.shape[-2]
        if s + n > suffix.capacity:
            if self.compressed and n == 1 and s >= self.fold_at:
                self.fold()
            else:
                # geometric growth while decoding (up to the fold size); exact size for a multi-token forward
                # (a prompt, a chunk, a question: what DynamicCache would add, no more)
                grow = max(2 * (s + n), MIN_CAPACITY) if n == 1 else 0
                if self.compressed and n == 1 or self.bounded:
                    grow = min(grow, self.fold_at + 1)
                self.suffix = DenseSuffix.of(suffix.keys, suffix.values, capacity=max(s + n, grow))
        cast(DenseSuffix, self.suffix).write(key_states, value_states)

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

    def _logical(self, *, values: bool) -> torch.Tensor | None:
        """The logical keys (or values), :func:`~lukv_cache.cache.storage.logical.logical_content`; a sliding layer
        gives its last ``sliding_window - 1`` columns, what ``DynamicSlidingWindowLayer`` holds."""
        if self.suffix is None:
            return None
        suffix = self.suffix.values if values else self.suffix.keys
        full = logical_content(self.store, suffix, self.cumulative_length, values=values)
        w = self.sliding_window
        if w is None or full.shape[-2] <= w - 1:
            return full
        return full[:, :, full.shape[-2] - (w - 1) :]

    def head_tokens(self, row: int, head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What KV head ``head`` of batch row ``row`` holds, oldest first: int64 positions ``[n]`` (the
        absolute column of each token), keys ``[n, D]`` and values ``[n, D]`` (store, then suffix).

        >>> layer = LUKVLayer()
        >>> _ = layer.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
        >>> positions, keys, values = layer.head_tokens(0, 1)
        >>> positions.tolist(), keys.shape
        ([0, 1, 2], torch.Size([3, 4]))
        """
        if self.suffix is None:
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
        suffix = self.suffix
        return head_tokens(self.store, suffix.keys, suffix.values, self.cumulative_length, row, head)

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
        suffix = cast(DenseSuffix, self.suffix)
        return suffix.keys, suffix.values

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def reset(self) -> None:
        self.store = None  # and its tail
        self.suffix = None
        self.cumulative_length = 0
        self.compressed = False
        self.eviction = EvictionRecord()
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` logical tokens (transformers passes a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead."
            )
        n = -tokens_to_remove
        if n == 0 or self.suffix is None:
            return
        n = min(n, self.cumulative_length)
        self.cumulative_length -= n
        self.eviction.crop(self.cumulative_length)
        if n <= self.suffix.length:
            self.suffix.truncate(self.suffix.length - n)
            return
        self.suffix.truncate(0)
        if self.store is not None:
            self.store = self.store.select(self.store.positions < self.cumulative_length)

    # ------------------------------------------------------------------ accounting
    def memory_bytes(self) -> int:
        """Bytes of every tensor this layer holds (store, positions, offsets, suffix buffers, its eviction
        record's)."""
        total = self.eviction.memory_bytes()
        total += 0 if self.suffix is None else self.suffix.memory_bytes()
        total += 0 if self.tail is None else self.tail.memory_bytes()
        return total + (self._store.memory_bytes() if self._store is not None else 0)

    def stored_counts(self) -> torch.Tensor:
        """int64 ``[B, H]``: tokens stored per (batch row, KV head), ragged store plus suffix."""
        if not self.is_initialized:
            return torch.zeros(0, 0, dtype=torch.long)
        b, h = self.batch_size, self.num_heads
        counts = torch.full((b, h), self.suffix_length, dtype=torch.long)
        stored = self.store_counts()
        if stored is not None:
            counts += stored.view(b, h).cpu()
        return counts

    # ------------------------------------------------------------------ eviction and folds
    def evict(self, keep: torch.Tensor, scores: torch.Tensor | None = None) -> None:
        """Move the kept tokens of the suffix's first ``R`` tokens (``keep [B, H, R]``) into the ragged store
        and drop the rest; the suffix then holds its last ``S - R`` tokens (the protected window) in a buffer
        of just those: the first decoded token grows it (geometrically while decoding, :meth:`_append`), so a
        compressed prompt holds no room it has not used yet.
        ``scores [B, H, R]``: stored with the kept tokens (eviction at fold time reuses them)."""
        suffix = cast(DenseSuffix, self.suffix)  # initialized
        r = keep.shape[-1]
        start = self.cumulative_length - suffix.length
        self.store = absorb(
            self.store, suffix.keys[:, :, :r], suffix.values[:, :, :r], keep, start, scores, self.kv_bits
        )
        kept = suffix.keys[:, :, r:], suffix.values[:, :, r:]
        self.suffix = DenseSuffix.of(*kept, capacity=suffix.length - r)
        self.compressed = True  # compression settles the layer's eviction record
        self.drop_out_of_window()

    def fold(
        self,
        room: int | None = None,
        valid: torch.Tensor | None = None,
        scores: torch.Tensor | None = None,
        tail_room: int = 0,
    ) -> None:
        """Move the whole dense suffix into the ragged store (nothing evicted) and start an empty one of
        ``room`` tokens (``None``: ``fold_at + 1``, what decoding fills before the next fold). ``valid``: bool
        ``[B, S]``, the suffix's real tokens (padding is dropped); ``None``: all of them. ``scores [B, H, >= S]``:
        stored with them (a store that keeps scores for eviction at fold time), the last ``S`` when longer
        (scored before a sliding layer dropped its oldest). ``tail_room``: a quantized store on CPU appends in
        place, into a :class:`~.tail.StoreTail` with room for this many tokens per segment (the folds the
        caller expects to append before the next eviction), instead of rebuilding the store; 0: rebuild."""
        suffix = self.suffix
        if suffix is None or not suffix.length:
            return
        s = suffix.length
        start = self.cumulative_length - s
        if scores is not None:  # a sliding layer may have dropped its oldest tokens since they were scored
            scores = scores[..., scores.shape[-1] - s :]
        if valid is None or bool(valid.all()):
            if self._tail_for(s, tail_room, scores) is not None:
                assert self.tail is not None and self._store is not None  # _tail_for made sure
                self.tail.write(suffix.keys, suffix.values, start, self._store, scores)
            else:
                self.store = append(self.store, suffix.keys, suffix.values, start, self.kv_bits, scores)
        else:
            keep = valid.to(suffix.keys.device).unsqueeze(1).expand(-1, suffix.num_heads, -1)
            self.store = absorb(self.store, suffix.keys, suffix.values, keep, start, scores, self.kv_bits)
        self.compressed = True  # it holds a store (a saved layer's state says so)
        capacity = self.fold_at + 1 if room is None else room
        if suffix.capacity == capacity:  # its own buffers again (a fold every few steps: no new ones)
            suffix.truncate(0)
        else:
            self.suffix = DenseSuffix.of(suffix.keys[:, :, :0], suffix.values[:, :, :0], capacity=capacity)
        self.slide()

    def _tail_for(self, tokens: int, room: int, scores: torch.Tensor | None) -> StoreTail | None:
        """The tail ``tokens`` appended tokens go to in place, or ``None``: appending rebuilds the store (no
        room asked, a store at the model's precision or off the CPU, a sliding layer, scores on one side only).
        A new tail has room for ``max(room, tokens)``; one without room for them grows by as much (a copy of
        the tail alone), or joins the store first once it holds :data:`FOLD_AT` tokens (a long run of folds that
        evict nothing: the store is then rebuilt once per ``FOLD_AT`` tokens, not at every fold)."""
        store = self._store
        if (
            room <= 0
            or store is None
            or store.kv_bits is None
            or store.offsets.device.type != "cpu"
            or self.sliding_window is not None
            or (scores is None) != (store.scores is None)
        ):
            return None
        if self.tail is not None and self.tail.room < tokens:  # more folds fit than it was sized for
            if self.tail.length >= FOLD_AT:
                self._join_tail()
            else:
                self.tail = self.tail.grown(self.tail.length + max(room, tokens))
        if self.tail is None:
            self.tail = StoreTail.beside(cast(RaggedStore, self._store), max(room, tokens))
        return self.tail

    def refold(
        self, source: torch.Tensor, counts: torch.Tensor, scores: torch.Tensor | None, capacity: int
    ) -> None:
        """Rebuild the store from what the layer holds and empty the suffix (eviction at fold time).

        ``source``: int64 ``[K]``, the kept tokens in store layout (segment-major, positions ascending),
        each a row of the store and its pending tail as :meth:`store_parts` gives them (``< N``: the store's
        rows, then the tail's slots) or a suffix token (``N +`` its flat index into ``[B, H, S]``), as
        :func:`~lukv_cache.cache.compression.fold_plan.held_tokens` numbers them; ``counts [B * H]``: kept
        tokens per segment; ``scores [K]``: stored with them (or ``None``); ``capacity``: the new suffix
        buffer's, in tokens. The tail is never joined first: the kept rows are gathered from both."""
        suffix = cast(DenseSuffix, self.suffix)  # initialized
        start = self.cumulative_length - suffix.length
        self.store = rebuild(
            self._store, suffix.keys, suffix.values, start, source, counts, scores, self.kv_bits, self.tail
        )
        self.suffix = DenseSuffix.of(suffix.keys[:, :, :0], suffix.values[:, :, :0], capacity=capacity)
        self.compressed = True  # compression settles the layer's eviction record
        self.slide()
