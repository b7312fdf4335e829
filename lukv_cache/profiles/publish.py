"""Publishing a profile to the shared repository: the file and its ``index.json`` entry in one commit."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from ..errors import ProfileError, PublishError
from .files import library_version
from .hub_errors import connection_errors, one_line
from .index import empty_index, index_bytes, index_entry, parse_index, published_copy, with_entry
from .location import INDEX_FILENAME, HubLocation, PublishedProfile, profile_filename


def _read_remote_index(api: Any, repo_id: str, commit: str | None) -> dict[str, Any]:
    """``index.json`` at ``commit``, fetched into a throwaway folder (publishing leaves the user's cache alone)."""
    from huggingface_hub.errors import EntryNotFoundError

    with tempfile.TemporaryDirectory(prefix="lukv-index-") as tmp:
        try:
            path = api.hf_hub_download(
                repo_id, INDEX_FILENAME, repo_type="model", revision=commit, local_dir=tmp
            )
        except EntryNotFoundError:
            return empty_index()
        return parse_index(Path(path).read_bytes(), f"{INDEX_FILENAME} of {repo_id!r} at {commit}")


def push_profile(
    profile: PublishedProfile,
    model_id: str | None = None,
    *,
    hub: HubLocation | None = None,
    commit_message: str | None = None,
) -> str:
    """Upload ``profile`` to ``<model_id>/<scorer>.safetensors`` and update ``index.json`` in one commit.

    ``hub.revision`` is the branch committed to (default main). Returns the commit sha. Any failure raises
    :class:`~lukv_cache.errors.PublishError`; nothing local is written, and both files go in one commit
    or none.

    >>> push_profile(Profile.load("keydiff.safetensors"), "meta-llama/Llama-3.1-8B-Instruct")  # doctest: +SKIP
    """
    from huggingface_hub import CommitOperationAdd, HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError

    hub = hub or HubLocation()
    profile = published_copy(profile, model_id)
    model_id = profile.model_id
    filename = profile_filename(model_id, profile.scorer)
    repo_id = hub.repo
    branch = hub.revision or constants.DEFAULT_REVISION
    api = HfApi(
        endpoint=hub.endpoint, token=hub.token, library_name="lukv_cache", library_version=library_version()
    )
    step = "creating the repository"
    try:
        api.create_repo(repo_id, repo_type="model", exist_ok=True)
        step = "reading the current index"
        head = api.repo_info(repo_id, repo_type="model", revision=branch).sha
        index = with_entry(_read_remote_index(api, repo_id, head), index_entry(profile, model_id))
        step = "uploading"
        operations = [
            CommitOperationAdd(path_in_repo=filename, path_or_fileobj=profile.to_bytes()),
            CommitOperationAdd(path_in_repo=INDEX_FILENAME, path_or_fileobj=index_bytes(index)),
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
    except (HfHubHTTPError, HFValidationError, OSError, ValueError, *connection_errors()) as err:  # type: ignore[misc]
        status = getattr(getattr(err, "response", None), "status_code", None)
        hint = (
            "The repository changed while publishing: retry."
            if status in (409, 412)
            else "Check that you are logged in with write access (hf auth login / HF_TOKEN / token=), "
            "that the Hub is reachable (HF_ENDPOINT, HF_HUB_OFFLINE unset), then retry."
        )
        if step == "uploading" and status is None:
            # the request may have reached the Hub before the connection failed: the commit is unknown
            state = (
                "Nothing was changed locally; the upload may or may not have been applied to the repository "
                f"(`lukv list --repo-id {repo_id}` shows what it holds)."
            )
        else:
            state = "Nothing was changed locally or in the repository."
        raise PublishError(
            f"Publishing the {profile.scorer!r} profile of {model_id!r} to {repo_id!r} ({filename!r}) failed "
            f"while {step}: {type(err).__name__}: {one_line(err)}. {state} {hint}"
        ) from err
    return commit.oid
