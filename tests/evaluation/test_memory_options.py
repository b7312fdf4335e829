"""``lukv bench --memory`` and ``lukv check --memory``: memory budgets as methods, with what they chose."""

from __future__ import annotations

import json

import pytest
import torch
from demo_helpers import byte_tokenizer, tiny_llama

from lukv_cache import LUKVCache
from lukv_cache.cli import main
from lukv_cache.errors import ConfigurationError
from lukv_cache.evaluation.check.formatting import format_check
from lukv_cache.evaluation.check.inputs import read_contexts
from lukv_cache.evaluation.check.report import CheckReport, CheckRow
from lukv_cache.evaluation.check.run import check
from lukv_cache.evaluation.methods import Method, build_methods, make_cache, memory_list
from lukv_cache.evaluation.prefill import SharedPrefill
from lukv_cache.evaluation.report import memory_summary, write_results
from lukv_cache.evaluation.runner import BenchSettings, run_benchmark


def test_a_memory_method_is_named_by_its_budget_and_takes_no_ratio_or_bits():
    assert Method("global", "kvzap", memory=0.1).name == "global/kvzap@mem0.1"
    assert Method("uniform", "keydiff", memory=0.05).name != Method("uniform", "keydiff", 0.05).name
    with pytest.raises(ConfigurationError, match="budget chooses"):
        Method("uniform", "keydiff", 0.5, memory=0.1)
    with pytest.raises(ConfigurationError, match="budget chooses"):
        Method("uniform", "keydiff", kv_bits=4, memory=0.1)


def test_build_methods_adds_a_method_per_budget_after_the_ratios():
    names = [m.name for m in build_methods(["uniform", "adakv"], ["keydiff"], [0.5], memory=(0.1, 0.05, 0.1))]
    assert names == [
        "full",
        "uniform/keydiff@0.5",
        "adakv/keydiff@0.5",
        "uniform/keydiff@mem0.1",
        "uniform/keydiff@mem0.05",
        "adakv/keydiff@mem0.1",
        "adakv/keydiff@mem0.05",
    ]
    assert len(set(names)) == len(names)
    # kv_bits multiplies the ratios only: the budget chooses its own bits
    grid = build_methods(["uniform"], ["keydiff"], [0.5], full=False, kv_bits=(None, 4), memory=(0.1,))
    assert [(m.ratio, m.kv_bits, m.memory) for m in grid] == [
        (0.5, None, None),
        (0.5, 4, None),
        (None, None, 0.1),
    ]


@pytest.mark.parametrize("value", ["0", "-0.1", "1.5", "nan", "half"])
def test_memory_list_refuses_a_budget_outside_0_1(value):
    with pytest.raises(ConfigurationError, match="--memory takes fractions in \\(0, 1\\]"):
        memory_list([value])
    assert memory_list(["1", "0.1"]) == (1.0, 0.1)


def _full_bytes(shared) -> int:
    """What the full cache holds for the recorded context: every layer's keys and values."""
    return sum(k.nbytes + v.nbytes for k, v in zip(shared.keys, shared.values))


@pytest.mark.parametrize("allocator", ["uniform", "profile"])
def test_make_cache_passes_the_budget_and_the_cache_holds_no_more(model, allocator, tmp_path):
    from demo_helpers import tiny_profile

    from lukv_cache.profiles import save_to_local_dir

    save_to_local_dir(tiny_profile(model), tmp_path)  # the profile allocator: from_pretrained's path
    method = Method(allocator, "keydiff", memory=0.1)
    cache = make_cache(method, model, tmp_path)
    assert isinstance(cache, LUKVCache) and cache.memory == 0.1
    assert cache.allocator_name == allocator
    shared = SharedPrefill.record(
        model, torch.randint(0, 256, (1, 400), generator=torch.Generator().manual_seed(0)), 2
    )
    replayed = shared.cache_for(method, model, tmp_path)
    assert replayed.memory_choice is not None and replayed.kv_bits == replayed.memory_choice.kv_bits
    assert replayed.memory_bytes() <= 0.1 * _full_bytes(shared)


def test_memory_summary_reports_one_bits_value_or_the_counts():
    choice = {
        "kv_bits": 8,
        "budget": 100,
        "length": 10,
        "kept": {"none": 0.1, "8": 0.3, "4": 0.5},
        "by": "rule",
    }
    assert memory_summary([choice, choice])["kv_bits"] == 8
    mixed = memory_summary([choice, choice | {"kv_bits": None}, choice | {"kv_bits": 4}])
    assert mixed["kv_bits"] == {"8": 1, "none": 1, "4": 1}
    assert mixed["kept"] == pytest.approx((0.3 + 0.1 + 0.5) / 3)


def test_bench_with_budgets_records_the_chosen_bits_and_holds_at_most_the_budget(
    model, tokenizer, articles, tmp_path
):
    settings = BenchSettings(
        tasks=("niah_multikey", "continuation"),
        samples=2,
        context_tokens=400,
        ratios=(),
        scorers=("keydiff",),
        allocators=("uniform",),
        needles=2,
        continuation_tokens=8,
        memory=(0.2, 0.05),
    )
    results = run_benchmark(model, tokenizer, settings, articles=articles, log=None)
    paths = write_results(results, tmp_path / "out", "memory")
    data = json.loads(paths["json"].read_text())
    rows = {(r["task"], r["method"]): r for r in data["results"]}
    assert {m for _, m in rows} == {"full", "uniform/keydiff@mem0.2", "uniform/keydiff@mem0.05"}
    for task in settings.tasks:
        full = rows[(task, "full")]
        assert full["kv_bytes_of_full"] == 1.0
        for memory, bits in ((0.2, 8), (0.05, 4)):  # the fallback rule on this model: docs/memory.md
            row = rows[(task, f"uniform/keydiff@mem{memory:g}")]
            assert row["memory"] == memory and row["ratio"] is None
            assert row["memory_choice"]["kv_bits"] == bits and row["memory_choice"]["by"] == "rule"
            assert 0 < row["memory_choice"]["kept"] < 1
            assert row["kv_bytes_of_full_max"] <= memory
            assert row["kv_bytes_of_full"] > 0.9 * memory  # it used the budget
            record = results.results[(task, row["method"])]
            assert all(
                h <= memory * f for h, f in zip(record.kv_bytes, results.results[(task, "full")].kv_bytes)
            )
    markdown = paths["md"].read_text()
    assert (
        "| allocator | scorer | memory | accuracy % | bits chosen | tokens kept | bytes of the full cache's |"
        in markdown
    )
    assert "| uniform | keydiff | 0.05 |" in markdown and "| int4 |" in markdown
    assert "ratio 0.5" not in markdown  # no ratio grid ran
    assert "excess_nll" in rows[("continuation", "uniform/keydiff@mem0.05")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama and its byte tokenizer saved as a model folder, as a user would pass one."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def test_lukv_bench_memory_alone_runs_the_budgets_and_the_full_cache(model_dir, tmp_path, capsys):
    argv = [
        "bench",
        "--model",
        str(model_dir),
        "--memory",
        "0.1",
        "--tasks",
        "continuation",
        "--samples",
        "1",
    ]
    argv += ["--context-tokens", "300", "--continuation-tokens", "8", "--scorers", "keydiff"]
    argv += ["--allocators", "uniform", "--out", str(tmp_path), "--name", "mem", "--threads", "1"]
    assert main(argv) == 0, capsys.readouterr().err
    rows = {r["method"]: r for r in json.loads((tmp_path / "mem.json").read_text())["results"]}
    assert set(rows) == {"full", "uniform/keydiff@mem0.1"}
    assert rows["uniform/keydiff@mem0.1"]["memory_choice"]["kv_bits"] == 8
    assert rows["uniform/keydiff@mem0.1"]["kv_bytes_of_full_max"] <= 0.1
    assert "| uniform | keydiff | 0.1 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--memory", "0"], "--memory takes fractions in (0, 1]"),
        (["--memory", "1.5"], "--memory takes fractions in (0, 1]"),
        (["--memory", "0.1", "--kv-bits", "4"], "a memory budget chooses its own bits"),
    ],
)
def test_lukv_bench_refuses_bad_budgets_before_the_model_loads(extra, message, no_weights, capsys):
    assert main(["bench", "--samples", "1", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_lukv_bench_takes_kv_bits_with_budgets_when_ratios_run_too():
    """--kv-bits then multiplies the ratios (the budgets choose their own): the flags pass the early check."""
    from lukv_cache.cli import build_parser
    from lukv_cache.cli.prechecks import precheck_bench

    precheck_bench(
        build_parser().parse_args(["bench", "--memory", "0.1", "--ratios", "0.5", "--kv-bits", "4"])
    )
    with pytest.raises(ConfigurationError, match="Drop --kv-bits, or add --ratios"):
        precheck_bench(build_parser().parse_args(["bench", "--memory", "0.1", "--kv-bits", "4"]))


# -------------------------------------------------------------------------------------- lukv check --memory
TEXT = "The ferry to Kestrel Quay leaves at nine. The harbour master is called Ada. " * 8


def _memory_report(agreements: dict[tuple[str, float], float], bits: str = "int8") -> CheckReport:
    rows = [
        CheckRow(allocator, None, agree=round(10 * agreement), asked=10, excess_nll=[0.1 - memory], memory=memory,
                 chosen=[bits, bits])
        for (allocator, memory), agreement in agreements.items()
    ]  # fmt: skip
    return CheckReport("keydiff", rows, contexts=2, questions=5, tolerance=0.9)


def test_check_recommends_the_smallest_budget_that_keeps_the_tolerance():
    report = _memory_report(
        {("uniform", 0.2): 1.0, ("uniform", 0.1): 0.9, ("uniform", 0.05): 0.5,
         ("adakv", 0.2): 1.0, ("adakv", 0.1): 0.6, ("adakv", 0.05): 1.0}
    )  # fmt: skip
    assert report.by_memory and report.safe_memory("uniform") == 0.1
    assert report.safe_memory("adakv") == 0.2  # 0.05 passes, but 0.1, a larger budget, did not
    text = format_check(report)
    assert "allocator      memory  bits  agreement  excess NLL" in text
    assert "uniform          0.05  int8        50%      +0.050" in text
    assert "uniform: agreement >= 90% down to memory 0.1 (int8)." in text
    last = text.splitlines()[-1]
    assert last.startswith("Recommended: memory=0.1 with allocator uniform (scorer keydiff; it chose int8)")
    assert "90% of the answers unchanged" in last


def test_check_without_a_safe_budget_suggests_a_larger_one():
    report = _memory_report({("uniform", 0.1): 0.5, ("uniform", 0.05): 0.2})
    text = format_check(report)
    assert "uniform: no budget checked keeps agreement >= 90% (best 50% at memory 0.1)." in text
    last = text.splitlines()[-1]
    assert last.startswith("Recommended: none. No budget checked") and "(--memory 0.2)" in last


def test_check_memory_rows_measure_each_budget_and_record_the_bits_chosen(model, tokenizer, tmp_path):
    text, questions = tmp_path / "notes.txt", tmp_path / "q.txt"
    text.write_text(TEXT)
    questions.write_text("When does the ferry leave?\nWho is the harbour master?\n")
    contexts = read_contexts(texts=[text, text], questions=questions)
    report = check(
        model, tokenizer, contexts, memory=(0.5, 0.05), allocators=("uniform",), scorer="keydiff",
        max_new_tokens=4, show_progress=False,
    )  # fmt: skip
    assert [(r.ratio, r.memory) for r in report.rows] == [(None, 0.5), (None, 0.05)]
    assert [r.chosen for r in report.rows] == [["int8", "int8"], ["int4", "int4"]]  # the rule, per context
    assert all(r.asked == 4 for r in report.rows)
    assert report.rows[0].agreement == 1.0  # half the bytes at 8 bits keep every token of this context
    text = format_check(report)
    assert "uniform           0.5  int8" in text and "memory budgets" in text
    assert text.splitlines()[-1].startswith("Recommended: memory=")


def test_check_skips_a_budget_too_small_for_a_context(model, tokenizer, tmp_path):
    text, questions = tmp_path / "short.txt", tmp_path / "q.txt"
    text.write_text("The ferry leaves at nine. " * 2)
    questions.write_text("When?\n")
    contexts = read_contexts(texts=[text], questions=questions)
    report = check(
        model, tokenizer, contexts, memory=(0.5, 0.01), allocators=("uniform",), scorer="keydiff",
        max_new_tokens=2, show_progress=False,
    )  # fmt: skip
    assert report.rows[0].skipped is None and report.rows[1].skipped.startswith("context 1: memory=0.01")
    assert "0.01  skipped: context 1: memory=0.01 gives" in format_check(report)


def test_check_refuses_budgets_with_ratios_or_kv_bits(model, tokenizer):
    contexts = [(TEXT, ["When?"])]
    with pytest.raises(ConfigurationError, match="not both"):
        check(model, tokenizer, contexts, ratios=(0.5,), memory=(0.1,), show_progress=False)
    with pytest.raises(ConfigurationError, match="chooses the bits itself"):
        check(model, tokenizer, contexts, memory=(0.1,), kv_bits=4, show_progress=False)
    with pytest.raises(ConfigurationError, match=r"\(0, 1\]"):
        check(model, tokenizer, contexts, memory=(1.5,), show_progress=False)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--memory", "0.1", "--kv-bits", "4"], "--memory and --kv-bits do not combine"),
        (["--memory", "0.1", "--ratios", "0.5"], "Give --memory or --ratios, not both"),
        (["--memory", "0"], "--memory takes fractions in (0, 1]"),
        (["--memory", "2"], "--memory takes fractions in (0, 1]"),
    ],
)
def test_lukv_check_refuses_bad_budgets_before_the_model_loads(
    extra, message, model_dir, tmp_path, no_weights, capsys
):
    text, questions = tmp_path / "notes.txt", tmp_path / "q.txt"
    text.write_text(TEXT)
    questions.write_text("When?\n")
    argv = ["check", str(model_dir), "--text", str(text), "--questions", str(questions), "--quiet", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "\n" not in err.strip()


def test_lukv_check_memory_prints_the_budgets_and_recommends_one(model_dir, tmp_path, capsys):
    text, questions = tmp_path / "notes.txt", tmp_path / "q.txt"
    text.write_text(TEXT)
    questions.write_text("When does the ferry leave?\n")
    argv = ["check", str(model_dir), "--text", str(text), "--questions", str(questions), "--quiet"]
    argv += [
        "--memory",
        "0.5",
        "0.1",
        "--allocators",
        "uniform",
        "--scorer",
        "keydiff",
        "--max-new-tokens",
        "3",
    ]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "allocator      memory  bits" in out and "uniform           0.5  int8" in out
    assert out.strip().splitlines()[-1].startswith("Recommended: ")
