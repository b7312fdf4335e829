"""The tuning runs: the benchmark's tasks on NEWS-article texts, where settings are chosen.

The reported benchmark (``lukv bench``) uses Wikipedia articles; choosing settings on the same texts would
tune to the report. These runs use gensim's 300 news articles instead (grouped, consecutive ones, into
longer documents), another seed, and the same task code. Results go to ``--out`` (default
``<lukv cache>/bench/tuning``, outside the repository; the cited runs: ``--out benchmarks/results/tuning``).

    python benchmarks/tuning.py --tasks niah_multikey --scorers kvzip --allocators global adakv \\
        --ratios 0.5 0.8 0.9 --samples 8 --name mk_kvzip

``--smoke``: multikey retrieval, one sample of 200 tokens, keydiff and ``kvzip_w1`` under ``global`` and
``calibrated_b50`` at 0.8, on the stand-ins of ``benchmarks/_smoke.py``, written in a temporary folder
(``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import functools
import sys

import _smoke
import torch
from _out import default_out

from lukv_cache.allocation import ALLOCATORS, register_allocator
from lukv_cache.evaluation.report import command_line, write_results
from lukv_cache.evaluation.runner import BenchSettings, run_benchmark
from lukv_cache.models import load_model
from lukv_cache.scorers import SCORERS, kvzip_scorer
from lukv_cache.texts import Article, news_articles

# the variants compared while tuning KVzip (the registered kvzip has window 32 since)
VARIANTS = {
    "kvzip_w1": kvzip_scorer(window=1, name="kvzip_w1"),
    "kvzip_plain": kvzip_scorer(template="plain", window=1, name="kvzip_plain"),
    "kvzip_plus_w1": kvzip_scorer(weighted=True, window=1, name="kvzip_plus_w1"),
}

# the allocator settings compared while tuning the calibrated allocator (issue 34): name -> (base, kwargs)
ALLOCATOR_VARIANTS = {
    "calibrated_f25": ("calibrated", {"floor": 0.25}),
    "calibrated_b25": ("calibrated", {"blend": 0.25}),
    "calibrated_b50": ("calibrated", {"blend": 0.5}),
    "calibrated_b75": ("calibrated", {"blend": 0.75}),
    "calibrated_b100": ("calibrated", {"blend": 1.0}),
    "calibrated_f50": ("calibrated", {"floor": 0.5}),
    "hybrid_global_f0": ("hybrid_global", {"floor": 0.0}),
    "hybrid_global_f25": ("hybrid_global", {"floor": 0.25}),
}


def register_variants() -> None:
    """Register :data:`VARIANTS` and :data:`ALLOCATOR_VARIANTS` under their names (for this process)."""
    for name, scorer in VARIANTS.items():
        SCORERS.add(name, scorer, overwrite=True)
    for name, (base, kwargs) in ALLOCATOR_VARIANTS.items():
        entry = ALLOCATORS.get(base)
        register_allocator(
            name,
            functools.partial(entry.factory, **kwargs),
            whole_model=entry.whole_model,
            adaptive=entry.adaptive,
            reads_profile=entry.reads_profile,
            overwrite=True,
        )


def news_documents(group: int) -> list[Article]:
    news = news_articles()
    return [
        Article(f"news-{i}", "\n\n".join(a.text for a in news[i : i + group]))
        for i in range(0, len(news), group)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["niah_multikey"])
    parser.add_argument("--scorers", nargs="+", default=["kvzip"])
    parser.add_argument("--allocators", nargs="+", default=["global"])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.8, 0.9])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=101)
    parser.add_argument(
        "--news-group", type=int, default=6, help="news articles per document (14 for continuation)"
    )
    parser.add_argument("--profiles", help="a folder of profiles searched first")
    parser.add_argument("--context-tokens", type=int, default=1000)
    parser.add_argument("--name")
    parser.add_argument(
        "--out", default=str(default_out("tuning")), help="output folder (default: %(default)s)"
    )
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args(argv)
    out = args.out
    if args.smoke:
        out = _smoke.begin().out("tuning")
        args.tasks, args.samples, args.context_tokens, args.ratios = ["niah_multikey"], 1, 200, [0.8]
        args.scorers, args.allocators = ["keydiff", "kvzip_w1"], ["global", "calibrated_b50"]
        args.name = "smoke"
    elif args.name is None:
        parser.error("the following arguments are required: --name")
    register_variants()
    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2")
    settings = BenchSettings(
        tasks=tuple(args.tasks),
        samples=args.samples,
        context_tokens=args.context_tokens,
        ratios=tuple(args.ratios),
        scorers=tuple(args.scorers),
        allocators=tuple(args.allocators),
        seed=args.seed,
        profiles_dir=args.profiles,
    )
    results = run_benchmark(
        model,
        tokenizer,
        settings,
        articles=news_documents(args.news_group),
        log=lambda m: print(m, flush=True),
    )
    results.command = command_line(
        ["python benchmarks/tuning.py", *(argv if argv is not None else sys.argv[1:])]
    )
    paths = write_results(results, out, args.name)
    print(paths["md"].read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
