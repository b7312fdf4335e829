from demo_helpers import tiny_profile

from lukv_cache.evaluation.demo import format_report, run_demo
from lukv_cache.profiles import save_to_local_dir


def test_demo_without_a_profile_falls_back_to_uniform_and_says_so(model, tokenizer, articles, tmp_path):
    report = run_demo(
        model, tokenizer, ratio=0.8, context_tokens=300, n_facts=2, profiles_dir=tmp_path, articles=articles
    )
    assert report.notes and "uniform" in report.notes[0]
    assert "allocator='uniform'" in report.cache_description
    assert report.compressed.kv_bytes < 0.5 * report.full.kv_bytes
    assert len(report.full.answers) == len(report.compressed.answers) == 2


def test_demo_with_a_profile_compresses_with_lukv(model, tokenizer, articles, tmp_path):
    save_to_local_dir(tiny_profile(model), tmp_path)
    report = run_demo(
        model, tokenizer, ratio=0.8, context_tokens=300, n_facts=2, profiles_dir=tmp_path, articles=articles
    )
    assert report.notes == []
    assert "LU-KV profile" in report.cache_description and "keydiff" in report.cache_description
    assert report.compressed.kv_bytes < report.full.kv_bytes


def test_report_lists_every_fact_memory_and_time(model, tokenizer, articles, tmp_path):
    report = run_demo(
        model, tokenizer, ratio=0.5, context_tokens=250, n_facts=3, profiles_dir=tmp_path, articles=articles
    )
    text = format_report(report)
    for key, value in zip(report.keys, report.expected):
        assert key in text and value in text
    assert "KV memory" in text and "MB" in text and "prefill time" in text
    assert "Note:" in text  # the fallback is printed, not hidden
