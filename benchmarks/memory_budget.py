"""What ``LUKVCache.from_pretrained(model, memory=m)`` gives, against every precision at the same bytes.

For each budget ``m`` (a fraction of the full cache's bytes) and each context, the one-line cache (the
shipped profile's scorer and allocator) holds the context four ways, each within the same bytes:

* ``memory=m``: what the cache chooses (the profile's measured table when the profile has one) -- the
  product; and what the fallback rule alone chooses (the profile's table removed);
* ``fp``, ``int8``, ``int4``: the budget with the precision fixed (``cache.compressor.precisions``): the
  model's precision (eviction alone), 8-bit and 4-bit codes. "The best hand-picked mix" at these bytes
  is the better of ``int8`` and ``int4``.

The chosen rows are not run again when the choice is one of the fixed rows, whose cache is the same (the
script checks that the stored tokens are identical); a choice of per-layer widths (some layers at 8 bits,
the others at 4: a profile whose table measured each layer's loss at 4 bits) is scored on its own. Every row is scored on the same contexts (seeded),
question-agnostic: multikey retrieval, continuation excess NLL against the full cache (paired per context),
recall. Bytes: ``kv_cache_bytes`` of the cache over the full ``DynamicCache``'s, the largest over contexts
(a bound: at most ``m``).

    python benchmarks/memory_budget.py --model smollm2 --context-tokens 1000 --samples 12 --threads 2

``--smoke``: the tiny stand-ins (``benchmarks/_smoke.py``), 2 contexts of ~300 tokens, budgets 0.3 and 0.1,
written in a temporary folder (``benchmarks/smoke.py``).
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

PRECISIONS = {"fp": None, "int8": 8, "int4": 4}
TASKS = ("niah_multikey", "continuation", "recall")
LAYER_NOTE = "; with each layer's loss at 4 bits"


def run(args: argparse.Namespace) -> dict:
    import torch

    from lukv_cache import LUKVCache
    from lukv_cache.cache.options.memory import mixed_name
    from lukv_cache.cache.storage.report import kv_cache_bytes
    from lukv_cache.errors import ConfigurationError
    from lukv_cache.evaluation.methods import FULL, Method
    from lukv_cache.evaluation.prefill import SharedPrefill
    from lukv_cache.evaluation.tasks import context_ids, make_samples, score_prefilled
    from lukv_cache.models import load_model
    from lukv_cache.scorers import get_scorer

    model, tokenizer = load_model(args.model, threads=args.threads)
    device = next(model.parameters()).device
    probe = LUKVCache.from_pretrained(model, memory=0.5, local_files_only=True)
    profile = probe.profile
    scorer = probe.scorer.name
    n_queries = max(2, get_scorer(scorer).n_queries)
    table = getattr(profile, "memory_table", None)
    rows: dict[str, dict] = {}  # row name -> task -> list of per-context records

    def record(name: str, task: str, entry: dict) -> None:
        rows.setdefault(name, {}).setdefault(task, []).append(entry)

    def held(cache, length: int, full_bytes: int) -> dict:
        """What ``cache`` holds: its bytes over the full cache's, the fraction of ``length`` tokens kept."""
        kept = float(cache.stored_tokens().double().mean()) / length
        return {"bytes": kv_cache_bytes(cache) / full_bytes, "kept": kept}

    def budget_cache(memory: float, precisions=None, rule: bool = False):
        cache = LUKVCache.from_pretrained(model, memory=memory, local_files_only=True)
        if rule and cache.profile is not None:  # the fallback rule: the profile without its table
            cache.profile = dataclasses.replace(cache.profile, memory_table=None)
        if precisions is not None:
            cache.compressor.precisions = precisions
        return cache

    started = time.time()
    for task in args.tasks:
        samples = make_samples(
            task, tokenizer, args.samples, args.context_tokens, seed=args.seed, continuation_tokens=128
        )
        for number, sample in enumerate(samples, start=1):
            ids = context_ids(tokenizer, sample, device)
            shared = SharedPrefill.record(model, ids, n_queries)
            full = shared.cache_for(Method(FULL), model)
            full_bytes = kv_cache_bytes(full)
            full_score, _, _ = score_prefilled(model, tokenizer, sample, full, shared.last_logits)
            record("full", task, {"score": full_score, "bytes": 1.0, "kept": 1.0})
            line = [f"full={full_score:.3g}"]
            for memory in args.budgets:
                stored = {}
                for label, bits in PRECISIONS.items():
                    name = f"{memory:g} {label}"
                    cache = budget_cache(memory, (bits,))
                    try:
                        shared.replay_into(cache)
                    except ConfigurationError as err:
                        record(name, task, {"score": None, "why": str(err).split(": raise")[0]})
                        continue
                    stored[bits] = cache.stored_tokens()
                    entry = held(cache, ids.shape[1], full_bytes)  # before scoring decodes into it
                    score, _, _ = score_prefilled(model, tokenizer, sample, cache, shared.last_logits)
                    record(name, task, {**entry, "score": score})
                    line.append(f"{name}={score:.3g}")
                for label, rule in (("memory", False), ("rule", True)):
                    if label == "memory" and table is None:
                        continue  # without a table the product is the rule
                    cache = budget_cache(memory, rule=rule)
                    try:
                        shared.replay_into(cache)
                    except ConfigurationError as err:
                        record(
                            f"{memory:g} {label}", task, {"score": None, "why": str(err).split(": raise")[0]}
                        )
                        continue
                    bits = cache.kv_bits
                    if isinstance(bits, tuple):  # per-layer widths: no fixed row holds them, scored here
                        entry = held(cache, ids.shape[1], full_bytes)  # before scoring decodes into it
                        entry["bits"] = mixed_name(bits)
                        entry["layers_at_8"] = [i for i, b in enumerate(bits) if b == 8]
                        score, _, _ = score_prefilled(model, tokenizer, sample, cache, shared.last_logits)
                        record(f"{memory:g} {label}", task, {**entry, "score": score})
                        line.append(f"{memory:g} {label}={score:.3g} ({entry['bits']})")
                        continue
                    same = bits in stored and torch.equal(cache.stored_tokens(), stored[bits])
                    if not same:
                        raise SystemExit(
                            f"memory={memory} chose {bits} bits but its cache differs from that row's"
                        )
                    fixed = rows[f"{memory:g} {next(k for k, v in PRECISIONS.items() if v == bits)}"][task][
                        -1
                    ]
                    record(f"{memory:g} {label}", task, {**fixed, "bits": bits})
            print(
                f"[{task} {number}/{len(samples)}] {ids.shape[1]} tokens, {time.time() - started:.0f}s: "
                + " ".join(line),
                flush=True,
            )
    return {
        "command": " ".join(["python", "benchmarks/memory_budget.py", *sys.argv[1:]]),
        "model": args.model,
        "scorer": scorer,
        "allocator": probe.allocator_name,
        "table": None
        if table is None
        else {
            "bits": list(table.bits),
            "measure": table.measure,
            "layer_loss": None
            if table.layer_loss is None
            else [round(float(v), 4) for v in table.layer_loss],
        },
        "context_tokens": args.context_tokens,
        "samples": args.samples,
        "seed": args.seed,
        "budgets": args.budgets,
        "threads": args.threads,
        "torch": torch.__version__,
        "seconds": round(time.time() - started, 1),
        "rows": rows,
    }


def table_lines(result: dict) -> list[str]:
    """The markdown table of :func:`run`'s result."""
    from lukv_cache.evaluation.tasks import mean_and_sem

    tasks = [t for t in TASKS if any(t in by_task for by_task in result["rows"].values())]
    full = result["rows"]["full"]
    heads = {"niah_multikey": "multikey % ± SE", "continuation": "excess NLL ± SE", "recall": "recall % ± SE"}
    lines = [
        "| budget | row | bits | bytes / full (max) | kept tokens % | "
        + " | ".join(heads[t] for t in tasks)
        + " |",
        "|---|---|---|---:|---:|" + "---:|" * len(tasks),
    ]
    for name, by_task in result["rows"].items():
        if name == "full":
            cells = [
                f"{100 * mean_and_sem([e['score'] for e in full[t]])[0]:.1f}"
                if t != "continuation"
                else "+0.000"
                for t in tasks
            ]
            lines.append("| 100% | full cache | model's | 1.000 | 100.0 | " + " | ".join(cells) + " |")
            continue
        budget, label = name.split(" ")
        row = {"memory": "**memory=**", "rule": "memory=, rule", "fp": "fp (eviction alone)"}.get(
            label, label
        )
        entries = [e for t in tasks for e in by_task.get(t, [])]
        if any(e.get("score") is None for e in entries):
            why = next(e["why"] for e in entries if e.get("score") is None)
            lines.append(
                f"| {float(budget):.0%} | {row} | | | | does not fit: {why} |" + " |" * (len(tasks) - 1)
            )
            continue
        if label in PRECISIONS:
            bits = PRECISIONS[label]
        else:
            chosen = {e.get("bits") for e in entries}
            bits = chosen.pop() if len(chosen) == 1 else " / ".join(sorted(map(str, chosen)))
        bits_text = "model's" if bits is None else (f"int{bits}" if isinstance(bits, int) else bits)
        cells = []
        for t in tasks:
            got = by_task.get(t, [])
            if t == "continuation":
                excess = [e["score"] - f["score"] for e, f in zip(got, full[t])]
                mean, se = mean_and_sem(excess)
                cells.append(f"{mean:+.3f} ± {se:.3f}")
            else:
                mean, se = mean_and_sem([100 * e["score"] for e in got])
                cells.append(f"{mean:.1f} ± {se:.1f}")
        worst = max(e["bytes"] for e in entries)
        kept = statistics.fmean(e["kept"] for e in entries)
        lines.append(
            f"| {float(budget):.0%} | {row} | {bits_text} | {worst:.3f} | {100 * kept:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--context-tokens", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.2, 0.1, 0.05, 0.03])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=default_out("memory_budget"))
    parser.add_argument("--name", default=None, help="file name stem (default: <model>_<context tokens>)")
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args()
    if args.smoke:
        args.out = _smoke.begin(stand_ins=True).out("memory_budget")
        args.context_tokens, args.samples, args.budgets, args.threads = 300, 2, [0.3, 0.1], 1
        args.tasks = ["niah_multikey", "continuation"]
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"{args.model}_{args.context_tokens}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    text = [
        f"# memory= on {result['model']} at ~{result['context_tokens']} context tokens",
        "",
        f"Made by `{result['command']}` ({result['samples']} contexts per task, seed {result['seed']}, "
        f"{result['scorer']}/{result['allocator']}, {result['threads']} threads, {result['seconds']:.0f} s; "
        f"the profile's measured table: {'yes, ' + result['table']['measure'] if result['table'] else 'none'}"
        f"{LAYER_NOTE if (result['table'] or {}).get('layer_loss') else ''}).",
        "",
        *table_lines(result),
    ]
    (args.out / f"{stem}.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    if args.smoke:
        print(f"smoke: memory_budget wrote {stem}.md ({len(result['rows'])} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
