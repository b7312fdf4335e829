"""``kv_bits=4`` packs two channels per byte, so a model whose head dim is odd cannot use it (issue 54, item
11b): refused with a ConfigurationError when the cache is built, where the head dim is known then (``config=``,
``LUKVCache.from_pretrained`` with a model or a model folder), else at the first compression as before;
``kv_bits=8`` (one channel per byte) takes such a model."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

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
