"""Every maintained benchmark script (``benchmarks/*.py``; experiments lie under ``benchmarks/results/``) has
a ``--smoke`` run (``benchmarks/smoke.py`` runs them in CI), read from the source: its argparse parser
declares ``--smoke`` and its docstring says so; ``benchmarks/README.md``'s table names it. Nothing is run
or imported but ``benchmarks/smoke.py`` itself (standard library only)."""

from __future__ import annotations

import ast

import pytest
from benchmark_scripts import BENCHMARKS, SCRIPTS, argument


def test_the_runner_finds_every_script_but_itself_and_the_helpers():
    names = {p.name for p in SCRIPTS}
    assert "run.py" in names and "cache_bench.py" in names
    assert "smoke.py" not in names and not any(n.startswith("_") for n in names)
    assert names == {p.name for p in BENCHMARKS.glob("*.py")} - {"smoke.py"} - {
        p.name for p in BENCHMARKS.glob("_*.py")
    }


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_script_has_a_smoke_flag_and_says_so(script):
    tree = ast.parse(script.read_text(), filename=str(script))
    assert argument(tree, "--smoke") is not None, (
        f"{script.name}: no add_argument('--smoke', ...): benchmarks/smoke.py fails it"
    )
    assert "--smoke" in (ast.get_docstring(tree) or ""), (
        f"{script.name}: its docstring does not mention --smoke"
    )


def test_the_readme_documents_every_maintained_script():
    readme = (BENCHMARKS / "README.md").read_text()
    missing = [p.name for p in SCRIPTS if f"| `{p.name}`" not in readme]
    assert not missing, (
        f"benchmarks/README.md's table lacks {missing} (what it measures, its command, its results)"
    )
