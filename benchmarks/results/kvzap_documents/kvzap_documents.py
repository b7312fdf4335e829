"""How many KVzip target documents a KVzap surrogate needs (issue 58, item 3): a learning curve.

Each row trains the surrogate exactly as ``lukv build --scorer kvzap --kvzap-documents <groups>`` does
(``train_kvzap``: the default MLP on the default features, news documents; the groups are prefixes of the
default set, 48 x 1,024 + 8 x 4,096 + 8 x 2,048 tokens, whose KVzip targets the build's cache keeps), then
tests it on text it never saw: the first 1,024 tokens of the first Wikipedia articles and the first 4,096
of others, against the targets it learns (log KVzip scores): Spearman per (layer, KV head), averaged, and the
share of the tokens KVzip's own `global` selection keeps at 0.8 / 0.9 that the surrogate's `global`
selection keeps too (sinks and the last 32 tokens aside, as the cache does). "Repeat-pass tokens" is what
a fresh build runs KVzip on (its time scales with it; a 4,096-token document costs about 16 times a
1,024-token one).

    PYTHONPATH=benchmarks:benchmarks/results/kvzap_surrogate python \
        benchmarks/results/kvzap_documents/kvzap_documents.py --model qwen2.5-coder-0.5b \
        --groups "12x1024 2x4096 2x2048" "48x1024" ... --test 6 2 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from kvzap_features import wikipedia_documents  # benchmarks/results/kvzap_surrogate
from kvzap_lengths import kept_share, mean_spearman

from lukv_cache.models import load_model
from lukv_cache.profiling.kvzap import SKIP_FIRST, token_feature_maps
from lukv_cache.profiling.kvzap_options import KVzapTraining
from lukv_cache.profiling.kvzap_training import cached_kvzip_targets, train_kvzap

WINDOW = 32


def groups_of(text: str) -> tuple[tuple[int, int], ...]:
    return tuple((int(c), int(t)) for c, t in (g.split("x") for g in text.split()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--groups", nargs="+", required=True, help='e.g. "12x1024 2x4096 2x2048"')
    parser.add_argument("--test", type=int, nargs=2, default=[6, 2], metavar=("N1K", "N4K"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("kvzap_documents.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.time()
    model, tokenizer = load_model(args.model)
    targets = cached_kvzip_targets(model, tokenizer, target="kvzip")
    tests = {tokens: wikipedia_documents(tokenizer, n, tokens) for tokens, n in zip((1024, 4096), args.test)}
    truth = {
        tokens: [
            {layer: y[0, SKIP_FIRST : tokens - WINDOW] for layer, y in targets(ids).items()} for ids in docs
        ]
        for tokens, docs in tests.items()
    }
    print(f"test targets ready ({time.time() - started:.0f} s)", flush=True)
    rows = []
    for text in args.groups:
        groups = groups_of(text)
        training = KVzapTraining(documents=groups)
        t0 = time.time()
        surrogate = train_kvzap(model, tokenizer, training, seed=0, cache_dir=None, show_progress=False)
        trained = time.time() - t0
        row = {
            "groups": text,
            "documents": sum(c for c, _ in groups),
            "tokens": sum(c * t for c, t in groups),
            "repeat_tokens": sum(c * t for c, t in groups),
            "train_seconds_targets_cached": trained,
        }
        for tokens, docs in tests.items():
            rho, kept8, kept9 = [], [], []
            for ids, true in zip(docs, truth[tokens]):
                features = token_feature_maps(model, ids, surrogate.features)
                predicted = {
                    layer: surrogate.predict(layer, features[layer])[0].T[SKIP_FIRST : tokens - WINDOW]
                    for layer in true
                }
                rho.append(mean_spearman(predicted, true))
                kept8.append(kept_share(true, predicted, 0.8))
                kept9.append(kept_share(true, predicted, 0.9))
            row[f"spearman_{tokens}"] = statistics.mean(rho)
            row[f"kept08_{tokens}"] = statistics.mean(kept8)
            row[f"kept09_{tokens}"] = statistics.mean(kept9)
        rows.append(row)
        print(json.dumps(row), flush=True)
    lines = [
        f"# KVzap surrogate learning curve ({args.model})",
        "",
        f"Command: `PYTHONPATH=benchmarks:benchmarks/results/kvzap_surrogate python "
        f"benchmarks/results/kvzap_documents/kvzap_documents.py {' '.join(repr(a) if ' ' in a else a for a in sys.argv[1:])}`; "
        f"{time.time() - started:.0f} s on {args.threads} thread(s) (targets read from the build's cache).",
        "",
        f"Tested on the first 1,024 tokens of {args.test[0]} and the first 4,096 of {args.test[1]} Wikipedia "
        "articles (never trained on) against log KVzip; kept at r: the share of KVzip's own `global` "
        "selection at ratio r that the surrogate's `global` selection keeps.",
        "",
        "| documents (groups) | repeat-pass tokens | Spearman 1k | kept 0.8 / 0.9 at 1k | Spearman 4k | "
        "kept 0.8 / 0.9 at 4k |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['documents']} ({r['groups']}) | {r['repeat_tokens']:,} | {r['spearman_1024']:.3f} | "
            f"{r['kept08_1024']:.3f} / {r['kept09_1024']:.3f} | {r['spearman_4096']:.3f} | "
            f"{r['kept08_4096']:.3f} / {r['kept09_4096']:.3f} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
