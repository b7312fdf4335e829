"""The Triton ragged-attention kernel, run in Triton's interpreter on CPU, matches the torch reference.

The interpreter must be switched on before triton is first imported, so the kernel runs in a child
process (``_interpreter_cases.py``). Skipped when triton is not installed (CPU torch does not ship it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (pip install triton: its interpreter runs the kernel on CPU)",
)


@pytest.fixture(scope="module")
def cases() -> dict[str, dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "_interpreter_cases.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {case["name"]: case for case in json.loads(proc.stdout.strip().splitlines()[-1])}


CASES = [
    "bf16_gqa_decode",
    "softcap_q3_splits",
    "bias_q3",
    "odd_head_dim_many_splits",
    "many_query_rows",
    "empty_store",
    "suffix_bf16_decode",
    "suffix_both_biases_softcap",
    "suffix_bias_only_empty_store",
    "suffix_empty",
]


@needs_triton
def test_every_case_the_child_ran_is_checked(cases):
    assert sorted(cases) == sorted(CASES)


@needs_triton
@pytest.mark.parametrize("name", CASES)
def test_triton_kernel_matches_reference_in_interpreter(cases, name):
    case = cases[name]
    assert case["shape_ok"] and case["dtype_ok"]
    assert not case["nan"]
    assert case["max_err_out"] < 1e-5
    assert case["max_err_lse"] < 1e-5


@needs_triton
@pytest.mark.parametrize("name", CASES)
def test_triton_kernel_gives_zero_and_minus_inf_for_empty_segments(cases, name):
    assert cases[name]["empty_ok"]


@needs_triton
def test_split_plan_fills_the_gpu_without_tiny_splits():
    from lukv_cache.attention._triton_ragged import plan_splits
    from lukv_cache.attention.limits import LIMITS

    MAX_SPLITS, MIN_CHUNK = LIMITS.triton_max_splits, LIMITS.triton_min_chunk

    # decode at 128k context, ratio 0.8, 8 KV heads on an H200 (132 SMs): ~4 programs per SM
    assert plan_splits(8, 8 * 26_000, 1, 132) == 66
    # a short store never splits below MIN_CHUNK keys per split on average
    assert plan_splits(8, 3 * MIN_CHUNK, 1, 132) == 3
    # many segments already fill the GPU: no split
    assert plan_splits(4096, 4096 * 5000, 1, 132) == 1
    assert plan_splits(1, 10**9, 1, 10**6) == MAX_SPLITS
    assert plan_splits(8, 0, 1, 132) == 1


@needs_triton
def test_generation_through_triton_kernels_matches_torch_reference():
    """End to end: a compressed LUKVCache generating with left padding, Triton (interpreter) vs torch."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "_interpreter_model.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # LUKV_RAGGED_KERNEL=triton routes CPU tensors to the interpreter: a generation that never reached the
    # kernel compared the torch path with itself (a broken routing), a failure, not a skip
    assert result["triton_calls"] > 0, f"no attention call reached the Triton kernel: {result}"
    assert result["triton_failure"] is None
    assert result["tokens_equal"]
    assert result["max_logit_diff"] < 1e-4
    # the 4-bit store: the Triton kernel on its codes (dequantized in registers), the same answers as the
    # torch reference reading the store block by block
    assert result["quantized_failure"] is None
    assert result["int4_codes_calls"] > 0, f"no attention call reached the Triton kernel on codes: {result}"
    assert result["int4_tokens_equal"]
    assert result["int4_max_logit_diff"] < 1e-4
