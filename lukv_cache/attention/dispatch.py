"""Route tagged keys to the ragged attention; everything else to the stock implementation.

Importing :mod:`lukv_cache` calls :func:`install`, which registers wrapped ``sdpa`` and ``eager`` functions
in transformers' ``AttentionInterface`` (paired with the stock mask functions in
``AttentionMaskInterface``), plus ``"lukv"`` as an explicit name. The wrappers only change behaviour for
keys that a :class:`~lukv_cache.LUKVCache` layer tagged in ``update()``; any other call goes straight
to the stock function, unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from ..errors import IncompatibleAttentionError
from . import cuda
from .ragged import merge_partials, partial_attention, ragged_attention


def _model_eager(module: torch.nn.Module) -> Callable:
    """The ``eager_attention_forward`` of the module's own modeling file (softcap, sinks... included)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise IncompatibleAttentionError(
            f"{type(module).__name__} has no eager_attention_forward in its modeling file; "
            "use attn_implementation='sdpa' with LUKVCache."
        )
    return fn


def _as_bias(mask: torch.Tensor) -> torch.Tensor:
    """Additive fp32 bias from a bool (True = attend) or float additive mask."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(
            ~mask, torch.finfo(torch.float32).min
        )
    return mask.float().clamp_min(torch.finfo(torch.float32).min)


def compressed_attention(
    layer,
    query: torch.Tensor,
    suffix_keys: torch.Tensor,
    suffix_values: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    """Exact attention of ``query [B, Hq, Q, D]`` over the layer's ragged store + dense suffix.

    Returns ``[B, Q, Hq, D]`` like the stock functions. The mask (over logical positions) is read at
    each stored token's original position, and at the suffix's last ``S`` positions.
    """
    b, hq, q_len, d = query.shape
    h = suffix_keys.shape[1]
    g = hq // h
    grouped = query.reshape(b, h, g * q_len, d)  # row m = g * Q + i
    s = suffix_keys.shape[-2]

    key_bias = None
    suffix_bias = None
    if attention_mask is not None:
        bias = _as_bias(attention_mask[:, 0])  # [B or 1, Q, L]
        bias = bias.expand(b, q_len, bias.shape[-1])
        suffix_bias = bias[:, None, :, bias.shape[-1] - s :].repeat(1, 1, g, 1)  # [B, 1, M, S]
        if layer.has_store:
            key_bias = bias[layer._segment_ids() // h, :, layer.store_positions.long()]  # [N, Q]
    if layer.has_store:
        fused = cuda.get_ragged_suffix_kernel(grouped, key_bias=key_bias, softcap=softcap)
        if fused is not None:  # store + suffix in one kernel pass, no host sync
            out, lse = fused(
                grouped,
                layer.store_keys,
                layer.store_values,
                layer.offsets,
                suffix_keys,
                suffix_values,
                scaling=scaling,
                softcap=softcap,
                key_bias=key_bias,
                suffix_bias=suffix_bias,
            )
            return out.view(b, hq, q_len, -1).transpose(1, 2).contiguous().to(query.dtype)
    if suffix_bias is not None and not bool((suffix_bias < 0).any()):
        suffix_bias = None  # decode without padding in the suffix: take the fused CPU path
    out, lse = partial_attention(
        grouped, suffix_keys, suffix_values, scaling=scaling, softcap=softcap, bias=suffix_bias
    )
    if layer.has_store:
        out_r, lse_r = ragged_attention(
            grouped,
            layer.store_keys,
            layer.store_values,
            layer.offsets,
            scaling=scaling,
            softcap=softcap,
            key_bias=key_bias,
            offsets_list=layer._offsets_list,
        )
        out, lse = merge_partials(out_r, lse_r, out, lse)
    return out.view(b, hq, q_len, -1).transpose(1, 2).contiguous().to(query.dtype)


def _route(stock: Callable | None) -> Callable:
    """Wrap a stock attention function (``None``: the module's own eager function)."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        fn = stock if stock is not None else _model_eager(module)
        layer = getattr(key, "_lukv_layer", None)
        if layer is None:
            return fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        layer._awaiting_attention = False
        if kwargs.get("sliding_window") is not None and not layer.compressed:
            # A sliding-window layer: hand it to the stock sliding layer, uncompressed.
            layer._cache._make_sliding(layer, kwargs["sliding_window"])
            return fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if layer.has_store:
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            output = (
                compressed_attention(layer, query, key, value, attention_mask, scale, kwargs.get("softcap")),
                None,
            )
        else:
            output = fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if layer.wants_compression(query.shape[2]):
            layer._cache._compress_layer(layer, module, query, attention_mask)
        return output

    attention.__name__ = f"lukv_{getattr(stock, '__name__', 'eager')}"
    attention._lukv_wrapped = True
    return attention


def _guard(name: str, fn: Callable) -> Callable:
    """Wrap an implementation that cannot read a LUKVCache: untagged calls pass through unchanged, a
    LUKVCache's keys raise instead of being attended to partially."""

    def guarded(module, query, key, *args, **kwargs):
        if getattr(key, "_lukv_layer", None) is not None:
            raise IncompatibleAttentionError(
                f"attn_implementation={name!r} cannot read a LUKVCache (its compressed tokens live in a ragged "
                "store). Use attn_implementation='sdpa' or 'eager' for this model, e.g. "
                "model.set_attn_implementation('sdpa'), or use transformers' DynamicCache."
            )
        return fn(module, query, key, *args, **kwargs)

    guarded._lukv_wrapped = True
    guarded.__wrapped__ = fn
    return guarded


def guard_all() -> None:
    """Guard every registered implementation that is not ours (cheap; re-run before each prefill so
    implementations registered after import are covered too)."""
    for name, fn in list(AttentionInterface._global_mapping.items()):
        if not getattr(fn, "_lukv_wrapped", False):
            AttentionInterface.register(name, _guard(name, fn))


_INSTALLED = False


def install() -> None:
    """Register the routing wrappers (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    AttentionInterface.register("sdpa", _route(sdpa_attention_forward))
    AttentionInterface.register("eager", _route(None))
    AttentionInterface.register("lukv", _route(sdpa_attention_forward))
    AttentionMaskInterface.register("lukv", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    guard_all()
    _INSTALLED = True
