from demo_helpers import tiny_profile

from lukv_cache.cli import main
from lukv_cache.evaluation.demo import LINEUP, format_report, run_demo
from lukv_cache.profiles import save_to_local_dir


def test_demo_compares_every_cache_at_each_ratio_over_every_fact(model, tokenizer, articles, tmp_path):
    save_to_local_dir(tiny_profile(model), tmp_path)
    report = run_demo(
        model, tokenizer, ratios=(0.5, 0.8), contexts=2, context_tokens=250, n_facts=2, profiles_dir=tmp_path,
        articles=articles,
    )  # fmt: skip
    assert [row.label for row in report.rows] == ["full cache"] + [label for label, _, _ in LINEUP] * 2
    assert [row.ratio for row in report.rows] == [None] + [0.5] * len(LINEUP) + [0.8] * len(LINEUP)
    for row in report.rows:
        assert row.skipped is None and row.asked == 4 and 0 <= row.correct <= 4
    full = sum(report.rows[0].kv_bytes)
    assert all(sum(row.kv_bytes) < full for row in report.rows[1:])
    text = format_report(report)
    assert "KV memory" in text and "correct" in text and "MB" in text and "/4" in text


def test_a_cache_whose_profile_is_missing_is_reported_as_skipped(model, tokenizer, articles, tmp_path):
    report = run_demo(
        model, tokenizer, ratios=(0.8,), contexts=1, context_tokens=200, n_facts=1, profiles_dir=tmp_path,
        articles=articles,
    )  # fmt: skip
    skipped = [row for row in report.rows if row.skipped]
    assert [row.label for row in skipped] == ["LU-KV profile, keydiff"]
    assert "skipped" in format_report(report)


def test_demo_refuses_a_bad_ratio_before_loading_anything(capsys):
    assert main(["demo", "--ratios", "0.5", "1.5"]) == 2
    assert "ratio" in capsys.readouterr().err


def test_demo_says_each_stage_of_a_context_as_it_ends(model, tokenizer, articles, tmp_path):
    """`lukv demo --threads 1` printed nothing for ~3.5 min between "Context 3/3" and its table."""
    save_to_local_dir(tiny_profile(model), tmp_path)
    said: list[str] = []
    run_demo(
        model, tokenizer, ratios=(0.8,), contexts=1, context_tokens=200, n_facts=1, profiles_dir=tmp_path,
        articles=articles, log=said.append,
    )  # fmt: skip
    assert said[0].startswith("Context 1/1") and said[1].startswith("  prefill: ")
    stages = [line.split(":")[0].strip() for line in said[2:]]
    assert stages == ["full cache"] + [f"{label} at ratio 0.8" for label, _, _ in LINEUP]
    assert all(line.endswith(" s") and "/1 facts" in line for line in said[2:])
