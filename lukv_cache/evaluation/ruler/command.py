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
        split=args.split,
    )


def _stem(args: argparse.Namespace) -> str:
    return args.name or "ruler_" + re.sub(r"[^A-Za-z0-9._-]+", "_", Path(args.model).name or args.model)


def _compared(head: dict[str, Any], files: list[str] | None) -> list[dict[str, Any]]:
    """The samples of the ``--compare`` files, each checked to be a run of the same model and seed."""
    from ...errors import ConfigurationError
    from .store import read_results

    records: list[dict[str, Any]] = []
    for file in files or ():
        other, samples = read_results(file)
        if {k: other.get(k) for k in ("model", "seed")} != {k: head.get(k) for k in ("model", "seed")}:
            raise ConfigurationError(
                f"--compare {file} holds a run of {other.get('model')!r} with seed {other.get('seed')!r}, not "
                f"{head.get('model')!r} with seed {head.get('seed')!r}: compare runs on the same samples."
            )
        records += samples
    return records


def _report(
    records: list[dict[str, Any]], methods: list[str], out: Path, stem: str, meta: dict[str, Any]
) -> None:
    from .report import format_markdown, summarize, write_report

    rows = summarize(records, methods)
    paths = write_report(rows, out, stem, meta)
    print(format_markdown(rows))
    print("wrote " + ", ".join(str(p) for p in paths.values()), flush=True)


def report_command(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """``lukv ruler --report``: the tables and the picture from the results file alone (no model, no run),
    over the first ``--samples`` samples of each task."""
    from .store import read_results

    out, stem = Path(args.out).expanduser(), _stem(args)
    head, records = read_results(out / f"{stem}.jsonl")
    first = [r for r in records + _compared(head, args.compare) if int(r["index"]) < args.samples]
    meta = {"model": head.get("model"), "seed": head.get("seed"), "command": command_line(argv)}
    _report(first, [], out, args.report_name or stem, meta)
    return 0


def run_command(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    if args.report:
        return report_command(args, argv)
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
    stem, out = _stem(args), Path(args.out).expanduser()
    store = Store(out / f"{stem}.jsonl", {"model": model_id, "seed": args.seed})
    compared = _compared({"model": model_id, "seed": args.seed}, args.compare)  # refused before the run
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
    meta = {"model": model_id, "seed": args.seed, "command": command_line(argv), "skipped": skipped}
    print(f"results {store.path}", flush=True)
    _report(store.records + compared, [m.name for m in methods], out, stem, meta)
    return 0
