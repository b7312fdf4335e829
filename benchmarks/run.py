"""The benchmark suite as a script; same flags as ``lukv bench`` (see ``--help``).

    python benchmarks/run.py                                   # the full grid (hours on 2 CPU threads)
    python benchmarks/run.py --tasks niah_multikey --samples 20 --ratios 0.5 0.8 \\
        --scorers keydiff --allocators uniform adakv pyramid profile

``--smoke``: the default tasks, one sample of 200 tokens, keydiff under uniform and the profile at 0.5,
on the stand-ins of ``benchmarks/_smoke.py`` (``benchmarks/smoke.py``); the other flags are ignored.
"""

from __future__ import annotations

import argparse
import sys

import _smoke

from lukv_cache.cli import add_bench_arguments
from lukv_cache.evaluation.cli import run_bench

SMOKE = ["--samples", "1", "--context-tokens", "200", "--ratios", "0.5", "--scorers", "keydiff"]
SMOKE += ["--allocators", "uniform", "profile", "--needles", "2", "--continuation-tokens", "8"]
SMOKE += ["--kv-bits", "none", "4", "--threads", "1"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__.split("\n")[0])
    add_bench_arguments(parser)
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.smoke:
        argv = [*SMOKE, "--out", str(_smoke.begin().out("bench"))]
        args = parser.parse_args(argv)
    return run_bench(args, argv=["python benchmarks/run.py", *argv])


if __name__ == "__main__":
    sys.exit(main())
