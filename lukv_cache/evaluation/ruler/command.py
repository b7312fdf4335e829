"""``lukv ruler``: its flags read (methods as ``lukv bench`` reads them), the optional packages and the
lengths checked before the model loads, the run resumed from its results file, the tables printed and
written."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from ...models import check_positions, load_config, load_model
from ..cli import split_values
from ..methods import ALLOCATORS, RATIOS, SCORERS, build_methods, kv_bits_list, memory_list
from ..report import command_line
from . import TASKS
from .deps import check_dependencies


def methods_of(args: argparse.Namespace) -> list[Any]:
    """The grid the method flags name, with ``lukv bench``'s defaults."""
    memory = memory_list(split_values(args.memory) or [])
    ratios = split_values(args.ratios) or ([] if memory else [str(r) for r in RATIOS])
    return build_methods(
        split_values(args.allocators) or ALLOCATORS,
        split_values(args.scorers) or SCORERS,
        [float(r) for r in ratios],
        full=not args.no_full,
        kv_bits=kv_bits_list(split_values(args.kv_bits) or []),
        sliding=args.sliding,
        memory=memory,
    )


def run_command(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from .report import format_markdown, summarize, write_report
    from .run import RulerSettings, run_ruler
    from .store import Store

    tasks = list(dict.fromkeys(split_values(args.tasks) or TASKS))
    check_dependencies(tasks)
    methods = methods_of(args)
    config = load_config(args.model)
    for length in args.lengths:  # refused before the weights load, as `lukv bench` does
        check_positions(config, length, f"--lengths {length}", "pass a smaller --lengths")
    model, tokenizer = load_model(args.model, threads=args.threads, verbose=True)
    model_id = str(getattr(model.config, "name_or_path", "") or args.model)
    stem = args.name or "ruler_" + re.sub(r"[^A-Za-z0-9._-]+", "_", Path(args.model).name or args.model)
    out = Path(args.out).expanduser()
    store = Store(out / f"{stem}.jsonl", {"model": model_id, "seed": args.seed})
    settings = RulerSettings(
        lengths=list(dict.fromkeys(args.lengths)),
        tasks=tasks,
        samples=args.samples,
        methods=methods,
        seed=args.seed,
        profiles_dir=args.profiles,
        hub=args.hub,
        share_prefill=not args.no_share_prefill,
    )
    skipped = run_ruler(model, tokenizer, settings, store, out / f"{stem}.samples", progress=not args.quiet)
    rows = summarize(store.records, [m.name for m in methods])
    meta = {"model": model_id, "seed": args.seed, "command": command_line(argv), "skipped": skipped}
    paths = write_report(rows, out, stem, meta)
    print(format_markdown(rows))
    print(f"results {store.path}; wrote " + ", ".join(str(p) for p in paths.values()), flush=True)
    return 0
