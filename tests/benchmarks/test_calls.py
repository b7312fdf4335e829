"""The benchmark scripts pass a cache under the keyword the model's forward takes it by
(``benchmarks/_calls.py``): ``cache`` from transformers 5.24, ``past_key_values`` before, as the library's own
calls do. Read from the source, and the helper run on a tiny model."""

from __future__ import annotations

import ast

import pytest
from benchmark_scripts import SCRIPTS, module

from lukv_cache._compat import cache_kwarg
from lukv_cache.testing import tiny_model

# kvpress's venv pins its own transformers (4.x); the README's line is quoted as the README writes it
OLD_NAME_KEPT = {"kvpress_efficiency.py", "kvpress_ruler.py", "readme_one_line.py"}


def test_the_helper_agrees_with_the_library():
    model = tiny_model()
    assert module("_calls").cache_kw(model) == cache_kwarg(model)


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s.name not in OLD_NAME_KEPT], ids=lambda p: p.name)
def test_no_script_names_the_old_keyword(script):
    tree = ast.parse(script.read_text())
    named = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.keyword) and n.arg == "past_key_values"]
    assert not named, f"{script.name}: past_key_values= on lines {named}; pass **{{cache_kw(model): cache}}"
