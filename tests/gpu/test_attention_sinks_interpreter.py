"""Learned attention sinks (``s_aux``) on the CUDA path: the fused Triton kernel returns its log-sum-exp
and ``compressed_attention`` applies the sink from it. Run in Triton's interpreter on CPU in a child
process (``_interpreter_sinks.py``); skipped when triton is not installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CASES = ["fp32_decode", "fp32_q3_bias_softcap", "bf16_decode"]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (pip install triton: its interpreter runs the kernel on CPU)",
)


@pytest.fixture(scope="module")
def cases() -> dict[str, dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "LUKV_RAGGED_KERNEL": "triton"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "_interpreter_sinks.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {case["name"]: case for case in json.loads(proc.stdout.strip().splitlines()[-1])}


def test_every_case_ran(cases):
    assert sorted(cases) == sorted(CASES)


@pytest.mark.parametrize("name", CASES)
def test_fused_triton_path_honours_the_sinks(cases, name):
    case = cases[name]
    assert case["fused_calls"] == 1, "the fused store + suffix kernel did not serve the call"
    assert case["triton_failure"] is None
    assert case["dtype_ok"] and not case["nan"]
    assert case["max_err"] < (2e-2 if name.startswith("bf16") else 2e-5)
