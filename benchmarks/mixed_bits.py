"""Would per-layer bit widths beat one width per cache at the same bytes? (issue 46's question, for heads)

A budget picks one precision for the whole cache. Mixed widths pay off only if the loss of 4-bit codes
is concentrated: then the few layers that suffer keep 8 bits and the rest take 4-bit's extra tokens. This
measures that on one model, layers standing in for heads (a layer's heads share its store):

1. **Tune** (the profile's calibration text, never the evaluation's): with every layer at 8 bits and no
   eviction, switch one layer at a time to 4 bits and measure the continuation's excess NLL against the
   full cache: each layer's sensitivity to 4-bit codes.
2. **Greedy**: the ``k`` most sensitive layers keep 8 bits, the others get 4 (the greedy that gives each
   byte to the cheapest loss; ``k`` in ``--keep8``).
3. **Evaluate** (Wikipedia contexts, seeded): int8 everywhere, int4 everywhere and each mix, each at the
   eviction ratio that makes its bytes equal to the budget's (``memory`` x the full cache's, found from two
   probes: bytes are linear in the kept tokens), scored on continuation excess NLL and multikey.

    python benchmarks/mixed_bits.py --model qwen2.5-coder-0.5b --memory 0.05 --threads 2

``--smoke``: the tiny stand-ins (``benchmarks/_smoke.py``), 2 contexts, in a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import _smoke  # noqa: E402
from _out import default_out  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--memory", type=float, default=0.05)
    parser.add_argument("--context-tokens", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--tune-windows", type=int, default=4)
    parser.add_argument("--keep8", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=default_out("mixed_bits"))
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args()
    if args.smoke:
        args.out = _smoke.begin(stand_ins=True).out("mixed_bits")
        args.model, args.context_tokens, args.samples, args.tune_windows, args.keep8 = (
            "smollm2",
            300,
            2,
            1,
            [1],
        )
        args.threads, args.memory = 1, 0.3

    import torch
    from transformers import DynamicCache

    from lukv_cache import LUKVCache
    from lukv_cache.cache.report import kv_cache_bytes
    from lukv_cache.evaluation.methods import FULL, Method
    from lukv_cache.evaluation.prefill import SharedPrefill
    from lukv_cache.evaluation.tasks import context_ids, make_samples, mean_and_sem, score_prefilled
    from lukv_cache.models import load_model
    from lukv_cache.profiling.continuation import continuation_nll, prefill
    from lukv_cache.profiling.memory_table import calibration_of, calibration_texts
    from lukv_cache.scorers import get_scorer

    started = time.time()
    model, tokenizer = load_model(args.model, threads=args.threads)
    probe = LUKVCache.from_pretrained(model, ratio=0.5, local_files_only=True)
    layers = model.config.get_text_config().num_hidden_layers

    def cache_with(bits: list[int], ratio: float):
        cache = LUKVCache.from_pretrained(model, ratio=ratio, kv_bits=8, local_files_only=True)
        for layer, b in zip(cache.layers, bits):
            layer.kv_bits = b  # before anything is stored: the layer's store is built in these bits
        return cache

    # 1. tune: each layer's sensitivity to 4-bit codes, on the profile's calibration text
    text = " ".join(calibration_texts(calibration_of(probe.profile) or "planted"))
    tokens = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    span = args.context_tokens + 128
    windows = [tokens[:, i * span : (i + 1) * span] for i in range(args.tune_windows)]
    windows = [w for w in windows if w.shape[1] == span]
    sensitivity = []
    with torch.no_grad():
        base = []
        for w in windows:
            full = DynamicCache(config=model.config)
            base.append(
                continuation_nll(
                    model,
                    full,
                    prefill(model, w[:, : args.context_tokens], full),
                    w[:, args.context_tokens :],
                )
            )
        for layer in range(layers):
            bits = [8] * layers
            bits[layer] = 4
            excess = []
            for w, b in zip(windows, base):
                cache = cache_with(bits, 0.0)
                last = prefill(model, w[:, : args.context_tokens], cache)
                excess.append(continuation_nll(model, cache, last, w[:, args.context_tokens :]) - b)
            sensitivity.append(statistics.fmean(excess))
            print(f"tune: layer {layer} at 4 bits: {sensitivity[-1]:+.4f} nats", flush=True)
    order = sorted(range(layers), key=lambda i: -sensitivity[i])
    configs = {"int8": [8] * layers, "int4": [4] * layers}
    for k in args.keep8:
        configs[f"mixed {k}x8"] = [8 if i in order[:k] else 4 for i in range(layers)]

    # 3. evaluate at equal bytes on Wikipedia contexts
    n_queries = max(2, get_scorer(probe.scorer.name).n_queries)
    results: dict[str, dict[str, list]] = {name: {} for name in configs}
    fit: dict[str, list[float]] = {name: [] for name in configs}
    for task in ("continuation", "niah_multikey"):
        samples = make_samples(
            task, tokenizer, args.samples, args.context_tokens, seed=args.seed, continuation_tokens=128
        )
        for sample in samples:
            ids = context_ids(tokenizer, sample, "cpu")
            shared = SharedPrefill.record(model, ids, n_queries)
            full = shared.cache_for(Method(FULL), model)
            full_bytes = kv_cache_bytes(full)  # before scoring: answering grows the cache (and its rows)
            target = args.memory * full_bytes
            full_score, _, _ = score_prefilled(model, tokenizer, sample, full, shared.last_logits)
            line = []
            for name, bits in configs.items():
                # bytes are linear in the kept tokens: two probes give the ratio that fills the budget
                measured = {}
                for r in (0.5, 0.9):
                    measured[r] = kv_cache_bytes(shared.replay_into(cache_with(bits, r)))
                slope = (measured[0.9] - measured[0.5]) / 0.4
                ratio = min(0.999, max(0.0, 0.5 + (target - measured[0.5]) / slope))
                cache = shared.replay_into(cache_with(bits, ratio))
                fit[name].append(kv_cache_bytes(cache) / full_bytes)
                score, _, _ = score_prefilled(model, tokenizer, sample, cache, shared.last_logits)
                value = score - full_score if task == "continuation" else 100 * score
                results[name].setdefault(task, []).append(value)
                line.append(f"{name}@{ratio:.3f}={value:.3g}")
            print(
                f"[{task}] {ids.shape[1]} tokens, {time.time() - started:.0f}s: " + " ".join(line), flush=True
            )

    lines = [
        f"# Per-layer bit widths against one width, at {args.memory:.0%} of the full cache's bytes ({args.model}, ~{args.context_tokens} tokens)",
        "",
        f"Made by `python benchmarks/mixed_bits.py {' '.join(sys.argv[1:])}` ({time.time() - started:.0f} s). "
        f"Tuned on {len(windows)} windows of the profile's calibration text; evaluated on {args.samples} Wikipedia "
        f"contexts per task (seed {args.seed}); {probe.scorer.name}/{probe.allocator_name}.",
        "",
        "Sensitivity (continuation excess NLL with only that layer at 4 bits, the rest 8, no eviction), most "
        "sensitive first: "
        + ", ".join(f"L{i} {sensitivity[i]:+.4f}" for i in order[:8])
        + ", ...; sum over layers "
        f"{sum(sensitivity):+.4f}.",
        "",
        "| widths | bytes / full (mean) | continuation excess NLL ± SE | multikey % ± SE |",
        "|---|---:|---:|---:|",
    ]
    for name in configs:
        nll = mean_and_sem(results[name]["continuation"])
        mk = mean_and_sem(results[name]["niah_multikey"])
        lines.append(
            f"| {name} | {statistics.fmean(fit[name]):.4f} | {nll[0]:+.3f} ± {nll[1]:.3f} | {mk[0]:.1f} ± {mk[1]:.1f} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"mixed_bits_{args.model}_{args.context_tokens}"
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (args.out / f"{stem}.json").write_text(
        json.dumps(
            {"sensitivity": sensitivity, "configs": configs, "results": results, "bytes": fit}, indent=1
        )
        + "\n"
    )
    print("\n".join(lines))
    if args.smoke:
        print(f"smoke: mixed_bits wrote {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
