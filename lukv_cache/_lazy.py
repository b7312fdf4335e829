"""Lazy public names for a package (PEP 562): each name's module is imported on first access, so importing
the package stays cheap (no torch, no transformers) until a name that needs them is used.

>>> import types
>>> module = types.ModuleType("pkg")
>>> module.__getattr__, module.__dir__ = lazy_names("json", {"dumps": "json"})
>>> module.dumps([1])
'[1]'
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_names(
    package: str, names: Mapping[str, str], submodules: Sequence[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: ``names`` maps a public name to the module that
    defines it (relative to ``package`` when it starts with a dot, e.g. ``".build"``); ``submodules`` are
    imported when accessed as attributes. A resolved name is stored in the package, so later look-ups skip
    ``__getattr__``."""

    def getattr_(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(names[name], package), name)
            setattr(sys.modules[package], name, value)
            return value
        if name in submodules:
            return importlib.import_module(f".{name}", package)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def dir_() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return getattr_, dir_
