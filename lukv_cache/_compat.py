"""What differs between the transformers releases the library supports (5.23 and 5.24), decided from public
facts (a model's signature), never from transformers' private names."""

from __future__ import annotations

import functools
import inspect
from typing import Any


def cache_kwarg(model: Any) -> str:
    """The keyword ``model``'s forward and ``generate`` take the cache by: ``"cache"`` when the forward has a
    ``cache`` parameter and transformers is 5.24 or later (5.24 renamed ``past_key_values``; the old name
    still works there, with a FutureWarning), else ``"past_key_values"`` (5.23, where a ``cache`` parameter
    is a model's own, as XLM's dict, and models whose own code predates the rename).

    >>> out = model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})  # doctest: +SKIP
    """
    return "cache" if "cache" in _forward_parameters(model) and _renamed() else "past_key_values"


def takes_cache(model: Any) -> bool:
    """Whether ``model``'s forward takes a cache at all, under either name (``cache`` from transformers 5.24,
    ``past_key_values`` before it, ``past_key_value`` in older remote code). RWKV takes none (it keeps a state
    of its own), nor does Mamba before 5.24 (its ``cache_params`` is a cache of its own class). Before 5.24 a
    ``cache`` parameter is no transformers cache: XLM's is a dict of its own (it still is on 5.24, where the
    cache then reaches XLM's own attention code, which a LUKVCache refuses with a typed error).

    >>> takes_cache(model)  # doctest: +SKIP
    True
    """
    names = {"past_key_values", "past_key_value"} | ({"cache"} if _renamed() else set())
    return not names.isdisjoint(_forward_parameters(model))


def _forward_parameters(model: Any) -> frozenset[str]:
    """The names ``model.forward`` takes; none when it has no readable forward (not a module)."""
    try:
        return frozenset(inspect.signature(model.forward).parameters)
    except (AttributeError, TypeError, ValueError):
        return frozenset()


@functools.cache  # the installed release does not change while the process runs
def _renamed() -> bool:
    """Whether the installed transformers (5.24 or later) calls the cache argument ``cache``."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version("5.24")
