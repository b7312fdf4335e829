"""Batch rows as ``DynamicCache.batch_select_indices`` takes them, checked (the layers and the cache keep
their rows aligned with it)."""

from __future__ import annotations

import torch

from ..errors import BatchIndexError, ConfigurationError


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
