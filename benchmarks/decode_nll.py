"""Excess NLL along a long teacher-forced continuation with eviction at fold time (issue 20): is the
memory bound of ``LUKVCache(decode_max_tokens=N)`` paid for in quality, method by method?

    python benchmarks/decode_nll.py --continuation 2048 4096 --budgets 256 512 --documents 6 --threads 2

Each document is one of the longest topics of Python's reference documentation (shipped with CPython:
neither the Wikipedia articles the other benchmarks report on nor the news the kvzap surrogate was
trained on). Its first ``--prompt`` tokens (256) are the prompt; the next C tokens are fed teacher-forced,
``--fold-interval`` tokens per forward. That is exactly what token-by-token decoding attends to: between
two folds nothing is evicted, and the fold runs after the forward that completes the interval. For every
token of the continuation, the NLL of the true next token against a full ``DynamicCache``; the table gives
the excess NLL per token (nats) in windows of ``--nll-window`` (256) tokens along the continuation, mean
over documents, per budget N and method:

* ``streaming``: StreamingLLM, sinks and the most recent tokens only (the floor any method must beat);
* ``keydiff / uniform``, ``keydiff / adakv``: budgets without a profile;
* ``keydiff / profile``: LU-KV, the shipped SmolLM2 keydiff profile read at each fold's ratio;
* ``kvzap / global``: the shipped kvzap surrogate's scores, kept from when each token was first scored,
  one top-k over the model (``kvzap / profile`` with ``--methods``).

``--decode-window W`` protects the last W tokens at every fold for every method (default: the cache's,
N // 4); ``--skip K`` leaves out the K longest documents (tuning runs use other documents than the reported
ones). Also the cache's bytes after every forward (peak and last, against the full cache's; the first
document's over time in the json) and the seconds per fold (median; a timing, so run it on a quiet
machine). Writes ``decode_nll.{md,json,png}`` under ``--out``.

``--smoke``: one document, a 32-token prompt and 96 tokens of continuation, N = 48, every default method,
on the stand-ins of ``benchmarks/_smoke.py``, written in a temporary folder (``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

import _smoke
import torch
import torch.nn.functional as F
from _calls import cache_kw
from _out import default_out
from transformers import DynamicCache

from lukv_cache import LUKVCache
from lukv_cache.cache.compression.compressor import CompressionStep
from lukv_cache.cache.storage.report import kv_cache_bytes
from lukv_cache.models import load_model
from lukv_cache.texts import python_docs


def _method(scorer: str, allocator: str, pretrained: bool = False):
    """``make(model, N, fold, window)``: the cache, with the shipped profile when ``pretrained``."""

    def make(model, n: int, fold: int, window: int | None) -> LUKVCache:
        options = dict(scorer=scorer, allocator=allocator, decode_max_tokens=n, fold_interval=fold)
        if pretrained:
            return LUKVCache.from_pretrained(model, **options, decode_window=window, local_files_only=True)
        return LUKVCache(**options, decode_window=window, config=model.config)

    return make


METHODS = {
    "streaming": _method("streaming", "uniform"),
    "keydiff / uniform": _method("keydiff", "uniform"),
    "keydiff / adakv": _method("keydiff", "adakv"),
    "keydiff / profile": _method("keydiff", "profile", pretrained=True),
    "kvzap / global": _method("kvzap", "global", pretrained=True),
    "kvzap / profile": _method("kvzap", "profile", pretrained=True),
    "snapkv / adakv": _method("snapkv", "adakv"),
}
DEFAULT_METHODS = ("streaming", "keydiff / uniform", "keydiff / adakv", "keydiff / profile", "kvzap / global")


def documents(tokenizer, n_docs: int, n_tokens: int, skip: int = 0) -> list[tuple[str, torch.Tensor]]:
    """The ``n_docs`` longest Python documentation topics that have ``n_tokens`` tokens (after the ``skip``
    longest ones: tuning runs use other documents than the reported ones), cut to that."""
    docs: list[tuple[str, torch.Tensor]] = []
    for article in sorted(python_docs(), key=lambda a: -len(a.text)):
        ids = tokenizer(article.text, add_special_tokens=False)["input_ids"]
        if len(ids) >= n_tokens:
            docs.append((article.title, torch.tensor([ids[:n_tokens]])))
        if len(docs) == skip + n_docs:
            return docs[skip:]
    raise SystemExit(f"only {len(docs)} documents have {n_tokens} tokens; ask for fewer or shorter")


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, reduction="none")


@torch.no_grad()
def full_nll(model, ids: torch.Tensor, prompt: int, step: int) -> tuple[torch.Tensor, int]:
    """Per-token NLL of the continuation with the full cache (fed as the others are, ``step`` tokens per
    forward), and the full cache's bytes."""
    cache = DynamicCache()
    last = model(input_ids=ids[:, :prompt], **{cache_kw(model): cache}, use_cache=True).logits[0, -1:]
    nll = []
    for start in range(prompt, ids.shape[1], step):
        chunk = ids[:, start : start + step]
        logits = model(input_ids=chunk, **{cache_kw(model): cache}, use_cache=True).logits[0]
        nll.append(_nll(torch.cat([last, logits[:-1]]), chunk[0]))
        last = logits[-1:]
    return torch.cat(nll), kv_cache_bytes(cache)


@torch.no_grad()
def cached_nll(model, ids: torch.Tensor, prompt: int, cache: LUKVCache) -> dict:
    """Per-token NLL of the continuation through ``cache``, its bytes after every forward and the
    seconds of every fold."""
    folds: list[float] = []

    def timed(step: CompressionStep) -> None:  # each step of the cache's compression, with its seconds
        if step.kind == "fold":
            folds.append(step.seconds)

    cache.compressor.observe(timed)
    last = cache.prefill(model, ids[:, :prompt]).logits[0, -1:]
    nll, memory = [], [cache.memory_bytes()]
    for start in range(prompt, ids.shape[1], cache.fold_interval):
        chunk = ids[:, start : start + cache.fold_interval]
        logits = model(input_ids=chunk, **{cache_kw(model): cache}, use_cache=True).logits[0]
        nll.append(_nll(torch.cat([last, logits[:-1]]), chunk[0]))
        last = logits[-1:]
        memory.append(cache.memory_bytes())
    return {"nll": torch.cat(nll), "bytes": memory, "folds": folds}


def run(args) -> dict:
    model, tokenizer = load_model(args.model, threads=args.threads)
    rows, corpora = [], set()
    for length in args.continuation:
        docs = documents(tokenizer, args.documents, args.prompt + length, args.skip)
        full = {title: full_nll(model, ids, args.prompt, args.fold_interval) for title, ids in docs}
        print(
            f"continuation {length}: full-cache NLL {_mean([f[0].mean() for f in full.values()]):.3f}",
            flush=True,
        )
        for n in args.budgets:
            for method in args.methods:
                excess, peaks, lasts, folds, over_time = [], [], [], [], None
                for title, ids in docs:
                    cache = METHODS[method](model, n, args.fold_interval, args.decode_window)
                    surrogate = getattr(cache.profile, "surrogate", None)
                    if surrogate is not None:
                        corpora.add(str(surrogate.meta.get("corpus")))
                    out = cached_nll(model, ids, args.prompt, cache)
                    excess.append(out["nll"] - full[title][0])
                    peaks.append(max(out["bytes"]))
                    lasts.append(out["bytes"][-1])
                    over_time = over_time or out["bytes"]  # the first document's, after every forward
                    folds += out["folds"]
                per_token = torch.stack(excess).mean(0)
                windows = [float(w.mean()) for w in per_token.split(args.nll_window)]
                row = {
                    "continuation": length,
                    "budget": n,
                    "method": method,
                    "excess_nll_windows": windows,
                    "excess_nll": float(per_token.mean()),
                    "peak_bytes": max(peaks),
                    "last_bytes": _mean(lasts),
                    "full_bytes": _mean([f[1] for f in full.values()]),
                    "fold_seconds_median": statistics.median(folds) if folds else None,
                    "folds": len(folds),
                    "bytes_over_time": over_time,
                }
                rows.append(row)
                print(
                    f"  N={n:5d} {method:<20} excess NLL {row['excess_nll']:+.4f}  windows "
                    + " ".join(f"{w:+.3f}" for w in windows)
                    + f"  peak {row['peak_bytes'] / 2**20:.1f} MiB (full {row['full_bytes'] / 2**20:.1f})"
                    + (f"  fold {1000 * row['fold_seconds_median']:.0f} ms" if folds else ""),
                    flush=True,
                )
    if any("python" in corpus.lower() for corpus in corpora):
        print(f"warning: the kvzap surrogate was trained on {corpora}, which these documents may be part of")
    return {
        "rows": rows,
        "documents": [title for title, _ in docs],
        "threads": torch.get_num_threads(),
        "kvzap_training_corpus": sorted(corpora),
    }


def _mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values)


def write(result: dict, args, command: str) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"command": command, **result}, indent=1) + "\n")
    lines = [
        "# Excess NLL along a teacher-forced continuation, eviction at fold time (SmolLM2-135M-Instruct)",
        "",
        f"Command: `{command}`; {result['threads']} CPU thread(s). Documents (Python reference topics): "
        f"{', '.join(result['documents'])}. A {args.prompt}-token prompt, then the continuation fed "
        f"{args.fold_interval} tokens per forward (a fold after each), the last "
        f"{'N // 4 (the default)' if args.decode_window is None else args.decode_window} tokens protected at "
        "every fold. Excess NLL per token (nats) against a "
        f"full DynamicCache, mean over documents, in windows of {args.nll_window} tokens; bytes: the cache's "
        "peak over the forwards and the full cache's at the end."
        + (
            f" The kvzap surrogate was trained on: {'; '.join(result['kvzap_training_corpus'])}."
            if result["kvzap_training_corpus"]
            else ""
        ),
    ]
    for length in args.continuation:
        for n in args.budgets:
            rows = [r for r in result["rows"] if r["continuation"] == length and r["budget"] == n]
            windows = len(rows[0]["excess_nll_windows"])
            lines += [
                "",
                f"## continuation {length}, N = {n}",
                "",
                "| method | " + " | ".join(f"{i * args.nll_window}-" for i in range(windows)) + " | all | "
                "peak MiB | full MiB | fold ms |",
                "|---|" + "---|" * (windows + 4),
            ]
            for r in rows:
                fold = "" if r["fold_seconds_median"] is None else f"{1000 * r['fold_seconds_median']:.0f}"
                lines.append(
                    f"| {r['method']} | "
                    + " | ".join(f"{w:+.3f}" for w in r["excess_nll_windows"])
                    + f" | {r['excess_nll']:+.3f} | {r['peak_bytes'] / 2**20:.1f} | {r['full_bytes'] / 2**20:.1f} "
                    f"| {fold} |"
                )
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    _plot(result, args, out / f"{args.name}.png")


def _plot(result: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(length, n) for length in args.continuation for n in args.budgets]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (length, n) in zip(axes[0], panels):
        for r in result["rows"]:
            if r["continuation"] == length and r["budget"] == n:
                x = [(i + 0.5) * args.nll_window for i in range(len(r["excess_nll_windows"]))]
                ax.plot(x, r["excess_nll_windows"], marker="o", label=r["method"])
        ax.set(title=f"continuation {length}, N = {n}", xlabel="tokens into the continuation")
        ax.axhline(0.0, color="grey", linewidth=0.5)
    axes[0][0].set_ylabel("excess NLL per token (nats)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--continuation", type=int, nargs="+", default=[2048])
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument(
        "--skip", type=int, default=0, help="skip the SKIP longest documents (tune on others than you report)"
    )
    parser.add_argument("--fold-interval", type=int, default=256)
    parser.add_argument("--nll-window", type=int, default=256)
    parser.add_argument(
        "--decode-window",
        type=int,
        default=None,
        help="recent tokens protected at every fold (default: N // 4)",
    )
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=list(METHODS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(default_out("decode_nll")))
    parser.add_argument("--name", default="decode_nll")
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.out, args.methods, args.threads = str(_smoke.begin().out("decode_nll")), list(DEFAULT_METHODS), 1
        args.prompt, args.continuation, args.budgets, args.documents, args.skip = 32, [96], [48], 1, 0
        args.fold_interval, args.nll_window, args.decode_window = 16, 32, None
    command = shlex.join(
        ["python", "benchmarks/decode_nll.py", *(argv if argv is not None else sys.argv[1:])]
    )
    write(run(args), args, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
