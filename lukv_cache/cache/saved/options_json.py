"""A saved context's ``"options"``: the cache's policy written as JSON (:func:`save_options`) and read back
into a cache of the class loading it (:func:`build_cache`), both from the fields of the cache's
``policy_class`` (:class:`~lukv_cache.cache.options.policy.CompressionPolicy`), so that an option added there is
saved and loaded with nothing added here.

Each option whose field is ``saved`` is written under its own name as the policy holds it, and read back
checked against the field's ``kinds`` and ``low`` (a key a file lacks is the field's ``before``: files
written before ``sliding`` existed load as ``"keep"``). The scorer, the allocator and its options have
entries of their own (a learned scorer's surrogate, an allocator's tables and profiles travel as tensors).
The file's layout is docs/saved.md's; :mod:`lukv_cache.cache.saved.file` reads and writes the file.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, NoReturn, Protocol

import numpy as np
import torch

from ...errors import LUKVError, SavedContextError, UnknownNameError
from ...scorers import SCORERS, Reconstruction, Scorer, get_scorer, kvzip_scorer
from ..compression.contract import CacheT, CompressedCache
from ..options.spec import option_spec
from ..storage.state_check import put_tensor

# the keys of "options" that are not a policy's fields: the cache's own, and the embedded profiles' names
_CACHE_KEYS = ("keep_scores", "profiles")


class SavedFile(Protocol):
    """The saved-context file being read: its path, its failure (a SavedContextError naming the field)
    and its checked tensors."""

    path: Path

    def fail(self, why: str, field: str | None = ..., cls: Any = ..., **kw: Any) -> NoReturn: ...

    def tensor(
        self, name: str, *, dtype: torch.dtype | None = ..., shape: tuple | None = ..., ndim: int | None = ...
    ) -> torch.Tensor: ...


# ---------------------------------------------------------------------------------------------- saving
def scorer_entry(scorer: Scorer, profile: Any, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The file's entry for ``scorer``: its name and settings, and a learned scorer's surrogate (in
    ``profile`` when the embedded profile holds it, else added to ``tensors``)."""
    entry = {
        "name": scorer.name,
        "window": scorer.window,
        "n_queries": scorer.n_queries,
        "context": scorer.context,
        "decodes": scorer.decodes,
        "rescores": scorer.rescores,
        "reconstruction": None
        if scorer.reconstruction is None
        else dataclasses.asdict(scorer.reconstruction),
        "surrogate": None,
    }
    surrogate = scorer.params.get("surrogate") if scorer.from_surrogate is not None else None  # a learned one
    if surrogate is not None:
        if profile is not None and profile.surrogate is surrogate:
            entry["surrogate"] = "profile"  # the embedded profile holds it
        else:
            from ...profiles import surrogate as surrogate_format

            arrays, text = surrogate_format.to_file(surrogate)
            for name, array in arrays.items():
                put_tensor(tensors, f"scorer.{name}", torch.from_numpy(np.ascontiguousarray(array)))
            entry["surrogate"] = {"metadata": text, "tensors": sorted(arrays)}
    return entry


def save_options(cache: CompressedCache, tensors: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """``cache``'s options as the file's ``"options"`` entry (its tables, profiles and surrogate added to
    ``tensors``); a value the format cannot store is a SavedContextError naming the option."""
    from ...profiles import Profile

    policy = cache.policy
    profiles: dict[str, Any] = {}
    if cache.profile is not None:
        profiles["profile"] = cache.profile
    kwargs: dict[str, Any] = {}
    for key, value in policy.allocator.params.items():
        if isinstance(value, Profile):
            name = next((n for n, p in profiles.items() if p is value), f"allocator.{key}")
            profiles[name] = value
            kwargs[key] = {"profile": name}
        elif isinstance(value, torch.Tensor | np.ndarray):
            t = torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else value
            kwargs[key] = {
                "tensor": put_tensor(tensors, f"allocator.{key}", t),
                "numpy": isinstance(value, np.ndarray),
            }
        else:
            field = f"options.allocator_kwargs.{key}"
            _check_json(
                value, f"allocator option {key!r}", field, path, "Build the allocator from such options."
            )
            kwargs[key] = {"json": value}
    for name, profile in profiles.items():
        put_tensor(
            tensors, f"profile.{name}", torch.frombuffer(bytearray(profile.to_bytes()), dtype=torch.uint8)
        )
    entry: dict[str, Any] = {}
    for f in dataclasses.fields(policy):
        if option_spec(f).saved:
            value = getattr(policy, f.name)
            _check_json(
                value, f"option {f.name!r}", f"options.{f.name}", path, "Give the option such a value."
            )
            entry[f.name] = value
    return {
        **entry,
        "scorer": scorer_entry(policy.scorer, cache.profile, tensors),
        "allocator": policy.allocator.name,
        "allocator_kwargs": kwargs,
        "keep_scores": cache.prefill_scores is not None,
        "profiles": sorted(profiles),
    }


def _check_json(value: Any, what: str, field: str, path: Path, fix: str) -> None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        raise SavedContextError(
            f"Cannot save this cache's {what} (a {type(value).__name__}): the format "
            f"stores JSON values, tensors, arrays and profiles. {fix}",
            path=str(path),
            field=field,
        ) from None


# ---------------------------------------------------------------------------------------------- loading
def saved_option(
    options: dict, key: str, kinds: tuple | None, reader: SavedFile, *, low: float | None = None
) -> Any:
    """``options[key]`` when it is one of ``kinds`` (``None``: any) and at least ``low``, else the file
    fails as damaged."""
    value = options.get(key)
    if kinds is None:
        return value
    bad = not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)
    if not bad and low is not None and value is not None and value < low:
        bad = True
    if bad:
        reader.fail(
            f"malformed option {key}={value!r} (damaged file). Save the context again.", f"options.{key}"
        )
    return value


def build_cache(
    cache_class: type[CacheT], meta: dict, model: Any, reader: SavedFile, scorer: Any, allocator: Any
) -> CacheT:
    """An empty ``cache_class`` built with the options of the file's ``meta`` (``scorer`` / ``allocator``,
    when given, replace the saved ones), laid out for ``model``; the file fails on a malformed option, one
    ``cache_class`` does not take, or options that do not build a cache."""
    from ...profiles import Profile

    options = meta.get("options")
    if not isinstance(options, dict):
        reader.fail("its options are missing (damaged file). Save the context again.", "options")
    profiles = {}
    for name in options.get("profiles") or []:
        data = reader.tensor(f"profile.{name}", dtype=torch.uint8, ndim=1)
        try:
            profiles[name] = Profile.from_bytes(
                data.numpy().tobytes(), source=f"{reader.path} [profile.{name}]"
            )
        except LUKVError as err:
            reader.fail(f"its embedded profile {name!r} is invalid: {err}", f"profile.{name}")
    kwargs: dict[str, Any] = {}
    saved_kwargs = options.get("allocator_kwargs")
    for key, spec in (saved_kwargs if isinstance(saved_kwargs, dict) else {}).items():
        if isinstance(spec, dict) and "json" in spec:
            kwargs[key] = spec["json"]
        elif isinstance(spec, dict) and spec.get("profile") in profiles:
            kwargs[key] = profiles[spec["profile"]]
        elif isinstance(spec, dict) and isinstance(spec.get("tensor"), str):
            t = reader.tensor(spec["tensor"])
            kwargs[key] = t.numpy() if spec.get("numpy") else t
        else:
            reader.fail(
                f"malformed allocator option {key!r} (damaged file).", f"options.allocator_kwargs.{key}"
            )
    policy_class = cache_class.policy_class
    kept: dict[str, Any] = {"allocator_kwargs": kwargs}
    for f in dataclasses.fields(policy_class):
        spec = option_spec(f)
        if not spec.saved:
            continue
        if f.name not in options and spec.has_before:
            kept[f.name] = spec.before
        else:
            kept[f.name] = saved_option(options, f.name, spec.kinds, reader, low=spec.low)
    keep_scores = saved_option(options, "keep_scores", (bool,), reader)
    known = {f.name for f in dataclasses.fields(policy_class)}.union(_CACHE_KEYS)
    for key, value in options.items():
        if key not in known and value is not None:  # an option of a newer lukv_cache, or of another class
            reader.fail(
                f"saved with {key}={value!r}, which this {cache_class.__name__} does not support. Load it "
                "with the version (and cache class) that wrote it.",
                f"options.{key}",
            )
    scorer_obj = scorer if scorer is not None else saved_scorer(options.get("scorer"), profiles, reader)
    allocator_name = allocator if allocator is not None else options.get("allocator")
    rebuilt = policy_class.rebuilt_options(kept)
    try:
        cache = cache_class(
            scorer=scorer_obj,
            allocator=allocator_name,
            keep_scores=keep_scores,
            config=model.config,
            **rebuilt,
        )
    except UnknownNameError as err:
        reader.fail(
            f"{err}. Register it in this process before loading (register_{err.kind or 'scorer'}(...)), or pass "
            f"{err.kind or 'scorer'}= to load_cache.",
            f"options.{err.kind or 'scorer'}",
        )
    except LUKVError as err:
        reader.fail(f"its options do not build a LUKVCache: {err}", "options")
    cache.profile = profiles.get("profile")
    return cache


def saved_scorer(entry: Any, profiles: dict, reader: SavedFile) -> Scorer:
    """The scorer the file's ``entry`` describes: a learned one rebuilt from its surrogate, a kvzip scorer
    with its saved settings, or the registered one (which must match what was saved)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        reader.fail("its scorer entry is malformed (damaged file).", "options.scorer")
    name, window = entry["name"], entry.get("window")  # save_cache writes the scorer's window, an int
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        reader.fail(
            f"its scorer's window is {window!r}, not a count of tokens (damaged file).",
            "options.scorer.window",
        )
    surrogate = entry.get("surrogate")
    learned = SCORERS.get(name).from_surrogate if name in SCORERS else None  # kvzap's kvzap_scorer
    if learned is not None and surrogate is not None:
        from ...profiles import surrogate as surrogate_format

        if surrogate == "profile":
            if "profile" not in profiles or profiles["profile"].surrogate is None:
                reader.fail(
                    f"its {name} scorer reads the embedded profile, which is missing.", "options.scorer"
                )
            return learned(profiles["profile"].surrogate, window=window)
        names = surrogate.get("tensors") if isinstance(surrogate, dict) else None
        if not isinstance(names, list):
            reader.fail(f"its {name} surrogate entry is malformed (damaged file).", "options.scorer")
        arrays = {n: reader.tensor(f"scorer.{n}").numpy() for n in names}
        try:
            surr = surrogate_format.from_file(arrays, surrogate.get("metadata", ""), str(reader.path))
            text = surr.weight.shape
            surrogate_format.check(surr, int(text[0]), int(text[1]), None, str(reader.path))
        except LUKVError as err:
            reader.fail(f"its {name} surrogate is invalid: {err}", "options.scorer")
        return learned(surr, window=window)
    try:
        registered = get_scorer(name)
    except UnknownNameError:
        reader.fail(
            f"it was saved with scorer {name!r}, which is not registered in this process. Register it "
            "(register_scorer) before loading, or pass scorer= to load_cache.",
            "options.scorer",
        )
    recon = entry.get("reconstruction")
    if isinstance(recon, dict):
        try:
            saved = Reconstruction(**recon)
        except TypeError:
            reader.fail("its scorer's reconstruction settings are malformed.", "options.scorer")
        if registered.reconstruction == saved and registered.window == window:
            return registered
        return kvzip_scorer(**dataclasses.asdict(saved), name=name, window=window)
    if registered.missing:  # e.g. kvzap without a surrogate: the cache refuses it with its own message
        return registered
    same = all(
        entry.get(key) == getattr(registered, key)
        for key in ("window", "n_queries", "context", "decodes", "rescores")
    )
    if not same:
        reader.fail(
            f"the scorer registered as {name!r} in this process is not the one the context was saved with "
            "(its window, queries or decoding settings differ). Pass the scorer it was saved with: "
            "load_cache(path, model, scorer=...).",
            "options.scorer",
        )
    return registered
