"""What filling a cache costs, side by side in one run: a full DynamicCache, LUKVCache with keydiff (one
layer's full KV at a time), with KVzap (its surrogate scoring in the same forward) and with KVzip (the
whole context held, then the repeat passes), on real text.

    python benchmarks/prefill_cost.py --tokens 1024 4096 --repeats 3 --threads 1

``--kvzap-profile FILE`` adds a row for another kvzap profile (e.g. an MLP surrogate's from ``lukv build
smollm2 --scorer kvzap --kvzap-family mlp``) under `global`. Prints and writes ``prefill_cost.{md,json}``: the median seconds of each prefill and its ratio to keydiff's.

``--smoke``: 128 tokens, once, every method (``--kvzap-profile`` too) on the stand-ins of
``benchmarks/_smoke.py``, written in a temporary folder (``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import _smoke
import torch
from _calls import cache_kw
from _out import default_out
from transformers import DynamicCache

from lukv_cache import LUKVCache
from lukv_cache.models import load_model
from lukv_cache.texts import wikipedia_articles

METHODS = (
    ("DynamicCache (full)", None),
    ("LUKVCache keydiff / uniform", ("keydiff", "uniform")),
    ("LUKVCache kvzap / global", ("kvzap", "global")),
    ("LUKVCache kvzap / profile", ("kvzap", "profile")),
    ("LUKVCache kvzip / global", ("kvzip", "global")),
)


def text_ids(tokenizer, n_tokens: int) -> torch.Tensor:
    ids: list[int] = []
    for article in sorted(wikipedia_articles(), key=lambda a: -len(a.text)):
        ids += tokenizer(article.text + "\n\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= n_tokens:
            return torch.tensor([ids[:n_tokens]])
    raise SystemExit(f"not enough text for {n_tokens} tokens")


@torch.no_grad()
def prefill_seconds(model, tokenizer, ids: torch.Tensor, method) -> float:
    started = time.perf_counter()
    if method is None:
        model(input_ids=ids, **{cache_kw(model): DynamicCache()}, use_cache=True, logits_to_keep=1)
    elif method[0] == "kvzap":  # the shipped profile (or the given file) holds the surrogate
        source = method[2] if len(method) > 2 else model
        cache = LUKVCache.from_pretrained(source, 0.8, "kvzap", local_files_only=True)
        if method[1] != "profile":
            cache = LUKVCache(0.8, cache.scorer, method[1])
        cache.prefill(model, ids, logits_to_keep=1)
    else:
        scorer, allocator = method
        LUKVCache(0.8, scorer, allocator).prefill(model, ids, tokenizer=tokenizer, logits_to_keep=1)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(default_out("prefill_cost")))
    parser.add_argument(
        "--skip-kvzip", action="store_true", help="leave out kvzip (its repeat passes are long)"
    )
    parser.add_argument(
        "--kvzap-profile", default=None, help="also time kvzap / global with this profile file"
    )
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        smoke = _smoke.begin()
        args.out, args.kvzap_profile = str(smoke.out("prefill_cost")), str(smoke.profile("kvzap"))
        args.tokens, args.repeats, args.threads, args.skip_kvzip = [128], 1, 1, False
    methods = [m for m in METHODS if not (args.skip_kvzip and m[1] and m[1][0] == "kvzip")]
    if args.kvzap_profile:
        methods.insert(
            4,
            (
                f"LUKVCache kvzap / global ({args.kvzap_profile})",
                ("kvzap", "global", args.kvzap_profile),
            ),
        )
    model, tokenizer = load_model("smollm2", threads=args.threads)
    rows = []
    for n in args.tokens:
        ids = text_ids(tokenizer, n)
        prefill_seconds(model, tokenizer, ids[:, :64], METHODS[1][1])  # warm-up
        times: dict[str, list[float]] = {label: [] for label, _ in methods}
        for _ in range(args.repeats):  # interleaved: a slow moment of the machine hits every method alike
            for label, method in methods:
                times[label].append(prefill_seconds(model, tokenizer, ids, method))
        medians = {label: statistics.median(t) for label, t in times.items()}
        base = medians[METHODS[1][0]]
        for label, seconds in medians.items():
            rows.append({"tokens": n, "method": label, "seconds": seconds, "vs_keydiff": seconds / base})
            print(f"{n:6d} {label:<30} {seconds:7.2f} s  {seconds / base:5.2f}x keydiff", flush=True)
    command = " ".join(["python benchmarks/prefill_cost.py", *(argv if argv is not None else sys.argv[1:])])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_cost.json").write_text(
        json.dumps({"command": command, "threads": torch.get_num_threads(), "rows": rows}, indent=1) + "\n"
    )
    lines = [
        "# Prefill cost: full cache vs keydiff vs KVzap vs KVzip (SmolLM2-135M-Instruct, real Wikipedia text)",
        "",
        f"Command: `{command}`; {torch.get_num_threads()} CPU thread(s); median of {args.repeats} prefills, "
        "the methods interleaved; ratio 0.8.",
        "",
        "| tokens | method | prefill s | vs keydiff |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['tokens']} | {r['method']} | {r['seconds']:.2f} | {r['vs_keydiff']:.2f}x |" for r in rows
    ]
    (out / "prefill_cost.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
