"""The checks of ``LUKVCache``'s arguments, and the :class:`CompressionPolicy` they build (once per cache).

:func:`build_policy` takes ``LUKVCache.__init__``'s compression arguments as given (numbers of any
integer type, a scorer or allocator by name, ``evict_ratio=`` beside ``allocator_kwargs=``), refuses every
combination that cannot hold with a :class:`~lukv_cache.errors.ConfigurationError` naming the fix, and
returns the frozen policy the cache and its layers read.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any, overload

import numpy as np
import torch

from ..allocation import get_allocator
from ..errors import ConfigurationError
from ..scorers import Scorer, get_scorer
from .compression import SLIDING, CompressionPolicy
from .layer import FOLD_AT
from .quant import check_kv_bits


def check_ratio(ratio: Any) -> float:
    """``ratio`` as a float in [0, 1): Python, numpy and 0-d torch numbers are accepted; bools, NaN,
    strings and anything out of range raise :class:`~lukv_cache.errors.ConfigurationError`.

    >>> check_ratio(0.8)
    0.8
    """
    if isinstance(ratio, torch.Tensor) and ratio.ndim == 0 and ratio.dtype != torch.bool:
        ratio = ratio.item()
    valid = (
        isinstance(ratio, numbers.Real) and not isinstance(ratio, bool) and type(ratio).__name__ != "bool_"
    )
    if not valid or math.isnan(float(ratio)) or not 0.0 <= float(ratio) < 1.0:
        raise ConfigurationError(
            f"ratio is the fraction of the prompt's KV entries to remove and must be in [0, 1); got {ratio!r}. "
            "ratio=0.8 keeps 20% of the tokens."
        )
    return float(ratio)


def check_flag(name: str, value: Any) -> bool:
    """``value`` as a bool (Python or numpy); anything else raises a ConfigurationError naming ``name``.

    >>> check_flag("keep_scores", True)
    True
    """
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise ConfigurationError(f"{name} must be True or False, got {value!r}.")


SINK = 4  # the first tokens every head keeps, by default
_MAX_TOKENS_LIMIT = 2**40  # far beyond any context; larger numbers are a mistake (None means no cap)


@overload
def _check_count(name: str, value: int, *, positive: bool = False, default: int | None = None) -> int: ...
@overload
def _check_count(name: str, value: Any, *, positive: bool = False, default: int) -> int: ...
@overload
def _check_count(name: str, value: Any, *, positive: bool = False, default: None = None) -> int | None: ...
def _check_count(name: str, value: Any, *, positive: bool = False, default: int | None = None) -> int | None:
    """``value`` as an int (Python or numpy integers), or a ConfigurationError naming ``name``. ``None``
    passes through (an option that ``None`` turns off), unless the option has a ``default`` instead."""
    kind = "a positive" if positive else "a non-negative"
    if value is None:
        if default is not None:
            raise ConfigurationError(
                f"{name} must be {kind} integer, got None; leave it out for its default ({default})."
            )
        return None
    if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_floating_point():
        value = value.item()
    if (
        isinstance(value, bool)
        or type(value).__name__ == "bool_"
        or not isinstance(value, numbers.Integral)
        or value < (1 if positive else 0)
    ):
        raise ConfigurationError(f"{name} must be {kind} integer, got {value!r}.")
    return int(value)


def _table_mean(table: Any) -> float:
    if isinstance(table, torch.Tensor):
        return float(table.detach().double().mean())
    return float(np.asarray(table, dtype=np.float64).mean())


def _check_table_alone(evict_ratio: Any, ratio: Any, max_tokens: Any) -> None:
    """A fixed evict-ratio table sets every head's budget, hence the ratio: refuse a second answer."""
    if evict_ratio is None or (ratio is None and max_tokens is None):
        return
    given = "ratio=" if ratio is not None else "max_tokens="
    raise ConfigurationError(
        f"evict_ratio= fixes every head's budget (its mean is the ratio), so {given} cannot also apply. "
        f"Drop {given}, or read a profile's curve at your ratio: LUKVCache(ratio, allocator='profile', "
        "allocator_kwargs={'profile': profile}) or LUKVCache.from_pretrained(model_id, ratio=...)."
    )


def _decode_window(decode_window, decode_max_tokens: int | None, sink: int, window: int) -> int:
    """The recent tokens protected at every fold: ``decode_window``, or a quarter of the bound (at least
    the prompt's ``window``, at most what the bound leaves after the sinks)."""
    decode_window = _check_count("decode_window", decode_window)
    if decode_max_tokens is None:
        if decode_window is not None:
            raise ConfigurationError(
                "decode_window= protects recent tokens when eviction at fold time runs; pass "
                "decode_max_tokens= too, or drop decode_window=."
            )
        return 0
    if decode_window is None:
        return min(max(window, decode_max_tokens // 4), decode_max_tokens - sink)
    if sink + decode_window > decode_max_tokens:
        raise ConfigurationError(
            f"decode_window={decode_window} and sink={sink} do not fit in decode_max_tokens={decode_max_tokens}: "
            f"lower decode_window to at most {decode_max_tokens - sink}, or raise decode_max_tokens."
        )
    return decode_window


def _check_decodes(scorer: Scorer) -> None:
    """A scorer asked to rank tokens generated while decoding must be able to (``Scorer.decodes``)."""
    if not scorer.decodes:
        why = (
            "its scores come from repeat passes over the whole context, run once by cache.prefill"
            if scorer.reconstruction is not None
            else "it is registered with decodes=False"
        )
        raise ConfigurationError(
            f"Scorer {scorer.name!r} cannot rank tokens generated while decoding (decode_max_tokens=): {why}. "
            "Use 'kvzap' (a learned surrogate of KVzip+ that scores every token in the ordinary forward: "
            "LUKVCache.from_pretrained(model, scorer='kvzap', decode_max_tokens=...)) or 'keydiff', or drop "
            "decode_max_tokens= to compress the prompt only."
        )
    if scorer.context and scorer.rescores:
        raise ConfigurationError(
            f"Scorer {scorer.name!r} reads every KV head of a token (context=True), which eviction no longer keeps "
            "together, so it cannot rescore a head's tokens at a fold: give it rescores=False (each token keeps "
            "the score it got when first scored)."
        )


def build_policy(
    ratio: float | None = None,
    scorer: str | Scorer = "keydiff",
    allocator: Any = "uniform",
    *,
    max_tokens: int | None = None,
    sink: int = SINK,
    window: int | None = None,
    min_keep: float = 0.01,
    prefill_chunk_size: int | None = None,
    evict_ratio: Any = None,
    allocator_kwargs: dict | None = None,
    decode_max_tokens: int | None = None,
    fold_interval: int = FOLD_AT,
    decode_window: int | None = None,
    kv_bits: int | None = None,
    sliding: str | None = None,
) -> CompressionPolicy:
    """The policy of ``LUKVCache(...)`` called with these arguments (see :class:`~lukv_cache.LUKVCache`),
    every one checked; a :class:`~lukv_cache.errors.ConfigurationError` for the first that cannot hold.

    >>> build_policy(0.8, sink=2).window, build_policy(max_tokens=64).ratio
    (1, 0.0)
    """
    if allocator_kwargs is not None and not isinstance(allocator_kwargs, Mapping):
        raise ConfigurationError(
            f"allocator_kwargs must be a dict of the allocator's options (e.g. {{'profile': profile}}), got "
            f"{type(allocator_kwargs).__name__}."
        )
    kwargs = dict(allocator_kwargs or {})
    if evict_ratio is not None:
        kwargs["evict_ratio"] = evict_ratio
    _check_table_alone(kwargs.get("evict_ratio"), ratio, max_tokens)
    decode_max_tokens = _check_count("decode_max_tokens", decode_max_tokens, positive=True)
    fold_interval = _check_count("fold_interval", fold_interval, positive=True, default=FOLD_AT)
    kv_bits = check_kv_bits(kv_bits)
    bounded = max_tokens is not None or decode_max_tokens is not None
    if (
        sliding is None
    ):  # the default: compress, but a token bound is shared by layers holding the same tokens
        sliding = "keep" if bounded else "compress"
    if not isinstance(sliding, str) or sliding not in SLIDING:
        raise ConfigurationError(
            f"sliding must be one of {', '.join(map(repr, SLIDING))} (what a sliding-window layer does with a "
            f"prompt longer than its window), got {sliding!r}."
        )
    if sliding == "compress" and bounded:
        raise ConfigurationError(
            "sliding='compress' does not combine with max_tokens= or decode_max_tokens= yet (their bound is "
            "shared by layers that all hold the same tokens); use ratio=, or leave sliding= unset (with a "
            "bound it is 'keep')."
        )
    if decode_max_tokens is not None:
        if decode_max_tokens > _MAX_TOKENS_LIMIT:
            raise ConfigurationError(
                f"decode_max_tokens={decode_max_tokens} is beyond any context; pass None for no bound."
            )
        if ratio is None and max_tokens is None and kwargs.get("evict_ratio") is None:
            max_tokens = decode_max_tokens  # the prompt is bounded too
    if max_tokens is not None:
        if ratio is not None:
            raise ConfigurationError(
                "Pass either ratio= (the fraction removed) or max_tokens= (a budget per head), not both."
            )
        max_tokens = _check_count("max_tokens", max_tokens, positive=True)
        if max_tokens > _MAX_TOKENS_LIMIT:
            raise ConfigurationError(
                f"max_tokens={max_tokens} is beyond any context; pass max_tokens=None for no cap."
            )
        ratio = 0.0  # decided per prompt, at prefill
    scorer_obj = get_scorer(scorer)
    if scorer_obj.missing:
        raise ConfigurationError(scorer_obj.missing)
    if decode_max_tokens is not None:
        _check_decodes(scorer_obj)
    sink = _check_count("sink", sink, default=SINK)
    window = _check_count("window", window)
    prefill_chunk_size = _check_count("prefill_chunk_size", prefill_chunk_size, positive=True)
    if isinstance(min_keep, bool) or not isinstance(min_keep, numbers.Real) or not 0.0 <= min_keep < 1.0:
        raise ConfigurationError(f"min_keep must be a number in [0, 1), got {min_keep!r}.")
    window = scorer_obj.window if window is None else window
    for name, bound in (("max_tokens", max_tokens), ("decode_max_tokens", decode_max_tokens)):
        if bound is not None and bound < sink + window:
            raise ConfigurationError(
                f"{name}={bound} is below the tokens every head always keeps (sink={sink} + "
                f"window={window}): raise {name} to at least {sink + window}, or lower sink/window."
            )
    decode_window = _decode_window(decode_window, decode_max_tokens, sink, window)
    allocator_obj = get_allocator(allocator, **kwargs)
    if kwargs.get("evict_ratio") is not None:  # validated by the allocator: the ratio it implies
        ratio = min(_table_mean(kwargs["evict_ratio"]), math.nextafter(1.0, 0.0))
    ratio = check_ratio(0.5 if ratio is None else ratio)
    return CompressionPolicy(
        ratio=ratio,
        scorer=scorer_obj,
        allocator=allocator_obj,
        sink=sink,
        window=window,
        min_keep=float(min_keep),
        prefill_chunk_size=prefill_chunk_size,
        max_tokens=max_tokens,
        decode_max_tokens=decode_max_tokens,
        fold_interval=fold_interval,
        decode_window=decode_window,
        kv_bits=kv_bits,
        sliding=sliding,
    )


def policy_property(name: str, doc: str | None = None) -> property:
    """A read-only property of the cache that reads ``cache.policy.<name>``."""
    return property(lambda cache: getattr(cache.policy, name), doc=doc)
