"""What differs between the transformers releases the library supports (5.23 to 5.25), decided from public
facts (a model's signature), never from transformers' private names."""

from __future__ import annotations

import functools
import inspect
import types
import typing
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


def own_cache_class(model: Any) -> str | None:
    """The name of the class ``model``'s forward declares for the cache it takes (under a name
    :func:`takes_cache` counts) when that class is no transformers ``Cache``: the model keeps its state in a
    cache class of its own and reads that class's fields, so any transformers cache passed there fails in the
    model's code (xLSTM from transformers 5.24 takes ``cache: xLSTMCache`` and reads ``cache.rnn_state``).
    ``None`` when the declared type admits a transformers ``Cache`` or tells nothing (no annotation, a name
    that does not resolve, a generic such as ``tuple[...]`` or ``dict[...]``).

    >>> own_cache_class(xlstm_model)  # doctest: +SKIP
    'xLSTMCache'
    """
    from transformers import Cache

    names = {"past_key_values", "past_key_value"} | ({"cache"} if _renamed() else set())
    parameters = _forward_signature(model)
    for name in sorted(names & set(parameters)):
        declared = _classes(parameters[name].annotation)
        if declared and not any(issubclass(cls, Cache) for cls in declared):
            return declared[0].__name__
    return None


def _classes(annotation: Any) -> tuple[type, ...]:
    """The classes an annotation admits besides ``None`` (``X | None``, ``Optional[X]``, ``Union[X, Y]``);
    empty when it is anything else (a generic, a string, a type variable, no annotation)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    else:
        members = [annotation]
    plain = all(isinstance(arg, type) and typing.get_origin(arg) is None for arg in members)
    return tuple(members) if plain and members and inspect.Parameter.empty not in members else ()


def _forward_signature(model: Any) -> typing.Mapping[str, inspect.Parameter]:
    """``model.forward``'s parameters, annotations written as strings evaluated where they resolve."""
    forward: Any = getattr(model, "forward", None)
    for eval_str in (True, False):
        try:
            return inspect.signature(forward, eval_str=eval_str).parameters
        except Exception:  # noqa: BLE001, S112 - a name that does not resolve: the raw annotations, or none
            continue
    return {}


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
