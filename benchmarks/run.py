"""The benchmark suite as a script; same flags as ``lukv bench`` (see ``--help``).

    python benchmarks/run.py                                   # the full grid (hours on 2 CPU threads)
    python benchmarks/run.py --tasks niah_multikey --samples 20 --ratios 0.5 0.8 \\
        --scorers keydiff --allocators uniform adakv pyramid profile
"""

from __future__ import annotations

import argparse
import sys

from lukv_cache.cli import add_bench_arguments
from lukv_cache.evaluation.cli import run_bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__.split("\n")[0])
    add_bench_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    return run_bench(parser.parse_args(argv), argv=["python benchmarks/run.py", *argv])


if __name__ == "__main__":
    sys.exit(main())
