"""``lukv ruler``'s tables from its results file: per length, one row per method with each task's mean ± SE
(over samples), the average over tasks ± SE (the tasks' SEs combined as independent), and the KV bytes the
method held after the context against the full cache's; written as JSON and markdown.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..tasks.statistics import mean_and_sem
from . import TASKS
from .leaderboard import plot_leaderboard


def _full_bytes(records: Sequence[dict[str, Any]]) -> dict[tuple[int, str, int], int]:
    """Each sample's full-cache bytes: the full method's, else the shared prefill's keys and values."""
    out: dict[tuple[int, str, int], int] = {}
    for r in records:
        sample = (int(r["length"]), r["task"], int(r["index"]))
        if r["method"] == "full":
            out[sample] = int(r["kv_bytes"])
        elif r.get("full_kv_bytes") is not None:
            out.setdefault(sample, int(r["full_kv_bytes"]))
    return out


def summarize(records: Sequence[dict[str, Any]], methods: Sequence[str] = ()) -> list[dict[str, Any]]:
    """One row per (length, method), ``methods`` first in their order: ``tasks`` (task -> mean, se, n),
    ``average`` and ``average_se`` over the tasks run, ``kv_bytes`` (mean) and ``kv_fraction`` (against the
    full cache's on the same samples; ``None`` when unknown)."""
    full = _full_bytes(records)
    groups: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(int(r["length"]), r["method"])].append(r)
    order = {name: i for i, name in enumerate(methods)}
    rows = []
    for (length, method), rs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], len(order)), kv[0][1])
    ):
        by_task: dict[str, list[float]] = defaultdict(list)
        for r in rs:
            by_task[r["task"]].append(float(r["score"]))
        tasks = {}
        for task in sorted(by_task, key=lambda t: TASKS.index(t) if t in TASKS else len(TASKS)):
            mean, se = mean_and_sem(by_task[task])
            tasks[task] = {"mean": mean, "se": se, "n": len(by_task[task])}
        average = sum(t["mean"] for t in tasks.values()) / len(tasks)
        average_se = math.sqrt(sum(t["se"] ** 2 for t in tasks.values())) / len(tasks)
        held = [int(r["kv_bytes"]) for r in rs]
        fulls = [full.get((length, r["task"], int(r["index"]))) for r in rs]
        fraction = sum(held) / sum(f for f in fulls if f) if fulls and all(fulls) else None
        rows.append(
            {
                "length": length, "method": method, "tasks": tasks, "average": average, "average_se": average_se,
                "kv_bytes": sum(held) / len(held), "kv_fraction": fraction,
            }
        )  # fmt: skip
    return rows


def format_markdown(rows: Sequence[dict[str, Any]], header: str = "") -> str:
    """The tables, one per length (scores x100, ± the standard error over samples; n: samples; an average
    over fewer tasks than the table's names how many)."""
    lines = [header] if header else []
    for length in sorted({r["length"] for r in rows}):
        at = [r for r in rows if r["length"] == length]
        tasks = [t for t in TASKS if any(t in r["tasks"] for r in at)]
        lines += [
            "",
            f"### RULER at {length} tokens",
            "",
            "| method | KV held / full | average | " + " | ".join(tasks) + " |",
            "|---|---:|---:|" + "---:|" * len(tasks),
        ]
        for r in at:
            cells = []
            for t in tasks:
                c = r["tasks"].get(t)
                cells.append(f"{c['mean']:.1f} ± {c['se']:.1f} (n={c['n']})" if c else "")
            kv = f"{r['kv_fraction']:.3f}" if r["kv_fraction"] is not None else "n/a"
            # a method not run on every task of the table yet: its average is over fewer tasks, and says so
            some = f" ({len(r['tasks'])} of {len(tasks)} tasks)" if len(r["tasks"]) < len(tasks) else ""
            lines.append(
                f"| {r['method']} | {kv} | {r['average']:.1f} ± {r['average_se']:.1f}{some} | "
                + " | ".join(cells)
                + " |"
            )
    return "\n".join(lines) + "\n"


def write_report(
    rows: Sequence[dict[str, Any]], out: Path, stem: str, meta: dict[str, Any]
) -> dict[str, Path]:
    """``<out>/<stem>.json`` (meta and rows), ``<out>/<stem>.md`` and, with matplotlib, the leaderboard's
    picture per length (``<out>/<stem>_<length>.png``); returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps({**meta, "rows": list(rows)}, indent=1) + "\n", encoding="utf-8")
    header = f"## RULER: {meta.get('model')}\n\nCommand: `{meta.get('command')}`"
    if meta.get("skipped"):
        header += "\n\nSkipped: " + "; ".join(f"{k} ({v})" for k, v in meta["skipped"].items())
    paths["md"].write_text(format_markdown(rows, header), encoding="utf-8")
    for picture in plot_leaderboard(rows, out / f"{stem}.png", str(meta.get("model") or "")):
        paths[picture.stem] = picture
    return paths
