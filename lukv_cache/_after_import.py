"""Run a function as soon as a module has been imported (at once if it already is).

``import lukv_cache`` must stay cheap (no torch, no transformers), yet lukv's attention wrappers must be
registered in transformers' attention registry before any model runs or is loaded with
``attn_implementation="lukv"``. That registry lives in ``transformers.modeling_utils``, which every model
class imports: :func:`when_imported` hooks its import, so the wrappers are installed the moment the
registry exists, whichever of lukv_cache or transformers is imported first.

>>> seen = []
>>> when_imported("json", lambda: seen.append("json"))  # already imported: runs now
>>> seen
['json']
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_waiting: dict[str, list[Callable[[], None]]] = {}


def when_imported(name: str, callback: Callable[[], None]) -> None:
    """Call ``callback()`` once module ``name`` has been executed: now if it is in ``sys.modules``, else
    right after its import finishes (in the importing thread). An exception in ``callback`` propagates to
    that import."""
    if name in sys.modules:
        callback()
        return
    with _lock:
        if not _waiting:
            sys.meta_path.insert(0, _Finder())
        _waiting.setdefault(name, []).append(callback)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module someone waits for, it asks the other finders for the spec and
    wraps its loader so the callbacks run after the module's code."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _waiting:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the callbacks; the module keeps its own loader afterwards."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        with _lock:
            callbacks = _waiting.pop(self._name, [])
            if not _waiting:
                sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
        for callback in callbacks:
            callback()

    def __getattr__(self, attr: str) -> Any:  # get_source, get_resource_reader...: the real loader's
        return getattr(self._loader, attr)
