"""Run the Triton ragged kernel in Triton's interpreter on CPU and compare it with the torch reference.

Run as a script with ``TRITON_INTERPRET=1`` in the environment (it must be set before triton is first
imported, hence a separate process); prints one JSON list of per-case results.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lukv_cache.attention._triton_ragged import triton_ragged_attention  # noqa: E402
from lukv_cache.attention.kernels import ragged_with_suffix_reference  # noqa: E402
from lukv_cache.attention.partial import ragged_attention_reference  # noqa: E402

NEG = torch.finfo(torch.float32).min


def store(lengths, b, h, m, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.zeros(b * h + 1, dtype=torch.long)
    offsets[1:] = torch.tensor(lengths, dtype=torch.long).cumsum(0)
    n = int(offsets[-1])
    q = torch.randn(b, h, m, d, generator=gen).to(dtype)
    k = (2 * torch.randn(n, d, generator=gen)).to(dtype)
    v = torch.randn(n, d, generator=gen).to(dtype)
    return q, k, v, offsets


def masked_randn(shape, gen):
    bias = torch.randn(shape, generator=gen)
    bias[torch.rand(bias.shape, generator=gen) < 0.3] = NEG
    return bias


def run_case(
    name, lengths, b, h, m, d, dtype=torch.float32, softcap=None, bias_q=None, num_splits=None, seed=0,
    suffix=None, suffix_bias=False,
):  # fmt: skip
    """``suffix``: length S of a dense suffix, stored as a view into a larger buffer like the cache's."""
    q, k, v, offsets = store(lengths, b, h, m, d, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    bias = masked_randn((k.shape[0], bias_q), gen) if bias_q is not None else None
    kw = {"scaling": d**-0.5, "softcap": softcap, "key_bias": bias}
    if suffix is None:
        out, lse = triton_ragged_attention(q, k, v, offsets, num_splits=num_splits, **kw)
        ref_out, ref_lse = ragged_attention_reference(q.float(), k.float(), v.float(), offsets.tolist(), **kw)
        empty = torch.tensor([n == 0 for n in lengths]).view(b, h)
    else:
        buf_k = torch.randn(b, h, suffix + 5, d, generator=gen).to(dtype)
        buf_v = torch.randn(b, h, suffix + 5, d, generator=gen).to(dtype)
        sk, sv = buf_k[:, :, :suffix], buf_v[:, :, :suffix]
        sb = masked_randn((b, 1, m, suffix), gen) if suffix_bias else None
        out, lse = triton_ragged_attention(
            q, k, v, offsets, num_splits=num_splits, suffix_keys=sk, suffix_values=sv, suffix_bias=sb, **kw
        )
        ref_out, ref_lse = ragged_with_suffix_reference(
            q.float(), k.float(), v.float(), offsets.tolist(), sk.float(), sv.float(), suffix_bias=sb, **kw
        )
        empty = torch.tensor([n == 0 and suffix == 0 for n in lengths]).view(b, h)
    full = ~empty
    return {
        "name": name,
        "shape_ok": tuple(out.shape) == (b, h, m, d) and tuple(lse.shape) == (b, h, m),
        "dtype_ok": out.dtype == torch.float32 and lse.dtype == torch.float32,
        "max_err_out": (out - ref_out)[full].abs().max().item() if bool(full.any()) else 0.0,
        "max_err_lse": (lse - ref_lse)[full].abs().max().item() if bool(full.any()) else 0.0,
        "empty_ok": bool((out[empty] == 0).all()) and bool(torch.isneginf(lse[empty]).all()),
        "nan": bool(torch.isnan(out).any() or torch.isnan(lse).any()),
    }


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1")
    torch.set_num_threads(1)  # tiny tensors: threads only add barrier waits on a busy machine
    cases = [
        # Llama-style GQA decode in bf16: G = 4 query heads per KV head, Q = 1; segments of every size
        run_case(
            "bf16_gqa_decode", [0, 1, 63, 64, 65, 300, 0, 17], 2, 4, 4, 32, dtype=torch.bfloat16, seed=1
        ),
        # several query tokens per head (M = G * Q = 2 * 3), softcap, forced split count (merge kernel)
        run_case("softcap_q3_splits", [5, 0, 270, 90, 1, 33], 3, 2, 6, 16, softcap=5.0, num_splits=3, seed=2),
        # key bias per stored token and query token, with masked (finite min) entries; M = 2 * 3
        run_case("bias_q3", [40, 0, 129, 7], 2, 2, 6, 16, bias_q=3, num_splits=2, seed=3),
        # head_dim not a power of two; one segment holds nearly everything, many splits stay empty
        run_case("odd_head_dim_many_splits", [700, 0, 3, 0], 1, 4, 2, 24, num_splits=8, seed=4),
        # more query rows than one block of rows (M = 40 > 32)
        run_case("many_query_rows", [50, 260, 0], 1, 3, 40, 16, seed=5),
        # nothing stored at all
        run_case("empty_store", [0, 0, 0, 0], 2, 2, 4, 16, seed=6),
        # store + dense suffix in one call: bf16 decode, suffix a strided view of a larger buffer
        run_case("suffix_bf16_decode", [0, 70, 300, 5], 2, 2, 4, 32, dtype=torch.bfloat16, suffix=9, seed=7),
        # both biases, masked entries, softcap, Q = 2 (M = 3 * 2), forced splits
        run_case(
            "suffix_both_biases_softcap",
            [33, 0, 129, 64],
            1,
            4,
            6,
            16,
            softcap=8.0,
            bias_q=2,
            num_splits=2,
            suffix=7,
            suffix_bias=True,
            seed=8,
        ),
        # only the suffix is masked (key_bias None); empty store: the suffix is everything
        run_case("suffix_bias_only_empty_store", [0, 0], 1, 2, 4, 16, suffix=6, suffix_bias=True, seed=9),
        # an empty suffix changes nothing
        run_case("suffix_empty", [10, 0, 90], 1, 3, 4, 16, suffix=0, seed=10),
    ]
    print(json.dumps(cases))


if __name__ == "__main__":
    main()
