"""``lukv ruler``'s picture, in the form of kvpress's leaderboard: the average RULER score against the
compression ratio, one line per method (``allocator/scorer``, ``kvpress:<press>``, each quantized variant
its own line), the full cache a dashed line across. A memory budget (``@mem0.1``) is a point at the ratio
its bytes amount to (1 minus the bytes it held over the full cache's): it chooses its tokens and bits, so it
has no ratio of its own. Needs matplotlib (``pip install -e ".[plots]"``); without it the tables are
written and the picture is skipped with one line saying so.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_RATIO = re.compile(r"^(?P<family>.+)@(?P<ratio>[0-9.]+)(?P<bits>/int\d+)?$")
_MEMORY = re.compile(r"^(?P<family>.+)@mem(?P<memory>[0-9.]+)$")


def curves(rows: Sequence[dict[str, Any]], length: int) -> dict[str, list[tuple[float, float, float]]]:
    """Method family -> its points ``(ratio, average, se)`` at ``length``, by ratio; a memory budget's
    family is ``<family> memory=<f>`` at the ratio its bytes amount to; the full cache is ``full`` at 0.

    >>> rows = [{"length": 4, "method": m, "average": a, "average_se": 1.0, "kv_fraction": f}
    ...         for m, a, f in [("full", 90, 1.0), ("global/kvzap@0.8", 80, 0.21), ("global/kvzap@0.5", 88, 0.5),
    ...                         ("global/kvzap@mem0.1", 85, 0.09)]]
    >>> sorted(curves(rows, 4).items())  # doctest: +NORMALIZE_WHITESPACE
    [('full', [(0.0, 90, 1.0)]), ('global/kvzap', [(0.5, 88, 1.0), (0.8, 80, 1.0)]),
     ('global/kvzap memory=0.1', [(0.91, 85, 1.0)])]
    """
    out: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for row in rows:
        if row["length"] != length:
            continue
        method, point = row["method"], (row["average"], row["average_se"])
        ratio_match, memory_match = _RATIO.match(method), _MEMORY.match(method)
        if method.endswith("full"):
            out[method].append((0.0, *point))
        elif ratio_match:
            family = ratio_match["family"] + (ratio_match["bits"] or "")
            out[family].append((float(ratio_match["ratio"]), *point))
        elif memory_match and row.get("kv_fraction") is not None:
            family = f"{memory_match['family']} memory={memory_match['memory']}"
            out[family].append((round(1.0 - float(row["kv_fraction"]), 4), *point))
    return {family: sorted(points) for family, points in out.items()}


def plot_leaderboard(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> list[Path]:
    """One picture per length, ``<path stem>_<length>.png`` (score against ratio); returns the files
    written, none when matplotlib is missing (a line says so)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('no RULER picture: it needs matplotlib (pip install -e ".[plots]")', flush=True)
        return []
    written = []
    for length in sorted({row["length"] for row in rows}):
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for family, points in sorted(curves(rows, length).items()):
            xs, ys, ses = zip(*points)
            if family.endswith("full"):
                ax.axhline(ys[0], linestyle="--", color="black" if family == "full" else "grey", label=family)
            elif "memory=" in family:
                ax.errorbar(xs, ys, yerr=ses, marker="*", markersize=12, linestyle="none", label=family)
            else:
                dashed = family.startswith("kvpress:")
                ax.errorbar(xs, ys, yerr=ses, marker="o", linestyle=":" if dashed else "-", label=family)
        ax.set_xlabel("compression ratio (fraction of the KV cache evicted)")
        ax.set_ylabel("RULER average score")
        ax.set_title(f"{title} RULER-{length}".strip())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
        fig.tight_layout()
        target = path.with_name(f"{path.stem}_{length}.png")
        fig.savefig(target, dpi=110)
        plt.close(fig)
        written.append(target)
    return written
