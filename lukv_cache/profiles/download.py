"""Finding a model's profile: an explicit file, a local folder, or the shared Hub repository.

Everything remote goes through ``huggingface_hub`` (its cache, ``HF_HUB_OFFLINE``, ``HF_ENDPOINT``, tokens,
revisions): nothing of it is re-implemented here.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError, HubUnavailableError, ProfileFormatError, ProfileNotFoundError
from .hub_errors import (
    LOCAL_OPTION,
    connection_errors,
    hub_answers,
    hub_file,
    shipped_fallback,
    translated_hub_errors,
)
from .location import (
    BUNDLED_DIR,
    DEFAULT_SCORER,
    LOCAL_DIR_ENV,
    PREFERRED_SCORERS,
    HubLocation,
    check_local_dir,
    profile_filename,
)
from .profile import Profile, library_version

logger = logging.getLogger("lukv_cache")


def model_id_of(model: Any) -> str:
    """The id a loaded model's profile is keyed by: ``model.config.name_or_path`` ("" when unset).

    >>> model_id_of(type("M", (), {"config": type("C", (), {"name_or_path": "org/m"})()})())
    'org/m'
    """
    config = model.config
    return getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "") or ""


def resolve_profile(
    model: Any,
    scorer: str | None = None,
    *,
    hub: HubLocation | None = None,
    local_dir: str | os.PathLike | None = None,
) -> Profile:
    """The profile for ``model``: a profile file, a model id, a loaded model (its ``name_or_path``), or a
    :class:`Profile` already in memory (returned as it is).

    A model id is looked up first in ``local_dir`` (else ``$LUKV_PROFILE_DIR``) at
    ``<local_dir>/<model_id>/<scorer>.safetensors``, then in the shared Hub repository through
    ``hf_hub_download`` (cache, offline mode, token, revision and endpoint from ``hub``). Without a
    ``scorer``, the model's ``kvzap`` profile if it has one, else its ``keydiff`` profile
    (:data:`~lukv_cache.profiles.location.PREFERRED_SCORERS`).

    >>> profile = resolve_profile("meta-llama/Llama-3.1-8B-Instruct", "snapkv")  # doctest: +SKIP
    >>> profile = resolve_profile("./my_profile.safetensors")                   # doctest: +SKIP
    """
    if isinstance(model, Profile):
        return model
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if _is_file(path):
            return Profile.load(path)
        if str(model).endswith(".safetensors"):
            raise ProfileNotFoundError(
                f"No profile file at {str(model)!r}. Check the path, or pass a model id to use the shared profile."
            )
        model_id = str(model)
    elif hasattr(model, "config"):
        model_id = model_id_of(model)
        if not model_id:
            raise ConfigurationError(
                "The model's config has no name_or_path, so its shared profile cannot be looked up. "
                "Pass the model id or a profile file."
            )
    else:
        raise ConfigurationError(
            f"Expected a profile file, a model id or a loaded model, got {type(model).__name__}."
        )
    path, scorer = _preferred_profile(model_id, scorer, hub, local_dir)
    _warn_if_folder_passed_over(model_id, scorer, path, local_dir or os.environ.get(LOCAL_DIR_ENV))
    profile = Profile.load(path)
    logger.info("lukv_cache: the %s profile of %s comes from %s", profile.scorer, model_id, path)
    if profile.scorer != scorer:
        raise ProfileFormatError(
            f"{path} is stored as the {scorer!r} profile of {model_id!r} but says it was built for scorer "
            f"{profile.scorer!r}. Report it to the repository's maintainers; meanwhile pass scorer={profile.scorer!r}.",
            source=str(path),
            field="scorer",
        )
    if profile.model_id != model_id:
        warnings.warn(
            f"The profile stored for {model_id!r} says it was built for {profile.model_id!r}.", stacklevel=2
        )
    return profile


def _is_file(path: Path) -> bool:
    """``path.is_file()``, ``False`` where the path cannot even be asked about (a name longer than the file
    system allows, ``OSError`` 36): such a string is no file, and is then checked as a model id."""
    try:
        return path.is_file()
    except OSError:
        return False


def _warn_if_folder_passed_over(
    model_id: str, scorer: str, path: Path, folder: str | os.PathLike | None
) -> None:
    """A UserWarning when a profile folder was given but ``path`` comes from elsewhere while the folder holds
    what looks meant for it: other scorers' profiles of this model (the preferred scorer was found first in
    the Hub or the shipped copies), or profiles at its top, where nothing is looked up."""
    if folder is None or not Path(folder).is_dir() or Path(folder).resolve() in path.resolve().parents:
        return
    mine = sorted(p.name for p in (Path(folder) / model_id).glob("*.safetensors"))
    flat = sorted(p.name for p in Path(folder).glob("*.safetensors"))
    if not (mine or flat):
        return
    said = []
    if mine:
        said.append(
            f"it holds {', '.join(mine)} for this model: pass scorer={Path(mine[0]).stem!r} to use "
            + ("it" if len(mine) == 1 else "one")
        )
    if flat:
        said.append(
            f"{', '.join(flat)} at its top {'is' if len(flat) == 1 else 'are'} not looked at: a folder holds "
            f"<model id>/<scorer>.safetensors ({model_id}/{scorer}.safetensors here)"
        )
    warnings.warn(
        f"The {scorer} profile of {model_id} comes from {path}, not from the folder {str(folder)!r}: "
        + "; ".join(said)
        + ".",
        stacklevel=3,
    )


def _preferred_profile(
    model_id: str, scorer: str | None, hub: HubLocation | None, local_dir: str | os.PathLike | None
) -> tuple[Path, str]:
    """The file of ``scorer``'s profile; without a scorer, the first of :data:`PREFERRED_SCORERS` that
    ``model_id`` has a profile for (where it is not found or not reachable, the next is tried)."""
    *preferred, last = [scorer] if scorer else PREFERRED_SCORERS
    for candidate in preferred:
        try:
            return download_profile(model_id, candidate, hub=hub, local_dir=local_dir), candidate
        except (ProfileNotFoundError, HubUnavailableError):
            continue
    return download_profile(model_id, last, hub=hub, local_dir=local_dir), last


def download_profile(
    model_id: str,
    scorer: str | None = None,
    *,
    hub: HubLocation | None = None,
    local_dir: str | os.PathLike | None = None,
) -> Path:
    """The local path of ``model_id``'s profile for ``scorer``.

    Resolution order: ``local_dir`` (else ``$LUKV_PROFILE_DIR``; a ``local_dir`` passed that is missing or
    is a file is a :class:`~lukv_cache.errors.ConfigurationError`); then the shared Hub repository through
    huggingface_hub (its cache, revision, offline mode; a Hub that does not answer within ``hub.timeout``
    seconds counts as unreachable); then, when the Hub has no such file or cannot be reached and no
    revision is pinned, the copy shipped inside this package. The shipped copies are the default
    repository's (``lukv-cache/profiles``): using one in its place is logged at INFO level; a short
    UserWarning (once per process) says so only when another repository was asked for. A Hub still
    silent after a second is announced on stderr (a WARNING log, once per process).

    >>> download_profile("meta-llama/Llama-3.1-8B-Instruct")  # doctest: +SKIP
    PosixPath('~/.cache/huggingface/hub/models--lukv-cache--profiles/snapshots/<sha>/meta-llama/...')
    """
    hub = hub or HubLocation()
    scorer = scorer or DEFAULT_SCORER
    filename = profile_filename(model_id, scorer)
    check_local_dir(local_dir)  # one passed that is missing or a file is an error, not a search of nothing
    local_dir = local_dir or os.environ.get(LOCAL_DIR_ENV) or None
    if local_dir is not None and (Path(local_dir) / filename).is_file():
        return Path(local_dir) / filename
    searched = f" (also searched the local directory {str(local_dir)!r})" if local_dir else ""
    try:
        return _from_hub(model_id, scorer, filename, hub, searched)
    except (HubUnavailableError, ProfileNotFoundError) as err:
        bundled = BUNDLED_DIR / filename
        if hub.revision is not None or not bundled.is_file():
            raise
        shipped_fallback(f"{scorer} profile of {model_id}", bundled, hub, err)
        return bundled


def _from_hub(model_id: str, scorer: str, filename: str, hub: HubLocation, searched: str) -> Path:
    from huggingface_hub.errors import RemoteEntryNotFoundError

    subject = f"{filename!r} (profile of {model_id!r})"
    reachable = hub_answers(filename, hub)
    with translated_hub_errors(subject, hub, model_id=model_id, searched=searched):
        try:
            # unreachable: the cache only
            return Path(
                hub_file(
                    filename,
                    hub,
                    reachable=reachable,
                    library_name="lukv_cache",
                    library_version=library_version(),
                )
            )
        except RemoteEntryNotFoundError:
            available = scorers_with_profiles(model_id, hub)
    repo, at = hub.repo, hub.at()
    if available:
        raise ProfileNotFoundError(
            f"{repo!r}{at} has no {scorer!r} profile for {model_id!r} ({filename!r} is missing){searched}. "
            f"Profiles for {model_id!r} exist for the scorers: {', '.join(available)}. Pass one of "
            f"them as scorer=, or build a {scorer!r} profile and publish it (lukv push).",
            model_id=model_id,
            scorer=scorer,
            available=available,
        )
    what = "could not be listed" if available is None else "none"
    raise ProfileNotFoundError(
        f"{repo!r}{at} has no shared profile for {model_id!r} ({filename!r} is missing; scorers with a "
        f"profile for this model: {what}){searched}. Build one with the profiling pipeline and publish it "
        f"(lukv push), {LOCAL_OPTION}; `lukv list` shows the models that have one.",
        model_id=model_id,
        scorer=scorer,
        available=available,
    )


def scorers_with_profiles(model_id: str, hub: HubLocation) -> list[str] | None:
    """Scorers with a profile for ``model_id`` in the repository ([] if none, None if it cannot be listed)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

    try:
        entries = HfApi(endpoint=hub.endpoint, token=hub.token).list_repo_tree(
            hub.repo, path_in_repo=model_id, revision=hub.revision, repo_type="model"
        )
        names = [entry.path.rsplit("/", 1)[-1] for entry in entries]
    except EntryNotFoundError:
        return []
    except HfHubHTTPError as err:
        return [] if err.response is not None and err.response.status_code == 404 else None
    except connection_errors():
        return None
    return sorted(name.removesuffix(".safetensors") for name in names if name.endswith(".safetensors"))
