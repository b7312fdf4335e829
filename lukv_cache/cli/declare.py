"""How a ``lukv`` command is declared: its subparser, whose help shows every option's default, and its work,
imported only when it runs."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it (``default``) or there is
    none to show (a required option, a flag that is off, ``None``: the help says what then happens)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or action.required
            or "default" in text
            or default is None
            or default is False
            or default == argparse.SUPPRESS
        ):
            return text
        if isinstance(default, list | tuple):
            return f"{text} (default: {' '.join(map(str, default))})"
        return f"{text} (default: %(default)s)"


def lazy_command(
    module: str, function: str, precheck: Callable[[argparse.Namespace], None] | None = None
) -> Callable[[argparse.Namespace], int]:
    """The command ``module.function``, imported when it runs (the heavy imports live there); ``precheck``
    refuses bad arguments first, without torch or transformers, so a mistake costs no import."""

    def run(args: argparse.Namespace) -> int:
        if precheck is not None:
            precheck(args)
        return getattr(importlib.import_module(module), function)(args)

    run.__qualname__ = run.__name__ = f"{module}.{function}"
    return run


def add_command(
    subparsers: Any, name: str, help: str, description: str | None = None
) -> argparse.ArgumentParser:
    return subparsers.add_parser(
        name, help=help, description=description or help, formatter_class=HelpFormatter
    )
