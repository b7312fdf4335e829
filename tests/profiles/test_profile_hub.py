"""Publishing and resolving profiles with the real huggingface_hub client against the test Hub server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hub_server import HubServer

from lukv_cache.errors import (
    ConfigurationError,
    HubUnavailableError,
    ProfileNotFoundError,
    PublishError,
)
from lukv_cache.profiles import (
    HubLocation,
    Profile,
    list_profiles,
    profile_filename,
    resolve_profile,
    save_to_local_dir,
)
from lukv_cache.testing import tiny_model

REPO = "lukv-test/profiles"
MODEL = "org/tiny-llama"
ROOT = Path(__file__).resolve().parents[2]


def _resolve(hub, cache, model=MODEL, scorer=None, *, revision=None, local_dir=None) -> Profile:
    location = HubLocation(repo_id=REPO, revision=revision, endpoint=hub.url, cache_dir=cache)
    return resolve_profile(model, scorer, hub=location, local_dir=local_dir)


def _list(hub, cache, **kw) -> list[dict]:
    return list_profiles(hub=HubLocation(repo_id=REPO, endpoint=hub.url, cache_dir=cache), **kw)


# ------------------------------------------------------------------------------------------ publish / list


def test_push_puts_profile_and_index_in_one_commit(hub, profile):
    sha = profile.push_to_hub(repo_id=REPO, endpoint=hub.url)
    repo = hub.repos[("model", REPO)]
    assert repo.branches["main"] == sha and len(sha) == 40
    assert sorted(repo.snapshots[sha]) == ["index.json", "org/tiny-llama/keydiff.safetensors"]
    # the commit before it (repo creation) holds neither: both files arrived together
    assert repo.snapshots[repo.history[-2]] == {}


def test_list_profiles_reads_the_index(hub, hf_cache, make_profile):
    make_profile(scorer="keydiff").push_to_hub(repo_id=REPO, endpoint=hub.url)
    make_profile(scorer="snapkv", layers=3).push_to_hub(repo_id=REPO, endpoint=hub.url)
    make_profile(model_id="other/model").push_to_hub(repo_id=REPO, endpoint=hub.url)
    entries = _list(hub, hf_cache)
    assert [(e["model_id"], e["scorer"]) for e in entries] == [
        ("org/tiny-llama", "keydiff"),
        ("org/tiny-llama", "snapkv"),
        ("other/model", "keydiff"),
    ]
    snapkv = entries[1]
    assert snapkv["num_layers"] == 3 and snapkv["num_kv_heads"] == 2
    assert snapkv["grid"] == {"size": 5, "min": pytest.approx(0.1), "max": pytest.approx(0.9)}
    assert snapkv["path"] == "org/tiny-llama/snapkv.safetensors"
    assert {"calibration", "created", "library_version"} <= set(snapkv)
    only = _list(hub, hf_cache, model_id="other/model")
    assert [e["model_id"] for e in only] == ["other/model"]


def test_repush_replaces_the_index_entry(hub, hf_cache, make_profile):
    make_profile(calibration="first").push_to_hub(repo_id=REPO, endpoint=hub.url)
    make_profile(calibration="second").push_to_hub(repo_id=REPO, endpoint=hub.url)
    entries = _list(hub, hf_cache)
    assert [e["calibration"] for e in entries] == ["second"]


def test_list_profiles_of_a_repo_without_index_is_empty(hub, hf_cache):
    from huggingface_hub import HfApi

    HfApi(endpoint=hub.url).create_repo(REPO)
    assert _list(hub, hf_cache) == []


def test_push_under_another_model_id_records_that_id(hub, hf_cache, profile):
    profile.push_to_hub("meta-llama/Llama-3.1-8B-Instruct", repo_id=REPO, endpoint=hub.url)
    fetched = _resolve(hub, hf_cache, "meta-llama/Llama-3.1-8B-Instruct")
    assert fetched.model_id == "meta-llama/Llama-3.1-8B-Instruct"
    assert fetched.extra["built_from_model_id"] == MODEL
    assert profile.model_id == MODEL  # the caller's object is unchanged


def test_save_to_local_dir_writes_profile_and_index(tmp_path, profile):
    path = save_to_local_dir(profile, tmp_path)
    assert path == tmp_path / "org" / "tiny-llama" / "keydiff.safetensors"
    assert [e["scorer"] for e in list_profiles(local_dir=tmp_path)] == ["keydiff"]


def test_the_top_level_profiles_hub_is_the_one_shipped_copy():
    """profiles_hub/ beside lukv_cache/ is what a checkout (or an editable install) reads; the wheel carries it
    as lukv_cache/profiles_hub/ (tests/test_wheel.py); no second copy lives in the package folder."""
    from lukv_cache.profiles.location import BUNDLED_DIR

    assert BUNDLED_DIR == ROOT / "profiles_hub"
    assert not (ROOT / "lukv_cache" / "profiles_hub" / "index.json").exists()


def test_shipped_profiles_hub_index_is_valid():
    bundled = ROOT / "profiles_hub"
    entries = list_profiles(local_dir=bundled)
    assert entries
    for entry in entries:  # every listed profile is there and loads
        assert Profile.load(bundled / entry["path"]).scorer == entry["scorer"]


# ------------------------------------------------------------------------------------------ resolve


def test_download_by_default_gets_the_latest_push(hub, hf_cache, make_profile):
    make_profile(calibration="v1").push_to_hub(repo_id=REPO, endpoint=hub.url)
    make_profile(calibration="v2").push_to_hub(repo_id=REPO, endpoint=hub.url)
    fetched = _resolve(hub, hf_cache)
    assert fetched.calibration == "v2" and fetched.scorer == "keydiff"
    assert str(hf_cache) in fetched.source  # it came through huggingface_hub's cache


def test_download_by_pinned_revision_gets_that_commit(hub, hf_cache, make_profile):
    first = make_profile(calibration="v1").push_to_hub(repo_id=REPO, endpoint=hub.url)
    make_profile(calibration="v2").push_to_hub(repo_id=REPO, endpoint=hub.url)
    pinned = _resolve(hub, hf_cache, revision=first)
    assert pinned.calibration == "v1" and first in pinned.source


def test_resolve_a_loaded_model_uses_its_name_or_path(hub, hf_cache, profile):
    profile.push_to_hub(repo_id=REPO, endpoint=hub.url)
    model = tiny_model()
    model.config.name_or_path = MODEL
    fetched = _resolve(hub, hf_cache, model)
    fetched.validate_for(model.config)
    np.testing.assert_array_equal(fetched.evict_ratio, profile.evict_ratio)


def test_resolve_a_file_path_loads_it(tmp_path, profile):
    path = profile.save(tmp_path / "mine.safetensors")
    assert resolve_profile(str(path)).model_id == MODEL
    assert resolve_profile(path).model_id == MODEL


def test_local_dir_is_searched_before_the_hub(hub, hf_cache, tmp_path, make_profile):
    make_profile(calibration="hub").push_to_hub(repo_id=REPO, endpoint=hub.url)
    save_to_local_dir(make_profile(calibration="local"), tmp_path)
    assert _resolve(hub, hf_cache, local_dir=tmp_path).calibration == "local"
    assert _resolve(hub, hf_cache, local_dir=tmp_path, scorer="keydiff").calibration == "local"


def test_local_dir_from_environment(hub, hf_cache, tmp_path, monkeypatch, make_profile):
    save_to_local_dir(make_profile(calibration="env"), tmp_path)
    monkeypatch.setenv("LUKV_PROFILE_DIR", str(tmp_path))
    hub.stop()  # never asked
    assert _resolve(hub, hf_cache).calibration == "env"


def test_repo_id_from_environment(hub, hf_cache, monkeypatch, profile):
    profile.push_to_hub(repo_id="someone/else", endpoint=hub.url)
    monkeypatch.setenv("LUKV_PROFILE_REPO", "someone/else")
    location = HubLocation(endpoint=hub.url, cache_dir=hf_cache)
    assert resolve_profile(MODEL, hub=location).model_id == MODEL


# ------------------------------------------------------------------------------------------ bad input


def test_model_id_with_no_profile_says_none_exist(hub, hf_cache, profile):
    profile.push_to_hub(repo_id=REPO, endpoint=hub.url)
    with pytest.raises(ProfileNotFoundError) as info:
        _resolve(hub, hf_cache, "org/unknown-model")
    message = str(info.value)
    assert "org/unknown-model" in message and "org/unknown-model/keydiff.safetensors" in message
    assert "profile for this model: none" in message and "lukv push" in message


def test_scorer_with_no_profile_lists_the_scorers_that_exist(hub, hf_cache, make_profile):
    make_profile(scorer="keydiff").push_to_hub(repo_id=REPO, endpoint=hub.url)
    make_profile(scorer="snapkv").push_to_hub(repo_id=REPO, endpoint=hub.url)
    with pytest.raises(ProfileNotFoundError) as info:
        _resolve(hub, hf_cache, scorer="tova")
    message = str(info.value)
    assert "no 'tova' profile for 'org/tiny-llama'" in message
    assert "exist for the scorers: keydiff, snapkv" in message and "scorer=" in message


def test_unknown_revision_raises_profile_not_found(hub, hf_cache, profile):
    profile.push_to_hub(repo_id=REPO, endpoint=hub.url)
    with pytest.raises(ProfileNotFoundError, match="Revision 'v9' does not exist"):
        _resolve(hub, hf_cache, revision="v9")


def test_missing_repository_raises_profile_not_found(hub, hf_cache):
    with pytest.raises(
        ProfileNotFoundError, match="repository 'lukv-test/profiles' was not found.*LUKV_PROFILE_REPO"
    ):
        _resolve(hub, hf_cache)


def test_local_path_as_model_id_raises_configuration_error(hf_cache):
    with pytest.raises(ConfigurationError, match="not a Hub model id"):
        resolve_profile("/home/me/models/llama", hub=HubLocation(cache_dir=hf_cache))


def test_missing_profile_file_path_raises_profile_not_found(tmp_path):
    with pytest.raises(ProfileNotFoundError, match="No profile file at"):
        resolve_profile(str(tmp_path / "nope.safetensors"))


def test_hub_unreachable_with_nothing_cached_names_offline_mode_and_local_file(hub, hf_cache, monkeypatch):
    import huggingface_hub.utils._http as hf_http

    # The client's real backoff retries a refused connection 5 times, sleeping 1+2+4+8+8 s; only the
    # sleeping is skipped here (the requests and the client's decisions are unchanged).
    waits: list[float] = []
    monkeypatch.setattr(hf_http.time, "sleep", waits.append)
    hub.stop()
    with pytest.raises(HubUnavailableError) as info:
        _resolve(hub, hf_cache)
    message = str(info.value)
    assert hub.url in message and "org/tiny-llama/keydiff.safetensors" in message
    assert "HF_HUB_OFFLINE" in message and "profile.safetensors" in message
    assert sum(waits) < 1  # no backoff: the Hub did not answer the probe, so only the cache was asked


def test_cached_profile_is_served_when_the_hub_goes_away(hub, hf_cache, profile):
    profile.push_to_hub(repo_id=REPO, endpoint=hub.url)
    _resolve(hub, hf_cache)
    hub.stop()
    assert _resolve(hub, hf_cache).model_id == MODEL


def test_failed_upload_raises_publish_error_and_touches_nothing(hub, tmp_path, make_profile):
    path = make_profile(calibration="first").save(tmp_path / "keydiff.safetensors")
    Profile.load(path).push_to_hub(repo_id=REPO, endpoint=hub.url)
    before_files = {p: p.read_bytes() for p in tmp_path.rglob("*")}
    repo = hub.repos[("model", REPO)]
    before_head = repo.branches["main"]
    hub.refuse_uploads = True
    changed = Profile.load(path)
    changed.calibration = "second"
    with pytest.raises(PublishError) as info:
        changed.push_to_hub(repo_id=REPO, endpoint=hub.url)
    message = str(info.value)
    assert "org/tiny-llama" in message and "org/tiny-llama/keydiff.safetensors" in message
    assert "403" in message and "write access" in message
    assert {p: p.read_bytes() for p in tmp_path.rglob("*")} == before_files
    assert repo.branches["main"] == before_head


def test_concurrent_publish_is_refused_not_overwritten(hub, hf_cache, make_profile):
    make_profile(scorer="keydiff").push_to_hub(repo_id=REPO, endpoint=hub.url)
    # another publisher commits between our read of index.json and our commit
    hub.before_commit = lambda: make_profile(scorer="snapkv").push_to_hub(repo_id=REPO, endpoint=hub.url)
    with pytest.raises(PublishError, match="changed while publishing: retry"):
        make_profile(scorer="tova").push_to_hub(repo_id=REPO, endpoint=hub.url)
    entries = _list(hub, hf_cache)
    assert [e["scorer"] for e in entries] == ["keydiff", "snapkv"]


def test_push_to_unreachable_hub_raises_publish_error(hub, profile, monkeypatch):
    import huggingface_hub.utils._http as hf_http

    monkeypatch.setattr(hf_http.time, "sleep", lambda seconds: None)  # skip the backoff waits only
    hub.stop()
    with pytest.raises(PublishError, match="while creating the repository"):
        profile.push_to_hub(repo_id=REPO, endpoint=hub.url)


def test_bad_scorer_name_raises_configuration_error():
    with pytest.raises(ConfigurationError, match="cannot name a profile file"):
        profile_filename(MODEL, "../evil")


# ------------------------------------------------------------------------------------------ offline

_OFFLINE_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, types

    # Load lukv_cache.profiles without the package __init__ (torch + transformers: many seconds);
    # the code under test is the same files.
    package = types.ModuleType("lukv_cache")
    package.__path__ = [os.path.join(sys.argv[1], "lukv_cache")]
    package.__version__ = "test"
    sys.modules["lukv_cache"] = package

    from huggingface_hub import constants
    from lukv_cache.errors import LUKVError
    from lukv_cache.profiles import HubLocation, resolve_profile

    endpoint, cache, repo, sha = sys.argv[2:6]
    out = {"offline": constants.is_offline_mode()}
    for name, kw in [
        ("default", {}),
        ("pinned", {"revision": sha}),
        ("uncached", {}),
    ]:
        try:
            location = HubLocation(repo_id=repo, endpoint=endpoint, cache_dir=cache, **kw)
            p = resolve_profile("org/tiny-llama", "snapkv" if name == "uncached" else None, hub=location)
            out[name] = {"calibration": p.calibration}
        except LUKVError as err:
            out[name] = {"error": type(err).__name__, "message": str(err)}
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    """Publish twice, download into a fresh cache, stop the Hub, then resolve with HF_HUB_OFFLINE=1."""
    from profile_factory import _make_profile

    cache = tmp_path_factory.mktemp("offline-cache")
    server = HubServer().start()
    try:
        first = _make_profile(calibration="v1").push_to_hub(repo_id=REPO, endpoint=server.url)
        _make_profile(calibration="v2").push_to_hub(repo_id=REPO, endpoint=server.url)
        _make_profile(scorer="snapkv").push_to_hub(repo_id=REPO, endpoint=server.url)
        for revision in (None, first):  # what a user would have fetched while online
            location = HubLocation(repo_id=REPO, revision=revision, endpoint=server.url, cache_dir=cache)
            resolve_profile(MODEL, hub=location)
    finally:
        server.stop()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _OFFLINE_SCRIPT, str(ROOT), server.url, str(cache), REPO, first],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_offline_mode_serves_the_default_revision_from_the_cache(offline_run):
    assert offline_run["offline"] is True
    assert offline_run["default"] == {"calibration": "v2"}


def test_offline_mode_serves_a_pinned_revision_from_the_cache(offline_run):
    assert offline_run["pinned"] == {"calibration": "v1"}


def test_offline_mode_with_nothing_cached_names_hf_hub_offline(offline_run):
    uncached = offline_run["uncached"]
    assert uncached["error"] == "HubUnavailableError"
    assert (
        "HF_HUB_OFFLINE is set" in uncached["message"]
        and "org/tiny-llama/snapkv.safetensors" in uncached["message"]
    )
    assert "lukv pull org/tiny-llama" in uncached["message"]


# ------------------------------------------------------------------------------------------ timeouts, bundled


@pytest.fixture
def silent_endpoint(monkeypatch):
    """An address that accepts connections and never answers (a hung Hub). The process's memory of
    endpoints that did not answer starts empty (the OS reuses ports: this one may have been marked)."""
    import socket

    from lukv_cache.profiles import hub_errors

    monkeypatch.setattr(hub_errors, "_unreachable", {})
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


def test_a_hub_that_never_answers_fails_within_the_timeout(silent_endpoint, hf_cache, hub_calls):
    """One probe whose caller waits at most the timeout in all, then no download attempt."""
    location = HubLocation(repo_id=REPO, endpoint=silent_endpoint, cache_dir=hf_cache, timeout=1.0)
    with pytest.raises(HubUnavailableError, match="Could not reach the Hub"):
        resolve_profile("org/no-bundled-copy", hub=location)
    assert len(hub_calls.probes) == 1 and 0 < hub_calls.wait_bound() <= 1.0, hub_calls.probes
    assert hub_calls.calls == {"get_hf_file_metadata": 1, "hf_hub_download": 0, "list_repo_tree": 0}


def test_the_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("LUKV_HUB_TIMEOUT", "2.5")
    assert HubLocation().timeout == 2.5
    monkeypatch.setenv("LUKV_HUB_TIMEOUT", "soon")
    with pytest.raises(ConfigurationError, match="LUKV_HUB_TIMEOUT"):
        HubLocation()


def test_an_unreachable_hub_falls_back_to_the_bundled_profile_with_a_warning(
    silent_endpoint, hf_cache, monkeypatch
):
    """Warned when another repository than the shipped copies' was asked (quiet for the default one:
    tests/profiles/test_offline_quiet.py)."""
    from lukv_cache.profiles import hub_errors

    monkeypatch.setattr(hub_errors, "_said", set())  # the warning is given once per process
    location = HubLocation(repo_id=REPO, endpoint=silent_endpoint, cache_dir=hf_cache, timeout=1.0)
    with pytest.warns(UserWarning, match="shipped with lukv_cache"):
        profile = resolve_profile("HuggingFaceTB/SmolLM2-135M-Instruct", hub=location)
    assert "profiles_hub" in profile.source and profile.num_layers == 30


def test_a_hub_without_the_file_falls_back_to_the_bundled_profile(hub, hf_cache, profile):
    profile.push_to_hub(repo_id=REPO, endpoint=hub.url)  # the repository exists, without SmolLM2's profile
    location = HubLocation(repo_id=REPO, endpoint=hub.url, cache_dir=hf_cache)
    found = resolve_profile("HuggingFaceTB/SmolLM2-135M-Instruct", "keydiff", hub=location)
    assert found.source.endswith("profiles_hub/HuggingFaceTB/SmolLM2-135M-Instruct/keydiff.safetensors")


def test_a_pinned_revision_never_falls_back(silent_endpoint, hf_cache):
    location = HubLocation(endpoint=silent_endpoint, cache_dir=hf_cache, timeout=1.0, revision="v1")
    with pytest.raises(HubUnavailableError):
        resolve_profile("HuggingFaceTB/SmolLM2-135M-Instruct", hub=location)


def test_offline_by_intent_uses_the_shipped_profile_quietly(hf_cache, caplog):
    """local_files_only=True (or HF_HUB_OFFLINE=1) is a choice, not a failure: an INFO log, no warning."""
    import logging
    import warnings

    location = HubLocation(cache_dir=hf_cache, local_files_only=True)
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="lukv_cache"):
        warnings.simplefilter("error")
        profile = resolve_profile("HuggingFaceTB/SmolLM2-135M-Instruct", hub=location)
    assert "profiles_hub" in profile.source
    assert any("offline" in record.getMessage() for record in caplog.records)


def test_listing_an_unreachable_hub_gives_up_after_one_probe(silent_endpoint, hf_cache, hub_calls):
    """`lukv list` offline retried the Hub five times (37 s); it now probes once, like from_pretrained, and
    lists the shipped profiles (a pinned revision still fails, without asking the same Hub again)."""
    from lukv_cache.profiles import list_profiles

    location = HubLocation(endpoint=silent_endpoint, cache_dir=hf_cache, timeout=1.0)
    assert any(e["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct" for e in list_profiles(hub=location))
    assert len(hub_calls.probes) == 1 and 0 < hub_calls.wait_bound() <= 1.0, hub_calls.probes
    with pytest.raises(HubUnavailableError):
        list_profiles(
            hub=HubLocation(endpoint=silent_endpoint, cache_dir=hf_cache, timeout=1.0, revision="v1")
        )
    assert len(hub_calls.probes) == 1, hub_calls.probes
    assert hub_calls.calls == {"get_hf_file_metadata": 1, "hf_hub_download": 0, "list_repo_tree": 0}


def test_a_profile_stored_under_another_model_id_warns_that_it_was_built_for_that_one(tmp_path, profile):
    path = tmp_path / profile_filename("org/renamed", "keydiff")
    path.parent.mkdir(parents=True)
    profile.save(path)  # as is: save_to_local_dir would record the id it is stored under
    with pytest.warns(UserWarning, match=f"stored for 'org/renamed' says it was built for '{MODEL}'"):
        assert resolve_profile("org/renamed", "keydiff", local_dir=tmp_path).model_id == MODEL


def test_a_profile_stored_under_its_own_model_id_resolves_without_a_warning(tmp_path, profile):
    import warnings

    save_to_local_dir(profile, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_profile(MODEL, "keydiff", local_dir=tmp_path).model_id == MODEL
