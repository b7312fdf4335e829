"""``index.json``: the list of profiles a repository (or a local mirror like ``profiles_hub/``) holds.

Format: ``{"format_version": 1, "profiles": [entry, ...]}``, one entry per (model id, scorer) with the
profile's summary and its ``path``; entries sorted by model id, then scorer.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, cast

from ..errors import ConfigurationError, HubUnavailableError, ProfileFormatError, ProfileNotFoundError
from .files import atomic_write
from .hub_errors import hub_answers, hub_file, shipped_fallback, translated_hub_errors
from .jsonfile import parse_json
from .location import (
    BUNDLED_DIR,
    INDEX_FILENAME,
    LOCAL_DIR_ENV,
    HubLocation,
    PublishedProfile,
    check_model_id,
    profile_filename,
)

INDEX_FORMAT_VERSION = 1


def empty_index() -> dict[str, Any]:
    return {"format_version": INDEX_FORMAT_VERSION, "profiles": []}


def parse_index(data: bytes, source: str) -> dict[str, Any]:
    """A validated index from its bytes; a malformed one raises :class:`ProfileFormatError`.

    Every entry must be an object whose ``model_id`` and ``scorer`` (and ``path``, when present) are
    strings: listing, publishing and mirroring sort and look entries up by them."""
    try:
        index = parse_json(data)
        if not isinstance(index, dict) or not isinstance(index.get("profiles"), list):
            raise ValueError("expected an object with a 'profiles' list")
        for number, entry in enumerate(index["profiles"], start=1):
            _check_entry(entry, number)
    except ValueError as err:
        raise ProfileFormatError(
            f"{source} is not a valid profile index ({err}). Fix or regenerate it, then retry.", source=source
        ) from None
    return index


def _check_entry(entry: Any, number: int) -> None:
    """Raise ValueError unless ``entry`` (the ``number``-th) has string ``model_id``, ``scorer`` and ``path``."""
    if not isinstance(entry, dict) or not {"model_id", "scorer"} <= set(entry):
        raise ValueError(f"entry {number}: every entry needs 'model_id' and 'scorer'")
    for key in ("model_id", "scorer", "path"):
        if key in entry and not isinstance(entry[key], str):
            raise ValueError(f"entry {number}: {key} must be a string, got {json.dumps(entry[key])[:80]}")


def index_entry(profile: PublishedProfile, model_id: str) -> dict[str, Any]:
    return {**profile.summary(), "model_id": model_id, "path": profile_filename(model_id, profile.scorer)}


def with_entry(index: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """``index`` with ``entry`` added, replacing the entry of the same (model id, scorer)."""
    key = (entry["model_id"], entry["scorer"])
    kept = [e for e in index["profiles"] if (e["model_id"], e["scorer"]) != key]
    profiles = sorted([*kept, entry], key=lambda e: (e["model_id"], e["scorer"]))
    return {**index, "format_version": INDEX_FORMAT_VERSION, "profiles": profiles}


def index_bytes(index: dict[str, Any]) -> bytes:
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def list_profiles(
    *,
    model_id: str | None = None,
    hub: HubLocation | None = None,
    local_dir: str | os.PathLike | None = None,
) -> list[dict[str, Any]]:
    """The entries of the shared repository's ``index.json`` (or of ``<local_dir>/index.json``).

    Each entry has ``model_id``, ``scorer``, ``path``, ``num_layers``, ``num_kv_heads``, ``head_dim``,
    ``grid`` (size/min/max), ``calibration``, ``created``, ``library_version``. When the Hub cannot serve
    the index (offline, unreachable, no cached copy) and no revision is pinned, the profiles
    ``from_pretrained`` would use are listed instead: those of ``$LUKV_PROFILE_DIR`` and those shipped with
    the package (an INFO log says so; a warning only when another repository than the default was asked).

    >>> [e["scorer"] for e in list_profiles(model_id="meta-llama/Llama-3.1-8B-Instruct")]  # doctest: +SKIP
    ['expected_attention', 'keydiff']
    """
    from huggingface_hub.errors import RemoteEntryNotFoundError

    if local_dir is not None:
        index = _folder_index(local_dir)
    else:
        hub = hub or HubLocation()
        reachable = hub_answers(INDEX_FILENAME, hub)  # one probe, as from_pretrained: no retries offline
        try:
            with translated_hub_errors(f"the profile index {INDEX_FILENAME!r}", hub):
                try:
                    path = hub_file(INDEX_FILENAME, hub, reachable=reachable)
                except RemoteEntryNotFoundError:
                    return []  # a repository without an index holds no profiles yet
            index = parse_index(Path(path).read_bytes(), f"{INDEX_FILENAME} of {hub.repo!r}")
        except (HubUnavailableError, ProfileNotFoundError) as err:
            if hub.revision is not None or not (BUNDLED_DIR / INDEX_FILENAME).is_file():
                raise
            index = _offline_index(hub, err)
    entries = [dict(e) for e in index["profiles"] if model_id is None or e["model_id"] == model_id]
    return [e for e in entries if _readable_entry(e)]


def _folder_index(local_dir: str | os.PathLike) -> dict[str, Any]:
    if not Path(local_dir).is_dir():
        raise ConfigurationError(
            f"{str(local_dir)!r} is not a folder of profiles (a local mirror like profiles_hub/)."
        )
    path = Path(local_dir) / INDEX_FILENAME
    return parse_index(path.read_bytes(), str(path)) if path.is_file() else empty_index()


def _offline_index(hub: HubLocation, err: BaseException) -> dict[str, Any]:
    """The shipped index merged with ``$LUKV_PROFILE_DIR``'s (whose entries win, as in download_profile)."""
    shipped = BUNDLED_DIR / INDEX_FILENAME
    shipped_fallback("profile index", shipped, hub, err)
    index = parse_index(shipped.read_bytes(), str(shipped))
    local = os.environ.get(LOCAL_DIR_ENV)
    if local and Path(local).is_dir():
        for entry in _folder_index(local)["profiles"]:
            index = with_entry(index, entry)
    return index


def _readable_entry(entry: dict[str, Any]) -> bool:
    """Whether an index entry has the fields a listing shows, with the right types; warns when not."""
    grid = entry.get("grid", {})
    ok = (
        isinstance(entry.get("model_id"), str)
        and isinstance(entry.get("scorer"), str)
        and all(
            isinstance(entry.get(k, 0), int) and not isinstance(entry.get(k, 0), bool)
            for k in ("num_layers", "num_kv_heads")
        )
        and isinstance(grid, dict)
        and all(isinstance(grid.get(k, 0), (int, float)) for k in ("size", "min", "max"))
    )
    if not ok:
        warnings.warn(
            f"Skipping a malformed profile index entry: {json.dumps(entry, default=str)[:200]}", stacklevel=3
        )
    return ok


def published_copy(profile: PublishedProfile, model_id: str | None) -> PublishedProfile:
    """The profile as published under ``model_id`` (its metadata names the id it is stored under)."""
    import dataclasses

    if model_id is None or model_id == profile.model_id:
        check_model_id(profile.model_id)
        return profile
    check_model_id(model_id)
    extra = {**profile.extra, "built_from_model_id": profile.model_id}
    return dataclasses.replace(cast(Any, profile), model_id=model_id, extra=extra)  # a dataclass


def save_to_local_dir(
    profile: PublishedProfile, local_dir: str | os.PathLike, model_id: str | None = None
) -> Path:
    """Write ``profile`` into a local mirror (e.g. ``profiles_hub/``) and update its ``index.json``.

    Writers of one mirror take a file lock around the read-modify-write of the index, so concurrent
    pushes (several processes) all land; the index then lists exactly the profiles whose files exist.

    >>> save_to_local_dir(profile, "profiles_hub")
    PosixPath('profiles_hub/org/tiny-llama/keydiff.safetensors')
    """
    from filelock import FileLock

    profile = published_copy(profile, model_id)
    root = Path(local_dir)
    if root.exists() and not root.is_dir():
        raise ConfigurationError(f"The profile mirror {str(root)!r} is a file; pass a folder.")
    path = root / profile_filename(profile.model_id, profile.scorer)
    index_path = root / INDEX_FILENAME
    for target in (path, index_path):
        if target.is_dir():
            raise ConfigurationError(
                f"{str(target)!r} is a folder where the mirror keeps a file; move it away, then retry."
            )
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{INDEX_FILENAME}.lock")):
        index = (
            parse_index(index_path.read_bytes(), str(index_path)) if index_path.is_file() else empty_index()
        )
        profile.save(path)
        index = with_entry(index, index_entry(profile, profile.model_id))
        present = [e for e in index["profiles"] if (root / e.get("path", "")).is_file()]
        atomic_write(index_path, index_bytes({**index, "profiles": present}))
    return path
