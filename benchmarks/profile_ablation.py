"""Ablations of LU-KV profile building, screened with a held-out proxy (SmolLM2-135M-Instruct, CPU).

Each variant builds a profile table from the shipped ``default`` calibration set (a 4.3k-token narrative,
30 questions) with one setting changed, then is scored by the **proxy**: the oracle attention mass that
the allocation evicts on the ``expository`` set (another text, 1.2k tokens: the length the benchmark uses,
20 questions), as a fraction of the total mass, at ratios 0.5 / 0.8 / 0.9. The proxy's oracle is fixed for
every variant (max over 64 decode steps, the paper's definition), so variants are compared on the same
target; budgets come from the library's own allocators at the held-out context's length, exactly as at run
time. uniform, AdaKV and the model-wide top-k (``global``) are scored the same way. The expository set
was never used to choose anything else in this repository's profiles.

    python benchmarks/profile_ablation.py --scorer keydiff --out benchmarks/results/profile_ablation_keydiff.json

Oracles are decoded once per (calibration set, k_max, aggregation) and cached under the usual build cache,
so a rerun takes seconds; a first run decodes 30-50 questions per new setting (minutes each on 2 cores).

``--smoke``: three variants (the paper's, smoothing, the early third) with keydiff on the stand-ins of
``benchmarks/_smoke.py`` (tiny calibration sets), written in a temporary folder (``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import _smoke
import numpy as np
import torch

VARIANTS: dict[str, dict] = {
    "paper (k_max 64, max, scope all, min_keep 1%, mean)": {},
    "k_max 8": {"k_max": 8},
    "k_max 16": {"k_max": 16},
    "k_max 128": {"k_max": 128},
    "aggregate mean over steps": {"aggregate": "mean"},
    "scope layer": {"scope": "layer"},
    "min_keep 0": {"min_keep": 0.0},
    "min_keep 3%": {"min_keep": 0.03},
    "median over questions": {"average": "median"},
    "smoothed over 5 grid points": {"smooth": 5},
    "10 questions (of 30)": {"max_questions": 10},
    "calibration: first 1.4k tokens, 10 early questions": {"truncate": "early"},
    "calibration: 24 planted facts, asked back": {"truncate": "planted"},
}
RATIOS = (0.5, 0.8, 0.9)
SMOKE_VARIANTS = [
    next(iter(VARIANTS)),
    "smoothed over 5 grid points",
    "calibration: first 1.4k tokens, 10 early questions",
]


def _runs(model, tokenizer, spec: dict, cache_dir):
    from lukv_cache.profiling.build import prepare_run

    kwargs = dict(k_max=spec.get("k_max", 64), cache_dir=cache_dir)
    if "aggregate" in spec:
        kwargs["aggregate"] = spec["aggregate"]
    calibration = "default"
    if spec.get("truncate") == "early":
        calibration = _early_third()
    elif spec.get("truncate") == "planted":
        calibration = planted_facts()
    run = prepare_run(model, tokenizer, calibration, max_questions=spec.get("max_questions"), **kwargs)
    return run


def _early_third() -> str:
    """A calibration file: the first third of the default context and its 10 'early' questions."""
    import os
    import tempfile

    from lukv_cache.profiling.calibration import calibration_path

    lines = [json.loads(line) for line in open(calibration_path("default"), encoding="utf-8") if line.strip()]
    context, questions = lines[0], [q for q in lines[1:] if q.get("where") == "early"]
    words = context["text"].split(" ")
    context = {**context, "text": " ".join(words[: len(words) // 3])}
    path = os.path.join(tempfile.mkdtemp(prefix="lukv_ablation_"), "early.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for row in [context, *questions]:
            f.write(json.dumps(row) + "\n")
    return path


def planted_facts(path: str | None = None, n: int = 24, seed: int = 7) -> str:
    """A calibration file: the default narrative with ``n`` planted facts ("the locker code for the amber
    heron is 1234567") spread evenly between its paragraphs, and one question asking each fact back.

    The phrasing differs from the benchmark's needles on purpose (no "special magic number").
    """
    import os
    import random
    import tempfile

    from lukv_cache.profiling.calibration import calibration_path

    lines = [json.loads(line) for line in open(calibration_path("default"), encoding="utf-8") if line.strip()]
    paragraphs = lines[0]["text"].split("\n\n")
    rng = random.Random(seed)
    colours = (
        "amber cobalt scarlet ivory olive saffron slate crimson teal umber violet ochre jade russet".split()
    )
    colours += "silver indigo copper plum lilac bronze pearl rust sable coral".split()
    things = "heron lantern anchor compass harbour kettle ledger beacon barrel sextant trawler pulley".split()
    things += "satchel rudder chisel capstan bellows tiller crate oar hammock spyglass winch buoy".split()
    facts = [
        (f"{colours[i]} {things[(i * 7) % len(things)]}", str(rng.randrange(10**6, 10**7))) for i in range(n)
    ]
    after = [round((i + 0.5) * len(paragraphs) / n) for i in range(n)]
    text = []
    for j, paragraph in enumerate(paragraphs):
        text.append(paragraph)
        text += [
            f"(Recorded in the margin: the locker code for the {k} is {v}.)"
            for i, (k, v) in enumerate(facts)
            if after[i] == j
        ]
    text += [
        f"(Recorded in the margin: the locker code for the {k} is {v}.)"
        for i, (k, v) in enumerate(facts)
        if after[i] >= len(paragraphs)
    ]
    rows = [
        {**lines[0], "title": "The Ledger of Kestrel Quay, with planted facts", "text": "\n\n".join(text)}
    ]
    thirds = ("early", "middle", "late")
    rows += [
        {
            "type": "question",
            "text": f"What is the locker code for the {k}?",
            "answer": v,
            "where": thirds[3 * i // n],
        }
        for i, (k, v) in enumerate(facts)
    ]
    path = path or os.path.join(tempfile.mkdtemp(prefix="lukv_ablation_"), "planted.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def build_table(run, scorer, spec: dict, grid: np.ndarray, sink: int) -> np.ndarray:
    """Evict ratios ``[G, L, H]`` for one variant: per-question solutions, then averaged."""
    from lukv_cache.profiling.solver import solve_evict_ratios

    layer_scores = run.scores(scorer)
    full = np.zeros((len(layer_scores) and max(layer_scores) + 1, *next(iter(layer_scores.values())).shape))
    for layer, v in layer_scores.items():
        full[layer] = v
    per_question = []
    for index in range(len(run.selected)):
        per_question.append(
            solve_evict_ratios(
                run.oracle(index),
                full,
                grid=grid,
                sink=sink,
                window=scorer.window,
                min_keep=spec.get("min_keep", 0.01),
                scope=spec.get("scope", "all"),
                layers=sorted(layer_scores),
            )
        )
    stack = np.stack(per_question).astype(np.float64)  # [Q, G, L, H]
    average = spec.get("average", "mean")
    if average == "median":
        table = np.median(stack, axis=0)
    else:
        table = stack.mean(0)
    width = spec.get("smooth", 0)
    if width > 1:  # moving average along the grid, then each row's mean restored to its grid ratio
        kernel = np.ones(width) / width
        padded = np.pad(table, ((width // 2, width - 1 - width // 2), (0, 0), (0, 0)), mode="edge")
        table = np.apply_along_axis(lambda x: np.convolve(x, kernel, mode="valid"), 0, padded)
    return table.astype(np.float32)


def proxy(eval_run, scorer, table: np.ndarray | None, grid, sink: int, method: str, min_keep: float):
    """Fraction of the held-out oracle mass evicted, per ratio."""
    from lukv_cache.profiles.profile import Profile
    from lukv_cache.profiling.diagnostics import head_losses, method_keep_counts

    t = eval_run.context_len
    n = t - sink - scorer.window
    layer_scores = eval_run.scores(scorer)
    layers = sorted(layer_scores)
    num_layers = max(layers) + 1
    heads = next(iter(layer_scores.values())).shape[0]
    scores = np.zeros((num_layers, heads, n))
    for layer, v in layer_scores.items():
        scores[layer] = v[:, sink : t - scorer.window]
    profile = None
    if table is not None:
        profile = Profile(
            grid=grid.astype(np.float32),
            evict_ratio=table,
            model_id="ablation",
            scorer=scorer.name,
            head_dim=64,
            sink=sink,
            window=scorer.window,
            min_keep=min_keep,
            k_max=64,
        )
    out = {}
    for ratio in RATIOS:
        keep = method_keep_counts(method, scores, layers, n, ratio, profile, min_keep)
        lost = total = 0.0
        for index in range(len(eval_run.selected)):
            importance = eval_run.oracle(index)[:, :, sink : t - scorer.window].astype(np.float64)
            loss, _ = head_losses(importance, scores, keep)
            lost += loss[layers].sum()
            total += importance[layers].sum()
        out[str(ratio)] = lost / total
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scorer", default="keydiff")
    p.add_argument("--variants", nargs="*", default=None, help="names (default: all)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = p.parse_args(argv)
    if args.smoke:
        args.out = str(_smoke.begin().out("profile_ablation.json"))
        args.scorer, args.variants, args.threads, args.cache_dir = "keydiff", SMOKE_VARIANTS, 1, None

    from lukv_cache.models import load_model
    from lukv_cache.profiling.build import prepare_run
    from lukv_cache.profiling.solver import DEFAULT_GRID
    from lukv_cache.scorers import get_scorer

    model, tokenizer = load_model("smollm2", threads=args.threads)
    torch.manual_seed(0)
    scorer = get_scorer(args.scorer)
    sink, grid = 4, np.asarray(DEFAULT_GRID)
    eval_run = prepare_run(model, tokenizer, "expository", k_max=64, cache_dir=args.cache_dir)
    results = {"scorer": scorer.name, "ratios": list(RATIOS), "baselines": {}, "variants": {}}
    for method in ("uniform", "adakv", "global"):
        results["baselines"][method] = proxy(eval_run, scorer, None, grid, sink, method, 0.01)
        print(method, {k: round(v, 4) for k, v in results["baselines"][method].items()}, flush=True)
    names = args.variants or list(VARIANTS)
    for name in names:
        spec = VARIANTS[name]
        t0 = time.time()
        run = _runs(model, tokenizer, spec, args.cache_dir)
        table = build_table(run, scorer, spec, grid, sink)
        row = {"spec": spec, "questions": len(run.selected), "context_tokens": run.context_len}
        for method in ("lukv", "hybrid"):
            row[method] = proxy(eval_run, scorer, table, grid, sink, method, spec.get("min_keep", 0.01))
        row["seconds"] = round(time.time() - t0, 1)
        results["variants"][name] = row
        print(name, {m: {k: round(v, 4) for k, v in row[m].items()} for m in ("lukv", "hybrid")}, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=2)
    _print_table(results)
    return 0


def _print_table(results) -> None:
    ratios = results["ratios"]
    print(
        f"\nEvicted oracle mass on the held-out expository set (lower is better), scorer {results['scorer']}"
    )
    print(
        "| variant | "
        + " | ".join(f"LU-KV {r}" for r in ratios)
        + " | "
        + " | ".join(f"hybrid {r}" for r in ratios)
        + " |"
    )
    print("|---" * (1 + 2 * len(ratios)) + "|")
    for name, row in results["baselines"].items():
        print(f"| {name} | " + " | ".join(f"{row[str(r)]:.4f}" for r in ratios) + " |" + " |" * len(ratios))
    for name, row in results["variants"].items():
        cells = [f"{row['lukv'][str(r)]:.4f}" for r in ratios] + [
            f"{row['hybrid'][str(r)]:.4f}" for r in ratios
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
