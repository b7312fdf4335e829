"""Benchmark results as tables, plots and JSON: means, standard errors, and LU-KV's share of the gap.

>>> from lukv_cache.evaluation.report import write_results
>>> paths = write_results(results, "benchmarks/results", "multikey_1k")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from .methods import FULL
from .runner import BenchResults
from .tasks.samples import ACCURACY_TASKS
from .tasks.statistics import mean_and_sem


def _is_retrieval(task: str) -> bool:
    return task in ACCURACY_TASKS


def summarize(results: BenchResults) -> list[dict[str, Any]]:
    """One row per (task, method): mean, standard error, 95% CI (normal approximation), sample counts,
    KV bytes and kept fraction; for continuation also the excess NLL over the full cache (paired).

    >>> rows = summarize(results)  # doctest: +SKIP
    """
    rows = []
    for (task, _name), record in results.results.items():
        full = results.results.get((task, FULL))
        mean, sem = mean_and_sem(record.scores)
        row: dict[str, Any] = {
            "task": task,
            "method": record.method.name,
            "allocator": record.method.allocator,
            "scorer": record.method.scorer,
            "ratio": record.method.ratio,
            "metric": "accuracy" if _is_retrieval(task) else "nll",
            "n_samples": len(record.scores),
            "n_questions": sum(len(q) for q in record.question_scores) or len(record.scores),
            "mean": mean,
            "sem": sem,
            "ci95": [mean - 1.96 * sem, mean + 1.96 * sem],
            "kv_bytes_mean": sum(record.kv_bytes) / max(1, len(record.kv_bytes)),
            "kept_fraction_mean": sum(record.kept_fraction) / max(1, len(record.kept_fraction)),
            "seconds": record.seconds,
            "per_sample": record.scores,
        }
        if full is not None and len(full.kv_bytes) == len(record.kv_bytes) and record.kv_bytes:
            # paired per sample: what this method holds of what the full cache holds for the same context
            shares = [held / max(1, whole) for held, whole in zip(record.kv_bytes, full.kv_bytes)]
            row["kv_bytes_of_full"] = sum(shares) / len(shares)
            row["kv_bytes_of_full_max"] = max(shares)
        if record.method.memory is not None:
            row["memory"] = record.method.memory
            row["memory_choice"] = memory_summary(record.memory_choices)
        if not _is_retrieval(task) and full is not None and len(full.scores) == len(record.scores):
            excess = [a - b for a, b in zip(record.scores, full.scores)]
            e_mean, e_sem = mean_and_sem(excess)
            row["excess_nll"] = {
                "mean": e_mean,
                "sem": e_sem,
                "ci95": [e_mean - 1.96 * e_sem, e_mean + 1.96 * e_sem],
            }
        rows.append(row)
    return rows


def memory_summary(choices: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What a memory budget chose over the samples (each a ``MemoryChoice.to_json()``): ``kv_bits`` (one
    value when every sample chose the same, else ``{"none" | "8" | "4": samples}``), the mean fraction of
    the prompt's tokens its bytes hold at the chosen bits (``kept``), the mean budget in bytes per row, and
    how the bits were chosen (``by``: ``"table"``, ``"rule"``, or both ``"table/rule"``).

    >>> c = {"kv_bits": 8, "budget": 100, "length": 10, "kept": {"none": 0.1, "8": 0.3, "4": 0.5}, "by": "rule"}
    >>> memory_summary([c, c | {"kv_bits": 4, "budget": 200}])
    {'kv_bits': {'8': 1, '4': 1}, 'kept': 0.4, 'budget_bytes_mean': 150.0, 'by': 'rule'}
    >>> memory_summary([c])["kv_bits"]
    8
    """
    if not choices:
        return {}
    bits = [c["kv_bits"] for c in choices]
    counts: dict[str, int] = {}
    for b in bits:
        key = _bits_key(b)
        counts[key] = counts.get(key, 0) + 1
    kept = [
        c["mixed_kept"] if isinstance(c["kv_bits"], list) else c["kept"][_bits_key(c["kv_bits"])]
        for c in choices
    ]
    return {
        "kv_bits": bits[0] if len(counts) == 1 and not isinstance(bits[0], list) else counts,
        "kept": sum(kept) / len(kept),
        "budget_bytes_mean": sum(c["budget"] for c in choices) / len(choices),
        "by": "/".join(sorted({c["by"] for c in choices})),
    }


def _bits_key(bits: Any) -> str:
    """A choice's ``kv_bits`` as a key: ``"none"``, ``"8"``, ``"4"``, or for per-layer widths ``"8 in 4/24
    layers"`` (how many layers keep 8 bits, the rest 4).

    >>> _bits_key(None), _bits_key(8), _bits_key([8, 4, 4, 8])
    ('none', '8', '8 in 2/4 layers')
    """
    if isinstance(bits, list):
        return f"8 in {sum(b == 8 for b in bits)}/{len(bits)} layers"
    return "none" if bits is None else str(bits)


def bits_text(bits: Any) -> str:
    """A :func:`memory_summary` ``kv_bits`` in words: ``int8``, ``model precision``, ``int8 x3, int4 x1``,
    ``int8 in 2/4 layers, int4 elsewhere x1``.

    >>> bits_text(8), bits_text(None), bits_text({"8": 3, "4": 1})
    ('int8', 'model precision', 'int8 x3, int4 x1')
    >>> bits_text({"8 in 2/4 layers": 1})
    'int8 in 2/4 layers, int4 elsewhere x1'
    """
    if isinstance(bits, dict):
        return ", ".join(
            f"{bits_text(k if ' ' in k else None if k == 'none' else int(k))} x{n}" for k, n in bits.items()
        )
    if isinstance(bits, str):
        return f"int{bits}, int4 elsewhere"
    return "model precision" if bits is None else f"int{bits}"


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "–"
    if row["metric"] == "accuracy":
        return f"{100 * row['mean']:.1f} ± {100 * row['sem']:.1f}"
    if "excess_nll" in row:
        return f"{row['excess_nll']['mean']:+.3f} ± {row['excess_nll']['sem']:.3f}"
    return f"{row['mean']:.3f} ± {row['sem']:.3f}"


def _recovery(rows: dict[str, dict[str, Any]], scorer: str, ratio: float, retrieval: bool) -> str:
    """LU-KV's share of the gap between uniform and the full cache: (profile - uniform) / (full - uniform)."""
    full, uniform = rows.get(FULL), rows.get(f"uniform/{scorer}@{ratio:g}")
    lukv = rows.get(f"profile/{scorer}@{ratio:g}")
    if full is None or uniform is None or lukv is None:
        return "–"
    gap = full["mean"] - uniform["mean"]
    if abs(gap) < 1e-9:
        return "no gap"
    return f"{100 * (lukv['mean'] - uniform['mean']) / gap:.0f}%"


def format_markdown(results: BenchResults, rows: list[dict[str, Any]] | None = None) -> str:
    """The results as markdown: the exact command, settings, then one table per task (rows: methods,
    columns: ratios) with ± one standard error, and the share of the uniform-to-full gap LU-KV recovers.

    >>> print(format_markdown(results))  # doctest: +SKIP
    """
    rows = rows if rows is not None else summarize(results)
    s = results.settings
    lines = [
        "# lukv_cache benchmark",
        "",
        f"Command: `{results.command}`" if results.command else "",
        "",
        f"* Model: {results.model_info.get('model_id', '?')} ({results.model_info.get('source', '')})",
        f"* Started {results.started_utc}, {results.seconds / 60:.1f} min on {torch.get_num_threads()} CPU "
        f"thread(s), torch {torch.__version__}",
        f"* {s.samples} samples per task, ~{s.context_tokens} context tokens, seed {s.seed}, "
        f"{s.needles} needles; shared prefill: {s.share_prefill}",
        "* Retrieval cells: accuracy % ± one standard error over contexts (all questions of a context share "
        "its prefill; the SE treats contexts as the unit). Continuation cells: excess NLL (nats/token) over "
        "the full cache, paired per document, ± SE. 95% CI ≈ ± 1.96 SE (in the JSON).",
        "* `ratio` = fraction of the context's KV entries removed (0.8 keeps 20%).",
    ]
    if getattr(s, "memory", ()):
        lines.append(
            "* `memory` = a budget (`LUKVCache(memory=...)`): what the cache may hold after the context, as a "
            "fraction of the full cache's bytes; it chooses the bits and the tokens kept (docs/memory.md). Its "
            "table says what it chose: the bits (per context, when they differ), the share of the context's "
            "tokens stored per head, and the bytes held as a share of the full cache's for the same context "
            "(mean, and the largest)."
        )
    for name, reason in results.skipped.items():
        lines.append(f"* Skipped {name}: {reason}")
    for task in s.tasks:
        task_rows = {r["method"]: r for r in rows if r["task"] == task}
        if not task_rows:
            continue
        tokens = results.context_tokens.get(task, [])
        n_q = task_rows[next(iter(task_rows))]["n_questions"]
        span = f"{min(tokens, default=0)}-{max(tokens, default=0)} tokens"
        lines += ["", f"## {task}", ""]
        if _is_retrieval(task):
            lines.append(f"{len(tokens)} contexts ({span}), {n_q} questions per method.")
        else:
            lines.append(
                f"{len(tokens)} documents, {span} compressed, {s.continuation_tokens} tokens teacher-forced."
            )
        if FULL in task_rows:
            lines.append(
                f"Full cache: {_cell(task_rows[FULL]) if _is_retrieval(task) else _full_nll(task_rows)}."
            )
        ratios = list(s.ratios)
        if ratios:
            # one row per kv_bits too when the run had several (`--kv-bits none 8 4`)
            widths = list(dict.fromkeys(getattr(s, "kv_bits", None) or (None,)))
            bits_column = len(widths) > 1
            lines += [
                "",
                "| allocator | scorer | "
                + ("bits | " if bits_column else "")
                + " | ".join(f"ratio {r:g}" for r in ratios)
                + " |",
                "|---|---|" + ("---|" if bits_column else "") + "---|" * len(ratios),
            ]
            for allocator in s.allocators:
                for scorer in s.scorers:
                    for bits in widths:
                        suffix = "" if bits is None else f"/int{bits}"
                        cells = [_cell(task_rows.get(f"{allocator}/{scorer}@{r:g}{suffix}")) for r in ratios]
                        label = ("model | " if bits is None else f"int{bits} | ") if bits_column else ""
                        lines.append(f"| {allocator} | {scorer} | {label}" + " | ".join(cells) + " |")
        lines += _memory_table(s, task_rows, _is_retrieval(task))
        kept = [
            f"{r:g}: {100 * task_rows[m]['kept_fraction_mean']:.1f}%"
            for r in ratios
            for m in [f"uniform/{s.scorers[0]}@{r:g}"]
            if m in task_rows
        ]
        if kept:
            lines += ["", "Mean share of context tokens stored per head (uniform): " + ", ".join(kept) + "."]
        if "profile" in s.allocators and ratios:
            lines += [
                "",
                "LU-KV (profile) recovery of the uniform→full gap:",
                "",
                "| scorer | " + " | ".join(f"ratio {r:g}" for r in ratios) + " |",
                "|---|" + "---|" * len(ratios),
            ]
            for scorer in s.scorers:
                cells = [_recovery(task_rows, scorer, r, _is_retrieval(task)) for r in ratios]
                lines.append(f"| {scorer} | " + " | ".join(cells) + " |")
    return "\n".join(line for line in lines) + "\n"


def _memory_table(s: Any, task_rows: dict[str, dict[str, Any]], retrieval: bool) -> list[str]:
    """The memory budgets' rows of one task: score, chosen bits, tokens kept, bytes of the full cache's."""
    budgets = list(getattr(s, "memory", ()))
    if not budgets:
        return []
    score = "accuracy %" if retrieval else "excess NLL"
    lines = [
        "",
        f"| allocator | scorer | memory | {score} | bits chosen | tokens kept | bytes of the full cache's |",
        "|---|---|---|---|---|---|---|",
    ]
    for allocator in s.allocators:
        for scorer in s.scorers:
            for memory in budgets:
                row = task_rows.get(f"{allocator}/{scorer}@mem{memory:g}")
                if row is None:
                    continue
                choice = row.get("memory_choice") or {}
                held = (
                    f"{100 * row['kv_bytes_of_full']:.2f}% (max {100 * row['kv_bytes_of_full_max']:.2f}%)"
                    if "kv_bytes_of_full" in row
                    else f"{row['kv_bytes_mean']:.0f} B (no full cache run)"
                )
                lines.append(
                    f"| {allocator} | {scorer} | {memory:g} | {_cell(row)} | "
                    f"{bits_text(choice['kv_bits']) if choice else '–'} | "
                    f"{100 * row['kept_fraction_mean']:.1f}% | {held} |"
                )
    return lines


def _full_nll(task_rows: dict[str, dict[str, Any]]) -> str:
    full = task_rows[FULL]
    return f"NLL {full['mean']:.3f} ± {full['sem']:.3f} nats/token"


def plot_results(
    results: BenchResults, path: str | os.PathLike[str], rows: list[dict[str, Any]] | None = None
) -> Path:
    """Accuracy (or excess NLL) vs ratio (vs the memory budget in a run of budgets alone), one panel per (task, scorer), one line per allocator; the full
    cache as a dashed line. Returns the PNG path.

    >>> plot_results(results, "bench.png")  # doctest: +SKIP
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rows if rows is not None else summarize(results)
    s = results.settings
    tasks = [t for t in s.tasks if any(r["task"] == t for r in rows)]
    # x: the ratios; a run of memory budgets alone (no ratios): the budgets
    by_memory = not s.ratios and bool(getattr(s, "memory", ()))
    xs = sorted(s.memory if by_memory else s.ratios)
    at = "@mem" if by_memory else "@"
    fig, axes = plt.subplots(
        len(tasks), len(s.scorers), figsize=(4 * len(s.scorers), 3.2 * len(tasks)), squeeze=False
    )
    for i, task in enumerate(tasks):
        task_rows = {r["method"]: r for r in rows if r["task"] == task}
        retrieval = _is_retrieval(task)

        def value(row: dict[str, Any], retrieval: bool = retrieval) -> tuple[float, float]:
            if retrieval:
                return 100 * row["mean"], 100 * 1.96 * row["sem"]
            e = row.get("excess_nll", {"mean": row["mean"], "sem": row["sem"]})
            return e["mean"], 1.96 * e["sem"]

        for j, scorer in enumerate(s.scorers):
            ax = axes[i][j]
            for allocator in s.allocators:
                found = [(x, task_rows.get(f"{allocator}/{scorer}{at}{x:g}")) for x in xs]
                points = [(r, value(row)) for r, row in found if row is not None]
                if points:
                    ax.errorbar(
                        [p[0] for p in points],
                        [p[1][0] for p in points],
                        yerr=[p[1][1] for p in points],
                        marker="o",
                        capsize=3,
                        label=allocator,
                    )
            if FULL in task_rows:
                ax.axhline(value(task_rows[FULL])[0], color="black", linestyle="--", label="full")
            ax.set_title(f"{task} / {scorer}", fontsize=9)
            ax.set_xlabel(
                "memory budget (fraction of the full cache's bytes)"
                if by_memory
                else "ratio (fraction evicted)"
            )
            ax.set_ylabel("accuracy %" if retrieval else "excess NLL (nats/token)")
            ax.grid(alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def to_json(results: BenchResults, rows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Everything needed to re-read the run: command, settings, model, per-row statistics, per-sample scores.

    >>> json.dumps(to_json(results))  # doctest: +SKIP
    """
    rows = rows if rows is not None else summarize(results)
    return {
        "command": results.command,
        "started_utc": results.started_utc,
        "seconds": results.seconds,
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "model": results.model_info,
        "settings": asdict(results.settings) | {"tasks": list(results.settings.tasks)},
        "context_tokens": results.context_tokens,
        "prefill_seconds": results.prefill_seconds,
        "skipped": results.skipped,
        "results": rows,
        "outputs": {f"{t}|{m}": r.outputs for (t, m), r in results.results.items() if _is_retrieval(t)},
    }


def write_results(
    results: BenchResults, out_dir: str | os.PathLike[str], name: str | None = None
) -> dict[str, Path]:
    """Write ``<name>.md``, ``<name>.json`` and ``<name>.png`` under ``out_dir``; return their paths.

    >>> paths = write_results(results, "benchmarks/results", "multikey_1k")  # doctest: +SKIP
    """
    s = results.settings
    name = name or f"{'-'.join(s.tasks)}_{s.context_tokens}tok_{s.samples}s"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(results)
    paths = {"md": out / f"{name}.md", "json": out / f"{name}.json", "png": out / f"{name}.png"}
    paths["md"].write_text(format_markdown(results, rows) + f"\nPlot: `{paths['png'].name}`\n")
    paths["json"].write_text(json.dumps(to_json(results, rows), indent=1, default=_json_default) + "\n")
    try:
        plot_results(results, paths["png"], rows)
    except ImportError:
        paths.pop("png")  # matplotlib is optional (the `plots` / `demo` extras)
    return paths


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed, for the results header."""
    argv = list(sys.argv if argv is None else argv)
    program = argv[0] if argv else "lukv"
    if " " not in program:  # an installed entry point: its name, not its path
        program = os.path.basename(program)
    return " ".join([program] + [_quote(a) for a in argv[1:]])


def _quote(arg: str) -> str:
    return arg if arg and all(c.isalnum() or c in "-_./=:,@" for c in arg) else json.dumps(arg)
