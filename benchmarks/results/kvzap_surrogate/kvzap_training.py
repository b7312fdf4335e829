"""What should a KVzap surrogate train on, and which family? Fidelity on held-out Wikipedia at 1k and 4k.

Trains surrogates of log KVzip+ (the library's ``kvzip_plus``) on the library's features (pre-RoPE keys and
values of every KV head of the layer) of SmolLM2-135M-Instruct, from several training sets:

* ``news 1k``: the build's default so far (gensim's news, 48 documents of 1,024 tokens);
* ``+ news 4k``: plus news documents of 4,096 tokens;
* ``+ docs``: plus Python's reference documentation (``pydoc_data``, shipped with CPython) in 1k and 4k
  documents: technical prose and code, a second domain;

and two families: ``linear`` (ridge, closed form) and, on the largest set, ``mlp`` (Linear-GELU-Linear,
512 hidden units, AdamW on MSE, as kvpress' KVzap MLP). Scored by Spearman per (layer, head, document) against the true
targets on the first 1,024 / 4,096 tokens of Wikipedia articles (never trained on), averaged per layer.
KVzip+ targets are cached where ``lukv build`` caches them, so a build on the same documents reuses them.

    python benchmarks/kvzap_training.py --news-4k 2 --docs-1k 8 --test 4 2 --threads 1

``--smoke``: one document of each training set and length (one token a character), 64 MLP rows per 1k
tokens, on the stand-ins of ``benchmarks/_smoke.py``, written in a temporary folder (``benchmarks/smoke.py``).
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
from kvzap_features import wikipedia_documents  # the benchmark next to this one

from lukv_cache.models import load_smollm2
from lukv_cache.profiling.kvzap import (
    SKIP_FIRST,
    fit_mlp,
    news_documents,
    python_docs_documents,
    spearman,
    token_feature_maps,
)
from lukv_cache.profiling.kvzap_training import cached_kvzip_targets
from lukv_cache.profiling.ridge import RidgeStats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--news-1k", type=int, default=48)
    parser.add_argument("--news-4k", type=int, default=12)
    parser.add_argument("--docs-1k", type=int, default=24)
    parser.add_argument("--docs-4k", type=int, default=0)
    parser.add_argument("--test", type=int, nargs=2, default=[8, 2], metavar=("N1K", "N4K"))
    parser.add_argument("--samples", type=int, default=512, help="MLP rows per 1k tokens of a document")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=default_out("kvzap_surrogate") / "kvzap_training.md")
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args()
    if args.smoke:
        args.out = _smoke.begin().out("kvzap_training.md")
        args.news_1k, args.news_4k, args.docs_1k, args.docs_4k, args.test = 1, 1, 1, 1, [1, 1]
        args.samples, args.threads = 64, 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    started = time.time()
    model, tokenizer = load_smollm2()
    cached = cached_kvzip_targets(model, tokenizer)

    def targets(ids: torch.Tensor) -> dict[int, torch.Tensor]:
        return {layer: t[0] for layer, t in cached(ids).items()}  # [T, H]

    sets = {
        "news 1k": news_documents(tokenizer, args.news_1k, 1024, seed=0),
        "news 4k": news_documents(tokenizer, args.news_4k, 4096, seed=1),
        "docs 1k": python_docs_documents(tokenizer, args.docs_1k, 1024, seed=0),
    }
    if args.docs_4k:
        sets["docs 4k"] = python_docs_documents(tokenizer, args.docs_4k, 4096, seed=1)
    trainings = {
        "news 1k": ["news 1k"],
        "news 1k + news 4k": ["news 1k", "news 4k"],
        "news + docs, 1k + 4k": list(sets),
    }
    # one pass over every document: ridge statistics per training set, MLP rows per document
    stats: dict[str, dict[int, RidgeStats]] = {name: {} for name in trainings}
    rows: dict[str, list[tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]]] = {}
    generator = torch.Generator().manual_seed(0)
    done = 0
    total = sum(len(d) for d in sets.values())
    for set_name, docs in sets.items():
        rows[set_name] = []
        for ids in docs:
            features = token_feature_maps(model, ids)
            y_all = targets(ids)
            t = ids.shape[1] - SKIP_FIRST
            pick = torch.randperm(t, generator=generator)[: args.samples * t // 1024] + SKIP_FIRST
            xs, ys = {}, {}
            for layer, y in y_all.items():
                x = features[layer][0]
                for name, members in trainings.items():
                    if set_name in members:
                        stats[name].setdefault(layer, RidgeStats(x.shape[-1], y.shape[-1]))
                        stats[name][layer].add(x[SKIP_FIRST:], y[SKIP_FIRST:])
                xs[layer], ys[layer] = x[pick].clone(), y[pick].clone()
            rows[set_name].append((xs, ys))
            done += 1
            print(f"train documents {done}/{total} ({time.time() - started:.0f} s)", flush=True)

    layers = sorted(stats["news 1k"])
    predictors = {}
    for name, members in trainings.items():
        ridge = {layer: s.solve(1.0) for layer, s in stats[name].items()}
        predictors[f"linear, {name}"] = lambda layer, x, r=ridge: (
            ((x - r[layer][2]) / r[layer][3]) @ r[layer][0] + r[layer][1]
        )
        if name != list(trainings)[-1]:
            continue  # the MLP on the largest training set only (it costs minutes per set on a CPU)
        x = {layer: torch.cat([xs[layer] for m in members for xs, _ in rows[m]]) for layer in layers}
        y = {layer: torch.cat([ys[layer] for m in members for _, ys in rows[m]]) for layer in layers}
        t0 = time.time()
        mlps = {layer: fit_mlp(x[layer], y[layer], seed=0) for layer in layers}
        print(f"MLP {name}: {x[layers[0]].shape[0]} rows per layer, {time.time() - t0:.0f} s", flush=True)
        predictors[f"mlp, {name}"] = lambda layer, x, m=mlps: m[layer](x)

    results: dict[tuple[str, int], dict[int, list[float]]] = {}
    for tokens, count in ((1024, args.test[0]), (4096, args.test[1])):
        for ids in wikipedia_documents(tokenizer, count, tokens):
            features = token_feature_maps(model, ids)
            for layer, y in targets(ids).items():
                x = features[layer][0]
                for name, predict in predictors.items():
                    with torch.no_grad():
                        p = predict(layer, x)
                    for h in range(y.shape[-1]):
                        rho = spearman(p[SKIP_FIRST:, h], y[SKIP_FIRST:, h])
                        results.setdefault((name, tokens), {}).setdefault(layer, []).append(rho)
            print(f"test {tokens} ({time.time() - started:.0f} s)", flush=True)

    lines = [
        "# KVzap surrogates: training set and family (SmolLM2-135M-Instruct)",
        "",
        f"Command: `python benchmarks/kvzap_training.py {' '.join(sys.argv[1:])}`; "
        f"{time.time() - started:.0f} s on {args.threads} thread(s).",
        "",
        "Features: pre-RoPE keys and values of every KV head of the layer (384). Training documents: "
        + ", ".join(f"{name} ({len(d)} documents)" for name, d in sets.items())
        + f"; the MLP sees {args.samples} random positions per 1k tokens of each document, ridge every "
        "token. Test: the first 1,024 tokens of "
        f"{args.test[0]} and the first 4,096 of {args.test[1]} Wikipedia articles. Spearman of predicted vs "
        "true log KVzip+ per (layer, head, document), averaged per layer; then over layers:",
        "",
        "| surrogate | 1k mean | 1k min layer | 4k mean | 4k min layer |",
        "|---|---|---|---|---|",
    ]
    for name in predictors:
        cells = []
        for tokens in (1024, 4096):
            per_layer = [statistics.mean(v) for v in results[name, tokens].values()]
            cells += [f"{statistics.mean(per_layer):.3f}", f"{min(per_layer):.3f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    write_table(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
