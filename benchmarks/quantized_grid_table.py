"""The equal-bytes table of the quantized store's grid: every method of the ``lukv bench`` runs that
``benchmarks/results/quantized/grid.sh`` wrote for one context length, sorted by the bytes it holds.

Each row: the method (``allocator/scorer@ratio[/intN]``, or ``allocator/scorer@memF`` for a ``lukv bench
--memory F`` budget, with the bits it chose), its bytes after the prefill as a share of the full
fp32 cache's (the mean over the multikey contexts, ``kv_bytes_mean``), multikey retrieval (% ± SE over
contexts) and continuation excess NLL against the full cache (nats/token ± SE, paired per document). Every
run has seed 0, so every run has the same samples and its own full-cache row; the share and the excess
are taken against the run's own full cache.

    python benchmarks/quantized_grid_table.py 1000 > benchmarks/results/quantized/equal_bytes_1000.md
    python benchmarks/quantized_grid_table.py 1000 --results benchmarks/results/quantized_qwen > ...

``--results``: another folder of such runs (another model's grid).

``--smoke``: the table of two tiny ``lukv bench`` runs on the stand-ins of ``benchmarks/_smoke.py`` (full
precision and 4 bits), written in a temporary folder instead of ``results/quantized`` (``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import _smoke

RESULTS = Path(__file__).resolve().parent / "results" / "quantized"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tokens", nargs="?", default="1000", help="the runs' context tokens (1000)")
    parser.add_argument(
        "--results",
        type=Path,
        default=RESULTS,
        help="the folder of the grid's runs (benchmarks/results/quantized)",
    )
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    tokens, results = args.tokens, args.results
    if args.smoke:
        tokens, results = "200", _smoke.begin().out("quantized")
        for name, bits in (("full", None), ("int4", 4)):
            _smoke.bench_results(results, f"grid_{tokens}_{name}", kv_bits=(bits,), samples=1)
    rows = {}
    commands = []
    for index, path in enumerate(sorted(results.glob(f"grid_{tokens}_*.json"))):
        data = json.loads(path.read_text())
        commands.append(data["command"])
        by = {(r["task"], r["method"]): r for r in data["results"]}
        full_bytes = by[("niah_multikey", "full")]["kv_bytes_mean"]
        for (task, method), r in by.items():
            if method == "full" and index:  # the full cache's row: from the first run
                continue
            row = rows.setdefault(method, {})
            if task == "niah_multikey":
                if r.get("memory_choice"):  # a budget: the bits it chose on the multikey contexts
                    row["chosen"] = _bits(r["memory_choice"]["kv_bits"])
                row["bytes"] = r["kv_bytes_mean"] / full_bytes
                row["keys"] = (100 * r["mean"], 100 * r["sem"])
            elif "excess_nll" in r:
                row["nll"] = (r["excess_nll"]["mean"], r["excess_nll"]["sem"])
            elif method == "full":
                row["nll"] = (0.0, 0.0)
    print(f"# Equal bytes: the quantized store's grid at ~{tokens} context tokens\n")
    where = "" if results == RESULTS or args.smoke else f" --results {_shown(results)}"
    print(f"Made by `python benchmarks/quantized_grid_table.py {tokens}{where}` from the runs of:\n")
    for command in commands:
        print(f"* `{command}`")
    print("\n| method | bytes of the full fp32 cache | multikey retrieval % ± SE | excess NLL ± SE |")
    print("|---|---:|---:|---:|")
    for method, row in sorted(rows.items(), key=lambda item: -item[1].get("bytes", 0)):
        keys = row.get("keys", (float("nan"), 0.0))
        nll = row.get("nll", (float("nan"), 0.0))
        name = f"{method} ({row['chosen']})" if "chosen" in row else method
        print(
            f"| {name} | {100 * row.get('bytes', float('nan')):.1f}% | {keys[0]:.1f} ± {keys[1]:.1f} | "
            f"{nll[0]:+.3f} ± {nll[1]:.3f} |"
        )
    return 0


def _bits(bits: object) -> str:
    """A ``memory_choice``'s ``kv_bits``: ``int8``, ``fp`` (the model's precision), or ``int8 x3, int4 x1``."""
    if isinstance(bits, dict):
        return ", ".join(f"{_bits(None if k == 'none' else int(k))} x{n}" for k, n in bits.items())
    return "fp" if bits is None else f"int{bits}"


def _shown(path: Path) -> str:
    """``path`` as the command line gave it from the repository root, when it lies inside it."""
    root = Path(__file__).resolve().parents[1]
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    raise SystemExit(main())
