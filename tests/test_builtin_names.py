"""lukv_cache._names (the built-in scorer and allocator names the command line reads without torch) is the
registries' names exactly, after every module of lukv_cache is imported (nothing else registers a name)."""

from __future__ import annotations

import json
import subprocess
import sys

from lukv_cache._names import BUILTIN_ALLOCATORS, BUILTIN_SCORERS


def test_builtin_names_are_the_registries_names_after_importing_every_module():
    # a fresh interpreter: this session's doctests and tests register names of their own
    code = """
import importlib, json, pkgutil
import lukv_cache
failed = []
for info in pkgutil.walk_packages(lukv_cache.__path__, "lukv_cache."):
    try:
        importlib.import_module(info.name)
    except ImportError as err:  # an optional dependency (triton, flash-attn) that is not installed
        failed.append([info.name, str(err)])
from lukv_cache.allocation import ALLOCATORS
from lukv_cache.scorers import SCORERS
print(json.dumps({"scorers": SCORERS.names(), "allocators": ALLOCATORS.names(), "failed": failed}))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["scorers"] == list(BUILTIN_SCORERS), "update lukv_cache/_names.py: BUILTIN_SCORERS"
    assert result["allocators"] == list(BUILTIN_ALLOCATORS), "update lukv_cache/_names.py: BUILTIN_ALLOCATORS"
    assert all("lukv_cache" not in why for _, why in result["failed"]), result["failed"]


def test_the_names_are_sorted_and_unique():
    for names in (BUILTIN_SCORERS, BUILTIN_ALLOCATORS):
        assert list(names) == sorted(set(names))
