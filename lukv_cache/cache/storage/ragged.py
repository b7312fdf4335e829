"""The ragged store: every kept token of every (batch row, KV head) of one layer, back to back.

* ``keys``, ``values``: ``[N, D]``; segment ``s = b * H_kv + h`` is rows ``offsets[s]:offsets[s + 1]``;
* ``positions``: int16 ``[N]`` while every position is below 32768 (int32 from there on), each token's
  original (logical) position, ascending inside a segment;
* ``offsets``: int64 ``[B * H_kv + 1]``;
* ``scores``: fp32 ``[N]`` or ``None``, each token's score from when it was first scored (kept only when
  eviction at fold time reuses scores: ``decode_max_tokens`` with a scorer that keeps them, e.g. ``kvzap``).
* quantized (``LUKVCache(kv_bits=8 / 4)``): ``keys`` and ``values`` are
  :class:`~lukv_cache.cache.storage.quant.PackedRows` (codes, scales and zeros, row by row; :mod:`.quant`), and
  :meth:`RaggedStore.dense` gives a block of rows back at the model's precision.

:class:`RaggedStore` is the frozen view of one layer's store that attention reads; the functions below
build and edit stores on any device with one gather and no host sync (sizes come from shapes).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch

from .quant import PackedRows
from .state_check import StateCheck, StateShape

if TYPE_CHECKING:
    from collections.abc import Iterator


@dataclass(frozen=True, eq=False)
class RaggedStore:
    """One layer's compressed prefix (see the module docstring). ``offsets_list`` is the host copy of
    ``offsets``, read by the CPU kernels without a device sync.

    >>> store = RaggedStore.build(torch.zeros(3, 2), torch.zeros(3, 2), torch.tensor([0, 5, 1]),
    ...                           torch.tensor([2, 1]), num_heads=2)
    >>> store.counts().tolist(), store.segment_ids().tolist()
    ([2, 1], [0, 0, 1])
    """

    keys: torch.Tensor | PackedRows
    values: torch.Tensor | PackedRows
    positions: torch.Tensor
    offsets: torch.Tensor
    offsets_list: tuple[int, ...]
    num_heads: int
    scores: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        keys: torch.Tensor | PackedRows,
        values: torch.Tensor | PackedRows,
        positions: torch.Tensor,
        counts: torch.Tensor,
        *,
        num_heads: int,
        scores: torch.Tensor | None = None,
        kv_bits: int | None = None,
        last: int | None = None,
    ) -> RaggedStore:
        """A store from its rows and per-segment ``counts [B * H_kv]`` (offsets are their cumulative sum).

        ``kv_bits``: quantize full-precision ``keys``/``values``; rows already :class:`PackedRows` stay
        as they are. ``last``: no position is above it (the positions are then int16 where it fits)."""
        offsets = offsets_from_counts(counts.to(keys.device))
        if scores is not None:
            scores = scores.float()
        if last is not None:
            pos = positions.to(position_dtype(last))
        else:  # rows of a store (kept as they are) or positions of unknown range (int32)
            pos = positions if positions.dtype in (torch.int16, torch.int32) else positions.to(torch.int32)
        if kv_bits is not None and not isinstance(keys, PackedRows):
            values = cast(torch.Tensor, values)  # full precision like keys
            keys, values = PackedRows.quantize(keys, kv_bits), PackedRows.quantize(values, kv_bits)
        return cls(keys, values, pos, offsets, tuple(offsets.tolist()), int(num_heads), scores)

    @property
    def kv_bits(self) -> int | None:
        """Bits per stored key / value entry, ``None`` at the model's precision."""
        return self.keys.bits if isinstance(self.keys, PackedRows) else None

    def dense(self, start: int = 0, stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of rows ``start:stop`` at the model's precision (a quantized store dequantizes
        just those rows; a full-precision one returns views)."""
        stop = self.num_tokens if stop is None else stop
        if not isinstance(self.keys, PackedRows):
            return self.keys[start:stop], cast(torch.Tensor, self.values)[start:stop]
        return self.keys.dequantize(start, stop), cast(PackedRows, self.values).dequantize(start, stop)

    def quantize_like(self, keys: torch.Tensor, values: torch.Tensor):
        """New full-precision rows in this store's format (rows already quantized, e.g. a
        :class:`~.tail.StoreTail`'s, as they are). Keys and values of one width and dtype are
        quantized in one call (each row on its own, so the codes are the same), their rows then views of one
        block: the callers copy them into a merged store."""
        if not isinstance(self.keys, PackedRows) or isinstance(keys, PackedRows):  # or rows already quantized
            return keys, values
        bits = self.keys.bits
        if keys.shape[1:] != values.shape[1:] or keys.dtype != values.dtype:
            return PackedRows.quantize(keys, bits), PackedRows.quantize(values, bits)
        both, n = PackedRows.quantize(torch.cat([keys, values]), bits), keys.shape[0]
        return (
            both.with_tensors(*(t[:n] for t in both.tensors())),
            both.with_tensors(*(t[n:] for t in both.tensors())),
        )

    @property
    def num_segments(self) -> int:
        return len(self.offsets_list) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[0])

    def counts(self) -> torch.Tensor:
        """int64 ``[B * H_kv]``: tokens per segment."""
        return self.offsets.diff()

    def segment_ids(self) -> torch.Tensor:
        """int64 ``[N]``: the segment of every row."""
        return segment_ids_from_offsets(self.offsets, self.num_tokens)

    def select(self, keep: torch.Tensor) -> RaggedStore:
        """The rows where ``keep [N]`` is True (segments stay, possibly emptier)."""
        counts = torch.bincount(self.segment_ids()[keep], minlength=self.num_segments)
        scores = None if self.scores is None else self.scores[keep]
        return RaggedStore.build(
            _take(self.keys, keep),
            _take(self.values, keep),
            self.positions[keep],
            counts,
            num_heads=self.num_heads,
            scores=scores,
        )

    def select_rows(self, rows: torch.Tensor) -> RaggedStore:
        """Batch rows ``rows`` (any order, repeats allowed): beam reorder, repeat, select."""
        h = self.num_heads
        rows = rows.to(self.offsets.device)
        old = (rows.view(-1, 1) * h + torch.arange(h, device=rows.device)).flatten()  # new seg -> old seg
        starts, counts = self.offsets[:-1][old], self.counts()[old]
        idx = torch.repeat_interleave(starts - torch.cumsum(counts, 0) + counts, counts)
        idx = idx + torch.arange(idx.numel(), device=idx.device)
        scores = None if self.scores is None else self.scores[idx]
        return RaggedStore.build(
            _take(self.keys, idx),
            _take(self.values, idx),
            self.positions[idx],
            counts,
            num_heads=h,
            scores=scores,
        )

    def extend(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        counts: torch.Tensor,
        scores: torch.Tensor | None = None,
        last: int | None = None,
    ) -> RaggedStore:
        """Segment-wise append of new rows (segment-major, ``counts [S]``) after each segment's rows.
        ``scores``: the new rows' scores (NaN for rows without one, when only one side has scores);
        ``last``: no new position is above it (the store's positions widen to int32 when it passes int16's)."""
        added = [0, *itertools.accumulate(counts.tolist())]  # host offsets of the new rows
        keys, values = self.quantize_like(keys, values)
        bounds = tuple(a + b for a, b in zip(self.offsets_list, added))
        offsets = torch.tensor(bounds, dtype=torch.long, device=self.offsets.device)
        join: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
        if self.num_segments <= SLICED_SEGMENTS:  # few segments: one cat of each segment's two slices
            join = partial(_join_slices, self.offsets_list, added)
        else:
            new_offsets = torch.tensor(added, dtype=torch.long, device=self.offsets.device)
            join = RaggedMerge.of(self.offsets, self.num_tokens, new_offsets, keys.shape[0]).apply
        merged_k, merged_v = _merge(join, self.keys, keys), _merge(join, self.values, values)
        kind = torch.int32 if last is None else wider(self.positions.dtype, position_dtype(last))
        merged_p = join(self.positions.to(kind), positions)
        merged_s = None
        if self.scores is not None or scores is not None:
            old, new = (
                torch.full((n,), float("nan"), device=keys.device) if t is None else t.float()
                for t, n in ((self.scores, self.num_tokens), (scores, keys.shape[0]))
            )
            merged_s = join(old, new)
        return RaggedStore(merged_k, merged_v, merged_p, offsets, bounds, self.num_heads, merged_s)

    def to(self, device) -> RaggedStore:
        """The same store on ``device`` (offloading); ``offsets_list`` is already on the host."""
        moved: Iterator[Any] = (
            None if t is None else t.to(device, non_blocking=True) for t in self._tensors()
        )
        keys, values, positions, offsets, scores = moved
        return RaggedStore(keys, values, positions, offsets, self.offsets_list, self.num_heads, scores)

    def state_dict(self) -> dict[str, Any]:
        """Every field but ``offsets_list`` (the host copy of ``offsets``): tensors, ``num_heads``, and the
        quantized rows (:class:`~lukv_cache.cache.storage.quant.PackedRows`, a frozen dataclass of tensors and plain
        values) of a quantized store."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "offsets_list"}

    @classmethod
    def check_fields(cls, names, check: StateCheck) -> None:
        """Refuse a state with a field this store does not have, or without one it needs."""
        known = {f.name: f for f in dataclasses.fields(cls) if f.name != "offsets_list"}
        where = f"{check.where}.store"
        unknown = [n for n in names if n not in known]
        if unknown:
            check.fail(
                f"{check.label}'s store has fields {unknown} this lukv_cache's RaggedStore does not have (written "
                "by another version). Load it with the version that wrote it.",
                where,
            )
        no_default = dataclasses.MISSING
        needed = (n for n, f in known.items() if f.default is no_default and f.default_factory is no_default)
        missing = [n for n in needed if n not in names]
        if missing:
            check.fail(f"{check.label}'s store lacks the fields {missing} (damaged file).", where)

    @classmethod
    def from_state(
        cls, state: dict, check: StateCheck, shape: StateShape, batch: int, before: int, value_dim: int
    ) -> RaggedStore:
        """The store of :meth:`state_dict`, checked: offsets over ``batch * kv_heads`` segments ending at its
        length, every position below ``before`` (the suffix follows the store) and ascending inside its
        segment, every field with a row per token (keys and values of the model's head dim, ``value_dim``
        and dtype; in the cache's ``kv_bits`` when it quantizes)."""
        cls.check_fields(state, check)
        label, where = f"{check.label}'s store", f"{check.where}.store"
        for name in ("offsets", "positions"):
            if not isinstance(state[name], torch.Tensor):
                check.fail(f"{label} has no {name} tensor (damaged file).", f"{where}.{name}")
        segments = batch * shape.kv_heads
        offsets = check.tensor(state["offsets"], f"{where}.offsets", dtype=torch.int64, shape=(segments + 1,))
        kind = state["positions"].dtype if isinstance(state["positions"], torch.Tensor) else None
        kind = kind if kind in (torch.int16, torch.int32) else torch.int32  # int16 where the positions fit
        positions = check.tensor(state["positions"], f"{where}.positions", dtype=kind, ndim=1)
        n = int(positions.shape[0])
        counts = offsets.diff()
        if int(offsets[0]) != 0 or bool((counts < 0).any()) or int(offsets[-1]) != n:
            check.fail(
                f"{label} offsets do not run from 0 to its {n} tokens in order (damaged or altered file).",
                f"{where}.offsets",
            )
        if n:
            starts = torch.zeros(n, dtype=torch.bool, device=positions.device)
            starts[offsets[:-1][counts > 0].to(positions.device)] = True
            rising = positions[1:] > positions[:-1]
            if (
                int(positions.min()) < 0
                or int(positions.max()) >= before
                or not bool((rising | starts[1:]).all())
            ):
                check.fail(
                    f"{label} positions are not ascending in [0, {before}) within each (row, KV head), the "
                    "tokens before the dense suffix (damaged or altered file).",
                    f"{where}.positions",
                )
        for name, value in state.items():
            if name not in ("offsets", "num_heads") and not _holds_rows(value, n):
                check.fail(f"{label} {name} does not hold one row per token ({n}).", f"{where}.{name}")
        bits = shape.fold_state.get("kv_bits")
        for name in ("keys", "values"):
            value = state[name]
            dims = (
                tuple(value.shape) if isinstance(value, torch.Tensor) else tuple(getattr(value, "shape", ()))
            )
            dtype = getattr(value, "dtype", None)
            dim = shape.head_dim if name == "keys" else value_dim
            fits = (
                PackedRows.fits(value, bits, dim, n, shape.dtype)
                if bits is not None
                else isinstance(value, torch.Tensor)
            )
            if not fits or len(dims) != 2 or dims[1] != dim or dtype != shape.dtype:
                check.fail(
                    f"{label} {name} ({list(dims)}, {dtype}, {getattr(value, 'bits', None)} bits) do not fit "
                    f"the model and the cache ([{n}, {dim}], {shape.dtype}, kv_bits={bits}).",
                    f"{where}.{name}",
                )
        scores = state.get("scores")
        if scores is not None and (not isinstance(scores, torch.Tensor) or scores.dtype != torch.float32):
            check.fail(f"{label} scores are not float32.", f"{where}.scores")
        if state.get("num_heads") != shape.kv_heads:
            check.fail(
                f"{label} num_heads={state.get('num_heads')!r}, the model has {shape.kv_heads}.", where
            )
        return cls(**state, offsets_list=tuple(offsets.tolist()))

    def _tensors(self) -> tuple:
        return (self.keys, self.values, self.positions, self.offsets, self.scores)

    def memory_bytes(self) -> int:
        """Bytes of every tensor the store holds: keys and values (codes, scales and zeros when quantized),
        positions, offsets and scores."""
        total = 0
        for t in self._tensors():
            if isinstance(t, PackedRows):
                total += t.memory_bytes()
            elif t is not None:
                total += t.numel() * t.element_size()
        return total


def _holds_rows(value: Any, n: int) -> bool:
    """Whether every tensor of a store field (a tensor, or a dataclass of them) has ``n`` rows."""
    if isinstance(value, torch.Tensor):
        return value.ndim >= 1 and value.shape[0] == n
    if dataclasses.is_dataclass(value):
        parts = [getattr(value, f.name) for f in dataclasses.fields(value)]
        return all(
            _holds_rows(t, n) for t in parts if isinstance(t, torch.Tensor) or dataclasses.is_dataclass(t)
        )
    return value is None


def _take(rows, index: torch.Tensor):
    """Rows ``index`` of a store's keys or values (full precision or quantized)."""
    return rows.take(index) if isinstance(rows, PackedRows) else rows[index]


def _merge(join, first, second):
    """``join`` (:meth:`RaggedMerge.apply` or :func:`_join_slices`) applied to keys or values, full precision
    or quantized (each tensor alike)."""
    if not isinstance(first, PackedRows):
        return join(first, second)
    return first.with_tensors(*(join(a, b) for a, b in zip(first.tensors(), second.tensors())))


SLICED_SEGMENTS = 64  # up to this many segments, a merge is one cat of views (no index to build)


def _join_slices(
    first_offsets: Sequence[int], second_offsets: Sequence[int], first: torch.Tensor, second: torch.Tensor
) -> torch.Tensor:
    """What :meth:`RaggedMerge.apply` gives, from host offsets: each segment's rows of ``first`` then of
    ``second`` (in ``first``'s dtype), one ``torch.cat`` of each side's ``split`` (no index; on CPU a fold of a
    few segments is bound by the number of calls, not by the bytes).

    >>> _join_slices([0, 2, 3], [0, 1, 3], torch.tensor([1, 2, 3]), torch.tensor([7, 8, 9]))
    tensor([1, 2, 7, 3, 8, 9])
    """
    sizes = [b - a for a, b in itertools.pairwise(first_offsets)]
    added = [b - a for a, b in itertools.pairwise(second_offsets)]
    old, new = first.split(sizes), second.to(first.dtype).split(added)
    return torch.cat([part for pair in zip(old, new) for part in pair])


POSITION_LIMIT = 2**15  # positions below it are stored as int16


def position_dtype(last: int) -> torch.dtype:
    """The narrowest dtype the store keeps positions up to ``last`` in: int16 below 32768, else int32.

    >>> position_dtype(4095), position_dtype(40_000)
    (torch.int16, torch.int32)
    """
    return torch.int16 if last < POSITION_LIMIT else torch.int32


def wider(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The wider of two position dtypes."""
    return torch.int32 if torch.int32 in (a, b) else torch.int16


def segment_ids_from_offsets(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """int64 ``[total]``: the segment of every row of a flat store (``offsets [S+1]``, ``total = offsets[-1]``).

    ``total`` is passed in (``keys.shape[0]``), so this never waits for the device, unlike
    ``repeat_interleave`` without ``output_size``.

    >>> segment_ids_from_offsets(torch.tensor([0, 2, 2, 5]), 5)
    tensor([0, 0, 2, 2, 2])
    """
    counts = offsets.diff()
    ids = torch.arange(counts.numel(), device=offsets.device)
    return torch.repeat_interleave(ids, counts, output_size=total)


def offsets_from_counts(counts: torch.Tensor) -> torch.Tensor:
    """int64 ``[S+1]`` segment offsets from per-segment counts (any shape, flattened row-major).

    >>> offsets_from_counts(torch.tensor([[2, 0], [3, 1]]))
    tensor([0, 2, 2, 5, 6])
    """
    flat = counts.reshape(-1).long()
    offsets = torch.zeros(flat.numel() + 1, dtype=torch.long, device=flat.device)
    torch.cumsum(flat, 0, out=offsets[1:])
    return offsets


def keep_mask_from_counts(scores: torch.Tensor, keep_counts: torch.Tensor) -> torch.Tensor:
    """bool ``[..., T]``: the ``keep_counts[...]`` highest-scoring positions along the last dim.

    One stable sort for the whole layer (ties go to the earlier position); counts are clamped to
    ``[0, T]``. Positions scored ``-inf`` are only kept if the count asks for more than the rest.

    >>> keep_mask_from_counts(torch.tensor([[[0.1, 0.9, 0.5]]]), torch.tensor([[2]]))
    tensor([[[False,  True,  True]]])
    """
    t = scores.shape[-1]
    order = scores.argsort(dim=-1, descending=True, stable=True)
    counts = keep_counts.to(device=scores.device).clamp(0, t).unsqueeze(-1)
    kept_in_order = torch.arange(t, device=scores.device) < counts  # over ranks
    return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(
        -1, order, kept_in_order
    )


def keep_mask_evicting_few(scores: torch.Tensor, keep_counts: torch.Tensor) -> torch.Tensor:
    """bool ``[..., T]``: what ``keep_mask_from_counts(scores, keep_counts) & finite`` keeps, where
    ``keep_counts`` are at most each row's finite scores (``-inf``: a slot never kept, e.g. protected): found
    from the few it evicts (a fold evicts a few dozen tokens of thousands), by a partial selection of the lowest
    instead of a sort of the row; ties at the threshold evict the later positions, as the stable sort keeps
    the earlier ones.

    >>> keep_mask_evicting_few(torch.tensor([[0.5, 0.1, 0.1, float("-inf"), 0.9]]), torch.tensor([3]))
    tensor([[ True,  True, False, False,  True]])
    """
    finite = scores > float("-inf")
    kept = keep_counts.to(scores.device).clamp_min(0)
    drop = (finite.sum(-1) - kept).clamp_min(0)  # [...]: evicted per row
    most = int(drop.max()) if drop.numel() else 0
    if most == 0:
        return finite
    ranked = scores.masked_fill(~finite, float("inf"))
    lowest = ranked.topk(most, dim=-1, largest=False).values  # ascending
    threshold = lowest.gather(-1, (drop - 1).clamp_min(0).unsqueeze(-1))  # each row's drop-th lowest
    below = ranked < threshold
    ties = ranked == threshold
    need = drop.unsqueeze(-1) - below.sum(-1, keepdim=True)  # ties to evict, the last ones
    from_end = ties.flip(-1).cumsum(-1).flip(-1)  # ties at or after each slot
    evicted = (below | (ties & (from_end <= need))) & (drop.unsqueeze(-1) > 0)
    return finite & ~evicted


def flat_index_from_mask(keep: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """int64 ``[N]``: the flat indices (into ``keep.numel()``) of the True entries, ascending.

    With ``total`` (the number of True entries, when the caller knows it on the host) no device sync
    happens; without it, one (for the count, as ``nonzero`` does).

    >>> flat_index_from_mask(torch.tensor([[False, True], [True, True]]), total=3)
    tensor([1, 2, 3])
    """
    flat = keep.reshape(-1)
    if total is None:
        return flat.nonzero().squeeze(-1)
    # Scatter every kept index to its rank among the kept; the rest go to one spare slot, dropped after.
    rank = torch.cumsum(flat, 0) - 1
    target = torch.where(flat, rank, torch.full_like(rank, total))
    index = torch.empty(total + 1, dtype=torch.long, device=flat.device)
    index.scatter_(0, target, torch.arange(flat.numel(), device=flat.device))
    return index[:total]


def gather_into_slots(
    rows: torch.Tensor, index: torch.Tensor, new: torch.Tensor, new_slots: torch.Tensor
) -> torch.Tensor:
    """``[len(index), ...]`` in ``new``'s dtype: ``rows[index]`` in every slot, then ``new``'s rows copied into
    ``new_slots`` (the slots whose index is a placeholder). How a fold merges a store's kept rows with a few
    suffix rows without copying the whole store beside them (a cat then a gather did; a bool mask per use, or
    ``index_copy_`` of every row, cost several times more on CPU).

    >>> gather_into_slots(torch.tensor([10, 11, 12]), torch.tensor([0, 0, 2]), torch.tensor([7]), torch.tensor([1]))
    tensor([10,  7, 12])
    """
    return rows.index_select(0, index).to(new.dtype).index_copy_(0, new_slots, new)


def gather_ragged(dense: torch.Tensor, flat_index: torch.Tensor) -> torch.Tensor:
    """``[N, ...]``: rows of ``dense [B, H, T, ...]`` at ``flat_index`` (indices into ``B * H * T``).

    Indexes the three leading dims directly, so a non-contiguous ``dense`` (transformers' keys are a
    transposed view) is not copied whole; the result is a fresh tensor that does not pin ``dense``.

    >>> gather_ragged(torch.arange(12.).view(1, 2, 3, 2), torch.tensor([1, 5])).tolist()
    [[2.0, 3.0], [10.0, 11.0]]
    """
    b, h, t = dense.shape[:3]
    row, rest = flat_index // (h * t), flat_index % (h * t)
    return dense[row, rest // t, rest % t]


@dataclass(frozen=True, eq=False)
class RaggedMerge:
    """Where each row of two ragged stores with the same segments lands in their segment-wise
    concatenation (``first``'s segment ``s``, then ``second``'s): computed once per fold and applied to
    each of the store's tensors (keys, values, their scales and zeros, positions, scores) as one gather over
    the two stacked (``rank``: the stacked row each output row takes; ``index_copy_`` into place costs up to 10x
    more on CPU, for uint8 codes). No sort and no device sync (sizes come from shapes).

    A row ``i`` of ``first``'s segment ``s`` lands at ``i + second_offsets[s]`` (the rows of ``second``'s
    earlier segments come before it); a row ``j`` of ``second``'s at ``j + first_offsets[s + 1]``.

    >>> merge = RaggedMerge.of(torch.tensor([0, 2, 3]), 3, torch.tensor([0, 1, 3]), 3)
    >>> merge.into_first.tolist(), merge.into_second.tolist(), merge.offsets.tolist()
    ([0, 1, 3], [2, 4, 5], [0, 3, 6])
    >>> merge.apply(torch.tensor([1, 2, 3]), torch.tensor([7, 8, 9]))
    tensor([1, 2, 7, 3, 8, 9])
    """

    into_first: torch.Tensor
    into_second: torch.Tensor
    offsets: torch.Tensor
    total: int
    rank: torch.Tensor

    @classmethod
    def of(
        cls, first_offsets: torch.Tensor, n_first: int, second_offsets: torch.Tensor, n_second: int
    ) -> RaggedMerge:
        device = first_offsets.device
        into_first = torch.arange(n_first, device=device)
        into_first += second_offsets[segment_ids_from_offsets(first_offsets, n_first)]
        into_second = torch.arange(n_second, device=device)
        into_second += first_offsets[1:][segment_ids_from_offsets(second_offsets, n_second)]
        total = n_first + n_second
        rank = torch.empty(total, dtype=torch.long, device=device)
        rank[into_first] = torch.arange(n_first, device=device)
        rank[into_second] = torch.arange(n_first, total, device=device)
        return cls(into_first, into_second, first_offsets + second_offsets, total, rank)

    def apply(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """``[total, ...]``: ``first``'s and ``second``'s rows (any trailing shape) in place, in
        ``first``'s dtype."""
        return torch.cat([first, second.to(first.dtype)]).index_select(0, self.rank)
