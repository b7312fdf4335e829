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
