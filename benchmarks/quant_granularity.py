"""Which quantization granularity the quantized store uses, measured: continuation loss of SmolLM2-135M
when the whole prompt's cache (ratio 0, so the quantizer alone is measured) is quantized and dequantized.

For each of 4 Wikipedia articles (``lukv_cache.texts.wikipedia_articles()[5:9]``, not the bench's seed-0
samples), the first 1,024 tokens fill a DynamicCache, its keys and values are replaced by their
quantize-dequantize round trip, and the next 256 tokens are teacher-forced: mean NLL per token, and its
excess over the exact cache. Asymmetric min/max codes with an fp16 scale and minimum per group:

* ``tok``: per token, groups of 32 channels (``16``: of 16), what ``LUKVCache(kv_bits=...)`` stores;
* ``chan``: keys per channel over blocks of 32 tokens (KIVI's key layout);
* ``norm``: keys divided by each head's per-channel absolute maximum, then per token.

    PYTHONPATH=. python benchmarks/quant_granularity.py --threads 1

``--smoke``: on the stand-ins of ``benchmarks/_smoke.py`` (head_dim 32), one thread (``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _smoke
import torch
from _calls import cache_kw

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def per_token(x: torch.Tensor, bits: int, group: int = 32) -> torch.Tensor:
    shape = x.shape
    y = x.reshape(*shape[:-1], shape[-1] // group, group)
    lo, hi = y.amin(-1, keepdim=True).half().float(), y.amax(-1, keepdim=True).half().float()
    scale = ((hi - lo) / (2**bits - 1)).clamp_min(1e-7).half().float()
    return (((y - lo) / scale).round().clamp(0, 2**bits - 1) * scale + lo).reshape(shape)


def per_channel(x: torch.Tensor, bits: int, block: int = 32) -> torch.Tensor:
    b, h, t, d = x.shape
    pad = (-t) % block
    y = torch.cat([x, x[:, :, -1:].expand(b, h, pad, d)], 2) if pad else x
    y = y.reshape(b, h, -1, block, d).transpose(-1, -2)
    return per_token(y, bits, block).transpose(-1, -2).reshape(b, h, -1, d)[:, :, :t]


def normalised(x: torch.Tensor, bits: int) -> torch.Tensor:
    scale = x.abs().amax(2, keepdim=True).clamp_min(1e-6)
    return per_token(x / scale, bits) * scale


MODES = {
    "exact": None,
    "k8 tok / v8 tok": (lambda k: per_token(k, 8), lambda v: per_token(v, 8)),
    "k4 tok / v4 tok": (lambda k: per_token(k, 4), lambda v: per_token(v, 4)),
    "k4 tok16 / v4 tok": (lambda k: per_token(k, 4, 16), lambda v: per_token(v, 4)),
    "k4 chan / v4 tok": (lambda k: per_channel(k, 4), lambda v: per_token(v, 4)),
    "k4 norm / v4 tok": (lambda k: normalised(k, 4), lambda v: per_token(v, 4)),
    "k2 tok / v2 tok": (lambda k: per_token(k, 2), lambda v: per_token(v, 2)),
    "k2 chan / v2 tok": (lambda k: per_channel(k, 2), lambda v: per_token(v, 2)),
    "k2 norm / v2 tok": (lambda k: normalised(k, 2), lambda v: per_token(v, 2)),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        _smoke.begin()
        args.threads = 1
    torch.set_num_threads(args.threads)
    from transformers import DynamicCache

    from lukv_cache.models import load_model
    from lukv_cache.texts import wikipedia_articles

    model, tokenizer = load_model("smollm2")
    nll = {name: [] for name in MODES}
    for article in wikipedia_articles()[5:9]:
        ids = tokenizer(article.text, return_tensors="pt").input_ids[:, :1280]
        context, target = ids[:, :1024], ids[:, 1024:]
        for name, quantizers in MODES.items():
            cache = DynamicCache()
            with torch.no_grad():
                model(context, **{cache_kw(model): cache})
                if quantizers is not None:
                    for layer in cache.layers:
                        layer.keys.copy_(quantizers[0](layer.keys))
                        layer.values.copy_(quantizers[1](layer.values))
                logits = model(target, **{cache_kw(model): cache}).logits[0, :-1].float()
            nll[name].append(float(torch.nn.functional.cross_entropy(logits, target[0, 1:])))
    exact = sum(nll["exact"]) / len(nll["exact"])
    print("PYTHONPATH=. python benchmarks/quant_granularity.py --threads", args.threads)
    print("\n| keys / values | NLL (nats/token) | excess |\n|---|---:|---:|")
    for name, values in nll.items():
        mean = sum(values) / len(values)
        print(f"| {name} | {mean:.4f} | {mean - exact:+.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
