"""Run a model with another attention function for a while (observers used by profiling and evaluation)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from ..errors import ConfigurationError
from .calls import lukv_aware


@contextlib.contextmanager
def attention_swapped(model: Any, name: str, fn: Callable, *, mask: str = "sdpa") -> Iterator[None]:
    """Register ``fn`` as attention implementation ``name``, paired with the stock mask function ``mask``
    (without a mask function transformers hands it ``attention_mask=None``), switch ``model`` to it, and
    switch back after.

    ``mask`` is the implementation whose masks ``fn``'s attention reads: ``"sdpa"`` (the default) gives
    ``None`` for a plainly causal prompt, meaning "causal" to sdpa but "attend to everything" to an eager
    attention; an observer that delegates to ``eager`` needs ``mask="eager"`` (always a full additive mask).

    ``fn`` is marked lukv-aware: it must delegate to a lukv-aware function (e.g. the installed ``sdpa``) if
    it may see a LUKVCache.

    >>> from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    >>> calls = []
    >>> def observer(module, query, *args, **kwargs):
    ...     calls.append(module.layer_idx)
    ...     return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, *args, **kwargs)
    >>> with attention_swapped(model, "my_observer", observer):
    ...     _ = model(**inputs)
    >>> calls, model.config._attn_implementation
    ([0, 1], 'sdpa')
    """
    if mask not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ConfigurationError(
            f"No mask function is registered for {mask!r}; pass the attention {name!r} delegates to, "
            f"one of {', '.join(sorted(ALL_MASK_ATTENTION_FUNCTIONS))}."
        )
    AttentionInterface.register(name, lukv_aware(fn))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[mask])
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
