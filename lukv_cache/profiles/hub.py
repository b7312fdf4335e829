"""Finding, fetching and publishing profiles: one shared Hub repository keyed by model id.

The profile for ``meta-llama/Llama-3.1-8B-Instruct`` with scorer ``keydiff`` lives at
``meta-llama/Llama-3.1-8B-Instruct/keydiff.safetensors`` in the repository named by the ``repo_id``
argument, else ``$LUKV_PROFILE_REPO``, else ``lukv-cache/profiles``; ``index.json`` at its root lists
what exists. Everything goes through ``huggingface_hub`` (its cache, ``HF_HUB_OFFLINE``,
``HF_ENDPOINT``, tokens, revisions): nothing of it is re-implemented here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import (
    ConfigurationError,
    HubUnavailableError,
    ProfileError,
    ProfileFormatError,
    ProfileNotFoundError,
    PublishError,
)
from .profile import DEFAULT_SCORER, Profile, _atomic_write, _library_version

DEFAULT_REPO_ID = "lukv-cache/profiles"
REPO_ID_ENV = "LUKV_PROFILE_REPO"
LOCAL_DIR_ENV = "LUKV_PROFILE_DIR"
INDEX_FILENAME = "index.json"
INDEX_FORMAT_VERSION = 1
_SCORER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _connection_errors() -> tuple[type[BaseException], ...]:
    """Transport errors of whichever HTTP stack huggingface_hub uses (httpx2 in 2.x, httpx, requests).

    Only stacks already imported can have raised, so nothing is imported here.
    """
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, name in (
        ("httpx2", "TransportError"),
        ("httpx", "TransportError"),
        ("requests", "RequestException"),
    ):
        error = getattr(sys.modules.get(module), name, None)
        if isinstance(error, type) and issubclass(error, BaseException):
            errors.append(error)
    return tuple(errors)


# ---------------------------------------------------------------------------------------------- names


def profile_repo_id(repo_id: str | None = None) -> str:
    """The shared repository: ``repo_id``, else ``$LUKV_PROFILE_REPO``, else ``lukv-cache/profiles``.

    >>> profile_repo_id("me/my-profiles")
    'me/my-profiles'
    """
    return repo_id or os.environ.get(REPO_ID_ENV) or DEFAULT_REPO_ID


def profile_filename(model_id: str, scorer: str) -> str:
    """Where a profile lives in the shared repository (and in a local mirror such as ``profiles_hub/``).

    >>> profile_filename("meta-llama/Llama-3.1-8B-Instruct", "keydiff")
    'meta-llama/Llama-3.1-8B-Instruct/keydiff.safetensors'
    """
    _check_model_id(model_id)
    if not isinstance(scorer, str) or not _SCORER_NAME.match(scorer):
        raise ConfigurationError(
            f"Scorer name {scorer!r} cannot name a profile file: use letters, digits, '_', '-' or '.' "
            f"(e.g. {DEFAULT_SCORER!r})."
        )
    return f"{model_id}/{scorer}.safetensors"


def _check_model_id(model_id: str) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        if not isinstance(model_id, str) or model_id.startswith((".", "/", "~")):
            raise HFValidationError("looks like a local path")
        validate_repo_id(model_id)
    except HFValidationError as err:
        raise ConfigurationError(
            f"{model_id!r} is not a Hub model id ({err}). Shared profiles are keyed by model id, "
            "e.g. 'meta-llama/Llama-3.1-8B-Instruct': pass the model id (a model loaded from a local folder "
            "has the folder as its name), or pass a profile file."
        ) from None


# ---------------------------------------------------------------------------------------------- resolve


def resolve_profile(
    model: Any,
    scorer: str | None = None,
    *,
    revision: str | None = None,
    repo_id: str | None = None,
    token: str | bool | None = None,
    local_dir: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    endpoint: str | None = None,
) -> Profile:
    """The profile for ``model``: a profile file, a model id, or a loaded model (its ``name_or_path``).

    A model id is looked up first in ``local_dir`` (else ``$LUKV_PROFILE_DIR``) at
    ``<local_dir>/<model_id>/<scorer>.safetensors``, then in the shared Hub repository through
    ``hf_hub_download`` (cache, offline mode, token, ``revision`` and ``endpoint`` honoured).

    >>> profile = resolve_profile("meta-llama/Llama-3.1-8B-Instruct", "snapkv")  # doctest: +SKIP
    >>> profile = resolve_profile("./my_profile.safetensors")                   # doctest: +SKIP
    """
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if path.is_file():
            return Profile.load(path)
        if str(model).endswith(".safetensors"):
            raise ProfileNotFoundError(
                f"No profile file at {str(model)!r}. Check the path, or pass a model id to use the shared profile."
            )
        model_id = str(model)
    elif hasattr(model, "config"):
        model_id = getattr(model.config, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
        if not model_id:
            raise ConfigurationError(
                "The model's config has no name_or_path, so its shared profile cannot be looked up. "
                "Pass the model id or a profile file."
            )
    else:
        raise ConfigurationError(
            f"Expected a profile file, a model id or a loaded model, got {type(model).__name__}."
        )
    path = download_profile(
        model_id,
        scorer,
        revision=revision,
        repo_id=repo_id,
        token=token,
        local_dir=local_dir,
        cache_dir=cache_dir,
        endpoint=endpoint,
    )
    profile = Profile.load(path)
    scorer = scorer or DEFAULT_SCORER
    if profile.scorer != scorer:
        raise ProfileFormatError(
            f"{path} is stored as the {scorer!r} profile of {model_id!r} but says it was built for scorer "
            f"{profile.scorer!r}. Report it to the repository's maintainers; meanwhile pass scorer={profile.scorer!r}."
        )
    if profile.model_id != model_id:
        warnings.warn(
            f"The profile stored for {model_id!r} says it was built for {profile.model_id!r}.", stacklevel=2
        )
    return profile


def download_profile(
    model_id: str,
    scorer: str | None = None,
    *,
    revision: str | None = None,
    repo_id: str | None = None,
    token: str | bool | None = None,
    local_dir: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    endpoint: str | None = None,
) -> Path:
    """The local path of ``model_id``'s profile for ``scorer`` (local directory first, then the Hub cache).

    >>> download_profile("meta-llama/Llama-3.1-8B-Instruct")  # doctest: +SKIP
    PosixPath('~/.cache/huggingface/hub/models--lukv-cache--profiles/snapshots/<sha>/meta-llama/...')
    """
    from huggingface_hub import hf_hub_download

    scorer = scorer or DEFAULT_SCORER
    filename = profile_filename(model_id, scorer)
    local_dir = local_dir or os.environ.get(LOCAL_DIR_ENV) or None
    if local_dir is not None and (Path(local_dir) / filename).is_file():
        return Path(local_dir) / filename
    repo_id = profile_repo_id(repo_id)
    searched = f" (also searched the local directory {str(local_dir)!r})" if local_dir else ""
    subject = f"{filename!r} (profile of {model_id!r})"
    with _hub_errors(subject, model_id, repo_id, revision, endpoint, searched) as lookup:
        try:
            return Path(
                hf_hub_download(
                    repo_id,
                    filename,
                    repo_type="model",
                    revision=revision,
                    token=token,
                    cache_dir=cache_dir,
                    endpoint=endpoint,
                    library_name="lukv_cache",
                    library_version=_library_version(),
                )
            )
        except _remote_entry_not_found():
            lookup.scorers = _scorers_for(model_id, repo_id, revision, token, endpoint)
            lookup.missing_scorer, lookup.filename = scorer, filename
            raise
    raise AssertionError("unreachable")  # _hub_errors turns every exception into ours


class _Lookup:
    """What a failed lookup learned: the scorers that do exist for the model (None: could not list)."""

    scorers: list[str] | None = None
    missing_scorer: str | None = None
    filename: str | None = None


def _remote_entry_not_found() -> type[BaseException]:
    from huggingface_hub.errors import RemoteEntryNotFoundError

    return RemoteEntryNotFoundError


@contextmanager
def _hub_errors(
    subject: str,
    model_id: str | None,
    repo_id: str,
    revision: str | None,
    endpoint: str | None,
    searched: str = "",
) -> Iterator[_Lookup]:
    """Turn huggingface_hub's exceptions into lukv_cache's, each naming the model, the file and what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    lookup = _Lookup()
    endpoint = endpoint or constants.ENDPOINT
    fetch_once = f"lukv pull {model_id}" if model_id else "lukv list"
    at = f" at revision {revision!r}" if revision else ""
    local_option = (
        "or use a local profile file (LUKVCache.from_pretrained('profile.safetensors')) or a folder of "
        f"profiles (local_dir= / ${LOCAL_DIR_ENV})"
    )
    try:
        yield lookup
    # LocalEntryNotFoundError first: it is also an EntryNotFoundError, but means "not cached, Hub not reached"
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as err:
        if constants.is_offline_mode() or _caused_by(err, OfflineModeIsEnabled):
            raise HubUnavailableError(
                f"No cached copy of {subject} from {repo_id!r}{at}, and HF_HUB_OFFLINE is set{searched}. "
                f"Unset HF_HUB_OFFLINE and fetch it once ({fetch_once}), {local_option}."
            ) from err
        raise HubUnavailableError(
            f"Could not reach the Hub at {endpoint} to fetch {subject} from {repo_id!r}{at}, and it is not "
            f"cached{searched}. Check the connection or HF_ENDPOINT (once cached, HF_HUB_OFFLINE=1 uses the "
            f"cache), {local_option}."
        ) from err
    except RepositoryNotFoundError as err:
        gated = " (it is gated: request access on its page)" if isinstance(err, GatedRepoError) else ""
        raise ProfileNotFoundError(
            f"The shared profile repository {repo_id!r} was not found at {endpoint}{gated} while looking for "
            f"{subject}{searched}. Check repo_id / ${REPO_ID_ENV} and your token, {local_option}."
        ) from err
    except RevisionNotFoundError as err:
        raise ProfileNotFoundError(
            f"Revision {revision!r} does not exist in {repo_id!r} (looking for {subject}). Pass an existing "
            "branch, tag or commit sha, or no revision for the latest."
        ) from err
    except EntryNotFoundError as err:
        scorer = lookup.missing_scorer
        if lookup.scorers:
            raise ProfileNotFoundError(
                f"{repo_id!r}{at} has no {scorer!r} profile for {model_id!r} ({lookup.filename!r} is missing)"
                f"{searched}. "
                f"Profiles for {model_id!r} exist for the scorers: {', '.join(lookup.scorers)}. Pass one of "
                f"them as scorer=, or build a {scorer!r} profile and publish it (lukv push)."
            ) from err
        what = "could not be listed" if lookup.scorers is None else "none"
        raise ProfileNotFoundError(
            f"{repo_id!r}{at} has no shared profile for {model_id!r} ({lookup.filename!r} is missing; scorers with a "
            f"profile for this model: {what}){searched}. Build one with the profiling pipeline and publish it "
            f"(lukv push), {local_option}; `lukv list` shows the models that have one."
        ) from err
    except HFValidationError as err:
        raise ConfigurationError(f"Invalid Hub argument while looking for {subject}: {err}") from err
    except (HfHubHTTPError, *_connection_errors()) as err:
        raise HubUnavailableError(
            f"The Hub at {endpoint} failed while fetching {subject} from {repo_id!r}{at}: {_one_line(err)}. "
            f"Retry later, {local_option}."
        ) from err


def _one_line(err: BaseException) -> str:
    """The error's message on one line (huggingface_hub's span several), without a trailing period."""
    return " ".join(str(err).split()).rstrip(".") or type(err).__name__


def _caused_by(err: BaseException | None, kind: type[BaseException]) -> bool:
    while err is not None:
        if isinstance(err, kind):
            return True
        err = err.__cause__ or err.__context__
    return False


def _scorers_for(
    model_id: str, repo_id: str, revision: str | None, token: str | bool | None, endpoint: str | None
) -> list[str] | None:
    """Scorers with a profile for ``model_id`` in the repository ([] if none, None if it cannot be listed)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

    try:
        entries = HfApi(endpoint=endpoint, token=token).list_repo_tree(
            repo_id, path_in_repo=model_id, revision=revision, repo_type="model"
        )
        names = [entry.path.rsplit("/", 1)[-1] for entry in entries]
    except EntryNotFoundError:
        return []
    except HfHubHTTPError as err:
        return [] if err.response is not None and err.response.status_code == 404 else None
    except _connection_errors():
        return None
    return sorted(name.removesuffix(".safetensors") for name in names if name.endswith(".safetensors"))


# ---------------------------------------------------------------------------------------------- index


def _empty_index() -> dict[str, Any]:
    return {"format_version": INDEX_FORMAT_VERSION, "profiles": []}


def _parse_index(data: bytes, source: str) -> dict[str, Any]:
    try:
        index = json.loads(data)
        if not isinstance(index, dict) or not isinstance(index.get("profiles"), list):
            raise ValueError("expected an object with a 'profiles' list")
        for entry in index["profiles"]:
            if not isinstance(entry, dict) or not {"model_id", "scorer"} <= set(entry):
                raise ValueError("every entry needs 'model_id' and 'scorer'")
    except ValueError as err:
        raise ProfileFormatError(
            f"{source} is not a valid profile index ({err}). Fix or regenerate it, then retry."
        ) from None
    return index


def _index_entry(profile: Profile, model_id: str) -> dict[str, Any]:
    return {**profile.summary(), "model_id": model_id, "path": profile_filename(model_id, profile.scorer)}


def _with_entry(index: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """``index`` with ``entry`` added, replacing the entry of the same (model id, scorer)."""
    key = (entry["model_id"], entry["scorer"])
    kept = [e for e in index["profiles"] if (e["model_id"], e["scorer"]) != key]
    profiles = sorted([*kept, entry], key=lambda e: (e["model_id"], e["scorer"]))
    return {**index, "format_version": INDEX_FORMAT_VERSION, "profiles": profiles}


def _index_bytes(index: dict[str, Any]) -> bytes:
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def list_profiles(
    repo_id: str | None = None,
    *,
    model_id: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_dir: str | os.PathLike | None = None,
) -> list[dict[str, Any]]:
    """The entries of the shared repository's ``index.json`` (or of ``<local_dir>/index.json``).

    Each entry has ``model_id``, ``scorer``, ``path``, ``num_layers``, ``num_kv_heads``, ``head_dim``,
    ``grid`` (size/min/max), ``calibration``, ``created``, ``library_version``.

    >>> [e["scorer"] for e in list_profiles(model_id="meta-llama/Llama-3.1-8B-Instruct")]  # doctest: +SKIP
    ['expected_attention', 'keydiff']
    """
    from huggingface_hub import hf_hub_download

    if local_dir is not None:
        path = Path(local_dir) / INDEX_FILENAME
        index = _parse_index(path.read_bytes(), str(path)) if path.is_file() else _empty_index()
    else:
        repo_id = profile_repo_id(repo_id)
        with _hub_errors(f"the profile index {INDEX_FILENAME!r}", None, repo_id, revision, endpoint):
            try:
                path = hf_hub_download(
                    repo_id,
                    INDEX_FILENAME,
                    repo_type="model",
                    revision=revision,
                    token=token,
                    cache_dir=cache_dir,
                    endpoint=endpoint,
                )
            except _remote_entry_not_found():
                return []  # a repository without an index holds no profiles yet
        index = _parse_index(Path(path).read_bytes(), f"{INDEX_FILENAME} of {repo_id!r}")
    return [dict(e) for e in index["profiles"] if model_id is None or e["model_id"] == model_id]


def save_to_local_dir(profile: Profile, local_dir: str | os.PathLike, model_id: str | None = None) -> Path:
    """Write ``profile`` into a local mirror (e.g. ``profiles_hub/``) and update its ``index.json``.

    >>> save_to_local_dir(profile, "profiles_hub")  # doctest: +SKIP
    PosixPath('profiles_hub/HuggingFaceTB/SmolLM2-135M-Instruct/keydiff.safetensors')
    """
    profile = _published_copy(profile, model_id)
    root = Path(local_dir)
    path = root / profile_filename(profile.model_id, profile.scorer)
    index_path = root / INDEX_FILENAME
    index = _parse_index(index_path.read_bytes(), str(index_path)) if index_path.is_file() else _empty_index()
    profile.save(path)
    _atomic_write(index_path, _index_bytes(_with_entry(index, _index_entry(profile, profile.model_id))))
    return path


# ---------------------------------------------------------------------------------------------- publish


def _published_copy(profile: Profile, model_id: str | None) -> Profile:
    """The profile as published under ``model_id`` (its metadata names the id it is stored under)."""
    if model_id is None or model_id == profile.model_id:
        _check_model_id(profile.model_id)
        return profile
    _check_model_id(model_id)
    extra = {**profile.extra, "built_from_model_id": profile.model_id}
    return dataclasses.replace(profile, model_id=model_id, extra=extra)


def _read_remote_index(api: Any, repo_id: str, commit: str) -> dict[str, Any]:
    """``index.json`` at ``commit``, fetched into a throwaway folder (publishing leaves the user's cache alone)."""
    import tempfile

    from huggingface_hub.errors import EntryNotFoundError

    with tempfile.TemporaryDirectory(prefix="lukv-index-") as tmp:
        try:
            path = api.hf_hub_download(
                repo_id, INDEX_FILENAME, repo_type="model", revision=commit, local_dir=tmp
            )
        except EntryNotFoundError:
            return _empty_index()
        return _parse_index(Path(path).read_bytes(), f"{INDEX_FILENAME} of {repo_id!r} at {commit}")


def push_profile(
    profile: Profile,
    model_id: str | None = None,
    *,
    repo_id: str | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Upload ``profile`` to ``<model_id>/<scorer>.safetensors`` and update ``index.json`` in one commit.

    Returns the commit sha. Any failure raises :class:`~lukv_cache.errors.PublishError`; nothing local
    is written (the repository is left as it was: both files go in one commit, or none).

    >>> push_profile(Profile.load("keydiff.safetensors"), "meta-llama/Llama-3.1-8B-Instruct")  # doctest: +SKIP
    """
    from huggingface_hub import CommitOperationAdd, HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError

    profile = _published_copy(profile, model_id)
    model_id = profile.model_id
    filename = profile_filename(model_id, profile.scorer)
    repo_id = profile_repo_id(repo_id)
    branch = revision or constants.DEFAULT_REVISION
    api = HfApi(endpoint=endpoint, token=token, library_name="lukv_cache", library_version=_library_version())
    step = "creating the repository"
    try:
        api.create_repo(repo_id, repo_type="model", exist_ok=True)
        step = "reading the current index"
        head = api.repo_info(repo_id, repo_type="model", revision=branch).sha
        index = _read_remote_index(api, repo_id, head)
        index = _with_entry(index, _index_entry(profile, model_id))
        step = "uploading"
        operations = [
            CommitOperationAdd(path_in_repo=filename, path_or_fileobj=profile.to_bytes()),
            CommitOperationAdd(path_in_repo=INDEX_FILENAME, path_or_fileobj=_index_bytes(index)),
        ]
        commit = api.create_commit(
            repo_id,
            operations,
            commit_message=commit_message or f"Add {profile.scorer} profile for {model_id}",
            repo_type="model",
            revision=branch,
            # the index was read at `head`: refuse to overwrite a concurrent publisher's entry
            parent_commit=head,
        )
    except ProfileError as err:
        raise PublishError(f"Publishing {filename!r} to {repo_id!r} failed: {err}") from err
    except (HfHubHTTPError, HFValidationError, OSError, ValueError, *_connection_errors()) as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        hint = (
            "The repository changed while publishing: retry."
            if status in (409, 412)
            else "Check that you are logged in with write access (hf auth login / HF_TOKEN / token=), "
            "that the Hub is reachable (HF_ENDPOINT, HF_HUB_OFFLINE unset), then retry."
        )
        raise PublishError(
            f"Publishing the {profile.scorer!r} profile of {model_id!r} to {repo_id!r} ({filename!r}) failed "
            f"while {step}: {type(err).__name__}: {_one_line(err)}. "
            f"Nothing was changed locally or in the repository. {hint}"
        ) from err
    return commit.oid
