"""The cache learns a model's layer layout from the model itself (no ``config=``): hybrids' linear and SSM
layers, parallel hybrid layers, KV-sharing producers, indexed and chunked layers get the right layer, and
reporting works on models whose layers differ (issue 30; tests/families runs every family)."""

from __future__ import annotations

import inspect
import os
import sys
import warnings

import pytest
import torch
from helpers import tiny_model

from lukv_cache import LUKVCache
from lukv_cache.cache.hybrid import LUKVHybridLayer
from lukv_cache.cache.layer import LUKVLayer
from lukv_cache.testing import prompt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "families"))

import families  # noqa: E402


def _run(model_type: str, cache, attn: str = "sdpa"):
    model = families.build_model(model_type, attn)
    model = model[0] if isinstance(model, tuple) else model
    ids, mask = families.inputs()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=3, do_sample=False)
    return model


@pytest.mark.parametrize("model_type", ["qwen3_next", "jamba", "lfm2"])
def test_a_hybrid_built_without_config_gets_the_models_layout_and_compresses(model_type):
    cache = LUKVCache(0.5)
    model = _run(model_type, cache)
    text = model.config.get_text_config()
    assert len(cache.layers) == text.num_hidden_layers
    compressed = [layer for layer in cache.layers if isinstance(layer, LUKVLayer)]
    assert compressed and all(layer.compressed for layer in compressed)
    assert int(cache.stored_tokens().min()) < families.LENGTHS[0]


@pytest.mark.parametrize("model_type", ["falcon_h1", "zamba2"])
def test_a_layer_with_a_linear_state_and_attention_compresses_its_attention(model_type):
    cache = LUKVCache(0.5)
    _run(model_type, cache)
    hybrid = [layer for layer in cache.layers if isinstance(layer, LUKVHybridLayer)]
    assert hybrid and all(layer.compressed for layer in hybrid)
    assert all(layer.has_previous_state[0] for layer in hybrid)
    assert cache.memory_bytes() > sum(layer.memory_bytes() for layer in hybrid) - 1


def test_kv_sharing_producers_keep_every_token_with_a_warning():
    with pytest.warns(UserWarning, match="KV sharing"):
        cache = LUKVCache(0.5)
        _run("gemma3n_text", cache)
    assert not any(isinstance(layer, LUKVLayer) for layer in cache.layers[:2])


def test_stored_tokens_pads_layers_with_fewer_kv_heads_and_skips_layers_without_keys():
    cache = LUKVCache(0.0)
    _run("recurrent_gemma", cache)  # recurrent layers hold no keys
    counts = cache.stored_tokens()
    assert counts.ndim == 3 and counts.shape[1] == 2
    cache = LUKVCache(0.0)
    _run("mimo_v2_flash", cache, "eager")
    counts = cache.stored_tokens()
    assert counts.ndim == 3 and counts.shape[0] == len(cache.layers)


def test_a_cache_used_outside_a_model_still_grows_lazily():
    cache = LUKVCache(0.0)
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 1)
    assert len(cache.layers) == 2 and cache.get_seq_length(1) == 3


def test_a_model_that_takes_no_cache_warns_that_the_cache_stays_empty():
    from transformers import RwkvConfig, RwkvForCausalLM

    torch.manual_seed(0)
    config = RwkvConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64
    )
    model = RwkvForCausalLM(config).eval()
    cache = LUKVCache(0.5)
    with pytest.warns(UserWarning, match="takes no cache"), torch.no_grad():
        model.generate(torch.randint(3, 60, (1, 8)), past_key_values=cache, max_new_tokens=2, do_sample=False)
    assert cache.memory_bytes() == 0


@pytest.mark.parametrize("keyword", ["past_key_values", "cache"])
def test_a_model_that_takes_a_cache_does_not_warn_that_the_cache_stays_empty(keyword):
    model = tiny_model()
    if keyword == "cache" and "cache" not in inspect.signature(model.forward).parameters:
        pytest.skip("the forward takes the cache as past_key_values only before transformers 5.24")
    cache = LUKVCache(0.5)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model.generate(prompt(), **{keyword: cache}, max_new_tokens=2, do_sample=False)
    assert not [w for w in caught if "takes no cache" in str(w.message)]
    assert cache.memory_bytes() > 0
