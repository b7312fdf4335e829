"""Fixtures for the profile tests: a Hub-protocol server on 127.0.0.1 and small profiles."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hub_server import HubServer  # noqa: E402
from profile_factory import _make_profile  # noqa: E402

from lukv_cache.profiles import Profile  # noqa: E402


@pytest.fixture
def hub(monkeypatch):
    """A fresh in-memory Hub on a free port; the real huggingface_hub client talks to ``hub.url``. The
    process's memory of endpoints that did not answer starts empty too: the OS reuses ports, and an earlier
    test's stopped server on this port would make this one "unreachable" without asking (a rare flake)."""
    from lukv_cache.profiles import hub_errors

    monkeypatch.setattr(hub_errors, "_unreachable", {})
    server = HubServer().start()
    yield server
    server.stop()


@pytest.fixture
def hf_cache(tmp_path):
    """A private huggingface_hub cache folder (never the user's)."""
    path = tmp_path / "hf-cache"
    path.mkdir()
    return path


@pytest.fixture
def make_profile():
    """``make_profile(layers=2, kv_heads=2, grid_size=5, model_id=..., scorer="keydiff", **fields)``."""
    return _make_profile


@pytest.fixture
def profile() -> Profile:
    return _make_profile()


class HubCalls:
    """What the profile code asked of the network: each Hub probe thread with the join timeouts it was
    given (the bound of the wait), and the huggingface_hub calls that talk to the Hub, by name."""

    def __init__(self) -> None:
        self.probes: list[list[float | None]] = []
        self.calls: dict[str, int] = {"get_hf_file_metadata": 0, "hf_hub_download": 0, "list_repo_tree": 0}

    def network_calls(self) -> int:
        return sum(self.calls.values())

    def wait_bound(self) -> float:
        """The longest any probe could make its caller wait: the sum of its join timeouts (a join without
        one waits for as long as the connection hangs: infinite), less 1 ms: the second join's timeout is
        the deadline less the time measured since the start, which a clock tick may put a hair under the
        first join's timeout."""
        bounds = [sum(float("inf") if t is None else t for t in joins) for joins in self.probes]
        return max(bounds, default=0.0) - 0.001


@pytest.fixture
def hub_calls(monkeypatch) -> HubCalls:
    """Counts the Hub probes and huggingface_hub's network calls made by lukv_cache.profiles (the calls
    still run)."""
    import threading
    import types

    import huggingface_hub

    from lukv_cache.profiles import hub_errors

    calls = HubCalls()

    class ProbeThread(threading.Thread):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.joins: list[float | None] = []
            calls.probes.append(self.joins)

        def join(self, timeout=None):
            self.joins.append(timeout)
            super().join(timeout)

    monkeypatch.setattr(hub_errors, "threading", types.SimpleNamespace(Thread=ProbeThread))

    def spy(name, real):
        def call(*args, **kwargs):
            calls.calls[name] += 1
            return real(*args, **kwargs)

        return call

    for name in ("get_hf_file_metadata", "hf_hub_download"):  # imported from the module at each call
        monkeypatch.setattr(huggingface_hub, name, spy(name, getattr(huggingface_hub, name)))
    api = huggingface_hub.HfApi
    monkeypatch.setattr(api, "list_repo_tree", spy("list_repo_tree", api.list_repo_tree))
    return calls
