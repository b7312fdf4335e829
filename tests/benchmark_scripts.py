"""The benchmark scripts, read as source: what tests/benchmarks checks them with (nothing is run)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def module(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported (only the standard-library ones: ``smoke``, ``_out``)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


SCRIPTS = module("smoke").scripts()  # every benchmarks/*.py but smoke.py and the _helpers


def argument(tree: ast.Module, flag: str) -> ast.Call | None:
    """The script's ``add_argument(flag, ...)`` call, if it has one."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == flag
        ):
            return node
    return None
