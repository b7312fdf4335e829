"""Rows a quantized store gains while decoding, appended in place beside it.

Under a memory budget (or ``decode_max_tokens``) every ``fold_interval`` decoding steps the dense suffix
joins the ragged store, and most of those folds evict nothing (an evicting fold evicts a few folds deeper,
so that the next ones only append). A ragged store is one flat tensor per field with each segment's rows back
to back, so appending to every segment rebuilds all of it: every row copied, for 8 new ones per segment. A
:class:`StoreTail` holds the appended rows beside the store instead, in its bits, with room for ``capacity``
rows per segment: an appending fold quantizes the suffix and writes it into that room, nothing else moves.

The CPU kernel over the codes reads a store and its tail in one call
(:func:`~lukv_cache.attention.cpu_codes.codes_attention`), and an evicting fold rescores and keeps rows of both
where they are (:meth:`LUKVLayer.store_parts <lukv_cache.cache.storage.layer.LUKVLayer.store_parts>`, the held
frame of :mod:`~lukv_cache.cache.compression.fold_plan`). Everything else reads the layer's store after the tail
joined it (one merge, what each appending fold cost before): :attr:`LUKVLayer.store
<lukv_cache.cache.storage.layer.LUKVLayer.store>` joins a pending tail when read, and attention gets a
:class:`TailedStore`, which joins it on the first read that is not the kernel's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .quant import PackedRows
from .ragged import RaggedStore, position_dtype


def _empty_like(rows: PackedRows, n: int) -> PackedRows:
    """``n`` rows of zeros in the format of ``rows`` (codes, scales and zeros of its dtypes and widths)."""
    return rows.with_tensors(*(t.new_zeros((n, *t.shape[1:])) for t in rows.tensors()))


@dataclass(eq=False)
class StoreTail:
    """The rows appended to one layer's quantized store since it was built (see the module docstring).

    ``keys`` / ``values``: :class:`~.quant.PackedRows` of ``segments * capacity`` rows, segment ``s``'s
    appended rows at ``s * capacity`` onward, the first ``length`` of them written; ``positions``: int32
    ``[capacity]``, each slot's logical position (every segment appends the same tokens); ``scores``: fp32
    ``[segments, capacity]`` when the store keeps scores, else ``None``.

    >>> store = RaggedStore.build(torch.randn(4, 8), torch.randn(4, 8), torch.arange(4) % 2,
    ...                           torch.tensor([2, 2]), num_heads=2, kv_bits=8)
    >>> tail = StoreTail.beside(store, capacity=3)
    >>> tail.write(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8), start=2, store=store)
    >>> tail.length, tail.room, tail.join(store).counts().tolist()
    (2, 1, [4, 4])
    >>> tail.grown(4).room
    2
    """

    keys: PackedRows
    values: PackedRows
    positions: torch.Tensor
    scores: torch.Tensor | None
    capacity: int
    segments: int
    length: int = field(default=0)

    @classmethod
    def beside(cls, store: RaggedStore, capacity: int) -> StoreTail:
        """An empty tail for ``store`` (quantized), with room for ``capacity`` rows per segment."""
        assert isinstance(store.keys, PackedRows) and isinstance(store.values, PackedRows)  # quantized
        return cls._empty(store.keys, store.values, store.num_segments, capacity, store.scores is not None)

    @classmethod
    def _empty(
        cls, keys: PackedRows, values: PackedRows, segments: int, capacity: int, keeps_scores: bool
    ) -> StoreTail:
        """A tail of no rows in the format of ``keys`` / ``values``, room for ``capacity`` per segment."""
        device = keys.device
        scores = torch.full((segments, capacity), float("nan"), device=device) if keeps_scores else None
        return cls(
            _empty_like(keys, segments * capacity),
            _empty_like(values, segments * capacity),
            torch.zeros(capacity, dtype=torch.int32, device=device),
            scores,
            capacity,
            segments,
        )

    @property
    def room(self) -> int:
        """Rows per segment still free."""
        return self.capacity - self.length

    def write(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        start: int,
        store: RaggedStore,
        scores: torch.Tensor | None = None,
    ) -> None:
        """Append every token of ``keys`` / ``values`` ``[B, H, S, D]`` (a dense block starting at logical
        position ``start``; ``S <= room``), quantized as ``store``'s rows, to each segment; ``scores
        [B, H, S]`` with them when the tail keeps scores."""
        b, h, s = keys.shape[:3]
        g, n = self.segments, self.length
        assert b * h == g and s <= self.room  # the caller checked
        new_k, new_v = store.quantize_like(keys.reshape(g * s, -1), values.reshape(g * s, -1))
        for rows, new in ((self.keys, new_k), (self.values, new_v)):
            for dst, src in zip(rows.tensors(), new.tensors()):
                dst.view(g, self.capacity, -1)[:, n : n + s].copy_(src.view(g, s, -1))
        self.positions[n : n + s] = torch.arange(start, start + s, dtype=torch.int32)
        if self.scores is not None and scores is not None:
            self.scores[:, n : n + s].copy_(scores.reshape(g, s))
        self.length = n + s

    def grown(self, capacity: int) -> StoreTail:
        """The same rows in a tail with room for ``capacity`` per segment (a copy of the tail alone)."""
        g, n = self.segments, self.length
        assert capacity >= n
        bigger = StoreTail._empty(self.keys, self.values, g, capacity, self.scores is not None)
        for rows, written in (
            (bigger.keys, self._written(self.keys)),
            (bigger.values, self._written(self.values)),
        ):
            for dst, src in zip(rows.tensors(), written.tensors()):
                dst.view(g, capacity, -1)[:, :n].copy_(src.view(g, n, -1))
        bigger.positions[:n] = self.positions[:n]
        if self.scores is not None and bigger.scores is not None:
            bigger.scores[:, :n] = self.scores[:, :n]
        bigger.length = n
        return bigger

    def _written(self, rows: PackedRows) -> PackedRows:
        g, n = self.segments, self.length
        return rows.with_tensors(
            *(t.view(g, self.capacity, -1)[:, :n].reshape(g * n, t.shape[-1]) for t in rows.tensors())
        )

    def join(self, store: RaggedStore) -> RaggedStore:
        """``store`` with this tail's rows after each segment's (a new store; the tail is left as it is)."""
        g, n = self.segments, self.length
        if not n:
            return store
        positions = self.positions[:n]
        last = int(positions[-1])
        counts = torch.full((g,), n, dtype=torch.long, device=store.offsets.device)
        scores = None if self.scores is None else self.scores[:, :n].reshape(-1)
        return store.extend(
            self._written(self.keys),  # type: ignore[arg-type]  # PackedRows: extend keeps them as they are
            self._written(self.values),  # type: ignore[arg-type]
            positions.to(position_dtype(last)).repeat(g),
            counts,
            scores,
            last=last,
        )

    def slot_positions(self) -> torch.Tensor:
        """int32 ``[segments * capacity]``: each slot's logical position (its segment's rows in order)."""
        return self.positions.repeat(self.segments)

    def memory_bytes(self) -> int:
        """Bytes of every tensor the tail holds (its free room included)."""
        total = self.keys.memory_bytes() + self.values.memory_bytes()
        total += self.positions.numel() * self.positions.element_size()
        return total + (0 if self.scores is None else self.scores.numel() * self.scores.element_size())


@dataclass(frozen=True, eq=False)
class TailedStore:
    """What attention reads of a layer whose store has a pending :class:`StoreTail`: the CPU kernel takes
    ``base`` and ``tail`` as they are; any other read (every field of a
    :class:`~lukv_cache.attention.calls.WholeStoreView`) goes to the store with the tail joined, which
    ``join`` (the layer's) builds once and keeps in the layer."""

    base: RaggedStore
    tail: StoreTail
    join: Callable[[], RaggedStore]

    @property
    def kv_bits(self) -> int | None:
        return self.base.kv_bits

    @property
    def num_heads(self) -> int:
        return self.base.num_heads

    def merged(self) -> RaggedStore:
        """The store with the tail joined (the layer keeps it: joined once)."""
        return self.join()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("base", "tail", "join"):  # copy / pickle probing a bare instance
            raise AttributeError(name)
        return getattr(self.merged(), name)
