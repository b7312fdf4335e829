"""A leading underscore means "this module's own": no other module of the package, and no benchmark or
example, uses it (issue 45). What two modules share has a public name (no underscore) and a docstring.

Read from the source with ``ast``, like the layering test (tests/test_architecture.py):

* inside ``lukv_cache``: no ``from <another module> import _name`` (relative or absolute) and no
  ``module._name`` through an imported module. Not private imports, so allowed: a public name bound to a
  private local name (``from .._ops import flash_attention_cpu as _flash_cpu``, ``from . import builtin as
  _builtin``, ``from .pretrained import from_pretrained as _from_pretrained``: what is imported is public);
  a package-internal module, whose file name starts with ``_`` (``from .. import _compat``, ``from
  .._paths import cache_root``: the module is the package's, its public names are for the package); dunders.
* ``benchmarks/`` and ``examples/``: the same, and no ``obj._name`` where ``_name`` is a private attribute
  or method of one of the package's classes (collected from the package: ``def _name`` in a class body,
  ``self._name = ...`` anywhere). Not ours, so allowed: attributes on ``self``/``cls`` (the script's own
  classes), on a benchmarks helper module (``import _smoke``, ``cache_bench._fill``), and transformers'
  or torch's private names that no class of the package defines (``config._attn_implementation``).
  What is left on purpose is in ``ALLOWED``, with why.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lukv_cache"
MODULES = sorted(PACKAGE.rglob("*.py"))
SCRIPTS = sorted([*(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "examples").rglob("*.py")])

# (script, private name) -> why it stays
ALLOWED: dict[tuple[str, str], str] = {
    ("benchmarks/results/prefill_cost_mlp/scorer_in_prefill.py", "_kvzap"): (
        "a committed result script: it is the record of how that result was measured, kept as it ran"
    ),
    **{
        ("benchmarks/results/kvzap_kvzip_targets/seed_cache.py", name): (
            "a committed result script (seeded the build's target cache once), kept as it ran"
        )
        for name in ("_ResultStore", "_sha")
    },
    **{
        (f"benchmarks/results/table_kl/{script}", name): (
            "a committed result script (the memory table's windows and layer passes, measured apart), kept as it "
            "ran (layer_est.py at c08ecb0: _LayerOutputs left with the layers' passes)"
        )
        for script, name in (
            ("cell_est.py", "_windows"),
            ("layer_est.py", "_windows"),
            ("layer_est.py", "_LayerOutputs"),
        )
    },
    ("benchmarks/results/table_gradient/grad_est.py", "_windows"): (
        "a committed result script (the layers' losses from one backward pass, measured apart), kept as it ran"
    ),
    ("benchmarks/results/build_2min/oracle_decode.py", "_rows_attention"): (
        "a committed result script: it times the oracle's batched attention, which only that module calls"
    ),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULE_NAMES = {_module_name(path) for path in MODULES}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _from_module(node: ast.ImportFrom, own: str | None, is_package: bool) -> str:
    """The absolute module an ``ImportFrom`` reads (``own``: the importing module's name, None outside the
    package, where relative imports do not reach the package)."""
    if not node.level:
        return node.module or ""
    if own is None:
        return ""
    package = own.split(".") if is_package else own.split(".")[:-1]
    base = ".".join(package[: len(package) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def _private_uses(tree: ast.AST, own: str | None, is_package: bool) -> list[tuple[int, str, str]]:
    """``(line, name, what)`` for each private name of another package module this file imports or reads
    as an attribute of an imported package module."""
    found: list[tuple[int, str, str]] = []
    modules: dict[str, str] = {}  # local name -> the package module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _from_module(node, own, is_package)
            if source not in MODULE_NAMES or source == own:
                continue
            for alias in node.names:
                if f"{source}.{alias.name}" in MODULE_NAMES:  # a module, private-named or not
                    modules[alias.asname or alias.name] = f"{source}.{alias.name}"
                elif _is_private(alias.name):
                    found.append((node.lineno, alias.name, f"from {source} import {alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "lukv_cache":
                    modules[alias.asname or "lukv_cache"] = alias.name if alias.asname else "lukv_cache"
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
            continue
        dotted = _dotted(node.value)
        if dotted is None or dotted.split(".")[0] not in modules:
            continue
        head, _, rest = dotted.partition(".")
        module = f"{modules[head]}.{rest}" if rest else modules[head]
        if module in MODULE_NAMES and module != own and f"{module}.{node.attr}" not in MODULE_NAMES:
            found.append((node.lineno, node.attr, f"{dotted}.{node.attr} ({module})"))
    return found


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


@functools.cache
def _class_private_names() -> frozenset[str]:
    """The private attributes and methods the package's objects carry: ``def _name`` in a class body,
    ``self._name = ...`` (or ``self._a, self._b = ...``) in a method."""
    names = set()
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_private(item.name):
                        names.add(item.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self" and _is_private(node.attr):
                    names.add(node.attr)
    return frozenset(names)


def _object_private_uses(tree: ast.AST) -> list[tuple[int, str, str]]:
    """``obj._name`` where ``_name`` is a private attribute of the package's classes and ``obj`` is not
    ``self``/``cls`` or a module the script imports that is not the package's (its own helpers)."""
    own_modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            own_modules.update(
                (a.asname or a.name.split(".")[0]) for a in node.names if not a.name.startswith("lukv_cache")
            )
        elif isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("lukv_cache"):
            own_modules.update(a.asname or a.name for a in node.names)
    private = _class_private_names()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in private:
            base = _dotted(node.value)
            if base in ("self", "cls") or (base is not None and base.split(".")[0] in own_modules):
                continue
            found.append((node.lineno, node.attr, ast.unparse(node)))
    return found


def _script_uses(path: Path) -> list[tuple[int, str, str]]:
    tree = ast.parse(path.read_text())
    uses = {*_private_uses(tree, None, False), *_object_private_uses(tree)}
    return sorted(uses)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_uses_another_modules_private_names(path):
    tree = ast.parse(path.read_text())
    uses = _private_uses(tree, _module_name(path), path.name == "__init__.py")
    assert not uses, "\n".join(f"{path.relative_to(ROOT)}:{line}: {what}" for line, _, what in uses)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_benchmark_or_example_uses_the_packages_private_names(path):
    where = str(path.relative_to(ROOT))
    uses = [use for use in _script_uses(path) if (where, use[1]) not in ALLOWED]
    assert not uses, "\n".join(f"{where}:{line}: {what}" for line, _, what in uses)


def test_every_allowed_private_use_is_still_there():
    for (where, name), why in ALLOWED.items():
        assert why
        assert name in {use[1] for use in _script_uses(ROOT / where)}, f"{where} no longer uses {name}"


def test_the_checks_see_each_kind_of_private_use():
    own = "lukv_cache.scorers.kvzap"
    source = (
        "from .base import _group_queries, public\n"  # relative import of a private name
        "from lukv_cache.attention.partial import _softcap\n"  # absolute
        "from .._ops import flash_attention_cpu as _flash\n"  # public name, private alias: fine
        "from .. import _compat\n"  # package-internal module: fine
        "from . import builtin as _builtin\n"
        "_builtin._helper()\n"  # a module's private name through the module
        "import lukv_cache.texts\n"
        "lukv_cache.texts._wikipedia_articles = None\n"
        "obj._logical\n"
        "self._logical\n"
    )
    uses = _private_uses(ast.parse(source), own, False)
    assert {name for _, name, _ in uses} == {"_group_queries", "_softcap", "_helper", "_wikipedia_articles"}
    assert [name for _, name, _ in _object_private_uses(ast.parse(source))] == ["_logical"]
    assert "_logical" in _class_private_names()  # LUKVLayer's logical content
