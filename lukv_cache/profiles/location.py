"""Where profiles live: the shared Hub repository (:class:`HubLocation`) and the file names inside it.

The profile for ``meta-llama/Llama-3.1-8B-Instruct`` with scorer ``keydiff`` lives at
``meta-llama/Llama-3.1-8B-Instruct/keydiff.safetensors`` in the repository named by ``repo_id``, else
``$LUKV_PROFILE_REPO``, else ``lukv-cache/profiles``; ``index.json`` at its root lists what exists. A local
mirror (``profiles_hub/`` at the top of this repository, ``$LUKV_PROFILE_DIR``) has the same layout.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..errors import ConfigurationError

DEFAULT_REPO_ID = "lukv-cache/profiles"
REPO_ID_ENV = "LUKV_PROFILE_REPO"
LOCAL_DIR_ENV = "LUKV_PROFILE_DIR"
INDEX_FILENAME = "index.json"
DEFAULT_SCORER = "keydiff"  # what `lukv pull` fetches by default
# from_pretrained without a scorer: the first a model has a profile for. KVzap (learned KVzip+ scores) beat
# keydiff on SmolLM2-135M on retrieval and continuation loss (docs/kvzap.md).
PREFERRED_SCORERS = ("kvzap", DEFAULT_SCORER)
# (scorer, allocator) of from_pretrained for a model with no profile anywhere, and of `lukv check` on one:
# the profile-free line the README recommends. Measured profile-free on SmolLM2-135M-Instruct only (1k-token
# Wikipedia contexts, ratio 0.8; benchmarks/results/scorers_1k/*_1k_grid.md, keydiff /
# global in benchmarks/results/kvzip_1k/*_kvzip_w1.md), nothing wins on both retrieval and continuation loss:
# keydiff/uniform 7.8% / +0.163 nats/token, keydiff/adakv 18.8% / +0.184, snapkv/uniform 7.8% / +0.071 (but
# 9.4% against keydiff/uniform's 25.0% at 0.5), keydiff/global 26.6% against 7.8% with +0.225 against +0.181.
# keydiff/uniform is also what the family matrix (tests/families) runs on every family. Re-measure on the
# real models before changing it.
PROFILE_FREE = ("keydiff", "uniform")
TIMEOUT_ENV = "LUKV_HUB_TIMEOUT"
DEFAULT_TIMEOUT = (
    5.0  # a HEAD to the Hub answers in well under a second; a hung Hub costs this once per command
)
MAX_TIMEOUT = 86_400.0  # one day: any longer wait is a typo
# the profiles this package ships (a copy of the shared repository's, for offline use): the repository's
# top-level profiles_hub/, which the wheel carries as lukv_cache/profiles_hub/ (setup.py); a source checkout or
# an editable install reads the top-level folder itself
_PACKAGE_DIR = Path(__file__).resolve().parent.parent
BUNDLED_DIR = _PACKAGE_DIR / "profiles_hub"
if not (BUNDLED_DIR / INDEX_FILENAME).is_file() and (_PACKAGE_DIR.parent / "pyproject.toml").is_file():
    BUNDLED_DIR = _PACKAGE_DIR.parent / "profiles_hub"
_SCORER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class PublishedProfile(Protocol):
    """What publishing reads of a profile (:class:`~lukv_cache.profiles.Profile` is one): the index and the
    upload are written from these, so they do not import the class whose ``push_to_hub`` calls them."""

    model_id: str
    scorer: str
    extra: dict[str, Any]

    def summary(self) -> dict[str, Any]: ...

    def to_bytes(self) -> bytes: ...

    def save(self, path: str | os.PathLike) -> Path: ...


@dataclass(frozen=True)
class HubLocation:
    """How to reach the shared profile repository: every Hub switch in one place.

    ``repo_id`` (default ``$LUKV_PROFILE_REPO``, else ``lukv-cache/profiles``), ``revision`` (branch, tag
    or commit sha; default the main branch), ``token``, ``cache_dir`` (huggingface_hub's cache) and
    ``endpoint`` (default ``$HF_ENDPOINT``) go to huggingface_hub unchanged; ``None`` means its default.
    ``local_files_only``: read huggingface_hub's cache only, never the network. ``timeout``: seconds to wait
    for the Hub before giving up on it (default ``$LUKV_HUB_TIMEOUT``, else 5) in all, probe included.

    >>> HubLocation(repo_id="me/my-profiles").repo
    'me/my-profiles'
    """

    repo_id: str | None = None
    revision: str | None = None
    token: str | bool | None = None
    cache_dir: str | os.PathLike | None = None
    endpoint: str | None = None
    local_files_only: bool = False
    timeout: float | None = field(default=None)

    def __post_init__(self) -> None:
        given = f"timeout={self.timeout!r}"
        if self.timeout is None:
            raw = os.environ.get(TIMEOUT_ENV, "")
            given = f"${TIMEOUT_ENV}={raw!r}"
            try:
                value = float(raw) if raw.strip() else DEFAULT_TIMEOUT
            except ValueError:
                raise ConfigurationError(f"{given} is not a number of seconds.") from None
            object.__setattr__(self, "timeout", value)
        timeout = self.timeout
        # refused, not clamped: inf or 1e300 overflow the socket's timeout, and the Hub would never be
        # declared unreachable (so the shipped profiles never served); a silent clamp would hide the typo
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not 0 < timeout <= MAX_TIMEOUT
        ):
            raise ConfigurationError(
                f"{given}: the Hub timeout must be a finite number of seconds in (0, {MAX_TIMEOUT:g}]; "
                f"e.g. {DEFAULT_TIMEOUT:g} (the default) or 60."
            )

    @property
    def repo(self) -> str:
        """The repository id in use: ``repo_id``, else ``$LUKV_PROFILE_REPO``, else the default."""
        return profile_repo_id(self.repo_id)

    def endpoint_url(self) -> str:
        """The endpoint in use (for messages): ``endpoint``, else huggingface_hub's."""
        from huggingface_hub import constants

        return self.endpoint or constants.ENDPOINT

    def at(self) -> str:
        """`` at revision 'x'`` when a revision is pinned (for messages)."""
        return f" at revision {self.revision!r}" if self.revision else ""


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
    check_model_id(model_id)
    if not isinstance(scorer, str) or not _SCORER_NAME.match(scorer):
        raise ConfigurationError(
            f"Scorer name {scorer!r} cannot name a profile file: use letters, digits, '_', '-' or '.' "
            f"(e.g. {DEFAULT_SCORER!r})."
        )
    return f"{model_id}/{scorer}.safetensors"


MAX_MODEL_ID = 96 * 2 + 1  # "org/name", each part at most 96 characters (huggingface_hub's rule)


def check_model_id(model_id: str) -> None:
    """Raise :class:`~lukv_cache.errors.ConfigurationError` unless ``model_id`` is a Hub model id.

    >>> check_model_id("x" * 300)
    Traceback (most recent call last):
    ...
    lukv_cache.errors.ConfigurationError: 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...' (300 characters) is not a Hub model id (at most 96 characters, or 'org/name' of at most 96 each). Shared profiles are keyed by model id, e.g. 'meta-llama/Llama-3.1-8B-Instruct': pass the model id (a model loaded from a local folder has the folder as its name), or pass a profile file.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        if isinstance(model_id, str) and len(model_id) > MAX_MODEL_ID:
            # said without repeating it: huggingface_hub's own message quotes the whole id again
            raise HFValidationError("at most 96 characters, or 'org/name' of at most 96 each")
        if not isinstance(model_id, str) or model_id.startswith((".", "/", "~")):
            raise HFValidationError("looks like a local path")
        validate_repo_id(model_id)
    except HFValidationError as err:
        shown = repr(model_id)
        if isinstance(model_id, str) and len(model_id) > MAX_MODEL_ID:
            shown = f"{model_id[:40] + '...'!r} ({len(model_id)} characters)"
        raise ConfigurationError(
            f"{shown} is not a Hub model id ({err}). Shared profiles are keyed by model id, "
            "e.g. 'meta-llama/Llama-3.1-8B-Instruct': pass the model id (a model loaded from a local folder "
            "has the folder as its name), or pass a profile file."
        ) from None


def check_local_dir(local_dir: str | os.PathLike | None) -> None:
    """Raise :class:`~lukv_cache.errors.ConfigurationError` unless ``local_dir`` (a folder of profiles
    passed by the caller; ``None``: none) is an existing folder: one that is missing or is a file would
    be searched in vain, without a word.

    >>> check_local_dir("/no/such/folder")
    Traceback (most recent call last):
    ...
    lukv_cache.errors.ConfigurationError: local_dir='/no/such/folder': no such folder. Pass a folder of profiles (<model id>/<scorer>.safetensors inside, as `lukv build` and save_to_local_dir write them), or leave local_dir out.
    """
    if local_dir is None:
        return
    path = Path(local_dir).expanduser()
    try:
        found = path.is_dir()
        why = "is a file, not a folder" if not found and path.exists() else "no such folder"
    except OSError as err:  # a name too long for the file system, ...
        found, why = False, f"cannot be read ({err.strerror or err})"
    if not found:
        raise ConfigurationError(
            f"local_dir={str(local_dir)!r}: {why}. Pass a folder of profiles (<model id>/<scorer>.safetensors "
            "inside, as `lukv build` and save_to_local_dir write them), or leave local_dir out."
        )
