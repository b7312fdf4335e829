"""``compressed_attention`` with learned sinks (``s_aux``) through the fused Triton store + suffix kernel,
run in Triton's interpreter on CPU, against a float64 reference; prints one JSON list of per-case results.

Run with ``TRITON_INTERPRET=1`` and ``LUKV_RAGGED_KERNEL=triton`` in the environment (the interpreter must
be on before triton is first imported, hence a separate process).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from sink_models import dense_reference, sink_case  # noqa: E402

from lukv_cache.attention import _triton_ragged, kernels  # noqa: E402
from lukv_cache.attention.compressed import compressed_attention  # noqa: E402

NEG = torch.finfo(torch.float32).min


def run_case(name, counts, heads, *, g=2, q_len=1, d=16, suffix=5, dtype=torch.float32, softcap=None,
             masked_cols=(), seed=0):  # fmt: skip
    store, query, sk, sv, s_aux, length = sink_case(
        counts, heads=heads, q_len=q_len, g=g, d=d, suffix=suffix, dtype=dtype, seed=seed
    )
    b = query.shape[0]
    mask = torch.zeros(b, 1, q_len, length)
    for i in range(q_len):
        mask[:, :, i, length - q_len + i + 1 :] = NEG
    for row, col in masked_cols:
        mask[row, :, :, col] = NEG
    calls = {"fused": 0}
    kernel = _triton_ragged.triton_ragged_attention

    def counted(*args, **kwargs):
        calls["fused"] += int(kwargs.get("suffix_keys") is not None)
        return kernel(*args, **kwargs)

    _triton_ragged.triton_ragged_attention = counted
    try:
        out = compressed_attention(store, query, sk, sv, mask, 0.25, softcap, s_aux=s_aux)
    finally:
        _triton_ragged.triton_ragged_attention = kernel
    ref = dense_reference(store, query, sk, sv, mask, 0.25, s_aux, softcap)
    return {
        "name": name,
        "fused_calls": calls["fused"],
        "triton_failure": kernels.triton_failure(),
        "dtype_ok": out.dtype == dtype and tuple(out.shape) == (b, q_len, heads * g, d),
        "max_err": (out.double() - ref).abs().max().item(),
        "nan": bool(torch.isnan(out).any()),
    }


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get(kernels.KERNEL_ENV) != "triton":
        raise SystemExit(f"set TRITON_INTERPRET=1 and {kernels.KERNEL_ENV}=triton")
    torch.set_num_threads(1)
    cases = [
        # decode (Q = 1), GQA, an empty segment, one segment longer than a split
        run_case("fp32_decode", [30, 7, 0, 300], 2, seed=1),
        # several query tokens (causal in the suffix), masked stored tokens (key bias), softcap
        run_case(
            "fp32_q3_bias_softcap",
            [40, 0, 129, 7],
            2,
            q_len=3,
            softcap=5.0,
            masked_cols=[(0, 3), (1, 9)],
            seed=2,
        ),
        # bf16 layer and bf16 sinks (the model's dtype): the sink is applied in fp32
        run_case("bf16_decode", [0, 70, 300, 5], 2, dtype=torch.bfloat16, suffix=9, seed=3),
    ]
    print(json.dumps(cases))


if __name__ == "__main__":
    main()
