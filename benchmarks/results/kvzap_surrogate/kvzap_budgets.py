"""Where does the shipped kvzap surrogate lose KVzip+'s selection under `global`: in the budgets it gives
each (layer, KV head), or in which tokens it picks within a head?

On held-out text (Python's documentation, never trained on), for each ratio r: KVzip+'s own `global`
selection (the target), the surrogate's, and two hybrids that swap one half: the surrogate's ranking
within each head with KVzip+'s per-head counts ("true budgets"), and KVzip+'s ranking with the surrogate's
counts ("true ranking"). Each row reports the share of the target's tokens the selection keeps (sinks
and the last 32 tokens excluded, as the cache does).

    python benchmarks/kvzap_budgets.py --threads 2

``--smoke``: one document of 1k and one of 4k tokens (one token a character), the stand-ins' kvzap profile
(``benchmarks/_smoke.py``), written in a temporary folder (``benchmarks/smoke.py``).
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
from kvzap_lengths import WINDOW, global_keep  # the benchmark next to this one

from lukv_cache import LUKVCache
from lukv_cache.models import load_smollm2
from lukv_cache.profiling.kvzap import SKIP_FIRST, python_docs_documents, token_feature_maps
from lukv_cache.profiling.kvzap_training import cached_kvzip_targets


def top_counts(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """bool ``[T, H]``: the ``counts[h]`` highest-scoring tokens of each head."""
    order = scores.argsort(dim=0, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(0, order, torch.arange(scores.shape[0])[:, None].expand_as(order))
    return ranks < counts[None, :]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--test", type=int, nargs=2, default=[8, 2], metavar=("N1K", "N4K"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", default=None, help="a kvzap profile file (default: the shipped one)")
    parser.add_argument("--out", type=Path, default=default_out("kvzap_surrogate") / "kvzap_budgets.md")
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args()
    if args.smoke:
        args.out = _smoke.begin().out("kvzap_budgets.md")
        args.test, args.threads, args.profile = [1, 1], 1, None
    torch.set_num_threads(args.threads)
    started = time.time()
    model, tokenizer = load_smollm2()
    source = args.profile or model
    cache = LUKVCache.from_pretrained(source, ratio=0.8, scorer="kvzap", local_files_only=True)
    surrogate = cache.profile.surrogate
    cached = cached_kvzip_targets(model, tokenizer)
    ratios = (0.5, 0.8, 0.9)
    kinds = ("surrogate", "true budgets", "true ranking")
    rows: dict[tuple[int, float, str], list[float]] = {}
    tests = ((1024, python_docs_documents(tokenizer, args.test[0], 1024, seed=0)),)
    tests += ((4096, python_docs_documents(tokenizer, args.test[1], 4096, seed=1)),)
    with torch.no_grad():
        for tokens, docs in tests:
            for ids in docs:
                maps = token_feature_maps(model, ids, surrogate.features)
                true, pred = {}, {}
                for layer, y in cached(ids).items():
                    true[layer] = y[0, SKIP_FIRST : tokens - WINDOW]  # [T', H]
                    full = surrogate.predict(layer, maps[layer]).transpose(1, 2)[0]  # [T, H]
                    pred[layer] = full[SKIP_FIRST : tokens - WINDOW]
                for ratio in ratios:
                    want, got = global_keep(true, ratio), global_keep(pred, ratio)
                    total = sum(int(w.sum()) for w in want.values())
                    picks = {
                        "surrogate": got,
                        "true budgets": {i: top_counts(pred[i], want[i].sum(0)) for i in true},
                        "true ranking": {i: top_counts(true[i], got[i].sum(0)) for i in true},
                    }
                    for kind, pick in picks.items():
                        kept = sum(int((want[i] & pick[i]).sum()) for i in true)
                        rows.setdefault((tokens, ratio, kind), []).append(kept / total)
            print(f"tested at {tokens} tokens ({time.time() - started:.0f} s)", flush=True)
    lines = [
        "# KVzap under `global`: budgets or ranking? (SmolLM2-135M-Instruct)",
        "",
        f"Command: `python benchmarks/kvzap_budgets.py {' '.join(sys.argv[1:])}`; {time.time() - started:.0f} s "
        f"on {args.threads} thread(s).",
        "",
        f"The kvzap surrogate ({args.profile or 'shipped'}: {surrogate.features}, trained on "
        f"{surrogate.meta.get('corpus')}) on held-out Python documentation ({args.test[0]} x 1,024 and {args.test[1]} x 4,096 tokens). "
        "Share of the tokens KVzip+'s own `global` selection keeps at ratio r that each selection keeps: the "
        "surrogate's `global`; the surrogate's ranking within each head with KVzip+'s per-head counts (true "
        "budgets); KVzip+'s ranking with the surrogate's counts (true ranking). Mean over documents.",
        "",
        "| context | ratio | " + " | ".join(kinds) + " |",
        "|---|---|" + "---|" * len(kinds),
    ]
    for tokens in (1024, 4096):
        for ratio in ratios:
            cells = [f"{statistics.mean(rows[(tokens, ratio, k)]):.3f}" for k in kinds]
            lines.append(f"| {tokens:,} | {ratio} | " + " | ".join(cells) + " |")
    write_table(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
