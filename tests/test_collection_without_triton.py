"""A contributor's install without the ``gpu-test`` extra (no triton) runs the suite: the Triton kernels'
modules and the Triton-interpreter scripts are not collected, and the tests that need triton skip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# `import triton` fails and importlib.util.find_spec("triton") is None, as where it is not installed
WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def test_the_suite_collects_without_triton():
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            WITHOUT_TRITON,
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "lukv_cache",
            "tests/gpu",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert (
        "_triton_ragged.py" not in run.stdout and "tests/gpu/test_triton_ragged_interpreter.py" in run.stdout
    )
