"""The precision a memory table's passes run in.

A memory table is a few hundred teacher-forced passes (:mod:`~lukv_cache.profiling.memory_table`), all
matrix products. A CPU with native bfloat16 matrix units (Intel AMX, AVX512-BF16) runs them 2-3x faster in
bfloat16 than in float32, so ``"auto"`` (a build's default) runs a float32 model's table passes on a bfloat16
copy of it there (half the model's bytes more while they run; skipped when that copy would take more than half
the memory available), each window's context prefilled once at the model's own precision and replayed into
them cast to bfloat16: a layer's loss at 4 bits is a small difference, and the rounding of a bfloat16
prefill's keys and values moves it (measured with every pass and prefill in bfloat16, the earlier ``auto``:
on Qwen2.5-0.5B that table kept 10-12 layers at 8 bits under ``memory=0.075`` and ``0.15`` where the float32
one kept 6-7, and held-apart multikey retrieval fell from 100.0 to 92.5 +- 3.8 at ``memory=0.15``;
docs/profiles.md, "Cost"). An explicit dtype runs every pass and prefill in it. A model that already runs in
bfloat16 (a GPU) measures its table in bfloat16 anyway.

A build's oracle (the calibration context's prefill and scores, the questions' batched decode:
:mod:`~lukv_cache.profiling.oracle`) is matrix products too, and ``BuildSettings(oracle_dtype=...)`` picks
its precision the same way (:func:`table_dtype`): ``"auto"`` runs it on a bfloat16 copy there. Its
importances are attention weights and their maxima, not small differences: on Qwen2.5-0.5B the profile's
evict ratios moved by 0.0097 per head on average, with the same held-apart scores (docs/profiles.md, "Cost").
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError

if TYPE_CHECKING:
    import torch

TABLE_DTYPES = ("auto", "model", "bfloat16", "float16", "float32")


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AMX tiles or AVX512-BF16), as torch's own
    CPU checks say."""
    import torch

    cpu = getattr(torch, "cpu", None)
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def available_bytes() -> int | None:
    """The memory the kernel says is available for new allocations (``MemAvailable``), or ``None`` where
    it does not say (not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_table_dtype(name: str, field: str = "table_dtype") -> str:
    """``name`` if it is one of :data:`TABLE_DTYPES`; else a :class:`~lukv_cache.errors.ConfigurationError`
    naming ``field`` (raised by ``BuildSettings(table_dtype=..., oracle_dtype=...)`` before a build starts,
    and by :func:`table_dtype`).

    >>> check_table_dtype("auto")
    'auto'
    """
    if name not in TABLE_DTYPES:
        what = "The memory table's dtype" if field == "table_dtype" else "The oracle's dtype"
        raise ConfigurationError(
            f"{what} ({field}) must be one of {', '.join(TABLE_DTYPES)} (or, to measure_memory_table, a torch "
            f"floating dtype), got {name!r}."
        )
    return name


def table_dtype(model: Any, dtype: str | torch.dtype | None) -> torch.dtype:
    """The dtype a memory table of ``model`` runs its cells in for ``dtype``: a torch floating dtype or its name;
    ``None`` or ``"model"``: the model's own; ``"auto"``: ``bfloat16`` for a float32 model on a CPU that
    multiplies bfloat16 natively (:func:`native_bf16`) when a bfloat16 copy of its weights fits in half the
    available memory, else the model's own (its layers' losses then stay in the model's own precision:
    :func:`~lukv_cache.profiling.memory_table.measure_memory_table`).

    >>> import torch
    >>> table_dtype(torch.nn.Linear(2, 2), "model"), table_dtype(torch.nn.Linear(2, 2), "bfloat16")
    (torch.float32, torch.bfloat16)
    """
    import torch

    own = next(model.parameters()).dtype
    if dtype is None or dtype == "model":
        return own
    if dtype == "auto":
        parameters = list(model.parameters())
        if own != torch.float32 or parameters[0].device.type != "cpu" or not native_bf16():
            return own
        available = available_bytes()
        copy_bytes = 2 * sum(p.numel() for p in parameters)
        return torch.bfloat16 if available is not None and copy_bytes <= available // 2 else own
    if isinstance(dtype, str):
        dtype = getattr(torch, check_table_dtype(dtype))
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigurationError(f"The memory table's dtype must be a floating torch dtype, got {dtype!r}.")
    return dtype


@contextlib.contextmanager
def model_in(model: Any, dtype: torch.dtype) -> Iterator[Any]:
    """``model`` itself when its parameters are in ``dtype``; else a copy whose floating parameters are cast
    to ``dtype`` (its buffers, rotary frequencies among them, kept as they are, as ``from_pretrained(...,
    dtype=...)`` keeps them), dropped on exit. ``model`` is never changed."""
    import torch

    if next(model.parameters()).dtype == dtype:
        yield model
        return
    # deepcopy's memo hands the copy the cast parameters, so the float32 weights are never copied
    memo = {
        id(p): torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
        for p in model.parameters()
        if p.is_floating_point()
    }
    clone = copy.deepcopy(model, memo)
    head = clone.get_output_embeddings() if hasattr(clone, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Linear):
        # torch's CPU bfloat16 matmul copies the whole transposed weight when its input is a strided view
        # (transformers' logits_to_keep slice of the last position, [1, 1, d] with the sequence's strides,
        # which is_contiguous() calls contiguous): 2.5 s a call for Gemma-3's 262k-token vocabulary against
        # 40 ms for a fresh copy of the input
        head.register_forward_pre_hook(
            lambda module, args: tuple(a.clone(memory_format=torch.contiguous_format) for a in args)
        )
    try:
        yield clone.eval()
    finally:
        del clone, memo
