"""What importing lukv_cache changes in the process, outside its own objects, and how to undo it.

It changes four things, all of them made and undone here:

1. ``sys.meta_path``: an import hook (the first finder) waits for ``transformers.modeling_utils``, where
   transformers' attention registry lives, runs :func:`install` right after it is imported and removes
   itself (:func:`install_when_imported`, called by ``import lukv_cache``; no hook if transformers came
   first: :func:`install` runs at once).
2. transformers' ``AttentionInterface`` (``ALL_ATTENTION_FUNCTIONS``), by :func:`install`: ``"sdpa"`` and
   ``"eager"`` become lukv's routing wrappers (``lukv_cache/attention/routing.py``), ``"lukv"`` is added, and
   every other implementation is replaced by a guard that raises ``IncompatibleAttentionError`` on a
   LUKVCache's call (:func:`guard_attention`; each LUKVCache forward runs it again, for implementations
   registered since).
3. transformers' ``AttentionMaskInterface`` (``ALL_MASK_ATTENTION_FUNCTIONS``): ``"lukv"`` is added (sdpa's
   mask function).
4. A thread-local slot (``lukv_cache/attention/calls.py``): the call a LUKVCache announces in ``update()``
   (:func:`announce_attention`) waits there for the attention function of the same forward, which consumes it.

Undo: :func:`uninstall` removes the hook, puts every registry entry lukv replaced back as it was (removes those
it added; an entry registered since by someone else stays), and empties this thread's slot (another thread's
holds at most one call, which that thread's next attention call drops). A LUKVCache forward then raises
``IncompatibleAttentionError`` until :func:`install` (idempotent) makes the changes again.

Not made here, and left by :func:`uninstall`: an attention function registered on request, for the length
of a ``with`` block, by ``attention_swapped`` (``lukv_cache/attention/swap.py``: profiling's and
evaluation's observers), whose name stays registered after the block.

>>> from lukv_cache import integration
>>> integration.uninstall()  # transformers' registries as they were, no hook
>>> integration.is_installed()
False
>>> integration.install()
>>> integration.is_installed()
True

This module imports neither torch nor transformers (``import lukv_cache`` stays cheap): :func:`install`,
:func:`uninstall` and :func:`guard_attention` import them when called.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._lazy import lazy_names

if TYPE_CHECKING:
    from .attention.calls import announce_attention, discard_attention

# transformers' attention registry; every model class imports it
REGISTRY_MODULE = "transformers.modeling_utils"

# The cache's side of the handoff (4.), from the module that holds the slot, imported on first use (PEP 562:
# the cache calls them on every layer, so they are the functions themselves, not wrappers).
_LAZY = {
    "announce_attention": "lukv_cache.attention.calls",
    "discard_attention": "lukv_cache.attention.calls",
}
__getattr__, __dir__ = lazy_names(__name__, _LAZY)

_lock = threading.Lock()  # the hook's place in sys.meta_path
_registry_lock = threading.RLock()  # lukv's entries in transformers' registries, and what they replaced
_installed = False
_withdrawn = False  # uninstall() ran (and install() did not since): a LUKVCache forward raises
_ABSENT = object()  # a registry entry that did not exist
# (registry class, name) -> (the entry before lukv changed it, or _ABSENT; the entry lukv put there)
_changed: dict[tuple[Any, str], tuple[object, Callable]] = {}
# the routing wrappers, built once: installing again puts the same ones back
_routes: dict[str, Callable] = {}


# ---------------------------------------------------------------------------------------- install / undo


def install() -> None:
    """Make the changes 2. and 3. (and remove the hook, 1.): lukv's routing for ``sdpa``, ``eager`` and
    ``lukv``, and the guard around every other attention implementation. Idempotent."""
    global _installed, _withdrawn
    _remove_hook()
    if _installed:
        return
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    from .attention.routing import route

    with _registry_lock:  # taken only around the registries' entries, never over an import
        if _installed:
            return
        if not _routes:
            _routes["sdpa"] = route(sdpa_attention_forward)
            _routes["eager"] = route(None)
            _routes["lukv"] = route(sdpa_attention_forward)
        for name, fn in _routes.items():
            _put(AttentionInterface, name, fn)
        _put(AttentionMaskInterface, "lukv", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        _installed, _withdrawn = True, False
    guard_attention()


def uninstall() -> None:
    """Undo every change: the hook (1.), the registries' entries (2., 3.; each back as it was before lukv
    changed it, if it is still lukv's), this thread's slot (4.). A LUKVCache forward raises
    :class:`~lukv_cache.errors.IncompatibleAttentionError` until :func:`install`. Run it while no model runs."""
    global _installed, _withdrawn
    _remove_hook()
    with _registry_lock:
        _withdrawn, installed = True, _installed
        if not installed:
            return  # nothing registered, and no cache announced a call (its first forward installs)
        for (registry, name), (before, ours) in _changed.items():
            mapping = _global_mapping(registry)
            if mapping.get(name) is not ours:
                continue  # registered since by someone else: theirs stays
            if before is _ABSENT:
                del mapping[name]
            else:
                registry.register(name, before)
        _changed.clear()
        _installed = False
    from .attention.calls import discard_attention

    discard_attention()


def is_installed() -> bool:
    """Whether lukv's routing and guards are in transformers' registries (:func:`install` ran, and
    :func:`uninstall` did not since)."""
    return _installed


def guard_attention() -> None:
    """Guard every registered attention implementation that is not lukv-aware (a LUKVCache's call raises
    :class:`~lukv_cache.errors.IncompatibleAttentionError` there instead of being attended to partially).
    Cheap; each LUKVCache forward runs it before its first layer, so implementations registered since are
    covered too. Installs first if nothing was yet; raises after :func:`uninstall`."""
    if _withdrawn:
        from .errors import IncompatibleAttentionError

        raise IncompatibleAttentionError(
            "lukv_cache's attention routing was uninstalled (lukv_cache.integration.uninstall()), so no "
            "attention function reads a LUKVCache: call lukv_cache.integration.install() first."
        )
    if not _installed:
        install()  # the cache is used before any model class imported the registry
        return
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from .attention.calls import guarded, is_lukv_aware

    with _registry_lock:
        for name, fn in list(ALL_ATTENTION_FUNCTIONS.items()):
            if not is_lukv_aware(fn):
                _put(AttentionInterface, name, guarded(name, fn))


def _put(registry: Any, name: str, fn: Callable) -> None:
    """Register ``fn`` as ``registry``'s ``name``, remembering what was there for :func:`uninstall`."""
    _changed[(registry, name)] = (_global_mapping(registry).get(name, _ABSENT), fn)
    registry.register(name, fn)


def _global_mapping(registry: Any) -> dict[str, Any]:
    # transformers registers into this class-wide dict (GeneralInterface.register) and has no call that
    # removes a name, which uninstall() needs for the names lukv added
    return registry._global_mapping


# ---------------------------------------------------------------------------------------- the import hook


def install_when_imported() -> None:
    """:func:`install` now if transformers' attention registry (``transformers.modeling_utils``) is imported,
    else right after its import, in the importing thread (an exception in it propagates to that import):
    lukv's functions are registered before any model can run, whichever of lukv_cache and transformers
    is imported first, and ``import lukv_cache`` imports neither."""
    if REGISTRY_MODULE in sys.modules:
        install()
        return
    with _lock:
        if not any(isinstance(finder, _Hook) for finder in sys.meta_path):
            sys.meta_path.insert(0, _Hook())


def hook_waiting() -> bool:
    """Whether the import hook (1.) is in ``sys.meta_path``, waiting for transformers' registry."""
    return any(isinstance(finder, _Hook) for finder in sys.meta_path)


def _remove_hook() -> bool:
    """Take the hook out of ``sys.meta_path``; whether it was there."""
    with _lock:
        hooks = [finder for finder in sys.meta_path if isinstance(finder, _Hook)]
        for hook in hooks:
            sys.meta_path.remove(hook)
    return bool(hooks)


class _Hook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for transformers' registry module it asks the other finders for the spec and
    wraps its loader, so :func:`install` runs after the module's code."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != REGISTRY_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    """The module's own loader, then :func:`install` (unless :func:`uninstall` removed the hook meanwhile);
    the module keeps its own loader afterwards."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        if _remove_hook():
            install()

    def __getattr__(self, attr: str) -> Any:  # get_source, get_resource_reader...: the real loader's
        return getattr(self._loader, attr)


__all__ = [
    "REGISTRY_MODULE",
    "announce_attention",
    "discard_attention",
    "guard_attention",
    "hook_waiting",
    "install",
    "install_when_imported",
    "is_installed",
    "uninstall",
]
