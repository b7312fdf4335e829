"""The cache's read-only properties of its options: ``cache.ratio``, ``cache.scorer``, ... (one
:class:`OptionProperty` per field of its policy, :func:`add_option_properties`), and ``cache.kv_bits``
(:class:`ChosenBits`: what a memory budget chose)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from .policy import CompressionPolicy
from .spec import fields_of, option_spec


class OptionProperty(property):
    """A read-only property of the cache that reads an option of ``cache.policy`` (``cache.ratio``), or
    what ``read(cache)`` says of it."""

    def __init__(self, name: str, doc: str | None = None, read: Callable[[Any], Any] | None = None):
        super().__init__(read or (lambda cache: getattr(cache.policy, name)))
        self.__doc__ = doc  # a property subclass's doc= is shadowed by the class's own docstring


class ChosenBits(OptionProperty):
    """``cache.kv_bits``: the option, or under a memory budget the bits it chose (``None`` until then; a
    tuple of each layer's when it chose per-layer widths)."""

    def __init__(self) -> None:
        doc = option_spec(fields_of(CompressionPolicy)["kv_bits"]).doc
        super().__init__("kv_bits", doc, _chosen_bits)


def _chosen_bits(cache: Any) -> int | None | tuple[int | None, ...]:
    choice = cache.compressor.memory_choice
    return cache.policy.kv_bits if choice is None else choice.kv_bits


def policy_property(name: str, doc: str | None = None) -> property:
    """A read-only property of the cache that reads ``cache.policy.<name>``."""
    return OptionProperty(name, doc)


def add_option_properties(cache_class: type, policy_class: type) -> None:
    """Give ``cache_class`` an :class:`OptionProperty` per option of ``policy_class`` that it lacks; an
    option named like another attribute of the cache is a TypeError (rename the field)."""
    for f in fields(policy_class):
        current = inspect.getattr_static(cache_class, f.name, None)
        if isinstance(current, OptionProperty):
            continue
        if current is not None:
            raise TypeError(
                f"{cache_class.__name__}: the option {f.name!r} of {policy_class.__name__} has the name of "
                "another attribute of the cache; rename the field."
            )
        setattr(cache_class, f.name, policy_property(f.name, option_spec(f).doc))
