"""``lukv demo``, ``lukv bench`` and ``lukv check``: the work behind the commands.

Their flags are declared in :mod:`lukv_cache.cli.evaluation_commands` (argparse alone, so ``--help`` stays
fast); it imports this module only when one of them runs. Commands return an exit code and let
:class:`~lukv_cache.errors.LUKVError` propagate (printed as one ``error:`` line, exit code 2).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..cache import check_ratio
from ..errors import ConfigurationError
from ..models import (
    PACKAGED_MODELS,
    SMOLLM2_ALIAS,
    load_config,
    load_model,
    load_tokenizer,
    packaged_provenance,
)


def split_values(values: list[str] | None) -> list[str] | None:
    """``--ratios 0.5 0.8`` and ``--ratios 0.5,0.8`` both work."""
    if values is None:
        return None
    return [part for value in values for part in value.split(",") if part]


def _demo(args: argparse.Namespace) -> int:
    from .demo import format_report, run_demo
    from .methods import check_bench_positions

    ratios = [check_ratio(r) for r in args.ratios]  # before the model loads: a bad argument fails at once
    if args.contexts < 1 or args.facts < 1:
        raise ConfigurationError("--contexts and --facts must be at least 1.")
    check_bench_positions(load_config(args.model), ["niah_multikey"], args.context_tokens, args.facts, 0)
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
    from .check.formatting import format_check
    from .check.inputs import check_options, encode_contexts, read_contexts
    from .check.run import check

    # everything that can be refused is refused before the model's weights load
    ratios = check_options(
        allocators=args.allocators,
        scorer=args.scorer,
        max_new_tokens=args.max_new_tokens,
        tolerance=args.tolerance,
        ratios=args.ratios,
        memory=args.memory or (),
        kv_bits=args.kv_bits,
    )
    contexts = read_contexts(args.calibration or (), args.text or (), args.questions, args.answers)
    encode_contexts(load_tokenizer(args.model), contexts, load_config(args.model), args.max_new_tokens)
    model, tokenizer = load_model(args.model, threads=args.threads, verbose=True)
    report = check(
        model,
        tokenizer,
        contexts,
        ratios=ratios if args.memory is None else None,
        memory=args.memory or (),
        allocators=args.allocators,
        scorer=args.scorer,
        max_new_tokens=args.max_new_tokens,
        tolerance=args.tolerance,
        profiles_dir=args.profiles,
        hub=args.hub,
        show_progress=not args.quiet,
        show_answers=args.show_answers,
        kv_bits=args.kv_bits,
    )
    print(format_check(report))
    return 0


def run_bench(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run the benchmark described by parsed ``args``; write markdown, JSON and a plot; print the table."""
    from .methods import (
        ALLOCATORS,
        DEFAULT_TASKS,
        RATIOS,
        SCORERS,
        check_bench_numbers,
        check_bench_positions,
        kv_bits_list,
        memory_list,
    )
    from .report import command_line, write_results
    from .runner import BenchSettings, run_benchmark

    check_bench_numbers(args.samples, args.context_tokens, args.needles, args.continuation_tokens, flags=True)
    memory = memory_list(split_values(getattr(args, "memory", None)) or [])
    # with budgets and no --ratios, only the budgets run (and the full cache)
    ratios = split_values(args.ratios) or ([] if memory else RATIOS)
    settings = BenchSettings(
        tasks=tuple(split_values(args.tasks) or DEFAULT_TASKS),
        samples=args.samples,
        context_tokens=args.context_tokens,
        ratios=tuple(float(r) for r in ratios),
        scorers=tuple(split_values(args.scorers) or SCORERS),
        allocators=tuple(split_values(args.allocators) or ALLOCATORS),
        full=not args.no_full,
        seed=args.seed,
        needles=args.needles,
        continuation_tokens=args.continuation_tokens,
        profiles_dir=args.profiles,
        hub=args.hub,
        share_prefill=not args.no_share_prefill,
        kv_bits=kv_bits_list(split_values(args.kv_bits) or []),
        sliding=args.sliding,
        split=args.split,
        memory=memory,
    )
    # a context the model has no positions for is refused before its weights load, as `lukv check` does
    check_bench_positions(
        load_config(args.model),
        settings.tasks,
        settings.context_tokens,
        settings.needles,
        settings.continuation_tokens,
    )
    model, tokenizer = load_model(args.model, threads=args.threads, verbose=True)
    info: dict[str, Any] = {"model_id": getattr(model.config, "name_or_path", args.model)}
    if args.model in PACKAGED_MODELS:
        info.update(packaged_provenance(args.model))
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
    print(f"wrote {', '.join(str(p) for p in paths.values())}", flush=True)
    return 0
