"""huggingface_hub's exceptions, translated into lukv_cache's: each names the model, the file and what to do."""

from __future__ import annotations

import logging
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, cast

from ..errors import ConfigurationError, HubUnavailableError, ProfileNotFoundError
from .location import DEFAULT_REPO_ID, LOCAL_DIR_ENV, REPO_ID_ENV, HubLocation

if TYPE_CHECKING:
    from types import FrameType

logger = logging.getLogger("lukv_cache")

# raised from Python and from the shell (`lukv pull|list`): name both spellings of the local folder
LOCAL_OPTION = (
    "or use a local profile file (e.g. profile.safetensors) or a folder of profiles "
    f"(${LOCAL_DIR_ENV}, --local-dir in the shell, local_dir= in Python)"
)
# a probe still unanswered after this many seconds says on stderr (a WARNING log) that it is waiting
NOTICE_AFTER = 1.0
# an endpoint that did not answer is not probed again for this long (one wait per command, not per file)
UNREACHABLE_TTL = 60.0
_unreachable: dict[str, float] = {}
_said: set[str] = set()  # the once-per-process notices already given
_PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)


def connection_errors() -> tuple[type[BaseException], ...]:
    """Transport errors of whichever HTTP stack huggingface_hub uses (httpx in 1.x/2.x, requests before).

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


def one_line(err: BaseException) -> str:
    """The error's message on one line (huggingface_hub's span several), without a trailing period."""
    return " ".join(str(err).split()).rstrip(".") or type(err).__name__


def _caused_by(err: BaseException | None, kind: type[BaseException]) -> bool:
    while err is not None:
        if isinstance(err, kind):
            return True
        err = err.__cause__ or err.__context__
    return False


@contextmanager
def translated_hub_errors(
    subject: str, hub: HubLocation, *, model_id: str | None = None, searched: str = ""
) -> Iterator[None]:
    """Run a Hub call; its exceptions leave as lukv_cache's typed errors.

    ``subject`` names what was fetched (``"'org/m/keydiff.safetensors' (profile of 'org/m')"``);
    ``searched`` says which local folder was tried first. A missing *file* is the caller's to handle
    (it knows which scorers exist); everything else is translated here.
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, at, endpoint = hub.repo, hub.at(), hub.endpoint_url()
    fetch_once = f"lukv pull {model_id}" if model_id else "lukv list"
    try:
        yield
    # LocalEntryNotFoundError first: it is also an EntryNotFoundError, but means "not cached, Hub not reached"
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as err:
        if hub.local_files_only:
            raise ProfileNotFoundError(
                f"No copy of {subject} from {repo!r}{at} in huggingface_hub's cache{searched}, and Hub lookups "
                f"are off (local_files_only). Build one (lukv build <model> --out <folder>/<model id>/), fetch it "
                f"once ({fetch_once}), {LOCAL_OPTION}.",
                model_id=model_id,
            ) from err
        if constants.is_offline_mode() or _caused_by(err, OfflineModeIsEnabled):
            raise HubUnavailableError(
                f"No cached copy of {subject} from {repo!r}{at}, and HF_HUB_OFFLINE is set{searched}. "
                f"Unset HF_HUB_OFFLINE and fetch it once ({fetch_once}), {LOCAL_OPTION}."
            ) from err
        raise HubUnavailableError(
            f"Could not reach the Hub at {endpoint} to fetch {subject} from {repo!r}{at}, and it is not "
            f"cached{searched}. Check the connection or HF_ENDPOINT (once cached, HF_HUB_OFFLINE=1 uses the "
            f"cache), {LOCAL_OPTION}."
        ) from err
    except RepositoryNotFoundError as err:
        gated = " (it is gated: request access on its page)" if isinstance(err, GatedRepoError) else ""
        raise ProfileNotFoundError(
            f"The shared profile repository {repo!r} was not found at {endpoint}{gated} while looking for "
            f"{subject}{searched}. Check repo_id / ${REPO_ID_ENV} and your token, {LOCAL_OPTION}.",
            model_id=model_id,
        ) from err
    except RevisionNotFoundError as err:
        raise ProfileNotFoundError(
            f"Revision {hub.revision!r} does not exist in {repo!r} (looking for {subject}). Pass an existing "
            "branch, tag or commit sha, or no revision for the latest.",
            model_id=model_id,
        ) from err
    except HFValidationError as err:
        raise ConfigurationError(f"Invalid Hub argument while looking for {subject}: {err}") from err
    except (HfHubHTTPError, *connection_errors()) as err:  # type: ignore[misc]  # a tuple of classes
        raise HubUnavailableError(
            f"The Hub at {endpoint} failed while fetching {subject} from {repo!r}{at}: {one_line(err)}. "
            f"Retry later, {LOCAL_OPTION}."
        ) from err


def hub_answers(filename: str, hub: HubLocation) -> bool:
    """Whether the Hub answers about ``filename`` within ``hub.timeout`` seconds in all (any answer, even
    "not found"). The deadline covers everything huggingface_hub does first (its agent-registry fetch
    included); an INFO log says the Hub is asked, and a probe still waiting after :data:`NOTICE_AFTER`
    seconds says so on stderr (once per process). An endpoint that did not answer is not asked again for
    :data:`UNREACHABLE_TTL` seconds."""
    from huggingface_hub import constants

    if hub.local_files_only or constants.is_offline_mode():
        return True  # huggingface_hub will not touch the network: nothing to wait for
    endpoint = hub.endpoint_url()
    since = _unreachable.get(endpoint)
    if since is not None and time.monotonic() - since < UNREACHABLE_TTL:
        logger.info(
            "lukv_cache: the Hub at %s did not answer %.0f s ago; not asking again",
            endpoint,
            time.monotonic() - since,
        )
        return False
    timeout = cast(float, hub.timeout)  # a number once HubLocation is built (its __post_init__)
    logger.info("lukv_cache: asking the Hub at %s for %s (up to %g s)", endpoint, filename, hub.timeout)
    answer: list[bool] = []
    probe = threading.Thread(target=_probe, args=(filename, hub, answer), name="lukv-hub-probe", daemon=True)
    start = time.monotonic()
    probe.start()
    probe.join(min(NOTICE_AFTER, timeout))
    if probe.is_alive():
        say_once(
            f"waiting:{endpoint}",
            f"lukv_cache: waiting up to {hub.timeout:g} s for the Hub at {endpoint} "
            "(HF_HUB_OFFLINE=1 uses the cached and shipped profiles without asking)",
        )
        probe.join(max(0.0, timeout - (time.monotonic() - start)))
    answered = bool(answer and answer[0])  # no answer by the deadline: unreachable (the thread is left)
    if not answered:
        _unreachable[endpoint] = time.monotonic()
    return answered


def _probe(filename: str, hub: HubLocation, answer: list[bool]) -> None:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    url = hf_hub_url(hub.repo, filename, revision=hub.revision, endpoint=hub.endpoint)
    try:
        get_hf_file_metadata(url, token=hub.token, timeout=hub.timeout, retry_on_errors=False)
    except connection_errors():
        answer.append(False)
    except Exception:  # an answer (404, 401, ...): hf_hub_download reports it properly
        answer.append(True)
    else:
        answer.append(True)


def hub_file(filename: str, hub: HubLocation, *, reachable: bool, **download_kwargs) -> str:
    """``hf_hub_download`` of ``filename`` from the repository; when the Hub did not answer, the cached copy
    only, read without any network call (``LocalEntryNotFoundError`` when there is none)."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import LocalEntryNotFoundError

    # any os.PathLike works (huggingface_hub annotates str | Path)
    cache_dir = cast("str | Path | None", hub.cache_dir)
    if not reachable and not hub.local_files_only:
        cached = try_to_load_from_cache(
            hub.repo, filename, cache_dir=cache_dir, revision=hub.revision, repo_type="model"
        )
        if isinstance(cached, str):
            return cached
        raise LocalEntryNotFoundError(f"{filename} is not cached and the Hub did not answer")
    return hf_hub_download(
        hub.repo,
        filename,
        repo_type="model",
        revision=hub.revision,
        token=hub.token,
        cache_dir=cache_dir,
        endpoint=hub.endpoint,
        local_files_only=hub.local_files_only,
        etag_timeout=cast(float, hub.timeout),  # a number once HubLocation is built
        **download_kwargs,
    )


def say_once(key: str, message: str) -> None:
    """A WARNING log (stderr when logging is not configured) the first time ``key`` is seen in this process."""
    if key not in _said:
        _said.add(key)
        logger.warning(message)


def caller_stacklevel() -> int:
    """The ``stacklevel`` that attributes a warning raised by the function calling this one to the first
    frame outside lukv_cache (the user's code, or the ``lukv`` entry point)."""
    frame: FrameType | None = sys._getframe(1)
    level = 1  # level 1: the function that calls warnings.warn
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def shipped_fallback(what: str, path: Path, hub: HubLocation, why: BaseException) -> None:
    """Say that ``what`` comes from the copy shipped with lukv_cache (``path``) because the Hub could not
    serve it (``why``). The shipped copies are the default repository's: where that is the repository in
    use, this is what was wanted and only an INFO log says so; where another repository was asked for, a
    short UserWarning (once per process) points at the caller."""
    from huggingface_hub import constants

    asked = hub.repo
    reason = (
        "offline" if hub.local_files_only or constants.is_offline_mode() else one_line(why).split(". ")[0]
    )
    logger.info("lukv_cache: using the shipped %s (%s): %s", what, reason, path)
    if asked == DEFAULT_REPO_ID or f"fallback:{asked}" in _said:
        return
    _said.add(f"fallback:{asked}")
    warnings.warn(
        f"lukv_cache: {asked!r} could not serve the {what}; using the copy shipped with lukv_cache "
        f"(from {DEFAULT_REPO_ID!r}) instead; a local folder of profiles or a profile file chooses another.",
        stacklevel=caller_stacklevel(),
    )
