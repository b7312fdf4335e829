"""Docstring examples run as tests (``python -m pytest`` collects ``lukv_cache`` with --doctest-modules).

Examples that need the real model or the network are marked ``# doctest: +SKIP``; the rest run against
the tiny objects below (``lukv_cache.testing``'s), each example in a fresh temporary folder.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

# conftest files are loaded as conftests, never collected as doctest modules (their names would clash);
# tests/gpu/_*.py are the scripts its tests run in child processes, not test modules
collect_ignore_glob = ["conftest.py", "tests/*/conftest.py", "tests/conftest.py", "tests/gpu/_*.py"]
if (
    importlib.util.find_spec("triton") is None
):  # the Triton kernels' doctests need triton (the gpu-test extra)
    collect_ignore_glob.append("lukv_cache/attention/_triton_*.py")


def _tiny_profile():
    from lukv_cache.testing import array_profile

    grid = np.array([0.25, 0.5, 0.75], dtype=np.float32)
    ratios = np.stack([np.full((2, 2), r, dtype=np.float32) for r in grid])
    ratios[:, 0, 0] -= 0.1  # layer 0, head 0 keeps more
    ratios[:, 1, 1] += 0.1
    return array_profile(grid, ratios, model_id="org/tiny-llama", head_dim=16)


@pytest.fixture(autouse=True)
def _doctest_objects(request, doctest_namespace, tmp_path, monkeypatch):
    from _pytest.doctest import DoctestItem

    if not isinstance(request.node, DoctestItem):
        return
    monkeypatch.chdir(tmp_path)
    from lukv_cache.testing import tiny_model

    model = tiny_model(name_or_path="org/tiny-llama")
    doctest_namespace.update(
        torch=torch,
        np=np,
        model=model,
        inputs={"input_ids": torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(1))},
        profile=_tiny_profile(),
    )
