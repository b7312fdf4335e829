"""Does the window attention (how strongly the context's last 32 queries read a token) help a KVzap surrogate?

A token's pre-RoPE key and value say what the token is, not what the context does with it; KVzip+'s scores
depend on both. The last queries of the prompt are in the cache's hands when it scores (SnapKV reads them
too): ``log mean exp(q . k * scaling)`` over the 32 last queries of each KV head's group that may see the
token (unnormalised, so a token gets the same value whichever other tokens the cache holds beside it; see
``lukv_cache.scorers.kvzap.window_attention``) is one more feature per KV head.

Ridge (alpha 1) per layer on log KVzip+, with and without that feature (both with the length and every
feature times it), trained on the shipped surrogate's corpus (news: 48 x 1,024, 8 x 4,096, 8 x 2,048
tokens); measured on held-out text of another domain (Python's documentation, 1k and 4k tokens), never on
the texts the quality benchmarks report on: Spearman per (layer, head), and the share of the tokens
KVzip+'s own `global` selection keeps at ratio r that the surrogate's `global` selection keeps too.

    python benchmarks/kvzap_window_attention.py --threads 2

``--smoke``: trained on one 1k-token news document (one token a character), tested on one of 1k and one of
4k, on the stand-ins of ``benchmarks/_smoke.py``, written in a temporary folder (``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import _smoke
import torch
from _out import default_out, write_table
from kvzap_lengths import (  # the benchmark next to this one
    WINDOW,
    kept_share,
    mean_spearman,
    smollm2_with_targets,
)

from lukv_cache.profiling.kvzap import (
    SKIP_FIRST,
    python_docs_documents,
    token_feature_maps,
)
from lukv_cache.profiling.kvzap_options import KVzapTraining
from lukv_cache.profiling.ridge import RidgeStats
from lukv_cache.scorers.kvzap import INTERACTION_FEATURES, WINDOW_FEATURES, surrogate_inputs

SETS = {"keys, values, log T, x log T": INTERACTION_FEATURES, "+ window attention": WINDOW_FEATURES}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--test", type=int, nargs=2, default=[8, 2], metavar=("N1K", "N4K"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--out", type=Path, default=default_out("kvzap_surrogate") / "kvzap_window_attention.md"
    )
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args()
    training_set = KVzapTraining()  # the shipped surrogate's 64 news documents
    if args.smoke:
        args.out = _smoke.begin().out(Path(__file__).stem + ".md")
        args.test, args.threads, training_set = [1, 1], 1, KVzapTraining(documents=((1, 1024),))
    torch.set_num_threads(args.threads)
    started = time.time()
    model, tokenizer, targets = smollm2_with_targets()
    heads = model.config.num_key_value_heads

    def inputs(ids: torch.Tensor) -> dict[str, dict[int, torch.Tensor]]:
        maps = token_feature_maps(model, ids, WINDOW_FEATURES)  # keys, values, then the window attention
        out = {}
        for name, feature_set in SETS.items():
            out[name] = {}
            for layer, x in maps.items():
                if (
                    feature_set == INTERACTION_FEATURES
                ):  # drop each head's window attention (its last feature)
                    x = x.view(*x.shape[:2], heads, -1)[..., :-1].flatten(2)
                out[name][layer] = surrogate_inputs(x, None, feature_set)[0]
        return out

    training = training_set.corpus(tokenizer)
    stats: dict[str, dict[int, RidgeStats]] = {name: {} for name in SETS}
    for ids in training:
        xs = inputs(ids)
        for layer, y in targets(ids).items():
            for name in SETS:
                x = xs[name][layer][SKIP_FIRST:]
                stats[name].setdefault(layer, RidgeStats(x.shape[1], y.shape[1])).add(x, y[SKIP_FIRST:])
    print(f"trained on {len(training)} news documents ({time.time() - started:.0f} s)", flush=True)
    solved = {name: {layer: s.solve(1.0) for layer, s in st.items()} for name, st in stats.items()}

    rows: dict[tuple[str, int], dict] = {}
    tests = ((1024, python_docs_documents(tokenizer, args.test[0], 1024, seed=0)),)
    tests += ((4096, python_docs_documents(tokenizer, args.test[1], 4096, seed=1)),)
    for tokens, docs in tests:
        for ids in docs:
            xs = inputs(ids)
            true = {layer: y[SKIP_FIRST : tokens - WINDOW] for layer, y in targets(ids).items()}
            for name in SETS:
                predicted = {}
                for layer, (weight, bias, mean, std) in solved[name].items():
                    x = xs[name][layer][SKIP_FIRST : tokens - WINDOW]
                    predicted[layer] = ((x - mean) / std) @ weight + bias
                cell = rows.setdefault((name, tokens), {"rho": [], 0.5: [], 0.8: [], 0.9: []})
                cell["rho"].append(mean_spearman(predicted, true))
                for ratio in (0.5, 0.8, 0.9):
                    cell[ratio].append(kept_share(true, predicted, ratio))
        print(f"tested at {tokens} tokens ({time.time() - started:.0f} s)", flush=True)

    lines = [
        "# KVzap: the window attention as a feature (SmolLM2-135M-Instruct)",
        "",
        f"Command: `python benchmarks/kvzap_window_attention.py {' '.join(sys.argv[1:])}`; "
        f"{time.time() - started:.0f} s on {args.threads} thread(s).",
        "",
        "Ridge (alpha 1) per layer on log KVzip+, trained on 64 news documents (48 x 1,024, 8 x 4,096, "
        "8 x 2,048 tokens); tested on held-out Python documentation "
        f"({args.test[0]} x 1,024 and {args.test[1]} x 4,096 tokens). Spearman: mean over (layer, head, "
        "document). Kept at r: the share of the tokens KVzip+'s own `global` selection keeps at ratio r that "
        "the surrogate's `global` selection keeps too (sinks and the last 32 tokens excluded).",
        "",
        "| inputs | context | Spearman | kept at 0.5 | kept at 0.8 | kept at 0.9 |",
        "|---|---|---|---|---|---|",
    ]
    for (name, tokens), cell in sorted(rows.items(), key=lambda kv: (kv[0][1], list(SETS).index(kv[0][0]))):
        lines.append(
            f"| {name} | {tokens:,} | {statistics.mean(cell['rho']):.3f} | {statistics.mean(cell[0.5]):.3f} | "
            f"{statistics.mean(cell[0.8]):.3f} | {statistics.mean(cell[0.9]):.3f} |"
        )
    write_table(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
