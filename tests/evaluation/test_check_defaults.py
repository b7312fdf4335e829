"""``lukv check`` without --scorer / --allocators measures what the README's one line uses for the model
(issue 44, item 5): before, it measured keydiff with uniform / adakv / profile whatever the one line used."""

from __future__ import annotations

from lukv_cache.cli import build_parser
from lukv_cache.evaluation.check.run import check
from lukv_cache.profiles import save_to_local_dir
from lukv_cache.testing import flat_profile, random_surrogate

TEXT = "The ferry to Kestrel Quay leaves at nine. The harbour master is called Ada. " * 8


def _check(model, tokenizer, profiles_dir, **kwargs):
    return check(
        model, tokenizer, [(TEXT, ["When does the ferry leave?"])], ratios=(0.5,), max_new_tokens=2,
        profiles_dir=profiles_dir, show_progress=False, **kwargs,
    )  # fmt: skip


def test_check_measures_kvzap_global_first_where_the_model_has_a_kvzap_profile(model, tokenizer, tmp_path):
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    kvzap = flat_profile(
        layers, heads, scorer="kvzap", head_dim=16, window=32, model_id=model.config.name_or_path,
        surrogate=random_surrogate(layers, heads),
    )  # fmt: skip
    save_to_local_dir(kvzap, tmp_path)
    report = _check(model, tokenizer, tmp_path)
    assert report.scorer == "kvzap"
    assert [row.allocator for row in report.rows] == ["global", "uniform", "adakv", "profile"]
    assert not any(row.skipped for row in report.rows)


def test_check_measures_keydiff_uniform_first_where_the_model_has_no_profile(model, tokenizer, tmp_path):
    report = _check(model, tokenizer, tmp_path)
    assert report.scorer == "keydiff"
    assert [row.allocator for row in report.rows] == ["uniform", "adakv", "profile"]
    assert report.rows[-1].skipped  # no profile: its row says so instead of running


def test_a_scorer_given_alone_keeps_the_one_lines_allocator_for_it_first(model, tokenizer, tmp_path):
    report = _check(model, tokenizer, tmp_path, scorer="snapkv")
    assert report.scorer == "snapkv"
    assert [row.allocator for row in report.rows] == ["uniform", "adakv", "profile"]


def test_the_command_leaves_scorer_and_allocators_to_the_one_line():
    args = build_parser().parse_args(["check", "smollm2", "--text", "a.txt", "--questions", "q.txt"])
    assert args.scorer is None and args.allocators is None


def test_check_measures_budgets_on_a_sliding_model_whose_one_line_holds_bytes(tokenizer, tmp_path):
    """On a sliding-window model the one line holds ``ratio`` as ``memory=1 - ratio`` (docs/memory.md), so
    ``lukv check`` with nothing chosen measures those budgets and recommends one; a ratio given is measured
    as asked."""
    from helpers import tiny_model

    from lukv_cache.evaluation.methods import CHECK_RATIOS

    gemma = tiny_model(
        "gemma3", attn="eager", vocab_size=tokenizer.vocab_size, sliding_window=64,
        max_position_embeddings=2048, name_or_path="tests/tiny-gemma3",
    )  # fmt: skip
    contexts = [(TEXT, ["When does the ferry leave?"])]
    report = check(gemma, tokenizer, contexts, max_new_tokens=2, profiles_dir=tmp_path, show_progress=False)
    assert sorted({row.memory for row in report.rows}) == sorted(round(1 - r, 6) for r in CHECK_RATIOS)
    assert all(row.ratio is None for row in report.rows)
    report = _check(gemma, tokenizer, tmp_path)  # ratios=(0.5,) given
    assert [row.ratio for row in report.rows] == [0.5] * len(report.rows)
