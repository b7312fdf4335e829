"""Run a model with another attention function for a while (observers used by profiling and evaluation)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from .calls import lukv_aware


@contextlib.contextmanager
def attention_swapped(model: Any, name: str, fn: Callable) -> Iterator[None]:
    """Register ``fn`` as attention implementation ``name`` (paired with the stock ``sdpa`` mask, without
    which transformers hands it ``attention_mask=None``), switch ``model`` to it, and switch back after.

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
    AttentionInterface.register(name, lukv_aware(fn))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
