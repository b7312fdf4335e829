"""Every registered scorer and allocator meets the contract the cache relies on.

Parametrised from the registries: a new scorer or allocator is tested here without editing this file
(CONTRIBUTING.md). An allocator whose factory needs arguments declares them in ``_factory_args`` (for
the factory alone) and ``_cache_args`` (in a cache); one registered with ``reads_profile=True`` gets a
profile's table and curve there without editing this file.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import scorer_for, tiny_model
from transformers import DynamicCache

from lukv_cache import AllocationRequest, LUKVCache
from lukv_cache.allocation import ALLOCATORS, get_allocator
from lukv_cache.profiles import Profile
from lukv_cache.scorers import SCORERS
from lukv_cache.scorers.kvzip import RepeatPrompt
from lukv_cache.testing import flat_profile, left_padded, prompt, with_gains

LAYERS, HEADS = 2, 2  # the tiny llama's shape
# reconstruction scorers (kvzip) need the repeat prompt in token ids; the tiny models have no tokenizer
PROMPT = RepeatPrompt(first=(5, 6, 7), next=(8, 9), suffix=(10,))


def _factory_args(name: str, ratio: float) -> dict:
    if name == "threshold":
        # the request's scores are uniform in [0, 1): the ratio is the threshold that removes that share
        return {"value": ratio}
    # the allocators that read a profile (reads_profile=True) read a flat curve (with a score-to-gain
    # table): at every ratio it asks for exactly the uniform total
    return {"profile": _flat_profile(LAYERS)} if ALLOCATORS.get(name).reads_profile else {}


def _flat_profile(layers: int) -> Profile:
    """Every head evicts the global ratio, at every ratio; with a score-to-gain table (``with_gains``)."""
    return with_gains(flat_profile(layers, HEADS, grid=np.linspace(0.01, 0.99, 99, dtype=np.float32)))


def _cache_args(name: str) -> dict:
    if name == "threshold":
        return {"value": -0.6}  # keydiff scores are -cos in [-1, 1]
    # in a cache, the allocators that read a profile read its curve at the cache's ratio: a flat one here
    return {"profile": _flat_profile(LAYERS)} if ALLOCATORS.get(name).reads_profile else {}


# ------------------------------------------------------------------------------------------ scorers


@pytest.mark.parametrize("name", SCORERS.names())
def test_scorer_gives_one_finite_score_per_token_and_head(name):
    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(0.0, scorer_for(name, model), sink=0, window=0, keep_scores=True)
    cache.prefill(model, prompt(2, 40, seed=2), repeat_prompt=PROMPT)
    assert sorted(cache.prefill_scores) == list(range(LAYERS))
    for scores in cache.prefill_scores.values():
        assert scores.dtype == torch.float32 and scores.shape == (2, HEADS, 40)
        assert torch.isfinite(scores).all()


@pytest.mark.parametrize("name", SCORERS.names())
def test_cache_with_any_scorer_keeps_the_uniform_budget_under_left_padding(name):
    model = tiny_model("llama", "sdpa")
    ids, mask = left_padded((60, 41), seed=3)
    cache = LUKVCache(0.5, scorer_for(name, model), sink=4, window=2)
    cache.prefill(model, ids, mask, repeat_prompt=PROMPT)
    stored = cache.stored_tokens()  # [L, B, H]
    for row, real in enumerate(mask.sum(-1).tolist()):
        evictable = real - 4 - 2
        # every head of every layer: its sinks and window plus exactly the rounded uniform share
        assert (stored[:, row] - 6).tolist() == [[round(0.5 * evictable)] * HEADS] * LAYERS


@pytest.mark.parametrize("name", SCORERS.names())
def test_ratio_zero_with_any_scorer_answers_like_dynamic_cache(name):
    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 30, seed=4)
    with torch.no_grad():
        want = model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=5, do_sample=False)
        cache = LUKVCache(0.0, scorer_for(name, model))
        got = model.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------ allocators


def _request(ratio: float, n_rows=(300, 37, 1)) -> AllocationRequest:
    n = torch.tensor(n_rows)
    width = int(n.max())
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(LAYERS, len(n_rows), HEADS, width, generator=gen)
    scores = scores.masked_fill(torch.arange(width) >= n.view(1, -1, 1, 1), float("-inf"))
    ratios = torch.full((len(n_rows),), ratio, dtype=torch.float64)
    return AllocationRequest(scores, n, ratios, tuple(range(LAYERS)), LAYERS, 0.01)


@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("name", ALLOCATORS.names())
def test_allocator_budgets_respect_the_bounds_and_the_model_total(name, ratio):
    req = _request(ratio)
    allocator = get_allocator(name, **_factory_args(name, ratio))
    counts = allocator(req)
    assert counts.shape == (LAYERS, 3, HEADS) and counts.dtype == torch.long
    mins = req.min_counts()
    for row, n in enumerate(req.n_evictable.tolist()):
        assert (counts[:, row] >= mins[row]).all() and (counts[:, row] <= n).all()
        target = round((1 - ratio) * n * HEADS * LAYERS)
        total = int(counts[:, row].sum())
        if allocator.adaptive:  # the total follows the scores: here ~ the target, by chance
            assert abs(total - target) <= 0.1 * n * HEADS * LAYERS + int(mins[row]) * HEADS * LAYERS
            continue
        # the exact total, give or take one token per layer of rounding; more only where the per-head
        # minimum asks for more than a head's share
        assert target - LAYERS <= total <= target + LAYERS + int(mins[row]) * HEADS * LAYERS, counts[:, row]


@pytest.mark.parametrize("name", ALLOCATORS.names())
def test_cache_with_any_allocator_stores_what_it_allocates(name):
    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(0.8, "keydiff", name, sink=4, window=1, allocator_kwargs=_cache_args(name))
    with torch.no_grad():
        model(prompt(1, 105, seed=5), past_key_values=cache)
    kept = int((cache.stored_tokens() - 5).sum())  # minus sinks and window, per (layer, head)
    if cache.allocator.adaptive:  # keeps what clears its threshold: some, not all
        assert 0 < kept < 100 * HEADS * LAYERS
        return
    assert abs(kept - round(0.2 * 100 * HEADS * LAYERS)) <= LAYERS
