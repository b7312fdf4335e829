"""No benchmark script writes into the repository unless told to: every ``--out`` defaults to a folder under
the lukv cache (``benchmarks/_out.py``), like ``lukv bench``'s. Read from the source; nothing is run."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest
from benchmark_scripts import SCRIPTS, argument, module

from lukv_cache._paths import cache_root
from lukv_cache.cli.evaluation_commands import add_bench_arguments


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_an_out_default_lies_under_the_lukv_cache(script):
    out = argument(ast.parse(script.read_text(), filename=str(script)), "--out")
    default = None if out is None else next((kw.value for kw in out.keywords if kw.arg == "default"), None)
    if default is None or (isinstance(default, ast.Constant) and default.value is None):
        return  # no --out, or nothing written unless one is given
    assert "default_out(" in ast.unparse(default), (
        f"{script.name}: --out defaults to {ast.unparse(default)}; use _out.default_out({script.stem!r})"
    )


@pytest.mark.parametrize("env", ["LUKV_CACHE_DIR", "XDG_CACHE_HOME", None])
def test_default_out_follows_the_library_cache_root(env, monkeypatch, tmp_path):
    for name in ("LUKV_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    if env is not None:
        monkeypatch.setenv(env, str(tmp_path / env))
    assert module("_out").default_out("decode_nll") == cache_root() / "bench" / "decode_nll"


def test_lukv_bench_and_run_py_default_to_the_lukv_cache():
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    assert Path(parser.parse_args([]).out) == cache_root() / "bench"
