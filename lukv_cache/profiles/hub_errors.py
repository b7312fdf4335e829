"""huggingface_hub's exceptions, translated into lukv_cache's: each names the model, the file and what to do."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import ConfigurationError, HubUnavailableError, ProfileNotFoundError
from .location import LOCAL_DIR_ENV, REPO_ID_ENV, HubLocation

LOCAL_OPTION = (
    "or use a local profile file (LUKVCache.from_pretrained('profile.safetensors')) or a folder of "
    f"profiles (local_dir= / ${LOCAL_DIR_ENV})"
)


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
    except (HfHubHTTPError, *connection_errors()) as err:
        raise HubUnavailableError(
            f"The Hub at {endpoint} failed while fetching {subject} from {repo!r}{at}: {one_line(err)}. "
            f"Retry later, {LOCAL_OPTION}."
        ) from err


def hub_answers(filename: str, hub: HubLocation) -> bool:
    """Whether the Hub answers about ``filename`` within ``hub.timeout`` (any answer, even "not found")."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url

    if hub.local_files_only or constants.is_offline_mode():
        return True  # huggingface_hub will not touch the network: nothing to wait for
    url = hf_hub_url(hub.repo, filename, revision=hub.revision, endpoint=hub.endpoint)
    try:
        get_hf_file_metadata(url, token=hub.token, timeout=hub.timeout, retry_on_errors=False)
    except connection_errors():
        return False
    except Exception:  # an answer (404, 401, ...): hf_hub_download reports it properly
        return True
    return True
