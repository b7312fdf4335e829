"""Batch rows as ``DynamicCache.batch_select_indices`` takes them, checked (:func:`select_rows`; the layers
and the cache keep their rows aligned with it), and a layer's batch operations and offloading
(:class:`BatchRows`)."""

from __future__ import annotations

from typing import Any, cast

import torch

from ...errors import BatchIndexError, ConfigurationError
from .ragged import RaggedStore
from .record import EvictionRecord
from .suffix import DenseSuffix


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


class BatchRows:
    """A layer's batch operations and offloading, transformers' layer API (a mixin of
    :class:`~lukv_cache.cache.storage.layer.LUKVLayer`): every tensor the layer keeps per batch row (its dense
    suffix, ragged store and the tensors of its eviction record) follows the rows selected, or moves to the
    device, together. A compressed layer's suffix keeps its capacity (it decodes into it).

    A mixin, not a part the layer holds: its public methods are transformers' layer contract, called on the
    layer itself, and they replace the layer's own suffix and store (a part would need the layer back, and
    the layer a forwarding method for each); what the layer only carries, its eviction record, is a part
    (:meth:`~lukv_cache.cache.storage.record.EvictionRecord.select_rows`, ``move_to``)."""

    suffix: DenseSuffix | None
    store: RaggedStore | None
    eviction: EvictionRecord
    compressed: bool
    is_initialized: bool
    device: Any

    def _select_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` (any order, repeats allowed): beam reorder, repeat, select."""
        if self.suffix is None:
            return
        suffix = self.suffix
        rows = rows.to(suffix.key_buffer.device)
        capacity = suffix.capacity if self.compressed else None
        self.suffix = DenseSuffix.of(
            suffix.keys.index_select(0, rows), suffix.values.index_select(0, rows), capacity
        )
        self.eviction.select_rows(rows)
        if self.store is not None:
            self.store = self.store.select_rows(rows)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized and self.suffix is not None:
            self._select_rows(torch.arange(self.suffix.batch_size).repeat_interleave(repeats))

    def batch_select_indices(self, indices) -> None:
        """Keep the batch rows ``indices`` selects, as ``DynamicCache`` does (``keys[indices, ...]``): a
        tensor, tuple or list of row indices (negative ones count from the end) or a bool mask over the
        rows; out of range is a :class:`~lukv_cache.errors.BatchIndexError` (the cache is unchanged)."""
        if self.is_initialized and self.suffix is not None:
            self._select_rows(select_rows(indices, self.suffix.batch_size))

    def offload(self) -> None:
        """Move every tensor the layer holds to the CPU (transformers' ``Cache(offloading=True)``)."""
        if self.is_initialized:
            self._move("cpu")

    def prefetch(self) -> None:
        """Move an offloaded layer back to its device."""
        if self.suffix is not None and self.suffix.key_buffer.device != self.device:
            self._move(self.device)

    def _move(self, device) -> None:
        self.suffix = cast(DenseSuffix, self.suffix).to(device)
        self.eviction.move_to(device)
        if self.store is not None:
            self.store = self.store.to(device)
