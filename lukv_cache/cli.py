"""The ``lukv`` command line: each area adds its subcommands (profiles, profiling, demo)."""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import LUKVError

_COMMAND_MODULES = ("lukv_cache.profiles.cli", "lukv_cache.profiling.cli", "lukv_cache.evaluation.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lukv", description="LU-KV per-head KV-cache eviction: profiles, profiling, evaluation."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:  # a real missing dependency inside the module: surface it
                raise
            continue
        module.register(subparsers)
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


if __name__ == "__main__":
    sys.exit(main())
