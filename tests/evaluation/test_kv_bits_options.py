"""``lukv bench --kv-bits`` and ``lukv check --kv-bits``: quantized stores as columns of the grid."""

from __future__ import annotations

import json

import pytest

from lukv_cache.cli import main
from lukv_cache.errors import ConfigurationError
from lukv_cache.evaluation.check.formatting import format_check
from lukv_cache.evaluation.check.inputs import read_contexts
from lukv_cache.evaluation.check.run import check
from lukv_cache.evaluation.methods import kv_bits_list
from lukv_cache.evaluation.report import write_results
from lukv_cache.evaluation.runner import BenchSettings, run_benchmark


def test_bench_grid_has_a_column_per_kv_bits_and_quantized_stores_hold_fewer_bytes(
    model, tokenizer, articles, tmp_path
):
    settings = BenchSettings(
        tasks=("niah_multikey", "continuation"),
        samples=2,
        context_tokens=200,
        ratios=(0.5,),
        scorers=("keydiff",),
        allocators=("uniform",),
        needles=2,
        continuation_tokens=8,
        kv_bits=(None, 8, 4),
    )
    results = run_benchmark(model, tokenizer, settings, articles=articles, log=None)
    paths = write_results(results, tmp_path / "out", "kv_bits")
    rows = {(r["task"], r["method"]): r for r in json.loads(paths["json"].read_text())["results"]}
    names = ("uniform/keydiff@0.5", "uniform/keydiff@0.5/int8", "uniform/keydiff@0.5/int4")
    held = [rows[("niah_multikey", name)]["kv_bytes_mean"] for name in names]
    assert held[0] > held[1] > held[2]  # the dense window is the same; the store shrinks with the bits
    kept = [rows[("niah_multikey", name)]["kept_fraction_mean"] for name in names]
    assert kept[0] == kept[1] == kept[2]  # the same tokens are kept
    assert "excess_nll" in rows[("continuation", names[2])]
    # the grid has a row per kv_bits (it showed the model precision's alone before)
    markdown = paths["md"].read_text()
    assert "| allocator | scorer | bits | ratio 0.5 |" in markdown
    for label in ("model", "int8", "int4"):
        assert f"| uniform | keydiff | {label} | " in markdown


def test_check_with_kv_bits_says_so_and_runs(model, tokenizer, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("The ferry to Kestrel Quay leaves at nine. The harbour master is called Ada. " * 8)
    questions = tmp_path / "q.txt"
    questions.write_text("When does the ferry leave?\n")
    contexts = read_contexts(texts=[text], questions=questions)
    report = check(
        model, tokenizer, contexts, ratios=(0.0,), allocators=("uniform",), max_new_tokens=4, show_progress=False,
        kv_bits=8,
    )  # fmt: skip
    assert report.kv_bits == 8
    assert "kept keys and values in 8 bits" in format_check(report)
    with pytest.raises(ConfigurationError, match="kv_bits"):
        check(
            model, tokenizer, contexts, ratios=(0.5,), allocators=("uniform",), kv_bits=3, show_progress=False
        )


def test_kv_bits_list_and_the_cli_refuse_other_widths(capsys):
    assert kv_bits_list(["none", "8", "4", "8"]) == (None, 8, 4)
    with pytest.raises(ConfigurationError, match="--kv-bits"):
        kv_bits_list(["2"])
    assert main(["bench", "--kv-bits", "16", "--samples", "1"]) == 2
    assert "--kv-bits takes none" in capsys.readouterr().err
