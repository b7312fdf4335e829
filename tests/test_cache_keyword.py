"""The library's own calls pass the cache by the keyword the model takes (issue 43): ``cache`` from
transformers 5.24, which renamed ``past_key_values`` (the old name still works there, with a FutureWarning
at every call), ``past_key_values`` on 5.23. Under ``simplefilter("error", FutureWarning)`` every entry point
that runs the model must work on both releases."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from helpers import tiny_model
from packaging.version import Version

from lukv_cache import LUKVCache, LUKVPipeline
from lukv_cache._compat import cache_kwarg
from lukv_cache.evaluation.check.run import _predictions
from lukv_cache.evaluation.decoding import greedy_decode
from lukv_cache.evaluation.prefill import SharedPrefill
from lukv_cache.evaluation.tasks.samples import ContinuationSample
from lukv_cache.evaluation.tasks.scoring import score_prefilled
from lukv_cache.profiling.continuation import prefill
from lukv_cache.profiling.oracle import oracle_importance, prefill_context
from lukv_cache.testing import BYTE_VOCAB, byte_tokenizer, prompt

RENAMED = Version(transformers.__version__) >= Version("5.24")


@pytest.fixture(autouse=True)
def _future_warnings_are_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        yield


def test_cache_kwarg_is_the_keyword_of_the_installed_release():
    assert cache_kwarg(tiny_model()) == ("cache" if RENAMED else "past_key_values")


def test_cache_kwarg_follows_the_forward_of_a_model_written_before_the_rename():
    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None): ...

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=None): ...

    assert cache_kwarg(Old()) == "past_key_values"
    # before 5.24 a `cache` parameter is a model's own (XLM's dict), not transformers' cache argument
    assert cache_kwarg(New()) == ("cache" if RENAMED else "past_key_values")


def test_prefill_runs_the_model_without_a_deprecated_keyword():
    cache = LUKVCache(0.5)
    with torch.no_grad():
        cache.prefill(tiny_model(), prompt(1, 40))
    assert cache.get_seq_length() == 40
    assert cache.stored_tokens().max() < 40  # compressed


def test_a_reconstruction_prefill_runs_its_passes_without_a_deprecated_keyword():
    cache = LUKVCache(0.5, scorer="kvzip")
    with torch.no_grad():
        cache.prefill(tiny_model(vocab_size=BYTE_VOCAB), prompt(1, 40), tokenizer=byte_tokenizer())
    assert cache.stored_tokens().max() < 40


def test_the_pipeline_generates_without_a_deprecated_keyword():
    model = tiny_model(vocab_size=BYTE_VOCAB)
    answers = LUKVPipeline(model, byte_tokenizer(), ratio=0.5)("a context " * 4, ["who?"], max_new_tokens=3)
    assert len(answers) == 1


def test_the_evaluation_tasks_prefill_decode_and_score_without_a_deprecated_keyword():
    model, ids = tiny_model(), prompt(1, 32)
    decoding, scoring = LUKVCache(0.5), LUKVCache(0.5)
    prefill(model, ids, decoding)
    assert len(greedy_decode(model, decoding, prompt(1, 3, seed=1), max_new_tokens=3)[0]) == 3
    sample = ContinuationSample("tiny", tuple(ids[0].tolist()), tuple(prompt(1, 4, seed=2)[0].tolist()))
    nll, _, _ = score_prefilled(model, None, sample, scoring, prefill(model, ids, scoring))
    assert nll > 0


def test_the_check_teacher_forces_an_answer_without_a_deprecated_keyword():
    model, cache = tiny_model(), LUKVCache(0.5)
    prefill(model, prompt(1, 32), cache)
    predicted, nll = _predictions(model, cache, prompt(1, 2, seed=1), [5, 6], stops=[], max_new_tokens=4)
    assert len(predicted) == 3 and nll > 0


def test_the_shared_prefill_records_without_a_deprecated_keyword():
    recording = SharedPrefill.record(tiny_model(), prompt(1, 32), n_queries=4)
    assert recording.keys[0].shape[-2] == 32


def test_the_oracle_prefills_and_decodes_without_a_deprecated_keyword():
    model = tiny_model()
    importance, answer = oracle_importance(
        model, prefill_context(model, prompt(1, 32)), prompt(1, 4, seed=1), k_max=3
    )
    assert importance.shape == (2, 2, 32) and len(answer) == 3
