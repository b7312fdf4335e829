"""The cache's layer layout: from ``config=`` (or a model handed to ``from_pretrained`` / ``prefill``),
hybrids' linear and SSM layers, parallel hybrid layers, KV-sharing producers, indexed and chunked layers get
the right layer; built without it, the cache learns the layout at its first attention call (the attention
module's config), and a layer that needs it earlier is a typed error naming ``config=``; reporting works on
models whose layers differ (issue 30; tests/families runs every family)."""

from __future__ import annotations

import inspect
import os
import sys
import warnings

import pytest
import torch
from helpers import tiny_model

from lukv_cache import LUKVCache
from lukv_cache.cache.layers.hybrid import LUKVHybridLayer
from lukv_cache.cache.storage.layer import LUKVLayer
from lukv_cache.errors import ConfigurationError
from lukv_cache.testing import prompt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "families"))

import families  # noqa: E402


def _model(model_type: str, attn: str = "sdpa"):
    model = families.build_model(model_type, attn)
    return model[0] if isinstance(model, tuple) else model


def _run(model_type: str, cache, attn: str = "sdpa", model=None):
    model = _model(model_type, attn) if model is None else model
    ids, mask = families.inputs()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=3, do_sample=False)
    return model


@pytest.mark.parametrize("model_type", ["qwen3_next", "jamba", "lfm2"])
def test_a_hybrid_built_with_its_config_gets_the_models_layout_and_compresses(model_type):
    model = _model(model_type)
    cache = LUKVCache(0.5, config=model.config)
    _run(model_type, cache, model=model)
    text = model.config.get_text_config()
    assert len(cache.layers) == text.num_hidden_layers
    compressed = [layer for layer in cache.layers if isinstance(layer, LUKVLayer)]
    assert compressed and all(layer.compressed for layer in compressed)
    assert int(cache.stored_tokens().min()) < families.LENGTHS[0]


def test_a_hybrid_built_without_config_is_refused_with_a_typed_error_naming_config():
    with pytest.raises(ConfigurationError, match=r"config=model\.config"):
        _run("qwen3_next", LUKVCache(0.5))


def test_prefill_lays_an_unlaid_cache_out_from_the_model_it_is_handed():
    model = _model("qwen3_next")
    cache = LUKVCache(0.5)
    ids, mask = families.inputs()
    with torch.no_grad():
        cache.prefill(model, ids, mask)
    assert len(cache.layers) == model.config.get_text_config().num_hidden_layers
    assert any(isinstance(layer, LUKVLayer) and layer.compressed for layer in cache.layers)


@pytest.mark.parametrize("model_type", ["falcon_h1", "zamba2"])
def test_a_layer_with_a_linear_state_and_attention_compresses_its_attention(model_type):
    model = _model(model_type)
    cache = LUKVCache(0.5, config=model.config)
    _run(model_type, cache, model=model)
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


def _rwkv():
    from transformers import RwkvConfig, RwkvForCausalLM

    torch.manual_seed(0)
    config = RwkvConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64
    )
    return RwkvForCausalLM(config).eval()


def test_prefilling_a_model_that_takes_no_cache_is_a_typed_error_saying_the_cache_would_stay_empty():
    cache = LUKVCache(0.5)
    with pytest.raises(ConfigurationError, match="takes no cache"), torch.no_grad():
        cache.prefill(_rwkv(), torch.randint(3, 60, (1, 8)))
    assert cache.memory_bytes() == 0


def test_the_one_line_on_a_model_that_takes_no_cache_warns_that_the_cache_stays_empty():
    model = _rwkv()
    model.config.name_or_path = "tiny-random/rwkv"
    with pytest.warns(UserWarning, match="takes no cache"):
        LUKVCache.from_pretrained(model, 0.5, local_files_only=True)


def test_the_one_line_with_a_hybrid_models_folder_lays_the_cache_out_from_its_config(tmp_path):
    """A model id (here a folder) whose config is readable without the network: the layout from the start,
    so a hybrid whose linear layers come first runs without config=."""
    model = _model("qwen3_next")
    model.config.save_pretrained(tmp_path)
    cache = LUKVCache.from_pretrained(str(tmp_path), 0.5, local_files_only=True)
    assert len(cache.layers) == model.config.get_text_config().num_hidden_layers
    _run("qwen3_next", cache, model=model)
    assert any(isinstance(layer, LUKVLayer) and layer.compressed for layer in cache.layers)


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


@pytest.mark.parametrize("model_type", ["gemma3n_text", "gemma3_text", "llama4_text", "mistral"])
def test_a_cache_built_without_config_lays_the_layers_out_as_config_does(model_type):
    """Learned at the first attention call (the attention module's config), the layout is the one
    ``config=`` gives from the start: same layer kinds, same tokens kept."""
    model = _model(model_type)
    bare, configured = LUKVCache(0.5), LUKVCache(0.5, config=model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the layout warnings, alike for both
        _run(model_type, bare, model=model)
        _run(model_type, configured, model=model)
    assert [type(layer) for layer in bare.layers] == [type(layer) for layer in configured.layers]
    assert torch.equal(bare.stored_tokens(), configured.stored_tokens())


def test_a_layer_filled_before_the_layout_that_the_layout_makes_another_kind_is_a_typed_error():
    """Layout.adopt moves what update() grew into the learned layout's layers; a grown layer the layout
    makes a linear-attention state cannot be moved: ConfigurationError naming config=."""
    cache = LUKVCache(0.5)
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    with pytest.raises(ConfigurationError, match=r"config=model\.config"):
        cache.layout.adopt(cache, _model("qwen3_next").config, 3)
