"""Offline and hung-Hub behaviour (issue 33, item 7): the shipped profiles serve quietly when they are what
was wanted, a hung Hub costs one bounded, announced wait per command, and `lukv list` works offline.

Nothing here leaves 127.0.0.1: a socket that accepts and never answers stands for a hung Hub, and a closed
port for an unreachable one.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import warnings

import pytest

from lukv_cache.errors import HubUnavailableError
from lukv_cache.profiles import HubLocation, hub_errors, list_profiles, resolve_profile, save_to_local_dir
from lukv_cache.profiles.location import DEFAULT_TIMEOUT

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch):
    """Each test sees a process that has given no notice yet and probed no endpoint."""
    monkeypatch.setattr(hub_errors, "_said", set())
    monkeypatch.setattr(hub_errors, "_unreachable", {})


@pytest.fixture
def hung_hub():
    """An address that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


@pytest.fixture
def closed_port():
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now: connections are refused at once
    return f"http://127.0.0.1:{port}"


def test_default_repository_unreachable_serves_the_shipped_profile_without_a_warning(
    closed_port, hf_cache, caplog
):
    location = HubLocation(endpoint=closed_port, cache_dir=hf_cache, timeout=2.0)
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="lukv_cache"):
        warnings.simplefilter("error")
        profile = resolve_profile(SMOL, hub=location)
    assert "profiles_hub" in profile.source
    assert any("using the shipped kvzap profile" in r.getMessage() for r in caplog.records)


def test_another_repository_warns_once_short_and_at_the_caller(closed_port, hf_cache):
    location = HubLocation(repo_id="me/my-profiles", endpoint=closed_port, cache_dir=hf_cache, timeout=2.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve_profile(SMOL, hub=location)
        resolve_profile(SMOL, "keydiff", hub=location)
    assert len(caught) == 1, [str(w.message) for w in caught]
    (warning,) = caught
    assert warning.filename == __file__  # not a line inside lukv_cache
    message = str(warning.message)
    assert "'me/my-profiles' could not serve" in message and "shipped with lukv_cache" in message
    assert len(message) < 260 and "\n" not in message


def test_a_hung_hub_costs_one_announced_wait_of_the_default_timeout(hung_hub, hf_cache, caplog, hub_calls):
    """Before: 13-15 s of silence (huggingface_hub's 3 s agent-registry fetch, then a 10 s HEAD), per file.
    Now one probe, whose caller waits at most the default timeout in all, and nothing more for the next
    file: no probe, no Hub call."""
    assert DEFAULT_TIMEOUT <= 5
    location = HubLocation(endpoint=hung_hub, cache_dir=hf_cache)
    with caplog.at_level(logging.INFO, logger="lukv_cache"):
        resolve_profile(SMOL, hub=location)
        assert len(hub_calls.probes) == 1 and hub_calls.calls["get_hf_file_metadata"] == 1
        assert hub_calls.calls["hf_hub_download"] == 0  # unreachable: the cache or the shipped copy only
        assert 0 < hub_calls.wait_bound() <= DEFAULT_TIMEOUT, hub_calls.probes
        asked = hub_calls.network_calls()
        resolve_profile(SMOL, "keydiff", hub=location)  # the same command asks again: no second wait
    assert len(hub_calls.probes) == 1 and hub_calls.network_calls() == asked, (
        hub_calls.probes,
        hub_calls.calls,
    )
    messages = [r.getMessage() for r in caplog.records]
    assert any(r.levelno == logging.INFO and "asking the Hub at" in r.getMessage() for r in caplog.records)
    waiting = [m for m in messages if "waiting up to" in m]
    assert len(waiting) == 1 and hung_hub in waiting[0] and "HF_HUB_OFFLINE=1" in waiting[0]


def test_a_hung_hub_without_a_shipped_copy_fails_within_the_timeout(hung_hub, hf_cache, hub_calls):
    location = HubLocation(endpoint=hung_hub, cache_dir=hf_cache, timeout=1.0)
    with pytest.raises(HubUnavailableError, match="Could not reach the Hub"):
        resolve_profile("org/no-shipped-copy", "keydiff", hub=location)
    assert len(hub_calls.probes) == 1 and 0 < hub_calls.wait_bound() <= 1.0, hub_calls.probes
    assert hub_calls.calls == {"get_hf_file_metadata": 1, "hf_hub_download": 0, "list_repo_tree": 0}


def test_listing_offline_gives_the_shipped_and_local_profiles(
    closed_port, hf_cache, tmp_path, monkeypatch, profile
):
    mirror = tmp_path / "mirror"
    save_to_local_dir(profile, mirror)
    monkeypatch.setenv("LUKV_PROFILE_DIR", str(mirror))
    for location in (
        HubLocation(cache_dir=hf_cache, local_files_only=True),
        HubLocation(endpoint=closed_port, cache_dir=hf_cache, timeout=2.0),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            entries = list_profiles(hub=location)
        keys = {(e["model_id"], e["scorer"]) for e in entries}
        assert (SMOL, "kvzap") in keys and (SMOL, "keydiff") in keys
        assert (profile.model_id, profile.scorer) in keys


def test_listing_a_pinned_revision_offline_still_fails(closed_port, hf_cache):
    location = HubLocation(endpoint=closed_port, cache_dir=hf_cache, timeout=2.0, revision="v1")
    with pytest.raises(HubUnavailableError):
        list_profiles(hub=location)


def _lukv(*args: str, home) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(home), "OMP_NUM_THREADS": "1"}
    env.pop("LUKV_PROFILE_DIR", None)
    code = "import sys; from lukv_cache.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_cli_list_and_pull_offline(tmp_path):
    listed = _lukv("list", home=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert SMOL in listed.stdout and "kvzap" in listed.stdout
    assert "Warning" not in listed.stderr
    pulled = _lukv("pull", SMOL, "--scorer", "keydiff", home=tmp_path)
    assert pulled.returncode == 0 and "profiles_hub" in pulled.stdout, pulled.stderr
    assert pulled.stderr.strip() == ""  # offline by intent: not a word on stderr
    missing = _lukv("pull", "org/none", home=tmp_path)
    assert missing.returncode == 2
    assert "--local-dir" in missing.stderr and "local_dir=" in missing.stderr  # both spellings


def test_a_hub_that_answers_is_asked_without_an_announced_wait(hub, hf_cache, profile, caplog):
    profile.push_to_hub(repo_id="lukv-test/profiles", endpoint=hub.url)
    location = HubLocation(repo_id="lukv-test/profiles", endpoint=hub.url, cache_dir=hf_cache)
    with caplog.at_level(logging.INFO, logger="lukv_cache"):
        assert resolve_profile(profile.model_id, "keydiff", hub=location).model_id == profile.model_id
    assert any("asking the Hub at" in r.getMessage() for r in caplog.records)  # the probe ran
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
