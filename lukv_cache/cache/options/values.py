"""Checks of one option's value, each alone: a ratio, a flag, a count, and each option's own
:data:`Check` (``(name, value as given, default) -> value as kept``), which raises a
:class:`~lukv_cache.errors.ConfigurationError` naming the option.

The fields of :class:`~lukv_cache.cache.options.policy.CompressionPolicy` name these checks
(:func:`~lukv_cache.cache.options.spec.option`'s ``check=``); what must hold across options is checked by
:meth:`~lukv_cache.cache.options.policy.CompressionPolicy.build`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, overload

import torch

from ...errors import ConfigurationError
from ...scorers import Scorer, get_scorer
from ..storage.quant import check_kv_bits


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


def checked_flag(name: str, value: Any, default: Any) -> bool:
    """A flag option's check (:func:`check_flag`)."""
    return check_flag(name, value)


# 1 PiB per batch row: beyond any memory; a larger max_bytes is a mistake (10**30 overflowed at the first
# forward; None means no budget)
MAX_BYTES_LIMIT = 2**50

# What a sliding-window layer does when the prompt is longer than its window (LUKVCache(sliding=...)):
# "compress" (the default with ratio=): the layer stays a LUKVLayer, drops what is older than its window
# (as the stock layer does) and evicts from what is left at the same ratio, allocated apart from the
# full-attention layers (it holds fewer tokens); "keep" (the default under max_tokens / decode_max_tokens):
# transformers' own sliding layer holds the window whole, and ``ratio`` counts the full-attention layers'
# entries only. A prompt that fits the window is compressed like a full layer's either way. Measured on
# Gemma-3-270M (docs/benchmarks.md): at equal bytes "compress" keeps far more of the text.
SLIDING = ("keep", "compress")
SPLITS = ("global_first", "ratio")  # how a memory budget shares its bytes between layer kinds


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


# ---------------------------------------------------------------------------------------------- one option
Check = Callable[[str, Any, Any], Any]  # (name, value as given, the field's default) -> value as kept


def count(*, positive: bool = False) -> Check:
    """The check of a count option: an int (Python, numpy, 0-d torch), at least 1 when ``positive``;
    ``None`` passes when it is the option's default (it turns the option off), else it is refused."""

    def check(name: str, value: Any, default: Any) -> int | None:
        return _check_count(name, value, positive=positive, default=default)

    return check


def checked_ratio(name: str, value: Any, default: Any) -> float:
    """``ratio``'s check: :func:`check_ratio`."""
    return check_ratio(value)


def checked_fraction(name: str, value: Any, default: Any) -> float:
    """``min_keep``'s check: a number in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) < 1.0:
        raise ConfigurationError(f"{name} must be a number in [0, 1), got {value!r}.")
    return float(value)


def checked_memory(name: str, value: Any, default: Any) -> float | None:
    """``memory``'s check: a fraction in (0, 1] of the full cache's bytes, or ``None``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < float(value) <= 1.0:
        raise ConfigurationError(
            f"memory must be a fraction in (0, 1] of the full cache's bytes (0.1: a tenth), got {value!r}."
        )
    return float(value)


def checked_max_bytes(name: str, value: Any, default: Any) -> int | None:
    """``max_bytes``'s check: a positive count of at most :data:`MAX_BYTES_LIMIT`, or ``None``."""
    bound = _check_count(name, value, positive=True, default=default)
    if bound is not None and bound > MAX_BYTES_LIMIT:
        digits = len(str(bound))
        shown = str(bound) if digits <= 24 else f"a number of {digits} digits"
        raise ConfigurationError(
            f"max_bytes={shown} is beyond any memory: at most 2**50 bytes (1 PiB) per row. Pass the bytes a row "
            "may hold (e.g. max_bytes=2**30), memory= for a fraction of the full cache's, or max_bytes=None "
            "for no budget."
        )
    return bound


def checked_scorer(name: str, value: Any, default: Any) -> Scorer:
    """``scorer``'s check: a registered scorer's name or a ``Scorer``, not a placeholder (``missing``:
    its message)."""
    scorer = get_scorer(value)
    if scorer.missing:
        raise ConfigurationError(scorer.missing)
    return scorer


def checked_kv_bits(name: str, value: Any, default: Any) -> int | None:
    """``kv_bits``'s check: :func:`~lukv_cache.cache.storage.quant.check_kv_bits`."""
    return check_kv_bits(value)


def checked_sliding(name: str, value: Any, default: Any) -> str:
    """``sliding``'s check: one of :data:`SLIDING`."""
    return _one_of(
        "sliding", value, SLIDING, "what a sliding-window layer does with a prompt longer than its window"
    )


def checked_split(name: str, value: Any, default: Any) -> str:
    """``split``'s check: one of :data:`SPLITS`."""
    return _one_of(
        "split",
        value,
        SPLITS,
        "how a memory budget shares its bytes between sliding-window and full-attention layers",
    )


def _one_of(name: str, value: Any, choices: tuple[str, ...], what: str) -> str:
    """``value``, one of ``choices``; else a :class:`ConfigurationError` naming them and ``what`` the option is."""
    if not isinstance(value, str) or value not in choices:
        raise ConfigurationError(
            f"{name} must be one of {', '.join(map(repr, choices))} ({what}), got {value!r}."
        )
    return value


def checked_allocator_options(name: str, value: Any, default: Any) -> Mapping | None:
    """``allocator_kwargs``'s check: a mapping, or ``None``."""
    if value is not None and not isinstance(value, Mapping):
        raise ConfigurationError(
            f"allocator_kwargs must be a dict of the allocator's options (e.g. {{'profile': profile}}), got "
            f"{type(value).__name__}."
        )
    return value
