"""The Triton kernels compile for NVIDIA GPUs (Hopper sm_90, Ampere sm_80) on this CPU-only machine.

Triton compiles ahead of time without a GPU (its wheel bundles ``ptxas``), so type errors, unsupported
ops and shared-memory overflows that the interpreter cannot see are caught here.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter mode: nothing to compile"
    ),
    pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION"),
]

SHARED_LIMIT = {90: 232448, 80: 166912}  # bytes of shared memory per block (opt-in maximum)


def compile_for(fn, types: dict[str, str], constexprs: dict, capability: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
    return triton.compile(
        ASTSource(fn, signature, constexprs),
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": 4},
    )


@pytest.mark.parametrize("capability", [90, 80])
def test_attention_kernel_compiles_with_every_feature_on(capability):
    from lukv_cache.attention import _triton_ragged as tr
    from lukv_cache.attention.limits import LIMITS

    half = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "sk_ptr", "sv_ptr")}
    fp32 = {name: "*fp32" for name in ("bias_ptr", "sbias_ptr", "out_ptr", "lse_ptr")}
    types = {**half, **fp32, "offsets_ptr": "*i64", "scaling": "fp32", "softcap": "fp32"}
    constexprs = {
        "q_len": 1, "HAS_SOFTCAP": True, "HAS_BIAS": True, "PRECISION": None, "DOT_FP32": False,
        "BLOCK_M": 16, "BLOCK_N": LIMITS.triton_block_n, "BLOCK_D": 128, "MIN_CHUNK": LIMITS.triton_min_chunk,
    }  # fmt: skip
    kernel = compile_for(tr._ragged_attention_partial, types, constexprs, capability)
    assert f"sm_{capability}" in kernel.asm["ptx"]
    assert kernel.metadata.shared <= SHARED_LIMIT[capability]


def test_merge_kernel_compiles():
    from lukv_cache.attention import _triton_ragged as tr

    types = {name: "*fp32" for name in ("part_out_ptr", "part_lse_ptr", "out_ptr", "lse_ptr")}
    kernel = compile_for(tr.merge_splits, types, {"BLOCK_PARTS": 256, "BLOCK_D": 128}, 90)
    assert "sm_90" in kernel.asm["ptx"]
