"""Make the stock ``sdpa`` and ``eager`` attention read a LUKVCache.

:func:`route` wraps a stock attention function; :func:`lukv_cache.integration.install` registers the wrapped
``sdpa`` and ``eager`` functions in transformers' ``AttentionInterface``, plus ``"lukv"`` as an explicit name
(paired with sdpa's mask function in ``AttentionMaskInterface``), and guards every other implementation.
A wrapper claims the call a LUKVCache announced for the keys it receives (:mod:`.calls`); any other call goes
straight to the stock function, unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from ..errors import IncompatibleAttentionError
from . import compressed
from .calls import any_pending, claim_attention, claimed_again, lukv_aware
from .compressed import compressed_attention

_EAGER: dict[type, Callable] = {}  # attention module class -> its modeling file's eager function


def _model_eager(module: torch.nn.Module) -> Callable:
    """The ``eager_attention_forward`` of the module's own modeling file (softcap, sinks... included)."""
    fn = _EAGER.get(type(module))
    if fn is not None:
        return fn
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise IncompatibleAttentionError(
            f"{type(module).__name__} has no eager_attention_forward in its modeling file; "
            "use attn_implementation='sdpa' with LUKVCache."
        )
    _EAGER[type(module)] = fn
    return fn


def _refuse_what_the_store_cannot_serve(module, call, value, attention_mask, kwargs) -> None:
    """Raise :class:`IncompatibleAttentionError` for what a model passes that the compressed store's
    attention cannot read exactly; return for everything else."""
    name = type(module).__name__
    if value.shape != call.values.shape:
        raise IncompatibleAttentionError(
            f"{name} changes the values between update() and attention (shape {list(call.values.shape)} -> "
            f"{list(value.shape)}, as DiffLlama's split does), so the compressed store's values cannot be attended "
            "to: use transformers' DynamicCache for this model."
        )
    if kwargs.get("sinks") is not None:
        raise IncompatibleAttentionError(
            f"{name} passes attention sinks computed per token (sinks=, as Inkling-2 does), which the compressed "
            "store's attention does not read (learned per-head sinks, s_aux=, it does): use transformers' "
            "DynamicCache for this model."
        )
    if _per_head(attention_mask):
        raise IncompatibleAttentionError(_per_head_message(module, attention_mask))


def _per_head(attention_mask: torch.Tensor | None) -> bool:
    """Whether ``attention_mask`` is one of the model's own per head (``[B, heads > 1, q, k]``)."""
    return (
        isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4 and attention_mask.shape[1] > 1
    )


def _per_head_message(module: torch.nn.Module, attention_mask: torch.Tensor) -> str:
    return (
        f"{type(module).__name__} passes an attention mask of its own per head (shape {list(attention_mask.shape)}: "
        "a position bias such as ALiBi's, Falcon's with alibi=True from transformers 5.25, or a dynamic mask such "
        "as Doge's), which the compressed store's attention does not read. Only ratio=0 works with it (nothing "
        "compressed, exact): use transformers' DynamicCache for this model."
    )


def _mask_for_keys(attention_mask: torch.Tensor | None, key: torch.Tensor) -> torch.Tensor | None:
    """``attention_mask`` over the keys a stock layer returned: its last ``key``-length columns where it is
    longer. transformers builds one mask per layer kind, sized by the first layer of that kind; when that
    layer is a compressed sliding LUKVLayer (logical positions, every column) and another of the kind is
    transformers' own sliding layer (its last ``window - 1`` tokens and the new ones), as a KV-sharing
    producer of Gemma-3n / Gemma-4 and the layers that read it are, the mask's last columns are exactly
    that layer's keys (both end at the newest token)."""
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        keys = key.shape[-2]
        if attention_mask.shape[-1] > keys:
            return attention_mask[..., -keys:]
    return attention_mask


def route(stock: Callable | None) -> Callable:
    """A lukv-aware attention function around ``stock`` (``None``: the module's own eager function).

    >>> from transformers import AttentionInterface
    >>> from transformers.integrations.sdpa_attention import sdpa_attention_forward
    >>> AttentionInterface.register("my_sdpa", route(sdpa_attention_forward))
    """

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        # torch's sdpa has no learned sinks (s_aux): a model that passes them reads its own eager function
        fn = stock if stock is not None and kwargs.get("s_aux") is None else _model_eager(module)
        if fn is not stock and stock is not None:
            # the eager function adds the mask (sdpa's may be boolean: allowed -> 0, masked -> the dtype's min)
            if isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool:
                blocked = torch.finfo(query.dtype).min
                attention_mask = torch.where(attention_mask, 0.0, blocked).to(query.dtype)
        # no LUKVCache call waits in this thread: the stock function alone (what torch.compile traces)
        if not any_pending():
            if claimed_again(key):
                raise IncompatibleAttentionError(
                    f"{type(module).__name__} attends twice over one cache update (as DiffLlama does, with values "
                    "changed in between), which a compressed LUKVCache cannot serve exactly: use transformers' "
                    "DynamicCache for this model."
                )
            attention_mask = _mask_for_keys(attention_mask, key)
            return fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        call = claim_attention(module, key)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if call is not None and call.store is not None:
            _refuse_what_the_store_cannot_serve(module, call, value, attention_mask, kwargs)
        elif call is not None and call.on_unservable is not None and _per_head(attention_mask):
            # nothing compressed yet: the cache raises if it would compress, else keeps every layer dense
            call.on_unservable(_per_head_message(module, attention_mask))
            call = None  # the stock attention reads the dense layer, exactly; nothing to finish
        if call is None or call.store is None:
            attention_mask = _mask_for_keys(attention_mask, key)
            output = fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        else:
            out = compressed_attention(
                call.store,
                query,
                key,
                value,
                attention_mask,
                scale,
                kwargs.get("softcap"),
                s_aux=kwargs.get("s_aux"),
            )
            weights = None
            # The eager function returns its weights (sdpa returns None): so do we, over the logical
            # positions, when this forward asks for them as transformers' output recorder reads it (the
            # kwarg, else the config), so that a plain decode step computes nothing more.
            if stock is None and (
                kwargs["output_attentions"]
                if "output_attentions" in kwargs
                else getattr(getattr(module, "config", None), "output_attentions", False)
            ):
                weights = compressed.attention_weights(  # looked up here: tests spy on it
                    call.store,
                    query,
                    key,
                    attention_mask,
                    scale,
                    kwargs.get("softcap"),
                    s_aux=kwargs.get("s_aux"),
                )
            output = (out, weights)
        if call is not None:
            call.finish(
                module,
                query,
                attention_mask,
                sliding_window=kwargs.get("sliding_window"),
                scaling=scale,
                softcap=kwargs.get("softcap"),
            )
        return output

    attention.__name__ = f"lukv_{getattr(stock, '__name__', 'eager')}"
    return lukv_aware(attention)
