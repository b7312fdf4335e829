"""Fidelity of a KVzap profile's surrogate: Spearman of predicted vs true log KVzip+ per layer, on
Wikipedia documents it was not trained on (it trains on news), at several context lengths.

    python benchmarks/kvzap_fidelity.py --tokens 1024 4096 --documents 8 3 --threads 2 \
        --out benchmarks/results/kvzap_surrogate/kvzap_fidelity.md

``--smoke``: one document of 128 tokens, the stand-ins' kvzap profile (``benchmarks/_smoke.py``), written in
a temporary folder (``benchmarks/smoke.py``).
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
from lukv_cache.profiles import HubLocation, resolve_profile
from lukv_cache.profiling.kvzap import fidelity


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--documents", type=int, nargs="+", default=[8, 3])
    parser.add_argument("--profile", help="a kvzap profile file (default: the shipped SmolLM2 one)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=default_out("kvzap_surrogate") / "kvzap_fidelity.md")
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args()
    if args.smoke:
        args.out = _smoke.begin().out("kvzap_fidelity.md")
        args.tokens, args.documents, args.threads, args.profile = [128], [1], 1, None
    torch.set_num_threads(args.threads)
    started = time.time()
    model, tokenizer = load_smollm2()
    profile = resolve_profile(args.profile or model, "kvzap", hub=HubLocation(local_files_only=True))
    lines = [
        "# KVzap surrogate fidelity (SmolLM2-135M-Instruct, shipped kvzap profile)",
        "",
        f"Command: `python benchmarks/kvzap_fidelity.py {' '.join(sys.argv[1:])}`.",
        "",
        f"Surrogate: {profile.surrogate.meta.get('corpus')}; test: the first tokens of Wikipedia articles "
        "(gensim's dump; never trained on). Spearman of predicted vs true log KVzip+ (`kvzip_plus`) per "
        "(KV head, document), averaged per layer; tokens after the 4 sinks.",
        "",
        "| context tokens | documents | median over layers | min | max | mean | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    per_length = {}
    for tokens, count in zip(args.tokens, args.documents):
        t0 = time.time()
        docs = wikipedia_documents(tokenizer, count, tokens)
        rho = fidelity(model, tokenizer, profile.surrogate, docs)
        per_length[tokens] = rho
        v = list(rho.values())
        lines.append(
            f"| {tokens} | {count} | {statistics.median(v):.3f} | {min(v):.3f} | {max(v):.3f} | "
            f"{statistics.mean(v):.3f} | {time.time() - t0:.0f} |"
        )
        print(lines[-1], flush=True)
    layers = sorted(next(iter(per_length.values())))
    lines += ["", "| layer | " + " | ".join(f"{t} tokens" for t in per_length) + " |"]
    lines.append("|---" * (len(per_length) + 1) + "|")
    for layer in layers:
        lines.append(f"| {layer} | " + " | ".join(f"{rho[layer]:.3f}" for rho in per_length.values()) + " |")
    lines.append(f"\nTotal {time.time() - started:.0f} s on {args.threads} thread(s).")
    write_table(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
