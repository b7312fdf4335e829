"""A row of a left-padded batch answers exactly as the same row alone.

Scorers never see padding (the cache scores each row's real tokens only), positions come from the mask on
every path, and every allocator budgets each row by its own tokens. So for every registered scorer and
allocator, a batch of rows of different lengths generates, row by row, the tokens and (within 1e-4) the
logits of each row generated alone: through ``generate`` and through ``cache.prefill`` then ``generate``.
"""

from __future__ import annotations

import pytest
import torch
from helpers import PROFILE_FAMILY, scorer_for, tiny_model

from lukv_cache import LUKVCache
from lukv_cache.allocation import ALLOCATORS
from lukv_cache.profiles import Profile
from lukv_cache.scorers import SCORERS, get_scorer
from lukv_cache.scorers.kvzip import RepeatPrompt
from lukv_cache.testing import PAD, curve_profile, left_padded, with_gains

PROMPT = RepeatPrompt(first=(5, 6, 7), next=(8, 9), suffix=(10,))
LENGTHS = (70, 45, 23)  # shorter than snapkv's 32-query window and expected_attention's 64 queries too
NEW_TOKENS = 4
QUESTION = torch.tensor([[11, 12, 13]])

MODELS = {
    "llama": lambda: tiny_model("llama", "sdpa"),
    "qwen2": lambda: tiny_model("qwen2", "sdpa"),
    "gemma2": lambda: tiny_model("gemma2", "eager"),  # soft-capped logits, sliding and full layers
    "mistral_sliding": lambda: tiny_model("mistral", "sdpa", sliding_window=16),
}


def _profile(model) -> Profile:
    """A crafted profile with uneven heads for ``model``'s shape (read at each row's ratio)."""
    text = model.config.get_text_config()
    layers, heads = text.num_hidden_layers, text.num_key_value_heads
    return with_gains(curve_profile(layers, heads, grid=[0.25, 0.5, 0.75], spread=0.2, head_dim=16))


def _cache(model, ratio: float, scorer: str, allocator: str) -> LUKVCache:
    kwargs = {"profile": _profile(model)} if allocator in PROFILE_FAMILY else None
    if allocator == "threshold":
        kwargs = {"value": 0.0}  # keydiff keeps about half; any threshold tests that rows are alone
    return LUKVCache(ratio, scorer_for(scorer, model), allocator, sink=2, window=3, allocator_kwargs=kwargs)


def _generate(model, ids, mask, cache, path: str):
    """Greedy tokens and per-step logits ``[B, steps, V]`` from ``cache``."""
    kwargs = dict(
        max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    with torch.no_grad():
        if path == "prefill":
            cache.prefill(model, ids, mask, repeat_prompt=PROMPT)
            question = QUESTION.expand(ids.shape[0], -1)
            ids = torch.cat([ids, question], dim=1)
            mask = torch.cat([mask, torch.ones_like(question)], dim=1)
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, **kwargs)
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits, dim=1)


def _check_rows(model_name: str, scorer: str, allocator: str, ratio: float, path: str) -> None:
    model = MODELS[model_name]()
    ids, mask = left_padded(LENGTHS, seed=5)
    batch = _cache(model, ratio, scorer, allocator)
    tokens, logits = _generate(model, ids, mask, batch, path)
    for row, n in enumerate(LENGTHS):
        alone_ids = ids[row : row + 1, -n:]
        alone = _cache(model, ratio, scorer, allocator)
        want_tokens, want_logits = _generate(model, alone_ids, torch.ones_like(alone_ids), alone, path)
        assert torch.equal(tokens[row : row + 1], want_tokens), f"row {row} ({n} tokens): tokens differ"
        torch.testing.assert_close(logits[row : row + 1], want_logits, atol=1e-4, rtol=0)
        assert torch.equal(batch.stored_tokens()[:, row], alone.stored_tokens()[:, 0]), f"row {row}: kept"


def _path(scorer: str) -> str:
    return "prefill" if get_scorer(scorer).reconstruction is not None else "generate"


FORWARD_SCORERS = [name for name in SCORERS.names() if get_scorer(name).reconstruction is None]


@pytest.mark.parametrize("allocator", ALLOCATORS.names())
@pytest.mark.parametrize("scorer", SCORERS.names())
@pytest.mark.parametrize("model_name", list(MODELS))
def test_every_scorer_and_allocator_keeps_each_rows_tokens(model_name, scorer, allocator):
    _check_rows(model_name, scorer, allocator, 0.5, _path(scorer))


@pytest.mark.parametrize("allocator", ALLOCATORS.names())
@pytest.mark.parametrize("scorer", FORWARD_SCORERS)
def test_cache_prefill_then_generate_keeps_each_rows_tokens(scorer, allocator):
    _check_rows("llama", scorer, allocator, 0.5, "prefill")


@pytest.mark.parametrize("scorer", FORWARD_SCORERS)
def test_a_row_is_scored_on_its_own_tokens_only(scorer):
    """The sharpest check: each row's scores equal the row's scores alone (padding scores -inf)."""
    model = MODELS["llama"]()
    ids, mask = left_padded(LENGTHS, seed=5)
    batch = LUKVCache(0.0, scorer_for(scorer, model), sink=2, window=3, keep_scores=True)
    with torch.no_grad():
        batch.prefill(model, ids, mask)
    width = ids.shape[1]
    for row, n in enumerate(LENGTHS):
        alone = LUKVCache(0.0, scorer_for(scorer, model), sink=2, window=3, keep_scores=True)
        with torch.no_grad():
            alone.prefill(model, ids[row : row + 1, -n:])
        for layer, scores in batch.prefill_scores.items():
            torch.testing.assert_close(scores[row, :, width - n :], alone.prefill_scores[layer][0])
            assert (scores[row, :, : width - n] == float("-inf")).all()


@pytest.mark.parametrize("path", ["generate", "prefill"])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_ratio_zero_keeps_each_row_as_alone(model_name, path):
    _check_rows(model_name, "keydiff", "uniform", 0.0, path)


def test_padding_is_really_left_padding_here():
    ids, mask = left_padded(LENGTHS, seed=5)
    assert (ids[mask == 0] == PAD).all() and mask.sum(-1).tolist() == list(LENGTHS)
