"""The built-in scorer and allocator names, without torch.

The registries (:data:`lukv_cache.scorers.SCORERS`, :data:`lukv_cache.allocation.ALLOCATORS`) import
torch, about 2 s; the ``lukv`` command line reads these names instead to refuse a mistyped ``--scorer`` or
``--allocators`` at once, with the registries' own message (:func:`lukv_cache._registry.unknown_name`).
``tests/test_builtin_names.py`` checks that they are the registries' names, exactly.

Names registered outside the package: nothing in lukv_cache loads plugins (no entry points) and the
commands import no user code, so in a ``lukv`` run the registries hold the built-in names and nothing else
(the same test imports every command's module and finds no other name). A name that is not built in would
be refused by the registry after the import anyway; refusing it first changes only how long that takes. If a
plugin mechanism is ever added, :func:`refuse_unknown` must let the names it could register through.

>>> refuse_unknown("scorer", ["keydiff", "kvzap"])
>>> refuse_unknown("allocator", ["uniform", "nope"])
Traceback (most recent call last):
    ...
lukv_cache.errors.UnknownNameError: Unknown allocator 'nope'. Known allocators: adakv, calibrated, global, hybrid, hybrid_global, profile, pyramid, threshold, uniform. Register your own with register_allocator().
"""

from __future__ import annotations

from collections.abc import Iterable

from ._registry import unknown_name

BUILTIN_SCORERS = (
    "expected_attention",
    "keydiff",
    "knorm",
    "kvzap",
    "kvzip",
    "kvzip_plus",
    "random",
    "snapkv",
    "streaming",
    "tova",
)
BUILTIN_ALLOCATORS = (
    "adakv",
    "calibrated",
    "global",
    "hybrid",
    "hybrid_global",
    "profile",
    "pyramid",
    "threshold",
    "uniform",
)
_BUILTIN = {"scorer": BUILTIN_SCORERS, "allocator": BUILTIN_ALLOCATORS}


def refuse_unknown(kind: str, names: Iterable[str]) -> None:
    """Raise the registry's :class:`~lukv_cache.errors.UnknownNameError` for the first of ``names`` that
    is not a built-in ``kind`` (``"scorer"`` or ``"allocator"``); nothing if every one is."""
    known = _BUILTIN[kind]
    for name in names:
        if name not in known:
            raise unknown_name(kind, name, known)
