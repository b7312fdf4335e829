"""Paired differences against a reference method, from `lukv bench` JSON files.

For every task, ratio and allocator of the files, the mean over samples of (method - reference) on the same
contexts, with its standard error (the samples are paired: every method saw the same contexts). Retrieval
and recall in points of accuracy (higher is better), continuation in nats/token (lower is better).

    python benchmarks/paired_table.py benchmarks/results/calibrated/grid_1000.json --reference global

``--smoke``: the table of a tiny ``lukv bench`` run on the stand-ins of ``benchmarks/_smoke.py`` (keydiff
under global and uniform), written in a temporary folder (``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import _smoke


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean and standard error of ``a[i] - b[i]``.

    >>> paired([1.0, 0.5, 1.0], [0.5, 0.5, 0.5])
    (0.3333333333333333, 0.16666666666666666)
    """
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    n = len(diffs)
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var / n)


def table(path: Path, reference: str, scorer: str | None = None) -> str:
    data = json.loads(path.read_text())
    rows = {(r["task"], r["allocator"], r["scorer"], r["ratio"]): r for r in data["results"]}
    lines = [
        f"### {path.name}: each allocator minus {reference}, paired over contexts (± SE)",
        "",
        "| task | ratio | allocator | difference | reference | allocator's mean |",
        "|---|---|---|---|---|---|",
    ]
    for (task, allocator, name, ratio), row in sorted(rows.items(), key=lambda kv: tuple(map(str, kv[0]))):
        if ratio is None or allocator == reference or (scorer is not None and name != scorer):
            continue
        ref = rows.get((task, reference, name, ratio))
        if ref is None:
            continue
        mean, sem = paired(row["per_sample"], ref["per_sample"])
        scale, unit = (100.0, " pts") if row["metric"] == "accuracy" else (1.0, "")
        ref_mean, own = ref["mean"] * scale, row["mean"] * scale
        lines.append(
            f"| {task} | {ratio:g} | {allocator}/{name} | {mean * scale:+.3g} ± {sem * scale:.2g}{unit} | "
            f"{ref_mean:.4g} | {own:.4g} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--reference", default="global")
    parser.add_argument("--scorer", default=None)
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        folder = _smoke.begin().out("bench")
        args.files = [_smoke.bench_results(folder, "paired", allocators=("global", "uniform"))]
        args.reference = "global"
    elif not args.files:
        parser.error("the following arguments are required: files")
    print("\n\n".join(table(path, args.reference, args.scorer) for path in args.files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
