"""The package's rooms talk one way: each area imports only the areas below it (docs/design.md, "Layout").

Read from the source with ``ast``, so a new import that breaks the layering fails here, not in review.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lukv_cache"

# area -> the areas it may import (besides itself); a module of the package root is its own area
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "_lazy": set(),
    "_registry": {"errors"},
    "_names": {"_registry"},  # the built-in scorer and allocator names, for the CLI without torch
    "_paths": set(),
    "_version": set(),
    "_ops": set(),
    "_compat": set(),  # what differs between the supported transformers releases
    "scorers": {"_registry", "_ops", "errors"},
    "allocation": {"_registry", "errors"},
    "attention": {"_ops", "errors", "_paths"},  # _paths: where the CPU kernel on codes is built
    # every change lukv makes in the process (transformers' registries, the import hook, the handoff's
    # thread-local slot) and its undo; cheap to import, attention imported when used
    "integration": {"_lazy", "attention", "errors"},
    "cache": {"_compat", "attention", "integration", "scorers", "allocation", "errors", "profiles"},
    "profiles": {"errors", "scorers", "_lazy", "_version"},
    "profiling": {
        "_compat",
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
    "pipeline": {"_compat", "cache", "errors"},
    "testing": {
        "profiles",
        "scorers",
        "errors",
    },  # tiny models, tokenizers and profiles for tests, doctests and examples
    "evaluation": {
        "_compat",
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
        "integration",  # install_when_imported(): the import hook
        "_version",
        "_lazy",
        "allocation",
        "attention",
        "cache",
        "errors",
        "scorers",
        "profiles",
        "profiling",
        "pipeline",  # LUKVPipeline: lazy at run time, imported for type checkers (if TYPE_CHECKING)
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
                elif alias.name == "lukv_cache":  # the package root: its __init__
                    areas.add("__init__")
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


def test_the_version_is_pyprojects():
    import tomllib

    from lukv_cache._version import __version__

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    assert __version__ == project["version"]


def test_no_file_cites_the_design_notes_outside_the_repository():
    outside = "DESIGN" + ".md"  # spelled apart so this test does not cite it either
    for path in [
        *MODULES,
        *(PACKAGE.parent / "tests").rglob("*.py"),
        *(PACKAGE.parent / "docs").rglob("*.md"),
    ]:
        assert outside not in path.read_text(), path


# ---------------------------------------------------------------------------------------- import cycles
# Every import between modules of the package, module-level and inside functions, relative and
# absolute, as an edge of one graph; it must have no cycle at all. A package's __init__ imports its
# modules, which import the leaf module that defines what they share (allocation/base.py,
# scorers/base.py, profiles/files.py), never the package; a method that needs a module above it delegates
# to a function of a lower module (LUKVCache.save / load -> cache/saved/file.py, not cache/save_load.py).


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULE_NAMES = {_module_name(path): path for path in MODULES}


def _package_module(name: str) -> str | None:
    """``name`` if it is a module of the package, else the closest enclosing one (a name imported from a
    module: ``lukv_cache.cache.LUKVCache`` is ``lukv_cache.cache``)."""
    while name and name not in MODULE_NAMES:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (imports that never run; the
    ``else`` branch does run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if _is_type_checking(node):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def _imported_modules(name: str, path: Path, typing: bool = False) -> dict[str, int]:
    """The package's modules ``name`` imports (anywhere in the file, at module level or in a function;
    not under ``if TYPE_CHECKING:``, which never runs, unless ``typing``), each with its first line.

    ``from . import x`` imports the module ``x`` when there is one, else a name of the package; an import
    of ``a.b.c`` is an edge to that module only (not to the packages ``a`` and ``a.b`` Python runs first:
    those edges would put every package in a cycle with its own modules)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges: dict[str, int] = {}
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if typing else _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            targets = [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            imported = _package_module(target)
            if imported is not None and imported != name:
                edges.setdefault(imported, node.lineno)
    return edges


@functools.cache
def _import_graph(typing: bool = False) -> dict[str, dict[str, int]]:
    """Module -> the modules it imports, with the line; ``typing``: ``if TYPE_CHECKING:`` imports too."""
    return {name: _imported_modules(name, path, typing) for name, path in MODULE_NAMES.items()}


def _cycles(graph: dict[str, dict[str, int]]) -> set[tuple[str, ...]]:
    """Every elementary cycle, as its modules from the smallest name on (a DFS per start module, over the
    modules greater than it: each cycle is found once, from its smallest module)."""
    found = set()
    order = sorted(graph)
    for start in order:
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
            elif child == start:
                found.add(tuple(path))
            elif child > start and child not in path and child in graph:
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
    return found


def _short(name: str) -> str:
    return name.removeprefix("lukv_cache.")


def _full(short: str) -> str:
    return short if short == "lukv_cache" else f"lukv_cache.{short}"


def test_the_import_graph_is_read_whole():
    graph = _import_graph()
    # a module-level import, a function-level one, a relative ``from . import`` of a module, an absolute one
    assert "lukv_cache.attention.calls" in graph["lukv_cache.attention.routing"]
    assert "lukv_cache.cache.saved.file" in graph["lukv_cache.cache.cache"]  # inside LUKVCache.save
    assert "lukv_cache.allocation.builtin" in graph["lukv_cache.allocation"]
    assert "lukv_cache.errors" in graph["lukv_cache.attention.kernels"]
    guarded = ast.parse("if TYPE_CHECKING:\n    import a\nelse:\n    import b\nimport c\n")
    imported = {alias.name for n in _runtime_nodes(guarded) if isinstance(n, ast.Import) for alias in n.names}
    assert imported == {"b", "c"}  # what runs
    assert _cycles({"a": {"b": 1}, "b": {"c": 1, "a": 1}, "c": {"a": 1}}) == {("a", "b", "c"), ("a", "b")}


def _cycle_lines(graph: dict[str, dict[str, int]]) -> list[str]:
    """The import cycles of ``graph``, each in words (``a (line n) -> b; b (line m) -> a``)."""
    lines = []
    for cycle in sorted(tuple(_short(m) for m in cycle) for cycle in _cycles(graph)):
        hops = [
            f"{a} (line {graph[_full(a)][_full(b)]}) -> {b}" for a, b in zip(cycle, cycle[1:] + cycle[:1])
        ]
        lines.append("; ".join(hops))
    return lines


def test_no_import_cycles():
    # TYPE_CHECKING imports count too: a module that needs a class above it only for its annotations types
    # against a protocol in a leaf instead (cache/compression/contract.py's CompressedCache,
    # profiles/location.py's PublishedProfile), so the package reads top-down for a type checker as it does when it runs
    lines = _cycle_lines(_import_graph(typing=True))
    assert not lines, "import cycles (TYPE_CHECKING imports included):\n" + "\n".join(lines)


def test_the_cycle_check_sees_type_checking_imports(tmp_path):
    a, b = "lukv_cache.a", "lukv_cache.b"
    assert _cycle_lines({a: {b: 1}, b: {a: 3}}) == ["a (line 1) -> b; b (line 3) -> a"]
    # an import under ``if TYPE_CHECKING:`` is an edge of the graph the cycle test reads, not of what runs
    module = tmp_path / "file.py"
    module.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..cache import LUKVCache\n"
    )
    name = "lukv_cache.cache.saved.file"
    assert _imported_modules(name, module, typing=True) == {"lukv_cache.cache.cache": 3}
    assert _imported_modules(name, module) == {}


# attention's leaf modules decide nothing about each other: each imports (within attention) only these
ATTENTION_LEAVES: dict[str, set[str]] = {
    "limits": set(),
    "partial": set(),
    "tiles": {"limits"},
    "masked": {"calls", "limits"},  # calls: the StoreView protocol
    "cpu_codes": {"calls"},
    "_triton_ragged": {"limits"},
    "kernels": {
        "partial",
        "limits",
        "_triton_ragged",
        "_triton_quantized",
    },  # partial: the references it falls back to
}


@pytest.mark.parametrize("leaf", sorted(ATTENTION_LEAVES))
def test_attention_leaves_import_only_the_math_they_need(leaf):
    graph = _import_graph()
    inside = {
        imported.removeprefix("lukv_cache.attention.")
        for imported in graph[f"lukv_cache.attention.{leaf}"]
        if imported.startswith("lukv_cache.attention.")
    }
    assert inside <= ATTENTION_LEAVES[leaf], (
        f"attention/{leaf}.py imports {sorted(inside - ATTENTION_LEAVES[leaf])}"
    )


def _cache_private_uses(tree: ast.AST) -> list[str]:
    """``cache._name`` (or ``<obj>.cache._name``) in ``tree``: a part reaching into the cache's privates."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            value = node.value
            named = value.id if isinstance(value, ast.Name) else getattr(value, "attr", None)
            if named == "cache":
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_part_reaches_into_the_caches_private_members(path):
    # the cache's parts talk to it through public members, and it to them through cache.compressor
    if path == PACKAGE / "cache" / "cache.py":
        return
    uses = _cache_private_uses(ast.parse(path.read_text()))
    assert not uses, f"{path.relative_to(PACKAGE)}: " + ", ".join(uses)


def test_the_private_member_check_sees_a_call_back_into_the_cache():
    source = "cache._evict(steps)\nself.cache._fold_evict()\ncache.evict(steps)\ncache.__class__\n"
    assert _cache_private_uses(ast.parse(source)) == [
        "line 1: cache._evict",
        "line 2: self.cache._fold_evict",
    ]


# ------------------------------------------------------------------------------- the cache's subpackages
# lukv_cache/cache/ is one subpackage per job, importing one way (docs/design.md, "The cache"): storage
# knows nothing of the options that fill it, the options nothing of the layout, and so on up to the
# modules of cache/ itself (LUKVCache, from_pretrained, save_load), which may import every subpackage.
CACHE_FLOORS = ["storage", "options", "layers", "compression", "saved"]


def _cache_part(module: str) -> str | None:
    """The subpackage of ``lukv_cache.cache`` that ``module`` is in (None: a module of cache/ itself)."""
    parts = module.split(".")
    if parts[:2] != ["lukv_cache", "cache"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in CACHE_FLOORS else None


def test_the_cache_subpackages_import_one_way():
    found = sorted(p.name for p in (PACKAGE / "cache").iterdir() if (p / "__init__.py").exists())
    assert found == sorted(CACHE_FLOORS), "a new subpackage of cache/: give it its place in CACHE_FLOORS"
    wrong = []
    for module, imported in _import_graph(typing=True).items():
        part = _cache_part(module)
        if part is None:  # cache/ itself, or outside the cache: may import every subpackage
            continue
        for target, line in imported.items():
            if not target.startswith("lukv_cache.cache"):
                continue
            target_part = _cache_part(target)
            if target_part is None or CACHE_FLOORS.index(target_part) > CACHE_FLOORS.index(part):
                wrong.append(f"{_short(module)} (line {line}) imports {_short(target)}")
    assert not wrong, "imports up the cache's floors:\n" + "\n".join(wrong)


# ------------------------------------------------------------------------------- one owner per piece of state
# (docs/design.md, "The parts and the data each owns"). The cache (cache.py) alone writes its layers and
# layer_class_to_replicate: the layout, a saved context and a reconstruction pass ask it (replace_layer,
# lay_out, grow_with). The compressor, which drives the forwards, alone writes the forward's state
# (ForwardState's own methods aside); the helpers it calls return what they decide. The pure modules write
# nothing of another object.
CACHE = PACKAGE / "cache"
LAYERS_OWNER = CACHE / "cache.py"
STATE_OWNERS = {CACHE / "compression" / "compressor.py", CACHE / "compression" / "forward_state.py"}
PURE = [CACHE / "compression" / "region.py", CACHE / "compression" / "fold_plan.py"]
_MUTATORS = {"append", "insert", "extend", "pop", "popitem", "clear", "remove", "update", "setdefault"}


def _state_fields() -> set[str]:
    tree = ast.parse((CACHE / "compression" / "forward_state.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ForwardState"]
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _written(tree: ast.AST):
    """Each expression ``tree`` assigns, deletes, or changes in place by a mutating method call."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _MUTATORS
        ):
            targets = [node.func.value]
        else:
            continue
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets.extend(target.elts)
            elif isinstance(target, ast.Starred):
                targets.append(target.value)
            else:
                yield target


def _is_state(node: ast.AST) -> bool:
    """``state`` or ``<x>.state``: a ForwardState, by the name every module gives it."""
    return (isinstance(node, ast.Name) and node.id == "state") or (
        isinstance(node, ast.Attribute) and node.attr == "state"
    )


def _owner_violations(tree: ast.AST, path: Path, fields: set[str]) -> list[str]:
    found = []
    for target in _written(tree):
        inner = target.value if isinstance(target, ast.Subscript) else target
        where = f"line {target.lineno}: {ast.unparse(target)}"
        if path != LAYERS_OWNER and isinstance(inner, ast.Attribute):
            if inner.attr in ("layers", "layer_class_to_replicate"):
                found.append(where)
        if path not in STATE_OWNERS and isinstance(inner, ast.Attribute):
            if (inner.attr in fields and _is_state(inner.value)) or (
                inner.attr == "state" and not isinstance(target, ast.Subscript)
            ):
                found.append(where)
        if (
            path in PURE
            and isinstance(target, ast.Attribute)
            and not (isinstance(target.value, ast.Name) and target.value.id == "self")
        ):
            found.append(where)
    return list(dict.fromkeys(found))


RECORD = CACHE / "storage" / "record.py"
COMPRESSION = CACHE / "compression"
RECORD_WRITERS = {"keep_sinks", "settle", "record_queries"}  # EvictionRecord's: compression's alone


def _record_fields() -> set[str]:
    tree = ast.parse(RECORD.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EvictionRecord"]
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _record_violations(tree: ast.AST, path: Path, fields: set[str]) -> list[str]:
    """A layer's eviction record (``<x>.eviction``, an ``EvictionRecord``) is compression's: its fields are
    assigned by its own methods alone, its writers called from ``compression/`` alone, and the layer (a
    module of ``storage/``) only builds its own (``self.eviction``) and forwards batch and device operations."""
    found = []
    for target in _written(tree):
        inner = target.value if isinstance(target, ast.Subscript) else target
        where = f"line {target.lineno}: {ast.unparse(target)}"
        if not isinstance(inner, ast.Attribute):
            continue
        if inner.attr in fields and not (path == RECORD and _is_self(inner.value)):
            found.append(where)
        if inner.attr == "eviction" and not (path.parent == CACHE / "storage" and _is_self(inner.value)):
            found.append(where)
    for node in ast.walk(tree):
        if (
            path.parent != COMPRESSION
            and isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in RECORD_WRITERS
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr == "eviction"
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node.func)}(...)")
    return list(dict.fromkeys(found))


CACHE_MODULES = sorted(CACHE.rglob("*.py"))


@pytest.mark.parametrize("path", CACHE_MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_one_owner_writes_the_layers_and_the_forward_state(path):
    tree = ast.parse(path.read_text())
    found = _owner_violations(tree, path, _state_fields())
    assert not found, (
        f"{path.relative_to(PACKAGE)} writes state another object owns (ask its owner: cache.replace_layer / "
        "lay_out / grow_with for the layers, the Compressor for the forward's state; a pure helper returns "
        "what it decides): " + ", ".join(found)
    )
    found = _record_violations(tree, path, _record_fields())
    assert not found, (
        f"{path.relative_to(PACKAGE)} writes a layer's eviction record, which compression owns (compression "
        "calls its writers, keep_sinks / settle / record_queries; the layer only carries it): "
        + ", ".join(found)
    )


def test_the_owner_check_sees_every_kind_of_write():
    assert {"awaiting", "readers", "held", "phase", "prompt"} <= _state_fields()
    source = (
        "cache.layers[i] = layer\n"
        "cache.layers = []\n"
        "a, cache.layer_class_to_replicate = 1, None\n"
        "cache.layers.append(layer)\n"
        "del cache.layers[0]\n"
        "cache.state.awaiting = None\n"
        "held, cache.state.held = cache.state.held, {}\n"
        "state.readers[i] = ref\n"
        "self.cache.state.deferred.clear()\n"
        "cache.state = None\n"
        "layer.sinks_left = left\n"
        "x = cache.layers[i]\n"
        "cache.state.end_prompt()\n"
        "state['attrs'] = {}\n"
        "self.total = 1\n"
    )
    found = _owner_violations(ast.parse(source), PURE[0], _state_fields())
    assert {int(line.split(":")[0].removeprefix("line ")) for line in found} == set(range(1, 12)), found


def test_the_owner_check_sees_every_write_of_an_eviction_record():
    assert _record_fields() == {"sinks_left", "settled_length", "queries"}
    source = (
        "layer.eviction.sinks_left = left\n"
        "self.eviction.queries = None\n"
        "layer.eviction.settle(n)\n"
        "cache.layers[i].eviction.record_queries(q, 2)\n"
        "layer.eviction = None\n"
        "a, layer.eviction.settled_length = 1, 0\n"
        "self.eviction = EvictionRecord()\n"
        "self.eviction.select_rows(rows)\n"
        "n = layer.eviction.settled_length\n"
    )
    layer = CACHE / "storage" / "layer.py"
    found = _record_violations(ast.parse(source), layer, _record_fields())
    assert {int(line.split(":")[0].removeprefix("line ")) for line in found} == set(range(1, 7)), found
    found = _record_violations(ast.parse(source), COMPRESSION / "fold.py", _record_fields())
    assert {int(line.split(":")[0].removeprefix("line ")) for line in found} == {1, 2, 5, 6, 7}, found
    assert not _record_violations(ast.parse("self.settled_length = n\n"), RECORD, _record_fields())


def _layout_writes(tree: ast.AST) -> list[str]:
    """``<x>.layout.<field> = ...`` (or ``+=``) in ``tree``: a part writing the layout's fields itself."""
    found = []
    for node in ast.walk(tree):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AugAssign)
            else []
        )
        flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        for target in flat:
            while isinstance(target, ast.Subscript):
                target = target.value
            if isinstance(target, ast.Attribute):
                owner = target.value
                named = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
                if named == "layout":
                    found.append(f"line {node.lineno}: {ast.unparse(target)}")
    return found


@pytest.mark.parametrize("path", CACHE_MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_layout_is_written_by_its_own_methods(path):
    # the cache, the compressor and a saved file's reader ask the Layout (restore, saw_other_keys,
    # record_the_past, set_num_layers, ...): it alone assigns its fields
    found = _layout_writes(ast.parse(path.read_text()))
    assert not found, (
        f"{path.relative_to(PACKAGE)} writes the layout's fields (ask a Layout method): " + ", ".join(found)
    )


def test_the_layout_check_sees_a_write():
    source = "cache.layout.undecided = False\na, self.layout.x = 1, 2\ncache.layout.n += 1\nlayout = 3\ncache.layout.full_layers[0] = 1\n"
    assert [f.split(":")[0] for f in _layout_writes(ast.parse(source))] == [
        "line 1",
        "line 2",
        "line 3",
        "line 5",
    ]
