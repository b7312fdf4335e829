"""Which implementation serves a ragged attention call (decided here, computed by the leaf modules)."""

from __future__ import annotations

import torch

from . import kernels, windows
from .partial import ragged_attention_reference


def ragged_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    key_bias: torch.Tensor | None = None,
    offsets_list: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: a fused kernel for CUDA tensors when one is available; on CPU the windowed fused calls
    of :mod:`lukv_cache.attention.windows`; else (softcap, a masking key bias) the torch reference."""
    impl = kernels.get_ragged_kernel(query, key_bias=key_bias, softcap=softcap)
    if impl is not None:
        return impl(query, keys, values, offsets, scaling=scaling, softcap=softcap, key_bias=key_bias)
    if key_bias is not None and not bool((key_bias < 0).any()):
        key_bias = None  # the usual case: stored tokens are real and precede every query
    if key_bias is None and windows.serves(query, keys, values, softcap):
        return windows.windowed_ragged_attention(query, keys, values, offsets, scaling=scaling)
    return ragged_attention_reference(
        query,
        keys,
        values,
        offsets_list if offsets_list is not None else offsets,
        scaling=scaling,
        softcap=softcap,
        key_bias=key_bias,
    )
