"""Generate with a compressed LUKVCache through the Triton kernels (Triton's interpreter on CPU) and
through the torch reference; print one JSON object comparing them, for a full-precision store and a 4-bit
one (``kv_bits=4``: the Triton kernel on its codes, dequantized in registers).

Run with ``TRITON_INTERPRET=1`` (set before triton is first imported, hence a separate process).
``LUKV_RAGGED_KERNEL=triton`` is what routes CPU tensors to the interpreter.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lukv_cache import LUKVCache  # noqa: E402
from lukv_cache.attention import _triton_ragged
from lukv_cache.attention import kernels as cuda  # noqa: E402
from lukv_cache.testing import tiny_model  # noqa: E402


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1")
    torch.set_num_threads(1)
    calls = {"triton": 0}
    kernel = _triton_ragged.triton_ragged_attention

    def counted(*args, **kwargs):
        calls["triton"] += 1
        return kernel(*args, **kwargs)

    _triton_ragged.triton_ragged_attention = counted
    from lukv_cache.attention import _triton_quantized

    on_codes = _triton_quantized.triton_quantized_ragged_attention

    def counted_codes(*args, **kwargs):
        calls["codes"] += 1
        return on_codes(*args, **kwargs)

    calls["codes"] = 0
    _triton_quantized.triton_quantized_ragged_attention = counted_codes
    model = tiny_model()  # seeds torch with 0: the prompt below is drawn after the weights
    ids = torch.randint(0, 128, (2, 60))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding: the mask reaches the kernels as key and suffix biases

    from lukv_cache.attention import limits

    out = {}
    for kv_bits in (None, 4):
        # a quantized store is dequantized a block at a time: small blocks here, several per layer
        limits.LIMITS = replace(limits.LIMITS, block_rows=4096 if kv_bits is None else 64)
        results = {}
        for kernel_name in ("torch", "triton"):
            os.environ[cuda.KERNEL_ENV] = kernel_name
            cache = LUKVCache(ratio=0.7, scorer="keydiff", allocator="uniform", window=4, kv_bits=kv_bits)
            with torch.no_grad():
                results[kernel_name] = model.generate(
                    ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6, do_sample=False,
                    output_logits=True, return_dict_in_generate=True,
                )  # fmt: skip
        ref, got = results["torch"], results["triton"]
        diff = (torch.stack(got.logits) - torch.stack(ref.logits)).abs().max().item()
        key = "" if kv_bits is None else f"int{kv_bits}_"
        out.update({
            f"{key}triton_calls": calls["triton"],
            f"{key}codes_calls": calls["codes"],
            f"{key}tokens_equal": bool(torch.equal(got.sequences, ref.sequences)),
            f"{key}max_logit_diff": diff,
        })  # fmt: skip
        calls["triton"] = calls["codes"] = 0
    out["triton_failure"] = cuda.triton_failure()
    out["quantized_failure"] = cuda._quantized_failure
    print(json.dumps(out))


if __name__ == "__main__":
    main()
