"""``kv_bits=4`` packs two channels per byte, so a model whose head dim is odd cannot use it (issue 54, item
11b): refused with a ConfigurationError when the cache is built, where the head dim is known then (``config=``,
``LUKVCache.from_pretrained`` with a model or a model folder), else at the first compression as before;
``kv_bits=8`` (one channel per byte) takes such a model."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model
from transformers import DynamicCache

from lukv_cache import LUKVCache
from lukv_cache.errors import ConfigurationError
from lukv_cache.testing import prompt

ODD = "head_dim 15 .* is odd; use kv_bits=8"


def _odd_model():
    """A tiny Phi-3 with 4 query heads of 15 channels (RoPE on half of them, 7 rotary pairs)."""
    model = tiny_model("phi3", hidden_size=60, partial_rotary_factor=0.5)
    text = model.config.get_text_config()
    assert text.hidden_size // text.num_attention_heads == 15
    return model


def _fill(model, cache):
    with torch.no_grad():
        model(prompt(1, 40), past_key_values=cache, use_cache=True)


def test_a_cache_given_the_config_refuses_4_bits_at_construction():
    with pytest.raises(ConfigurationError, match=ODD):
        LUKVCache(0.5, "keydiff", kv_bits=4, config=_odd_model().config)


def test_without_a_config_the_first_compression_refuses_it_as_before():
    model = _odd_model()
    cache = LUKVCache(0.5, "keydiff", kv_bits=4)  # the head dim is not known yet
    with pytest.raises(ConfigurationError, match="head_dim 15 is odd; use kv_bits=8"):
        _fill(model, cache)


def test_8_bits_take_an_odd_head_dim():
    model = _odd_model()
    cache = LUKVCache(0.5, "keydiff", kv_bits=8, config=model.config)
    _fill(model, cache)
    assert cache.kv_bits == 8 and cache.layers[0].store.keys.dim == 15


def test_from_pretrained_with_a_model_refuses_4_bits_at_construction(tmp_path):
    model = _odd_model()
    model.config.name_or_path = str(tmp_path)  # a local folder: keys no shared profile, no network
    with pytest.raises(ConfigurationError, match=ODD):
        LUKVCache.from_pretrained(model, 0.5, kv_bits=4, cache_dir=tmp_path / "hf", local_files_only=True)


def test_from_pretrained_with_a_model_folder_refuses_4_bits_at_construction(tmp_path):
    _odd_model().config.save_pretrained(tmp_path)  # its config is readable without the network
    with pytest.raises(ConfigurationError, match=ODD):
        LUKVCache.from_pretrained(
            str(tmp_path), 0.5, kv_bits=4, cache_dir=tmp_path / "hf", local_files_only=True
        )


def test_a_memory_budget_never_chooses_4_bits_for_an_odd_head_dim():
    """A budget that would choose 4 bits (it did, then failed at its first compression telling the user to
    pass kv_bits=8, which they had not set) chooses among the model's precision and 8 bits, and fits."""
    model = _odd_model()
    ids = prompt(1, 400, seed=2)
    even = LUKVCache(memory=0.05)
    with torch.no_grad():
        tiny_model("phi3")(ids, past_key_values=even, use_cache=True)
    assert even.kv_bits == 4  # the same budget on an even head dim takes 4 bits
    cache = LUKVCache(memory=0.05)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    assert cache.kv_bits == 8 and cache.memory_choice.kept[4] == 0.0
    full = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=full, use_cache=True)
    assert cache.memory_bytes() <= 0.05 * sum(
        layer.keys.nbytes + layer.values.nbytes for layer in full.layers
    )
