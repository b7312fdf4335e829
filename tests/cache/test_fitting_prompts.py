"""A bound the prompt already fits evicts nothing, for every allocator (the threshold one included), and
settings that cannot work are refused up front."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model
from test_registry_contracts import _cache_args

from lukv_cache import LUKVCache
from lukv_cache.allocation import ALLOCATORS
from lukv_cache.errors import ConfigurationError
from lukv_cache.testing import flat_profile, prompt


@pytest.mark.parametrize("bound", [{"max_tokens": 1000}, {"decode_max_tokens": 100_000}])
@pytest.mark.parametrize("allocator", ALLOCATORS.names())
def test_a_bound_above_the_prompts_length_keeps_every_token(allocator, bound):
    model, ids = tiny_model("llama"), prompt(1, 200, seed=3)
    args = _cache_args(allocator)
    if allocator == "threshold":
        args = {"value": 0.5}  # keydiff scores are -cos in [-1, 1]: this threshold alone would cut
    cache = LUKVCache(scorer="keydiff", allocator=allocator, allocator_kwargs=args, **bound)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    assert bool((cache.stored_tokens() == 200).all()), cache.stored_tokens()


def test_fold_interval_none_is_the_default_and_zero_a_typed_error():
    assert LUKVCache(0.5, fold_interval=None).fold_interval == LUKVCache(0.5).fold_interval == 256
    assert LUKVCache(memory=0.1).fold_interval == 8  # under a budget the decode room counts: it folds sooner
    with pytest.raises(ConfigurationError, match="fold_interval must be a positive integer"):
        LUKVCache(0.5, fold_interval=0)


def test_from_pretrained_without_a_ratio_means_what_lukv_cache_without_one_means(tmp_path):
    import numpy as np

    grid = np.linspace(0.1, 0.9, 9, dtype=np.float32)
    curve = flat_profile(2, 2, grid=grid)
    path = tmp_path / "keydiff.safetensors"
    curve.save(path)
    assert LUKVCache.from_pretrained(path).ratio == LUKVCache().ratio == 0.5
