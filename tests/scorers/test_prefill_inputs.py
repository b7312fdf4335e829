"""KVzip's inputs are checked before any forward: ids, the padding mask, the repeat prompt and its settings
are typed ConfigurationErrors that say what to pass instead (``check_prefill_inputs``, ``RepeatPrompt``,
``kvzip_scorer``)."""

from __future__ import annotations

import pytest
import torch

from lukv_cache.errors import ConfigurationError
from lukv_cache.scorers import kvzip_scorer
from lukv_cache.scorers.kvzip import RepeatPrompt

IDS = torch.tensor([[5, 6, 7, 8], [0, 0, 7, 8]])
LEFT = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])


def _check(ids, mask, left_padding_only=True, vocab_size=16):
    from lukv_cache.cache.compression.prefill_inputs import check_prefill_inputs

    return check_prefill_inputs(ids, mask, left_padding_only=left_padding_only, vocab_size=vocab_size)


def test_a_left_padded_batch_passes_and_returns_its_mask():
    assert torch.equal(_check(IDS, LEFT), LEFT)
    assert torch.equal(_check(IDS, LEFT.bool()), LEFT)
    assert torch.equal(_check(IDS, None), torch.ones_like(IDS))
    assert _check(IDS, None, vocab_size=None).dtype == torch.long


@pytest.mark.parametrize(
    "ids",
    [torch.tensor([5, 6, 7]), torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, 4, dtype=torch.long),
     torch.ones(1, 2, 3, dtype=torch.long), torch.tensor([[1.0, 2.0]]), [[1, 2]]],
    ids=["1-D", "no tokens", "no rows", "3-D", "float", "list"],
)  # fmt: skip
def test_ids_that_are_not_a_non_empty_2d_integer_tensor_are_refused(ids):
    with pytest.raises(ConfigurationError, match=r"input_ids must be a non-empty \[batch, tokens\] integer"):
        _check(ids, None)


@pytest.mark.parametrize("bad", [16, 99, -1])
def test_ids_outside_the_vocabulary_are_refused(bad):
    ids = IDS.clone()
    ids[0, 1] = bad
    with pytest.raises(ConfigurationError, match=r"\[0, 16\).*model's own tokenizer"):
        _check(ids, LEFT)


@pytest.mark.parametrize(
    "mask",
    [torch.ones(2, 3, dtype=torch.long), torch.ones(4, dtype=torch.long), torch.ones(1, 2, 4, dtype=torch.long),
     [[1, 1, 1, 1], [0, 0, 1, 1]]],
    ids=["short", "1-D", "3-D", "list"],
)  # fmt: skip
def test_a_mask_of_the_wrong_shape_or_rank_is_refused(mask):
    with pytest.raises(ConfigurationError, match="shape of input_ids"):
        _check(IDS, mask)


@pytest.mark.parametrize("value", [2, -1])
def test_a_mask_with_values_other_than_0_and_1_is_refused(value):
    mask = LEFT.clone()
    mask[0, 0] = value
    with pytest.raises(ConfigurationError, match="only 0 .* and 1"):
        _check(IDS, mask)


@pytest.mark.parametrize(
    "mask", [torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]), torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1]])],
    ids=["right-padded", "holey"],
)  # fmt: skip
def test_right_padded_or_holey_masks_are_refused_when_left_padding_is_required(mask):
    with pytest.raises(ConfigurationError, match="Row 1 .* left padding.*padding_side = 'left'"):
        _check(IDS, mask)
    assert torch.equal(_check(IDS, mask, left_padding_only=False), mask)


def test_a_row_of_padding_only_is_refused():
    with pytest.raises(ConfigurationError, match="Row 1 .* all padding"):
        _check(IDS, torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]]), left_padding_only=False)


# ------------------------------------------------------------------------------------------ repeat prompt


@pytest.mark.parametrize(
    "fields", [((-1, 2), (3,), (4,)), ((1, 2), (3.5,), (4,)), ((1,), (2,), ("x",)), ((1,), (True,), (2,))]
)
def test_a_repeat_prompt_of_other_than_token_ids_is_refused(fields):
    with pytest.raises(ConfigurationError, match="RepeatPrompt.* must be token ids"):
        RepeatPrompt(*fields)


def test_repeat_prompt_ids_outside_the_vocabulary_are_refused():
    prompt = RepeatPrompt((5, 6), (7,), (300,))
    prompt.check_vocabulary(301)
    with pytest.raises(ConfigurationError, match=r"\[300\] outside the model's vocabulary of 128"):
        prompt.check_vocabulary(128)


def _char_tokenizer(chat_template: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(c): i for i, c in enumerate(range(32, 127))} | {"\n": 95}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=" "))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=" ")
    tok.chat_template = chat_template
    return tok


@pytest.mark.parametrize(
    "template",
    ["{{ raise_exception('system messages only') }}", "{% for m in messages %}{{ m.x.y }}{% endfor %}"],
)
def test_a_chat_template_that_raises_is_a_configuration_error_with_the_way_out(template):
    with pytest.raises(ConfigurationError, match="chat template failed.*template='plain'.*repeat_prompt="):
        RepeatPrompt.from_tokenizer(_char_tokenizer(template))
    assert RepeatPrompt.from_tokenizer(_char_tokenizer(template), template="plain").suffix == (95,)


# ------------------------------------------------------------------------------------------ kvzip_scorer


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"window": -1}, "window"), ({"window": 2.5}, "window"), ({"overlap": -1}, "overlap"),
     ({"overlap": True}, "overlap"), ({"weighted": "yes"}, "weighted"), ({"name": ""}, "name")],
)  # fmt: skip
def test_kvzip_scorer_refuses_bad_settings(kwargs, name):
    with pytest.raises(ConfigurationError, match=name):
        kvzip_scorer(**kwargs)


def test_kvzip_scorer_accepts_zero_window_and_overlap():
    scorer = kvzip_scorer(window=0, overlap=0)
    assert scorer.window == 0 and scorer.reconstruction.overlap == 0
