import pytest
import torch
from transformers import DynamicCache

from lukv_cache.errors import ConfigurationError
from lukv_cache.evaluation.tasks.samples import ContinuationSample, RetrievalSample, make_samples
from lukv_cache.evaluation.tasks.scoring import evaluate_sample
from lukv_cache.evaluation.tasks.statistics import mean_and_sem


def test_multikey_context_holds_every_needle_and_each_question_asks_one(tokenizer, articles):
    (sample,) = make_samples("niah_multikey", tokenizer, 1, 400, n_needles=3, articles=articles)
    assert isinstance(sample, RetrievalSample) and len(sample.questions) == 3
    values = [q.answers[0] for q in sample.questions]
    assert len(set(values)) == 3
    for question in sample.questions:
        key = question.prompt.split(" for ", 1)[1].split(" mentioned", 1)[0]
        assert f"One of the special magic numbers for {key} is: {question.answers[0]}." in sample.context
        assert question.prompt.endswith("mentioned in the provided text is")
        assert not any(v in question.prompt for v in values)  # the question never leaks the answer


def test_context_length_is_close_to_the_requested_tokens(tokenizer, articles):
    for sample in make_samples("niah_single", tokenizer, 3, 500, articles=articles):
        n = len(tokenizer(sample.context)["input_ids"])
        assert 450 <= n <= 600


def test_samples_are_seeded(tokenizer, articles):
    first = make_samples("niah_multikey", tokenizer, 2, 300, seed=1, articles=articles)
    again = make_samples("niah_multikey", tokenizer, 2, 300, seed=1, articles=articles)
    other = make_samples("niah_multikey", tokenizer, 2, 300, seed=2, articles=articles)
    assert first == again
    assert first != other


def test_multivalue_asks_for_all_values_in_one_question(tokenizer, articles):
    (sample,) = make_samples("niah_multivalue", tokenizer, 1, 300, n_needles=4, articles=articles)
    (question,) = sample.questions
    assert len(question.answers) == 4
    assert "What are all the special magic numbers" in question.prompt
    assert all(value in sample.context for value in question.answers)


def test_continuation_sample_has_exact_token_counts(tokenizer, articles):
    samples = make_samples("continuation", tokenizer, 2, 200, continuation_tokens=32, articles=articles)
    assert all(isinstance(s, ContinuationSample) for s in samples)
    assert [(len(s.context_ids), len(s.continuation_ids)) for s in samples] == [(200, 32), (200, 32)]


def test_unknown_task_raises_configuration_error(tokenizer, articles):
    with pytest.raises(ConfigurationError, match="niah_multikey"):
        make_samples("needle", tokenizer, 1, 300, articles=articles)


def test_continuation_nll_through_the_cache_matches_one_full_forward(model, tokenizer, articles):
    (sample,) = make_samples("continuation", tokenizer, 1, 120, continuation_tokens=16, articles=articles)
    result = evaluate_sample(model, tokenizer, sample, DynamicCache)
    ids = torch.tensor([sample.context_ids + sample.continuation_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, 119:-1]
    expected = torch.nn.functional.cross_entropy(logits, ids[0, 120:])
    assert result.score == pytest.approx(float(expected), abs=1e-4)
    assert result.context_tokens == 120 and result.kv_bytes > 0


def test_retrieval_result_scores_every_question(model, tokenizer, articles):
    (sample,) = make_samples("niah_multikey", tokenizer, 1, 200, n_needles=2, articles=articles)
    result = evaluate_sample(model, tokenizer, sample, DynamicCache)
    assert len(result.outputs) == len(result.question_scores) == 2
    assert result.score == sum(result.question_scores) / 2


def test_mean_and_sem_of_known_values():
    assert mean_and_sem([1.0, 0.0, 1.0, 0.0]) == pytest.approx((0.5, 0.288675), abs=1e-6)
    assert mean_and_sem([0.3]) == (0.3, 0.0)


@pytest.mark.parametrize("cache_kind", ["dynamic", "lukv"])
def test_questions_decoded_as_one_batch_match_one_by_one_decoding(model, tokenizer, articles, cache_kind):
    import copy

    from lukv_cache import LUKVCache
    from lukv_cache.evaluation.decoding import greedy_decode, stop_ids
    from lukv_cache.evaluation.tasks.scoring import context_ids, score_prefilled
    from lukv_cache.profiling.continuation import prefill

    def new_cache():
        return DynamicCache() if cache_kind == "dynamic" else LUKVCache(0.5, "keydiff", config=model.config)

    (sample,) = make_samples("niah_multikey", tokenizer, 1, 250, n_needles=3, articles=articles)
    prompts = [tokenizer(q.prompt)["input_ids"] for q in sample.questions]
    assert len({len(p) for p in prompts}) == 1  # keys are drawn so that the questions batch
    cache = new_cache()
    last = prefill(model, context_ids(tokenizer, sample), cache)
    one_by_one = []
    for prompt in prompts:
        ids = greedy_decode(model, copy.deepcopy(cache), torch.tensor([prompt]), 12, stop_ids(tokenizer))[0]
        one_by_one.append(tokenizer.decode(ids))
    _, batched, _ = score_prefilled(model, tokenizer, sample, cache, last)
    # Batched rows may stop earlier (once an answer looks complete); up to there they must agree.
    assert all(b and s.startswith(b) for b, s in zip(batched, one_by_one))


def test_recall_quotes_whole_sentences_of_its_own_context(tokenizer, articles):
    from lukv_cache.evaluation.tasks.samples import RecallSample

    samples = make_samples("recall", tokenizer, 2, 300, n_needles=3, articles=articles)
    assert samples == make_samples("recall", tokenizer, 2, 300, n_needles=3, articles=articles)  # seeded
    for sample in samples:
        assert isinstance(sample, RecallSample) and len(sample.context_ids) == 300 and len(sample.quotes) == 3
        context = tokenizer.decode(list(sample.context_ids))
        for prompt, cue, rest in sample.quotes:
            cue_text = tokenizer.decode(list(cue))
            assert cue_text in tokenizer.decode(list(prompt))  # the prompt names the cue
            assert tokenizer.decode(list(cue + rest)) in context  # the sentence is the context's own
            assert len(cue_text.split()) == 5 and 8 <= len(rest) <= 48


def test_recall_scores_the_greedy_copy_of_each_sentence(model, tokenizer, articles):
    (sample,) = make_samples("recall", tokenizer, 1, 200, n_needles=2, articles=articles)
    result = evaluate_sample(model, tokenizer, sample, DynamicCache)
    assert len(result.question_scores) == 2 and result.score == sum(result.question_scores) / 2
    for (prompt, cue, rest), got in zip(sample.quotes, result.question_scores):
        ids = torch.tensor([sample.context_ids + prompt + cue + rest])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
        start = len(sample.context_ids) + len(prompt) + len(cue) - 1
        predicted = logits[start : start + len(rest)].argmax(-1)
        assert got == pytest.approx(float((predicted == torch.tensor(rest)).double().mean()))


def test_recall_without_enough_sentences_is_refused(tokenizer, articles):
    with pytest.raises(ConfigurationError, match="whole sentences to quote"):
        make_samples("recall", tokenizer, 1, 300, n_needles=500, articles=articles)
