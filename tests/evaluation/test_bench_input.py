"""``lukv bench`` (and ``lukv demo``) refuse what they cannot measure before anything runs, as ``lukv check``
does: a context longer than the model's positions (before its weights load), and counts that cannot run
(issue 54, item 5)."""

from __future__ import annotations

import pytest
from demo_helpers import byte_tokenizer, tiny_llama

from lukv_cache.cli import main
from lukv_cache.errors import ConfigurationError
from lukv_cache.evaluation.runner import BenchSettings, run_benchmark
from lukv_cache.testing import tiny_model

POSITIONS = 512


def _short_model():
    """The evaluation tests' tiny Llama with 512 positions."""
    return tiny_model(
        vocab_size=tiny_llama().config.vocab_size,
        max_position_embeddings=POSITIONS,
        name_or_path="tests/short",
    )


@pytest.fixture(scope="module")
def short_model_dir(tmp_path_factory):
    """A tiny Llama of 512 positions and its byte tokenizer, saved as a model folder."""
    folder = tmp_path_factory.mktemp("tiny-llama-512")
    _short_model().save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "command, extra",
    [
        ("bench", ["--context-tokens", "100000"]),
        ("bench", ["--context-tokens", "500", "--tasks", "continuation"]),  # 500 + 128 continuation tokens
        ("demo", ["--context-tokens", "100000"]),
    ],
)
def test_a_context_longer_than_the_models_positions_is_refused_before_the_weights_load(
    command, extra, short_model_dir, tmp_path, no_weights, capsys
):
    out = ["--out", str(tmp_path)] if command == "bench" else []  # the demo writes no file
    code = main([command, "--model", str(short_model_dir), *extra, *out])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: --context-tokens ") and "\n" not in err
    assert f"positions but the model has {POSITIONS}" in err and "pass a --context-tokens of at most" in err
    assert not list(tmp_path.iterdir())  # no results written


def test_a_sample_longer_than_the_positions_is_refused_before_any_method_runs(tokenizer, articles):
    """500 context tokens + a 12-token answer pass the early bound; the question's own tokens do not fit."""
    model = _short_model()
    settings = BenchSettings(
        tasks=("niah_multikey",),
        samples=1,
        context_tokens=500,
        ratios=(0.5,),
        scorers=("keydiff",),
        allocators=("uniform",),
        needles=2,
    )
    ran = []
    with pytest.raises(ConfigurationError, match=f"Sample 1 of niah_multikey .* the model has {POSITIONS}"):
        run_benchmark(model, tokenizer, settings, articles=articles, log=ran.append)
    assert not ran  # nothing was prefilled or scored


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "needles",
            -1,
            "needles (needles per retrieval context, sentences quoted per recall context) must be an "
            "integer in [1, 900], got -1.",
        ),
        ("needles", 0, "must be an integer in [1, 900], got 0"),
        (
            "continuation_tokens",
            0,
            "continuation_tokens (teacher-forced tokens after each continuation context) "
            "must be an integer of at least 2, got 0.",
        ),
        ("samples", 0, "samples (contexts per task) must be an integer of at least 1, got 0."),
        ("context_tokens", 8, "must be an integer of at least 32, got 8"),
    ],
)
def test_run_benchmark_refuses_counts_that_cannot_run(model, tokenizer, articles, field, value, message):
    fields = dict(tasks=("continuation",), samples=1, context_tokens=64, ratios=(0.5,), scorers=("keydiff",))
    settings = BenchSettings(**{**fields, "allocators": ("uniform",), field: value})
    with pytest.raises(ConfigurationError) as info:
        run_benchmark(model, tokenizer, settings, articles=articles, log=None)
    assert message in str(info.value)


def test_the_needles_bound_is_the_number_of_distinct_keys():
    from lukv_cache.evaluation import methods
    from lukv_cache.evaluation.tasks import samples

    assert methods.MAX_NEEDLES == len(samples._ADJECTIVES) * len(samples._NOUNS)
