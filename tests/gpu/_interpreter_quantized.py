"""Run the quantized-store Triton kernel in Triton's interpreter on CPU; compare it with the torch
reference on the dequantized store.

Run as a script with ``TRITON_INTERPRET=1`` in the environment (it must be set before triton is first
imported, hence a separate process); prints one JSON list of per-case results.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lukv_cache.attention._triton_quantized import triton_quantized_ragged_attention  # noqa: E402
from lukv_cache.attention.kernels import ragged_with_suffix_reference  # noqa: E402
from lukv_cache.attention.partial import ragged_attention_reference  # noqa: E402
from lukv_cache.cache.storage.quant import PackedRows  # noqa: E402

NEG = torch.finfo(torch.float32).min


def masked_randn(shape, gen, hide=0.3):
    """fp32 bias with a share ``hide`` of its entries at the finite minimum (tokens hidden from a query)."""
    bias = torch.randn(shape, generator=gen)
    bias[torch.rand(bias.shape, generator=gen) < hide] = NEG
    return bias


def run_case(
    name, bits, lengths, b, h, m, d, dtype=torch.float32, softcap=None, bias_q=None, num_splits=None,
    seed=0, suffix=None, suffix_bias=False,
):  # fmt: skip
    """``suffix``: length S of a dense suffix, stored as a view into a larger buffer like the cache's."""
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.zeros(b * h + 1, dtype=torch.long)
    offsets[1:] = torch.tensor(lengths, dtype=torch.long).cumsum(0)
    n = int(offsets[-1])
    q = torch.randn(b, h, m, d, generator=gen).to(dtype)
    # keys with a few large channels (as real keys have), values plain
    keys = 2 * torch.randn(n, d, generator=gen) * (1 + 4 * (torch.arange(d) % 7 == 0))
    pk = PackedRows.quantize(keys.to(dtype), bits)
    pv = PackedRows.quantize(torch.randn(n, d, generator=gen).to(dtype), bits)
    k_ref, v_ref = pk.dequantize(dtype=torch.float32), pv.dequantize(dtype=torch.float32)
    bias = masked_randn((n, bias_q), torch.Generator().manual_seed(seed + 1)) if bias_q is not None else None
    kw = {"scaling": d**-0.5, "softcap": softcap, "key_bias": bias}
    packed = (*pk.tensors(), *pv.tensors(), offsets)
    started = time.perf_counter()
    if suffix is None:
        out, lse = triton_quantized_ragged_attention(
            q, *packed, bits=bits, dim=d, num_splits=num_splits, **kw
        )
        seconds = time.perf_counter() - started
        ref_out, ref_lse = ragged_attention_reference(q.float(), k_ref, v_ref, offsets.tolist(), **kw)
        empty = torch.tensor([c == 0 for c in lengths]).view(b, h)
    else:
        sgen = torch.Generator().manual_seed(seed + 2)
        buf_k = torch.randn(b, h, suffix + 5, d, generator=sgen).to(dtype)
        buf_v = torch.randn(b, h, suffix + 5, d, generator=sgen).to(dtype)
        sk, sv = buf_k[:, :, :suffix], buf_v[:, :, :suffix]
        sb = masked_randn((b, 1, m, suffix), sgen) if suffix_bias else None
        out, lse = triton_quantized_ragged_attention(
            q, *packed, bits=bits, dim=d, num_splits=num_splits, suffix_keys=sk, suffix_values=sv,
            suffix_bias=sb, **kw,
        )  # fmt: skip
        seconds = time.perf_counter() - started
        ref_out, ref_lse = ragged_with_suffix_reference(
            q.float(), k_ref, v_ref, offsets.tolist(), sk.float(), sv.float(), suffix_bias=sb, **kw
        )
        empty = torch.tensor([c == 0 and suffix == 0 for c in lengths]).view(b, h)
    full = ~empty
    hidden = bool(bias is not None and (bias == NEG).any())
    return {
        "name": name,
        "bits": bits,
        "head_dim": d,
        "rows": m,
        "shape_ok": tuple(out.shape) == (b, h, m, d) and tuple(lse.shape) == (b, h, m),
        "dtype_ok": out.dtype == torch.float32 and lse.dtype == torch.float32,
        "max_err_out": (out - ref_out)[full].abs().max().item() if bool(full.any()) else 0.0,
        "max_err_lse": (lse - ref_lse)[full].abs().max().item() if bool(full.any()) else 0.0,
        "empty_ok": bool((out[empty] == 0).all()) and bool(torch.isneginf(lse[empty]).all()),
        "nan": bool(torch.isnan(out).any() or torch.isnan(lse).any()),
        # the quantization is not a no-op: the dequantized keys differ from the keys (so the test is
        # about codes, not about rows that happen to round-trip)
        "quant_err": (k_ref - keys).abs().max().item() if n else 0.0,
        "hidden_tokens": hidden,
        "seconds": round(seconds, 3),
    }


CASES = [
    # GQA decode (G = 4 query heads per KV head, Q = 1), head_dim 64 (groups of 32), segments of every
    # size around the key block of 64, two of them empty
    ("int8_d64_decode", dict(bits=8, lengths=[0, 1, 63, 64, 65, 200, 0, 17], b=2, h=4, m=4, d=64, seed=1)),
    ("int4_d64_decode", dict(bits=4, lengths=[0, 1, 63, 64, 65, 200, 0, 17], b=2, h=4, m=4, d=64, seed=2)),
    # head_dim 16 (groups of 16), more query rows than one block of rows (M = 70 > 64: two blocks)
    ("int8_d16_many_rows", dict(bits=8, lengths=[50, 130, 0], b=1, h=3, m=70, d=16, seed=3)),
    ("int4_d16_many_rows", dict(bits=4, lengths=[50, 130, 0], b=1, h=3, m=70, d=16, seed=4)),
    # key bias per stored token and query token hiding 30% of the tokens (M = G * Q = 2 * 3), splits
    ("int8_d64_bias_q3", dict(bits=8, lengths=[40, 0, 129, 7], b=2, h=2, m=6, d=64, bias_q=3, num_splits=2, seed=5)),
    ("int4_d16_bias_q3", dict(bits=4, lengths=[40, 0, 129, 7], b=2, h=2, m=6, d=16, bias_q=3, num_splits=2, seed=6)),
    # softcap, several query tokens per head, a forced split count (the merge kernel)
    ("int4_d64_softcap_splits", dict(bits=4, lengths=[5, 0, 270, 90, 1, 33], b=3, h=2, m=6, d=64, softcap=5.0, num_splits=3, seed=7)),
    # one segment holds nearly everything: many splits, most of them empty
    ("int8_d16_many_splits", dict(bits=8, lengths=[700, 0, 3, 0], b=1, h=4, m=2, d=16, num_splits=8, seed=8)),
    # head_dim 128 (4 groups of 32 per row)
    ("int4_d128_decode", dict(bits=4, lengths=[3, 100, 0, 64], b=2, h=2, m=4, d=128, seed=9)),
    # head_dim 24: groups of 8, three per row in a block of 32 channels (the last block of groups masked)
    ("int4_d24_groups_of_8", dict(bits=4, lengths=[20, 0, 90], b=1, h=3, m=4, d=24, bias_q=1, seed=15)),
    # head_dim 12: one group of 12 (not a power of two: scales read per channel), 4 and 8 bits
    ("int4_d12_one_group", dict(bits=4, lengths=[7, 66, 0], b=1, h=3, m=3, d=12, softcap=6.0, seed=16)),
    ("int8_d12_one_group", dict(bits=8, lengths=[7, 66, 0], b=1, h=3, m=3, d=12, suffix=4, seed=17)),
    # store + dense suffix in one launch, bf16 query and suffix (a strided view of a larger buffer)
    ("int8_d64_suffix_bf16", dict(bits=8, lengths=[0, 70, 150, 5], b=2, h=2, m=4, d=64, dtype=torch.bfloat16, suffix=9, seed=10)),
    # both biases with hidden entries, softcap, Q = 2 (M = 3 * 2), forced splits, a suffix
    ("int4_d16_suffix_both_biases_softcap", dict(bits=4, lengths=[33, 0, 129, 64], b=1, h=4, m=6, d=16, softcap=8.0, bias_q=2, num_splits=2, suffix=7, suffix_bias=True, seed=11)),
    ("int8_d64_suffix_both_biases", dict(bits=8, lengths=[33, 0, 129, 64], b=1, h=4, m=6, d=64, bias_q=2, num_splits=3, suffix=7, suffix_bias=True, seed=12)),
    # empty store: the suffix is everything (only the suffix masked); nothing stored at all
    ("int4_d64_empty_store_suffix", dict(bits=4, lengths=[0, 0], b=1, h=2, m=4, d=64, suffix=6, suffix_bias=True, seed=13)),
    ("int8_d16_empty_store", dict(bits=8, lengths=[0, 0, 0, 0], b=2, h=2, m=4, d=16, seed=14)),
]  # fmt: skip


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1")
    torch.set_num_threads(1)  # tiny tensors: threads only add barrier waits on a busy machine
    only = set(sys.argv[1:])
    print(json.dumps([run_case(name, **kw) for name, kw in CASES if not only or name in only]))


if __name__ == "__main__":
    main()
