"""The README's two lines, decoded side by side on a real model: ``LUKVCache.from_pretrained(model_id,
ratio=0.8)`` (the one line) against ``LUKVCache.from_pretrained(model_id, memory=0.1)`` (a memory budget),
with the shipped profiles and their default scorer, after a prefill of real text.

``benchmarks/quantized_cost.py`` times the same budget on a random-weight model with keydiff, the scorer
that rescores every held token at each evicting fold (the worst case for a budget's folds); this script
times what a user of the two lines gets: the profiles' own scorer (kvzap for the packaged models, which keeps
each token's first score, so a fold rescores only the new tokens), its bits chosen from the profile's memory
table, real keys and values. Each batch row is its own slice of Wikipedia (gensim's test articles), so the rows
hold different counts; every cache is prefilled with the same ids, then decoded one token at a time, one step
of each cache in turn (``cache_bench.interleaved_steps``: machine noise hits them alike).

``decode ms`` is a step's median, ``mean ms`` counts every step, the budget's folds included (every
``fold_interval`` steps its dense suffix joins the store; an evicting fold also picks what to evict).

    python benchmarks/one_line_decode.py --model smollm2 --tokens 4096 --batch 1 4 --threads 2 --decode-steps 64

``--scorer NAME``: both lines with that scorer's profile instead of the default. ``--smoke``: the stand-ins of
``benchmarks/_smoke.py``, 256 tokens, batch 1, 2 steps (``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import _smoke  # noqa: E402
import cache_bench  # noqa: E402  (interleaved_steps)
from _calls import cache_kw  # noqa: E402


def prompt_ids(tokenizer, batch: int, tokens: int) -> torch.Tensor:
    """``[batch, tokens]``: row ``r`` the ``r``-th run of ``tokens`` tokens of the Wikipedia articles, joined."""
    from lukv_cache.texts import wikipedia_articles

    ids: list[int] = []
    for article in wikipedia_articles():
        ids += tokenizer(article.text + "\n\n", add_special_tokens=False).input_ids
        if len(ids) >= batch * tokens:
            break
    if len(ids) < batch * tokens:
        raise SystemExit(f"the articles hold {len(ids):,} tokens, fewer than {batch} x {tokens}")
    return torch.tensor(ids[: batch * tokens]).view(batch, tokens)


def run(name: str, tokens: int, batch: int, threads: int, steps: int, memory: float, ratio: float, scorer):
    from lukv_cache import LUKVCache
    from lukv_cache.models import load_model

    torch.set_num_threads(threads)
    model, tokenizer = load_model(name)
    model_id = model.config.name_or_path
    ids = prompt_ids(tokenizer, batch, tokens)
    extra = {} if scorer is None else {"scorer": scorer}
    caches = {
        "one line": LUKVCache.from_pretrained(model_id, ratio=ratio, **extra),
        "memory": LUKVCache.from_pretrained(model_id, memory=memory, **extra),
    }
    folds: dict[str, list[float]] = {}
    with torch.no_grad():
        for label, cache in caches.items():
            model(input_ids=ids, **{cache_kw(model): cache}, use_cache=True)
            seen = folds.setdefault(label, [])
            cache.compressor.observe(
                lambda step, seen=seen: step.kind == "fold" and seen.append(step.seconds)
            )
    times = cache_bench.interleaved_steps(model, caches, batch, steps)
    row = {}
    for label, cache in caches.items():
        bits = sorted({layer.kv_bits for layer in cache.layers if hasattr(layer, "kv_bits")}, key=str)
        row[label] = {
            "scorer": cache.profile.scorer,
            "bits": "/".join("fp32" if b is None else f"int{b}" for b in bits),
            "kept": float(cache.stored_tokens().double().mean()),
            "mib": cache.memory_bytes() / 2**20,
            "median": 1000 * statistics.median(times[label]),
            "mean": 1000 * statistics.mean(times[label]),
            "folds": folds[label],
        }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="a packaged model's name (lukv_cache.models)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--ratio", type=float, default=0.8)
    parser.add_argument("--memory", type=float, default=0.1)
    parser.add_argument("--scorer", help="both lines with this scorer's profile (default: the profile's own)")
    parser.add_argument("--out", help="write the table here too")
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.out = str(_smoke.begin().out("one_line_decode.md"))
        args.tokens, args.batch, args.threads, args.decode_steps = [256], [1], 1, 2
    lines = [
        f"Command: python benchmarks/one_line_decode.py --model {args.model} --tokens "
        f"{' '.join(map(str, args.tokens))} --batch {' '.join(map(str, args.batch))} --threads {args.threads} "
        f"--decode-steps {args.decode_steps} --ratio {args.ratio:g} --memory {args.memory:g}"
        + (f" --scorer {args.scorer}" if args.scorer else ""),
        "",
        "| context | batch | cache | scorer | bits | kept/head | MiB | folds (median ms) | decode ms | / one line "
        "| mean ms | / one line |",
        "|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for tokens in args.tokens:
        for batch in args.batch:
            row = run(
                args.model,
                tokens,
                batch,
                args.threads,
                args.decode_steps,
                args.memory,
                args.ratio,
                args.scorer,
            )
            base = row["one line"]
            for label, r in row.items():
                name = (
                    f"from_pretrained(ratio={args.ratio:g})"
                    if label == "one line"
                    else (f"from_pretrained(memory={args.memory:g})")
                )
                fold = (
                    f"{len(r['folds'])} ({1000 * statistics.median(r['folds']):.1f})" if r["folds"] else "0"
                )
                lines.append(
                    f"| {tokens} | {batch} | {name} | {r['scorer']} | {r['bits']} | {r['kept']:.1f} | "
                    f"{r['mib']:.2f} | {fold} | {r['median']:.2f} | {r['median'] / base['median']:.3f} | "
                    f"{r['mean']:.2f} | {r['mean'] / base['mean']:.3f} |"
                )
            print("\n".join(lines[-len(row) :]), flush=True)
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.smoke:
        print("smoke: one_line_decode ran")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
