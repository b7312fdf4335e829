"""Issue-2 benchmark: memory and speed of LUKVCache vs DynamicCache on a SmolLM2-135M-shaped model.

Random weights (30 layers, 9 query heads, 3 KV heads, head_dim 64), CPU. Each measurement runs in its
own subprocess so that peak RSS (``ru_maxrss``) belongs to that method alone; all figures are printed
side by side at the end.

    python benchmarks/cache_bench.py --contexts 8192 16384 --ratio 0.8
    python benchmarks/cache_bench.py --contexts 512 --decode-steps 4 --small   # seconds, for CI

``BENCH_THREADS`` (default 2) sets torch's threads in each measurement; on a shared machine use 1:
two OpenMP threads on a contended core make every op wait (seen here: 2 s/token instead of 0.1 s).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(small: bool, max_positions: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if small:
        cfg = LlamaConfig(
            vocab_size=256,
            hidden_size=96,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
        )
    else:  # SmolLM2-135M's shape
        cfg = LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            tie_word_embeddings=True,
        )
    cfg.max_position_embeddings = max_positions
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _decode_ms(model, cache, first_token, steps: int) -> float:
    import torch

    token = first_token
    times = []
    with torch.no_grad():
        for _ in range(steps + 2):
            t0 = time.perf_counter()
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t0)
            token = out.logits[:, -1:].argmax(-1)
    times = sorted(times[2:])  # drop warm-up
    return 1000 * times[len(times) // 2]


def child(method: str, tokens: int, ratio: float, steps: int, small: bool, keep_per_head: int) -> dict:
    """One measurement in a fresh process: prefill (timed, peak RSS), then decode ms/token."""
    import torch
    from transformers import DynamicCache

    sys.path.insert(0, ROOT)
    import lukv_cache
    from lukv_cache.cache.layer import LUKVLayer

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model = _model(small, max(tokens, 2048) + steps + 8)
    cfg = model.config
    gen = torch.Generator().manual_seed(1)
    result = {"method": method, "tokens": tokens}
    if method == "dynamic_uniform":
        # A DynamicCache that already holds `keep_per_head` tokens per head (no prefill needed to time decode).
        cache = DynamicCache(config=cfg)
        shape = (1, cfg.num_key_value_heads, keep_per_head, cfg.head_dim)
        for idx in range(cfg.num_hidden_layers):
            cache.update(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), idx)
        result["kv_bytes"] = 2 * cfg.num_hidden_layers * torch.Size(shape).numel() * 4
        result["decode_ms"] = _decode_ms(model, cache, torch.tensor([[1]]), steps)
        return result
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=gen)
    if method == "dynamic":
        cache = DynamicCache(config=cfg)
    else:
        cache = lukv_cache.LUKVCache(ratio=ratio, scorer="keydiff", allocator="uniform")
        compress_time = [0.0]
        original = LUKVLayer.compress

        def timed(self, *args, **kwargs):
            t0 = time.perf_counter()
            original(self, *args, **kwargs)
            compress_time[0] += time.perf_counter() - t0

        LUKVLayer.compress = timed
    rss_before = _rss_mib()
    with torch.no_grad():
        t0 = time.perf_counter()
        # logits_to_keep=1 as generate() does: the full [T, vocab] logits would dominate the peak
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        result["prefill_s"] = time.perf_counter() - t0
    result["prefill_peak_rss_delta_mib"] = _rss_mib() - rss_before
    if method == "dynamic":
        result["kv_bytes"] = sum(layer.keys.numel() * 2 * layer.keys.element_size() for layer in cache.layers)
    else:
        result["compress_s"] = compress_time[0]
        result["kv_bytes"] = cache.memory_bytes()
        stored = sum(int(layer.offsets[-1]) for layer in cache.layers)
        result["ideal_store_bytes"] = stored * cfg.head_dim * 2 * 4
        result["store_bytes"] = sum(
            t.numel() * t.element_size()
            for layer in cache.layers
            for t in (layer.store_keys, layer.store_values, layer.store_positions, layer.offsets)
        )
        result["suffix_bytes"] = result["kv_bytes"] - result["store_bytes"]
        result["kept_per_head"] = stored / (cfg.num_hidden_layers * cfg.num_key_value_heads)
    result["decode_ms"] = _decode_ms(model, cache, out.logits[:, -1:].argmax(-1), steps)
    return result


def run_child(args, method: str, tokens: int, keep_per_head: int = 0) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        method,
        "--contexts",
        str(tokens),
        "--ratio",
        str(args.ratio),
        "--decode-steps",
        str(args.decode_steps),
        "--keep-per-head",
        str(keep_per_head),
    ]
    if args.small:
        cmd.append("--small")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} at {tokens} tokens failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--ratio", type=float, default=0.8)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--small", action="store_true", help="tiny model (for CI / smoke runs)")
    p.add_argument("--out", default=None, help="write the raw numbers as JSON here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--keep-per-head", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(
            json.dumps(
                child(
                    args.child,
                    args.contexts[0],
                    args.ratio,
                    args.decode_steps,
                    args.small,
                    args.keep_per_head,
                )
            )
        )
        return 0
    rows = []
    for tokens in args.contexts:
        dyn = run_child(args, "dynamic", tokens)
        lukv = run_child(args, "lukv", tokens)
        # same tokens per head as the compressed cache holds (store + suffix after prefill), dense
        uni = run_child(args, "dynamic_uniform", tokens, keep_per_head=round(lukv["kept_per_head"]) + 1)
        rows.append({"tokens": tokens, "dynamic": dyn, "lukv": lukv, "dynamic_uniform": uni})
    print(
        f"\nLUKVCache(ratio={args.ratio}, keydiff, uniform) vs DynamicCache; decode over {args.decode_steps} steps"
    )
    header = (
        "context",
        "bytes/ideal",
        "bytes/Dynamic",
        "decode ms LUKV",
        "ms Dynamic",
        "ms uniform-Dyn",
        "LUKV/Dynamic",
        "LUKV/uniform",
        "evict share",
        "prefill s L/D",
        "peak MiB L/D",
    )
    print(" | ".join(header))
    for r in rows:
        d, lk, u = r["dynamic"], r["lukv"], r["dynamic_uniform"]
        print(
            " | ".join(
                [
                    str(r["tokens"]),
                    f"{lk['store_bytes'] / lk['ideal_store_bytes']:.4f} (+suffix {lk['suffix_bytes'] / 2**20:.2f} MiB)",
                    f"{lk['kv_bytes'] / d['kv_bytes']:.3f}",
                    f"{lk['decode_ms']:.2f}",
                    f"{d['decode_ms']:.2f}",
                    f"{u['decode_ms']:.2f}",
                    f"{lk['decode_ms'] / d['decode_ms']:.3f}",
                    f"{lk['decode_ms'] / u['decode_ms']:.3f}",
                    f"{lk['compress_s'] / lk['prefill_s']:.2%}",
                    f"{lk['prefill_s']:.1f}/{d['prefill_s']:.1f}",
                    f"{lk['prefill_peak_rss_delta_mib']:.0f}/{d['prefill_peak_rss_delta_mib']:.0f}",
                ]
            )
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ratio": args.ratio, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
