"""Does a KVzap surrogate need to know the context's length? Global allocation at 1k and 4k tokens.

`global` compares predicted scores across layers and heads, so what matters is not only how a surrogate ranks
a head's tokens (Spearman) but whether its scores put each layer at the right level: KVzip+ scores of
broadly-attending heads fall as the context grows (attention spreads over more tokens) while local heads'
do not, so a surrogate trained at one length misplaces layers at another. Ridge surrogates of log KVzip+ on
the library's features (pre-RoPE keys and values of the layer's KV heads), trained on news documents:

* ``1k``: 1,024-token documents only (the surrogate shipped before);
* ``1k+2k+4k``: plus 2,048- and 4,096-token documents;
* ``1k+2k+4k, log T``: the same, with the log of the context length as one more feature (each (layer,
  head) learns how its scores move with the length);
* ``... and x log T``: also every feature times ``log T`` (each weight may move with the length).

Scored on the first 1,024 / 4,096 tokens of Wikipedia articles (never trained on): Spearman per (layer,
head) as before, and the share of the tokens that KVzip+ itself keeps under `global` at ratio r that the
surrogate's own `global` selection keeps too (sinks and the last 32 tokens excluded, as the cache does),
and the smallest share of a head's tokens its `global` selection keeps.

    python benchmarks/kvzap_lengths.py --threads 2

``--smoke``: one document of each length (1k, 2k, 4k tokens: one token a character) to train on and to test,
on the stand-ins of ``benchmarks/_smoke.py``, written in a temporary folder (``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import math
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
    news_documents,
    spearman,
    token_feature_maps,
)
from lukv_cache.profiling.kvzap_training import cached_kvzip_targets
from lukv_cache.profiling.ridge import RidgeStats

WINDOW = 32


def with_length(x: torch.Tensor, tokens: int, mode: str | None) -> torch.Tensor:
    """Features ``[T, F]`` plus the context's length: nothing, ``log T``, or ``log T`` and ``x log T``."""
    if mode is None:
        return x
    log_t = torch.full((x.shape[0], 1), math.log(tokens))
    return torch.cat([x, log_t] + ([x * log_t] if mode == "interactions" else []), 1)


def global_keep(scores: dict[int, torch.Tensor], ratio: float) -> dict[int, torch.Tensor]:
    """{layer: bool [T', H]}: one top-(1 - ratio) selection over every layer and head."""
    flat = torch.cat([s.flatten() for s in scores.values()])
    k = max(1, round(len(flat) * (1 - ratio)))
    threshold = flat.topk(k).values.min()
    return {layer: s >= threshold for layer, s in scores.items()}


def smollm2_with_targets():
    """SmolLM2-135M-Instruct, its tokenizer and ``targets(ids)``: a document's log KVzip+ scores
    ``{layer: [T, H]}``, cached across runs (the build's cache)."""
    model, tokenizer = load_smollm2()
    cached = cached_kvzip_targets(model, tokenizer)

    def targets(ids: torch.Tensor) -> dict[int, torch.Tensor]:
        return {layer: t[0] for layer, t in cached(ids).items()}

    return model, tokenizer, targets


def kept_share(true: dict[int, torch.Tensor], predicted: dict[int, torch.Tensor], ratio: float) -> float:
    """The share of the tokens ``true``'s `global` selection keeps at ``ratio`` that ``predicted``'s keeps."""
    want, got = global_keep(true, ratio), global_keep(predicted, ratio)
    kept = sum(int((want[layer] & got[layer]).sum()) for layer in true)
    return kept / sum(int(want[layer].sum()) for layer in true)


def least_head(predicted: dict[int, torch.Tensor], ratio: float) -> float:
    """The smallest share of its tokens any head keeps under ``predicted``'s `global` selection."""
    got = global_keep(predicted, ratio)
    return min(float(g.float().mean(0).min()) for g in got.values())


def mean_spearman(predicted: dict[int, torch.Tensor], true: dict[int, torch.Tensor]) -> float:
    """Spearman of predicted vs true scores ``[T, H]``, averaged over every (layer, head)."""
    return statistics.mean(
        spearman(predicted[layer][:, h], true[layer][:, h])
        for layer in true
        for h in range(true[layer].shape[1])
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, nargs=3, default=[48, 8, 8], metavar=("N1K", "N2K", "N4K"))
    parser.add_argument("--test", type=int, nargs=2, default=[4, 2], metavar=("N1K", "N4K"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=default_out("kvzap_surrogate") / "kvzap_lengths.md")
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args()
    if args.smoke:
        args.out = _smoke.begin().out("kvzap_lengths.md")
        args.docs, args.test, args.threads = [1, 1, 1], [1, 1], 1
    torch.set_num_threads(args.threads)
    started = time.time()
    model, tokenizer, targets = smollm2_with_targets()

    groups = {
        1024: news_documents(tokenizer, args.docs[0], 1024, seed=0),
        2048: news_documents(tokenizer, args.docs[1], 2048, seed=2),
        4096: news_documents(tokenizer, args.docs[2], 4096, seed=1),
    }
    variants = {
        "1k": ([1024], None),
        "1k+2k+4k": ([1024, 2048, 4096], None),
        "1k+2k+4k, log T": ([1024, 2048, 4096], "log"),
        "1k+2k+4k, log T and x log T": ([1024, 2048, 4096], "interactions"),
    }
    stats = {name: {} for name in variants}
    for tokens, docs in groups.items():
        for ids in docs:
            features = token_feature_maps(model, ids)
            for layer, y in targets(ids).items():
                x = features[layer][0, SKIP_FIRST:]
                for name, (lengths, mode) in variants.items():
                    if tokens in lengths:
                        xx = with_length(x, ids.shape[1], mode)
                        stats[name].setdefault(layer, RidgeStats(xx.shape[1], y.shape[1])).add(
                            xx, y[SKIP_FIRST:]
                        )
        print(f"trained on {tokens}-token documents ({time.time() - started:.0f} s)", flush=True)
    solved = {name: {layer: s.solve(1.0) for layer, s in st.items()} for name, st in stats.items()}

    rows = {}
    for tokens, count in ((1024, args.test[0]), (4096, args.test[1])):
        for ids in wikipedia_documents(tokenizer, count, tokens):
            features = token_feature_maps(model, ids)
            true = {layer: y[SKIP_FIRST : tokens - WINDOW] for layer, y in targets(ids).items()}
            for name, (_, mode) in variants.items():
                predicted = {}
                for layer, (weight, bias, mean, std) in solved[name].items():
                    x = with_length(features[layer][0, SKIP_FIRST : tokens - WINDOW], tokens, mode)
                    predicted[layer] = ((x - mean) / std) @ weight + bias
                cell = rows.setdefault((name, tokens), {"rho": [], 0.5: [], 0.8: [], 0.9: [], "min": []})
                cell["rho"].append(mean_spearman(predicted, true))
                for ratio in (0.5, 0.8, 0.9):
                    cell[ratio].append(kept_share(true, predicted, ratio))
                cell["min"].append(least_head(predicted, 0.8))
        print(f"tested at {tokens} tokens ({time.time() - started:.0f} s)", flush=True)

    lines = [
        "# KVzap surrogates and the context's length: global allocation (SmolLM2-135M-Instruct)",
        "",
        f"Command: `python benchmarks/kvzap_lengths.py {' '.join(sys.argv[1:])}`; {time.time() - started:.0f} s "
        f"on {args.threads} thread(s).",
        "",
        f"Ridge (alpha 1) per layer on log KVzip+, trained on news documents ({args.docs[0]} x 1,024, "
        f"{args.docs[1]} x 2,048, {args.docs[2]} x 4,096 tokens; `1k` uses the first group only); tested on the "
        f"first 1,024 tokens of {args.test[0]} and the first 4,096 of {args.test[1]} Wikipedia articles. "
        "Spearman: mean over (layer, head, document). Kept at r: the share of the tokens KVzip+'s own `global` "
        "selection keeps at ratio r that the surrogate's `global` selection keeps too (1.0 = the same cache). "
        "Least head: the smallest share of its tokens any head keeps under the surrogate's `global` at 0.8.",
        "",
        "| surrogate | context | Spearman | kept at 0.5 | kept at 0.8 | kept at 0.9 | least head at 0.8 |",
        "|---|---|---|---|---|---|---|",
    ]
    for (name, tokens), cell in rows.items():
        lines.append(
            f"| {name} | {tokens:,} | {statistics.mean(cell['rho']):.3f} | {statistics.mean(cell[0.5]):.3f} | "
            f"{statistics.mean(cell[0.8]):.3f} | {statistics.mean(cell[0.9]):.3f} | {statistics.mean(cell['min']):.3f} |"
        )
    write_table(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
