"""The package's rooms talk one way: each area imports only the areas below it (docs/design.md, "Layout").

Read from the source with ``ast``, so a new import that breaks the layering fails here, not in review.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lukv_cache"

# area -> the areas it may import (besides itself); a module of the package root is its own area
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "_after_import": set(),
    "_lazy": set(),
    "_registry": {"errors"},
    "_names": {"_registry"},  # the built-in scorer and allocator names, for the CLI without torch
    "_paths": set(),
    "_ops": set(),
    "scorers": {"_registry", "_ops", "errors"},
    "allocation": {"_registry", "errors"},
    "attention": {"_ops", "errors"},
    "cache": {"attention", "scorers", "allocation", "errors", "profiles"},
    "profiles": {"errors", "scorers", "_lazy"},
    "profiling": {
        "_lazy",
        "cache",
        "attention",
        "scorers",
        "allocation",
        "profiles",
        "errors",
        "_paths",
        "models",
        "texts",
    },
    "models": {"errors", "_paths"},
    "texts": {"errors"},
    "plot": {"errors"},
    "pipeline": {"cache", "errors"},
    "evaluation": {
        "cache",
        "attention",
        "scorers",
        "allocation",
        "profiles",
        "profiling",
        "errors",
        "models",
        "texts",
    },
    # __init__: only __version__ (the package root imports nothing heavy)
    "cli": {"errors", "models", "profiles", "profiling", "evaluation", "_paths", "_names", "__init__"},
    "__init__": {
        "_after_import",
        "_lazy",
        "allocation",
        "attention",
        "cache",
        "errors",
        "scorers",
        "profiles",
        "profiling",
    },
}


def _area(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0].removesuffix(".py")


def _is_area(name: str) -> bool:
    return (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").exists()


def _imported_areas(path: Path) -> set[str]:
    """The package areas a module imports (absolute ``lukv_cache.x`` or relative ``..x`` imports)."""
    tree = ast.parse(path.read_text())
    depth = len(path.relative_to(PACKAGE).parts) - 1  # 0 for a module at the package root
    areas = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if node.module and node.module.startswith("lukv_cache."):
                    areas.add(node.module.split(".")[1])
                elif node.module == "lukv_cache":
                    areas.update(alias.name for alias in node.names)
            elif node.level > depth:  # climbs to the package root, then into an area
                if node.module:
                    areas.add(node.module.split(".")[0])
                else:  # ``from . import x``: the area x, or a name of the package's __init__
                    areas.update(alias.name if _is_area(alias.name) else "__init__" for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("lukv_cache."):
                    areas.add(alias.name.split(".")[1])
    return areas


MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_imports_only_the_areas_below_it(path):
    area = _area(path)
    assert area in ALLOWED, f"new area {area!r}: add it to ALLOWED with the areas it may use"
    imported = _imported_areas(path) - {area}
    assert imported <= ALLOWED[area], (
        f"{path.relative_to(PACKAGE)} imports {sorted(imported - ALLOWED[area])}"
    )


def test_no_file_cites_the_design_notes_outside_the_repository():
    outside = "DESIGN" + ".md"  # spelled apart so this test does not cite it either
    for path in [
        *MODULES,
        *(PACKAGE.parent / "tests").rglob("*.py"),
        *(PACKAGE.parent / "docs").rglob("*.md"),
    ]:
        assert outside not in path.read_text(), path
