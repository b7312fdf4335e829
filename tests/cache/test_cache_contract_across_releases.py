"""The parts of transformers' cache contract that moved in 5.24 (issue 43), held on whichever release is
installed: ``crop`` does what DynamicCache's does for the same argument (a negative count removes that many
tokens; a positive one, the old absolute length, is refused by DynamicCache's full-attention layers on 5.23
and 5.24 alike), ``is_croppable`` answers as DynamicCache's (5.24's assisted decoding refuses a cache that
says False), and ``update`` takes the ``kwargs=`` keyword 5.24's attention modules pass."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model
from transformers import DynamicCache

from lukv_cache import LUKVCache
from lukv_cache._compat import cache_kwarg
from lukv_cache.cache.storage.layer import LUKVLayer
from lukv_cache.testing import prompt

ATOL = 1e-5
T = 24  # longer than the tiny Gemma 3's sliding window (8): its sliding layers stay transformers' own


def _filled(model, cache):
    cache.activate_past_recording()  # transformers' sliding layers can only roll back when recording
    with torch.no_grad():
        model(prompt(1, T, seed=3), use_cache=True, **{cache_kwarg(model): cache})
    return cache


def _crop(cache, tokens_to_remove):
    """What ``crop`` did: the exception type it raised, or the logical length it left."""
    try:
        cache.crop(tokens_to_remove)
    except Exception as error:  # noqa: BLE001 - the type is what is compared
        return type(error)
    return cache.get_seq_length()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("ratio", [0.0, 0.5])
@pytest.mark.parametrize("tokens_to_remove", [-3, 0, T - 5], ids=["minus_3", "zero", "max_length"])
def test_crop_does_what_dynamic_cache_does_with_the_same_argument(arch, ratio, tokens_to_remove):
    model = tiny_model(arch, "eager" if arch == "gemma3" else "sdpa")
    ref, cache = _filled(model, DynamicCache(config=model.config)), _filled(model, LUKVCache(ratio))
    outcome = _crop(ref, tokens_to_remove)
    assert _crop(cache, tokens_to_remove) == outcome
    if ratio == 0 and isinstance(outcome, int):  # cropped, not refused: the same tensors as well
        for mine, theirs in zip(cache.layers, ref.layers):
            torch.testing.assert_close(mine.keys, theirs.keys, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_is_croppable_answers_as_dynamic_cache(arch):
    model = tiny_model(arch, "eager" if arch == "gemma3" else "sdpa")
    ref, cache = _filled(model, DynamicCache(config=model.config)), _filled(model, LUKVCache(0.5))
    assert cache.is_croppable == ref.is_croppable is True


def test_cache_update_takes_the_attention_kwargs_keyword():
    ratio = 0.0  # hand-made updates, without a model: only an evicting cache needs the model's attention
    cache, keys = LUKVCache(ratio), torch.rand(1, 2, 5, 16)
    out_keys, out_values = cache.update(keys, keys + 1, 0, kwargs={"position_ids": torch.arange(5)[None]})
    assert torch.equal(out_keys, keys) and torch.equal(out_values, keys + 1)
    assert cache.get_seq_length() == 5


def test_layer_update_takes_the_attention_kwargs_keyword():
    layer, keys = LUKVLayer(), torch.rand(1, 2, 5, 16)
    layer.update(keys, keys, kwargs={})
    out_keys, _ = layer.update(keys[:, :, :1], keys[:, :, :1], kwargs={"position_ids": torch.tensor([[5]])})
    assert torch.equal(out_keys, torch.cat([keys, keys[:, :, :1]], dim=2))
    assert layer.get_seq_length() == 6
