"""The quantized-store Triton kernel (dequantization in registers), run in Triton's interpreter on CPU,
matches the torch reference on the dequantized store.

The interpreter must be switched on before triton is first imported, so the kernel runs in a child
process (``_interpreter_quantized.py``). Skipped when triton is not installed (CPU torch does not ship it).
"""

from __future__ import annotations

import importlib.util
import inspect
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

CASES = [
    "int8_d64_decode",
    "int4_d64_decode",
    "int8_d16_many_rows",
    "int4_d16_many_rows",
    "int8_d64_bias_q3",
    "int4_d16_bias_q3",
    "int4_d64_softcap_splits",
    "int8_d16_many_splits",
    "int4_d128_decode",
    "int8_d64_suffix_bf16",
    "int4_d16_suffix_both_biases_softcap",
    "int8_d64_suffix_both_biases",
    "int4_d64_empty_store_suffix",
    "int8_d16_empty_store",
    "int4_d24_groups_of_8",
    "int4_d12_one_group",
    "int8_d12_one_group",
]


@pytest.fixture(scope="module")
def cases() -> dict[str, dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "_interpreter_quantized.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {case["name"]: case for case in json.loads(proc.stdout.strip().splitlines()[-1])}


@needs_triton
def test_every_case_the_child_ran_is_checked(cases):
    assert sorted(cases) == sorted(CASES)
    # the set covers both widths, the head_dims and their groups, and more rows than one block of rows
    assert {case["bits"] for case in cases.values()} == {8, 4}
    assert {case["head_dim"] for case in cases.values()} >= {16, 64, 128}
    assert max(case["rows"] for case in cases.values()) > 64
    # some key biases really hide tokens
    assert any(case["hidden_tokens"] for case in cases.values())


@needs_triton
@pytest.mark.parametrize("name", CASES)
def test_quantized_kernel_matches_reference_on_dequantized_store(cases, name):
    case = cases[name]
    assert case["shape_ok"] and case["dtype_ok"]
    assert not case["nan"]
    assert case["max_err_out"] < 1e-5
    assert case["max_err_lse"] < 1e-5


@needs_triton
@pytest.mark.parametrize("name", CASES)
def test_quantized_kernel_gives_zero_and_minus_inf_for_empty_segments(cases, name):
    assert cases[name]["empty_ok"]


@needs_triton
def test_quantization_is_not_a_round_trip(cases):
    """The stored rows really lose precision, so matching the reference means decoding the codes."""
    assert cases["int8_d64_decode"]["quant_err"] > 1e-3
    assert cases["int4_d64_decode"]["quant_err"] > 1e-2


@needs_triton
def test_kernel_takes_codes_scales_and_zeros_only():
    """The function is never handed full-precision store rows: its store arguments are the packed
    tensors (and the suffix, which is dense by design)."""
    from lukv_cache.attention._triton_quantized import triton_quantized_ragged_attention

    params = inspect.signature(triton_quantized_ragged_attention).parameters
    positional = [n for n, p in params.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == [
        "query",
        "key_codes",
        "key_scale",
        "key_zero",
        "value_codes",
        "value_scale",
        "value_zero",
        "offsets",
    ]
    keyword = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keyword == [
        "bits",
        "dim",
        "scaling",
        "softcap",
        "key_bias",
        "suffix_keys",
        "suffix_values",
        "suffix_bias",
        "num_splits",
    ]
    assert not {"keys", "values"} & set(params)


@needs_triton
def test_quantized_kernel_rejects_rows_that_are_not_packed():
    import torch

    from lukv_cache.attention._triton_quantized import triton_quantized_ragged_attention
    from lukv_cache.cache.storage.quant import PackedRows

    q = torch.zeros(1, 1, 1, 64)
    pk = PackedRows.quantize(torch.randn(3, 64), 4)
    offsets = torch.tensor([0, 3])
    kw = {"bits": 4, "dim": 64, "scaling": 0.125}
    with pytest.raises(ValueError, match="key_codes must be uint8"):  # full-precision rows as codes
        triton_quantized_ragged_attention(
            q, torch.randn(3, 64), *pk.tensors()[1:], *pk.tensors(), offsets, **kw
        )
    with pytest.raises(ValueError, match="key_codes must be uint8"):  # 8-bit codes read as 4-bit
        pk8 = PackedRows.quantize(torch.randn(3, 64), 8)
        triton_quantized_ragged_attention(q, *pk8.tensors(), *pk.tensors(), offsets, **kw)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        triton_quantized_ragged_attention(q, *pk.tensors(), *pk.tensors(), offsets, **{**kw, "bits": 2})
    with pytest.raises(ValueError, match="head_dim is 64"):
        triton_quantized_ragged_attention(q, *pk.tensors(), *pk.tensors(), offsets, **{**kw, "dim": 32})


def _compile_for_cuda(bits: int, block_d: int, group: int, capability: int, half: str = "bf16"):
    """Ahead-of-time compile of the partial kernel for an NVIDIA target (no GPU needed: the triton wheel
    bundles ptxas), every feature on; as tests/gpu/test_triton_compiles_for_cuda.py does."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lukv_cache.attention import _triton_quantized as tq

    fn = tq._quantized_ragged_attention_partial
    types = {
        **{name: f"*{half}" for name in ("q_ptr", "sk_ptr", "sv_ptr")},
        **{name: "*u8" for name in ("kc_ptr", "vc_ptr")},
        **{name: f"*{half}" for name in ("ks_ptr", "kz_ptr", "vs_ptr", "vz_ptr")},  # the rows' dtype
        **{name: "*fp32" for name in ("bias_ptr", "sbias_ptr", "out_ptr", "lse_ptr")},
        "offsets_ptr": "*i64",
        "scaling": "fp32",
        "softcap": "fp32",
    }
    constexprs = {
        "q_len": 1, "BITS": bits, "GROUP": group, "HAS_SOFTCAP": True, "HAS_BIAS": True, "PRECISION": None,
        "DOT_FP32": False, "BLOCK_M": 16, "BLOCK_N": tq.BLOCK_N, "BLOCK_D": block_d, "MIN_CHUNK": tq.MIN_CHUNK,
    }  # fmt: skip
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
    return triton.compile(
        ASTSource(fn, signature, constexprs),
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": 4, "num_stages": 3},
    )


@needs_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter mode: nothing to compile")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize(
    ("bits", "block_d", "group", "capability", "half"),
    [
        (8, 128, 32, 90, "bf16"),
        (4, 128, 32, 90, "bf16"),
        (4, 64, 32, 80, "fp16"),
        (4, 16, 16, 90, "bf16"),
        (8, 32, 8, 80, "bf16"),  # head_dim 24: groups of 8
        (4, 16, 12, 90, "bf16"),  # head_dim 12: one group of 12, scales read per channel
    ],
)
def test_quantized_kernel_compiles_for_cuda(bits, block_d, group, capability, half):
    kernel = _compile_for_cuda(bits, block_d, group, capability, half)
    assert f"sm_{capability}" in kernel.asm["ptx"]
    assert kernel.metadata.shared <= {90: 232448, 80: 166912}[capability]
