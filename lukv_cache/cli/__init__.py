"""The ``lukv`` command line.

Every command's flags are declared in this package with argparse alone, so ``lukv --help`` and ``lukv
<command> --help`` answer without importing torch or transformers (``tests/test_cli_startup.py`` checks it).
The work of each command lives in its area's ``cli`` module (:mod:`lukv_cache.profiles.cli`,
:mod:`lukv_cache.profiling.cli`, :mod:`lukv_cache.evaluation.cli`), imported only when the command runs;
commands return an exit code and let :class:`~lukv_cache.errors.LUKVError` propagate (printed as one
``error:`` line, exit code 2).

One job per module: :mod:`.declare` (how a command is declared: the help formatter, the subparser, the
work imported when it runs), :mod:`.profiles_commands` (``pull``, ``push``, ``list``, ``convert``),
:mod:`.profiling_commands` (``build``, ``memory-table``, ``show``), :mod:`.evaluation_commands` (``demo``,
``bench``, ``ruler``, ``check``) and :mod:`.prechecks` (arguments refused before torch is imported); here,
:func:`build_parser` and :func:`main`.

>>> build_parser().parse_args(["pull", "org/model"]).scorer
'keydiff'
"""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from ..errors import LUKVError
from .declare import HelpFormatter
from .evaluation_commands import add_bench_arguments, evaluation_commands
from .profiles_commands import profiles_commands
from .profiling_commands import profiling_commands

__all__ = ["add_bench_arguments", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``lukv`` parser with every command; imports nothing heavy."""
    parser = argparse.ArgumentParser(
        prog="lukv",
        description="LU-KV per-head KV-cache eviction: profiles, profiling, evaluation.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"lukv {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    profiles_commands(subparsers)
    profiling_commands(subparsers)
    evaluation_commands(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 1
    try:
        return int(args.func(args) or 0)
    except LUKVError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a path the user gave that cannot be read or written (plots, outputs)
        where = f" {err.filename!r}" if getattr(err, "filename", None) else ""
        print(f"error: cannot use{where}: {err.strerror or err}. Check the path.", file=sys.stderr)
        return 2
