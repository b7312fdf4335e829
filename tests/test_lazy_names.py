"""Lazy public names are visible to type checkers and editors: every package whose ``__init__`` gives names
through :func:`lukv_cache._lazy.lazy_names` (a ``_LAZY`` table of name -> module) also imports exactly
those names, each from the module the table names, in an ``if TYPE_CHECKING:`` block (never run), and
each name resolves at run time to the very object that module defines. ``import lukv_cache`` stays light
(tests/test_cli_startup.py)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "lukv_cache"


def _lazy_packages() -> list[Path]:
    """The ``__init__.py`` files that call ``lazy_names``."""
    return sorted(
        path for path in PACKAGE_DIR.rglob("__init__.py") if "lazy_names(" in path.read_text(encoding="utf-8")
    )


def _package_name(init: Path) -> str:
    return ".".join(init.parent.relative_to(PACKAGE_DIR.parent).parts)


def _absolute(module: str, package: str) -> str:
    """``module`` as ``_LAZY`` or an import from ``package``'s ``__init__`` writes it (``".x"``, ``"..x"``)."""
    return importlib.util.resolve_name(module, package)


def _lazy_table(tree: ast.Module) -> dict[str, str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_LAZY"]:
            return ast.literal_eval(node.value)
    raise AssertionError("no _LAZY = {...} table")


def _type_checking_imports(tree: ast.Module) -> list[tuple[str, str, str]]:
    """``(bound name, module as written, its name there)`` for each import of the ``if TYPE_CHECKING:``
    block at the module's top level (exactly one such block, holding only ``from ... import ...``)."""
    blocks = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    ]
    assert len(blocks) == 1, f"{len(blocks)} top-level `if TYPE_CHECKING:` blocks, expected 1"
    assert not blocks[0].orelse, "the TYPE_CHECKING block has an else branch"
    out = []
    for statement in blocks[0].body:
        assert isinstance(statement, ast.ImportFrom), ast.unparse(statement)
        module = "." * statement.level + (statement.module or "")
        out += [(alias.asname or alias.name, module, alias.name) for alias in statement.names]
    return out


LAZY_INITS = _lazy_packages()


def test_the_lazy_packages_are_found():
    assert {_package_name(p) for p in LAZY_INITS} >= {
        "lukv_cache",
        "lukv_cache.profiles",
        "lukv_cache.profiling",
    }


@pytest.mark.parametrize("init", LAZY_INITS, ids=_package_name)
def test_type_checking_block_imports_exactly_the_lazy_names_from_their_modules(init):
    package = _package_name(init)
    tree = ast.parse(init.read_text(encoding="utf-8"))
    table = _lazy_table(tree)
    imports = _type_checking_imports(tree)
    bound = [name for name, _, _ in imports]
    assert len(bound) == len(set(bound)), f"{package}: a name imported twice: {sorted(bound)}"
    assert set(bound) == set(table), (
        f"{package}: TYPE_CHECKING imports {sorted(set(bound) - set(table))} that are not lazy, "
        f"and misses {sorted(set(table) - set(bound))}"
    )
    for name, module, original in imports:
        assert original == name, f"{package}: {name} is imported as another name ({original})"
        assert _absolute(module, package) == _absolute(table[name], package), (
            f"{package}.{name}: TYPE_CHECKING imports it from {module}, _LAZY from {table[name]}"
        )


@pytest.mark.parametrize("init", LAZY_INITS, ids=_package_name)
def test_each_lazy_name_resolves_to_the_object_its_module_defines(init):
    package = _package_name(init)
    imported = importlib.import_module(package)
    for name, module, original in _type_checking_imports(ast.parse(init.read_text(encoding="utf-8"))):
        defined = getattr(importlib.import_module(_absolute(module, package)), original)
        assert getattr(imported, name) is defined, f"{package}.{name} is not {module}.{original}"
        assert name in dir(imported) and name in imported.__all__, f"{package}.{name}: not public"
