"""One context, many questions: LUKVCache.fork shares the compressed stores, and LUKVPipeline answers each
question as a deep copy of the compressed context would, holding the stores once."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import CharTokenizer, greedy_with_logits, tiny_model

from lukv_cache import LUKVCache, LUKVPipeline
from lukv_cache.cache.storage.layer import LUKVLayer
from lukv_cache.errors import ConfigurationError
from lukv_cache.testing import prompt


def _filled(model, ratio=0.5):
    cache = LUKVCache(ratio)
    with torch.no_grad():
        model(prompt(1, 40, seed=1), past_key_values=cache, use_cache=True)
    return cache


def test_a_fork_shares_the_stores_and_answers_as_a_deep_copy_does():
    model = tiny_model("llama")
    cache = _filled(model)
    question = torch.cat([prompt(1, 40, seed=1), prompt(1, 6, seed=2)], 1)
    fork, deep = cache.fork(), copy.deepcopy(cache)
    for mine, theirs in zip(fork.layers, cache.layers):
        assert mine.store is theirs.store
        assert mine.suffix_keys.data_ptr() != theirs.suffix_keys.data_ptr()
    got, got_logits = greedy_with_logits(model, question, fork, new_tokens=20)  # folds nothing, appends
    want, want_logits = greedy_with_logits(model, question, deep, new_tokens=20)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=0)
    # the original is untouched: a second fork answers the same
    again, _ = greedy_with_logits(model, question, cache.fork(), new_tokens=20)
    assert torch.equal(again, want)


def test_a_fork_that_folds_or_crops_leaves_the_shared_store_alone():
    model = tiny_model("llama")
    cache = LUKVCache(0.5, fold_interval=4)
    with torch.no_grad():
        model(prompt(1, 40, seed=1), past_key_values=cache, use_cache=True)
    before = [layer.store.keys.clone() for layer in cache.layers if isinstance(layer, LUKVLayer)]
    fork = cache.fork()
    greedy_with_logits(
        model, torch.cat([prompt(1, 40, seed=1), prompt(1, 3, seed=2)], 1), fork, new_tokens=12
    )
    fork.crop(-30)
    after = [layer.store.keys for layer in cache.layers if isinstance(layer, LUKVLayer)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_the_pipeline_answers_like_a_deep_copy_per_question():
    model, tokenizer = tiny_model("llama"), CharTokenizer()
    context, questions = "a context of some length for the tiny model " * 2, ["who?", "when was it?"]
    answers = LUKVPipeline(model, tokenizer, ratio=0.5)(context, questions, max_new_tokens=5)
    context_ids = tokenizer(context).input_ids
    cache = LUKVCache(0.5)
    with torch.no_grad():
        cache.prefill(model, context_ids)
    for question, answer in zip(questions, answers):
        ids = torch.cat([context_ids, tokenizer(f"\n\nQuestion: {question}\nAnswer:").input_ids], 1)
        out, _ = greedy_with_logits(model, ids, copy.deepcopy(cache), new_tokens=5)
        assert answer == tokenizer.decode(out[0, ids.shape[1] :])


def test_the_pipeline_refuses_what_cannot_work():
    model, tokenizer = tiny_model("llama"), CharTokenizer()
    with pytest.raises(ConfigurationError, match="empty"):
        LUKVPipeline(model, tokenizer)("  ", ["q"])
    with pytest.raises(ConfigurationError, match="question"):
        LUKVPipeline(model, tokenizer, question_template="no slot")
    with pytest.raises(ConfigurationError, match="not both"):
        LUKVPipeline(model, tokenizer, lambda: LUKVCache(0.5), ratio=0.5)


@pytest.mark.parametrize("questions", [None, ["a", None], b"bytes", 3, {"q": "a"}])
def test_the_pipeline_refuses_questions_that_are_not_strings_before_compressing(questions):
    calls = []
    ask = LUKVPipeline(tiny_model("llama"), CharTokenizer(), lambda: calls.append(1) or LUKVCache(0.5))
    with pytest.raises(ConfigurationError, match="questions must be a string or a list of strings"):
        ask("some context", questions)
    assert not calls  # refused before the context is compressed


@pytest.mark.parametrize(
    "template", ["Q: {other} {question}", "{question} {}", "{question} {0}", "{question", 3]
)
def test_a_question_template_with_another_field_or_a_lone_brace_is_refused(template):
    with pytest.raises(ConfigurationError, match="question_template must be a string with the field"):
        LUKVPipeline(tiny_model("llama"), CharTokenizer(), question_template=template)


def test_a_question_template_with_doubled_braces_is_accepted():
    ask = LUKVPipeline(tiny_model("llama"), CharTokenizer(), question_template="{{json}}: {question}")
    assert ask.question_template.format(question="q") == "{json}: q"


@pytest.mark.parametrize("context", [None, b"bytes"])
def test_a_context_that_is_not_text_is_refused(context):
    with pytest.raises(ConfigurationError, match="not text"):
        LUKVPipeline(tiny_model("llama"), CharTokenizer())(context, "q")


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_a_cache_of_your_own_holds_the_compressed_context_and_answers_as_make_cache_would(keyword):
    """Issue 54, item 7: cache= raised generate's "multiple values" TypeError; past_key_values= was ignored
    (the cache stayed empty)."""
    model, tokenizer = tiny_model("llama"), CharTokenizer()
    context, questions = "a context of some length for the tiny model " * 2, ["who?", "when was it?"]
    want = LUKVPipeline(model, tokenizer, ratio=0.5)(context, questions, max_new_tokens=5)
    mine = LUKVCache(0.5)
    ask = LUKVPipeline(model, tokenizer, lambda: pytest.fail("make_cache() ran although a cache was given"))
    assert ask(context, questions, max_new_tokens=5, **{keyword: mine}) == want
    assert ask.cache is mine
    assert mine.get_seq_length() == tokenizer(context).input_ids.shape[1]  # the context, compressed
    assert int(mine.stored_tokens().max()) < mine.get_seq_length()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"cache": "DynamicCache"}, "cache= must be a LUKVCache"),
        ({"past_key_values": "DynamicCache"}, "past_key_values= must be a LUKVCache"),
        ({"cache": "LUKVCache", "past_key_values": "LUKVCache"}, "cache= or as past_key_values=, not both"),
        ({"cache": "filled"}, "already holds 40 tokens"),
        ({"attention_mask": torch.ones(1, 3)}, "attention_mask= cannot be passed"),
        ({"input_ids": torch.ones(1, 3)}, "input_ids= cannot be passed"),
        (
            {"max_new_tokens": 0},
            "max_new_tokens is the answer tokens decoded per question and must be a positive",
        ),
        ({"max_new_tokens": -1}, "must be a positive integer, got -1"),
        ({"max_new_tokens": 2.5}, "must be a positive integer, got 2.5"),
        ({"max_new_tokens": True}, "must be a positive integer, got True"),
    ],
)
def test_what_the_pipeline_cannot_honour_is_a_typed_error_before_compressing(kwargs, message):
    from transformers import DynamicCache

    model = tiny_model("llama")
    made = {
        "DynamicCache": DynamicCache,
        "LUKVCache": lambda: LUKVCache(0.5),
        "filled": lambda: _filled(model),
    }
    kwargs = {k: made[v]() if isinstance(v, str) else v for k, v in kwargs.items()}
    calls = []
    ask = LUKVPipeline(model, CharTokenizer(), lambda: calls.append(1) or LUKVCache(0.5))
    with pytest.raises(ConfigurationError, match="LUKVPipeline") as info:
        ask("some context", ["q"], **kwargs)
    assert message in str(info.value)
    assert not calls and ask.cache is None  # refused before the context is compressed
