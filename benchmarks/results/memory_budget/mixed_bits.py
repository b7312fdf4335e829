"""Would per-head (or per-layer) bit widths beat one width per cache at the same bytes? (issue 46's question)

A budget picks one precision for the whole cache. Mixed widths pay off only if the loss of 4-bit codes
is concentrated: then the few heads that suffer keep 8 bits and the rest take 4-bit's extra tokens. This
measures that on one model, for (layer, KV head) units and for whole layers:

1. **Tune** (the profile's calibration text, never the evaluation's): with every unit at 8 bits and no
   eviction, switch one unit at a time to 4 bits and measure the continuation's excess NLL against the
   full cache: each unit's sensitivity to 4-bit codes. The same windows, held by the budget's int4 cache,
   give each unit's kept tokens (what upgrading it to 8 bits costs in bytes).
2. **Greedy**: units ranked by sensitivity per upgrade byte (sensitivity / kept tokens: the greedy that
   gives each byte to the cheapest loss, as the token allocator does); the first ``k`` keep 8 bits, the
   rest 4 (``--keep8-heads``, ``--keep8-layers``).
3. **Evaluate** (Wikipedia contexts, seeded): int8 everywhere, int4 everywhere and each mix, each holding
   what ``memory=`` keeps (the shipped profile's scorer and allocator, the window in the store) at the
   bytes of the budget (``--memory`` x the full cache's), scored on continuation excess NLL and multikey,
   with each mix's paired difference to int8 (same contexts).

The store holds one width per layer, so the mixes are *simulated*: the cache holds the model's precision
and every stored row (the prompt's after eviction, each fold's after it) is replaced by its round trip
through :class:`~lukv_cache.cache.storage.quant.PackedRows` at its unit's bits, the store's own codes. The bytes
are what a store of those widths would hold: the model-precision cache's own bytes less, per stored row,
the difference between a dense key + value and a packed one (positions, scores, offsets and the decode
room are the same). The kept tokens are found from two probes (bytes are linear in them), for each context
and configuration, so every row holds the budget's bytes (the table prints the mean).

    python benchmarks/mixed_bits.py --model qwen2.5-coder-0.5b --memory 0.1 --threads 2

``--smoke``: the tiny stand-ins (``benchmarks/_smoke.py``), 2 contexts, in a temporary folder.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    parser.add_argument("--memory", type=float, default=0.1)
    parser.add_argument("--context-tokens", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--tune-windows", type=int, default=2)
    parser.add_argument("--keep8-heads", type=int, nargs="*", default=[2, 4, 8, 16])
    parser.add_argument("--keep8-layers", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=default_out("mixed_bits"))
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args()
    if args.smoke:
        args.out = _smoke.begin(stand_ins=True).out("mixed_bits")
        args.model, args.context_tokens, args.samples, args.tune_windows = "smollm2", 300, 2, 1
        args.keep8_heads, args.keep8_layers, args.threads, args.memory = [1], [1], 1, 0.3

    import torch

    from lukv_cache import LUKVCache
    from lukv_cache.cache.options.memory import layer_shapes
    from lukv_cache.cache.storage.quant import PackedRows
    from lukv_cache.cache.storage.report import kv_cache_bytes
    from lukv_cache.evaluation.methods import FULL, Method
    from lukv_cache.evaluation.prefill import SharedPrefill
    from lukv_cache.evaluation.tasks import context_ids, make_samples, mean_and_sem, score_prefilled
    from lukv_cache.models import load_model
    from lukv_cache.profiling.continuation import continuation_nll
    from lukv_cache.profiling.memory_table import calibration_of, calibration_texts
    from lukv_cache.scorers import get_scorer

    started = time.time()
    model, tokenizer = load_model(args.model, threads=args.threads)
    probe = LUKVCache.from_pretrained(model, memory=0.5, local_files_only=True)
    text_config = model.config.get_text_config()
    layers, heads = text_config.num_hidden_layers, text_config.num_key_value_heads
    n_queries = max(2, get_scorer(probe.scorer.name).n_queries)

    def round_trip(rows: torch.Tensor, four: torch.Tensor) -> torch.Tensor:
        """``rows [N, D]`` through the store's codes: rows where ``four`` at 4 bits, the others at 8."""
        out = rows.clone()
        for bits, mask in ((8, ~four), (4, four)):
            if bool(mask.any()):
                out[mask] = PackedRows.quantize(rows[mask], bits).dequantize()
        return out

    def simulated(four: torch.Tensor, memory: float):
        """The budget's cache at the model's precision whose stored rows round-trip through the codes of
        their unit's bits (``four [layers, heads]``: 4 bits where true), the prompt's and every fold's."""
        cache = LUKVCache.from_pretrained(model, memory=memory, local_files_only=True)
        cache.compressor.precisions = (None,)  # the model's precision; the codes are applied below
        done = [0] * layers  # per layer: positions below this are round-tripped already

        def apply(idx: int) -> None:
            layer = cache.layers[idx]
            store = layer.store
            if store is None:
                return
            fresh = store.positions.long() >= done[idx]
            if not bool(fresh.any()):  # folded and round-tripped already
                return
            unit = four[idx][store.segment_ids() % heads] & fresh
            keys, values = store.keys.clone(), store.values.clone()
            keys[fresh] = round_trip(store.keys[fresh], unit[fresh])
            values[fresh] = round_trip(store.values[fresh], unit[fresh])
            layer.store = dataclasses.replace(store, keys=keys, values=values)
            done[idx] = layer.cumulative_length - layer.suffix_length  # the suffix is folded later

        for idx, layer in enumerate(cache.layers):

            def fold(original=layer.fold, idx=idx) -> None:
                original()
                apply(idx)

            layer.fold = fold
        return cache, apply

    def hold(shared, four: torch.Tensor, memory: float):
        cache, apply = simulated(four, memory)
        shared.replay_into(cache)
        for idx in range(layers):
            apply(idx)
        return cache

    def packed_bytes(cache, four: torch.Tensor) -> int:
        """Bytes of ``cache`` were its stored rows packed at their unit's bits (the budget's own per-token
        bytes, :class:`~lukv_cache.cache.options.memory.Shapes`: only the key and value differ)."""
        shapes = layer_shapes(cache.layers[0], layers, heads)
        saved = {bits: shapes.stored_token(None, False) - shapes.stored_token(bits, False) for bits in (8, 4)}
        total = kv_cache_bytes(cache)
        for idx, layer in enumerate(cache.layers):
            counts = layer.store.counts().view(-1, heads).sum(0)
            for bits, mask in ((8, ~four[idx]), (4, four[idx])):
                total -= int(counts[mask].sum()) * saved[bits]
        return total

    def at_bytes(shared, four: torch.Tensor, target: float):
        """The simulated cache holding ``target`` bytes (two probes: bytes are linear in kept tokens)."""
        probes = {m: packed_bytes(hold(shared, four, m), four) for m in (0.3, 0.6)}
        slope = (probes[0.6] - probes[0.3]) / 0.3
        memory = min(
            0.99, max(0.01, 0.3 + (target - probes[0.3]) / slope)
        )  # 1.0 is the whole cache, no store
        cache = hold(shared, four, memory)
        return cache, packed_bytes(cache, four)

    # 1. tune: each unit's sensitivity to 4-bit codes, and its kept tokens in the budget's int4 cache
    all8 = torch.zeros(layers, heads, dtype=torch.bool)
    units = {"head": [(i, h) for i in range(layers) for h in range(heads)], "layer": list(range(layers))}
    sensitivity: dict[str, list[float]] = {"head": [], "layer": []}
    kept = torch.zeros(layers, heads)
    text = " ".join(calibration_texts(calibration_of(probe.profile) or "planted"))
    tokens = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    span = args.context_tokens + 128
    windows = [tokens[:, i * span : (i + 1) * span] for i in range(args.tune_windows)]
    windows = [w for w in windows if w.shape[1] == span]
    excess: dict[str, list[list[float]]] = {
        "head": [[] for _ in units["head"]],
        "layer": [[] for _ in units["layer"]],
    }
    with torch.no_grad():
        for w in windows:
            context, target = w[:, : args.context_tokens], w[:, args.context_tokens :]
            shared = SharedPrefill.record(model, context, n_queries)

            def nll(four: torch.Tensor, shared=shared, target=target) -> float:
                full = shared.cache_for(Method(FULL), model)
                for idx, layer in enumerate(full.layers):
                    for name in ("keys", "values"):
                        t = getattr(layer, name)  # [1, H, T, D]
                        rows = t[0].reshape(-1, t.shape[-1])
                        unit = four[idx].repeat_interleave(t.shape[2])
                        setattr(layer, name, round_trip(rows, unit).view_as(t[0]).unsqueeze(0))
                return continuation_nll(model, full, shared.last_logits, target)

            base = nll(all8)
            for kind in ("head", "layer"):
                for number, unit in enumerate(units[kind]):
                    four = all8.clone()
                    four[unit] = True
                    excess[kind][number].append(nll(four) - base)
            full_bytes = kv_cache_bytes(shared.cache_for(Method(FULL), model))
            cache, _ = at_bytes(shared, ~all8, args.memory * full_bytes)
            for idx, layer in enumerate(cache.layers):
                kept[idx] += layer.store.counts().view(-1, heads).sum(0).float() / len(windows)
            print(f"tune: window done, {time.time() - started:.0f}s", flush=True)
    for kind in ("head", "layer"):
        sensitivity[kind] = [statistics.fmean(e) for e in excess[kind]]

    def per_byte(kind: str, number: int) -> float:
        unit = units[kind][number]
        return sensitivity[kind][number] / max(1.0, float(kept[unit].sum()))

    order = {kind: sorted(range(len(units[kind])), key=lambda n: -per_byte(kind, n)) for kind in units}
    configs = {"int8": all8, "int4": ~all8}
    for kind, ks in (("head", args.keep8_heads), ("layer", args.keep8_layers)):
        for k in ks:
            four = ~all8
            for n in order[kind][:k]:
                four[units[kind][n]] = False
            configs[f"{k} {kind}{'s' if k > 1 else ''} at 8"] = four

    # 3. evaluate at equal bytes on Wikipedia contexts
    results: dict[str, dict[str, list[float]]] = {name: {} for name in configs}
    fit: dict[str, list[float]] = {name: [] for name in configs}
    with torch.no_grad():
        for task in ("continuation", "niah_multikey"):
            samples = make_samples(
                task, tokenizer, args.samples, args.context_tokens, seed=args.seed, continuation_tokens=128
            )
            for sample in samples:
                ids = context_ids(tokenizer, sample, "cpu")
                shared = SharedPrefill.record(model, ids, n_queries)
                full = shared.cache_for(Method(FULL), model)
                full_bytes = kv_cache_bytes(full)  # before scoring: answering grows the cache (and its rows)
                full_score, _, _ = score_prefilled(model, tokenizer, sample, full, shared.last_logits)
                line = []
                for name, four in configs.items():
                    cache, held = at_bytes(shared, four, args.memory * full_bytes)
                    fit[name].append(held / full_bytes)
                    score, _, _ = score_prefilled(model, tokenizer, sample, cache, shared.last_logits)
                    value = score - full_score if task == "continuation" else 100 * score
                    results[name].setdefault(task, []).append(value)
                    line.append(f"{name}={value:.3g}@{held / full_bytes:.4f}")
                print(
                    f"[{task}] {ids.shape[1]} tokens, {time.time() - started:.0f}s: " + ", ".join(line),
                    flush=True,
                )

    def ranked(kind: str) -> str:
        label = (lambda u: f"L{u[0]}h{u[1]}") if kind == "head" else (lambda u: f"L{u}")
        return ", ".join(
            f"{label(units[kind][n])} {sensitivity[kind][n]:+.4f} ({float(kept[units[kind][n]].sum()):.0f} kept)"
            for n in order[kind][:8]
        )

    lines = [
        f"# Per-head and per-layer bit widths against one width, at {args.memory:.0%} of the full cache's bytes "
        f"({args.model}, ~{args.context_tokens} tokens)",
        "",
        f"Made by `python benchmarks/mixed_bits.py {' '.join(sys.argv[1:])}` ({time.time() - started:.0f} s). "
        f"Tuned on {len(windows)} windows of the profile's calibration text; evaluated on {args.samples} Wikipedia "
        f"contexts per task (seed {args.seed}); {probe.scorer.name}/{probe.allocator_name}, what `memory=` keeps; "
        "codes simulated per unit (the script's docstring).",
        "",
        "Sensitivity (continuation excess NLL with only that unit at 4 bits, the rest 8, no eviction), first "
        f"by sensitivity per kept token: heads: {ranked('head')}, ...; layers: {ranked('layer')}, ...; sum "
        f"over heads {sum(sensitivity['head']):+.4f}, over layers {sum(sensitivity['layer']):+.4f}.",
        "",
        "| widths | bytes / full (mean) | continuation excess NLL ± SE | − int8's (paired) ± SE | multikey % ± SE |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in configs:
        nll_ = mean_and_sem(results[name]["continuation"])
        diff = mean_and_sem(
            [a - b for a, b in zip(results[name]["continuation"], results["int8"]["continuation"])]
        )
        mk = mean_and_sem(results[name]["niah_multikey"])
        lines.append(
            f"| {name} | {statistics.fmean(fit[name]):.4f} | {nll_[0]:+.3f} ± {nll_[1]:.3f} | "
            f"{diff[0]:+.3f} ± {diff[1]:.3f} | {mk[0]:.1f} ± {mk[1]:.1f} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"mixed_bits_{args.model}_{args.context_tokens}_{args.memory:g}"
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    payload = {
        "sensitivity": sensitivity,
        "kept": kept.tolist(),
        "configs": {name: four.int().tolist() for name, four in configs.items()},
        "results": results,
        "bytes": fit,
    }
    (args.out / f"{stem}.json").write_text(json.dumps(payload, indent=1) + "\n")
    print("\n".join(lines))
    if args.smoke:
        print(f"smoke: mixed_bits wrote {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
