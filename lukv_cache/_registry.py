"""A tiny name -> object registry shared by scorers and allocators."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

from .errors import ConfigurationError, UnknownNameError

T = TypeVar("T")


class Registry(Generic[T]):
    """Names to objects of one ``kind`` ("scorer", "allocator"); unknown names raise
    :class:`~lukv_cache.errors.UnknownNameError` listing the known ones.

    >>> reg = Registry("widget")
    >>> reg.add("a", 1)
    1
    >>> reg.names()
    ['a']
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def add(self, name: str, item: T, *, overwrite: bool = False) -> T:
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"A {self.kind} name must be a non-empty string, got {name!r}.")
        if name in self._items and not overwrite:
            raise ConfigurationError(
                f"A {self.kind} named {name!r} is already registered; pass overwrite=True to replace it."
            )
        self._items[name] = item
        return item

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise unknown_name(self.kind, name, self.names()) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def unknown_name(kind: str, name: object, known: Iterable[str]) -> UnknownNameError:
    """The error for a ``kind`` named ``name`` that is not among ``known``: one line naming the known
    names and saying how to add one (a registry's :meth:`Registry.get`, and the ``lukv`` command line
    before torch is imported, :mod:`lukv_cache._names`).

    >>> print(unknown_name("widget", "b", ["a"]))
    Unknown widget 'b'. Known widgets: a. Register your own with register_widget().
    """
    known = sorted(known)
    return UnknownNameError(
        f"Unknown {kind} {name!r}. Known {kind}s: {', '.join(known)}. Register your own with register_{kind}().",
        kind=kind,
        name=name,
        known=known,
    )
