"""Bad input gives a clear, typed error; a compressed cache never meets an attention that cannot read it."""

from __future__ import annotations

import inspect
import re
from typing import Optional

import numpy as np
import pytest
import torch
import transformers
from helpers import tiny_model
from packaging.version import Version
from transformers import AttentionInterface, Cache, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lukv_cache import ConfigurationError, IncompatibleAttentionError, LUKVCache, LUKVError, UnknownNameError
from lukv_cache._compat import own_cache_class
from lukv_cache.testing import prompt


@pytest.mark.parametrize("ratio", [1.0, 1, -0.1, 1.5, float("nan"), "0.5", True, False])
def test_ratio_outside_zero_to_one_raises_configuration_error(ratio):
    with pytest.raises(ConfigurationError, match="ratio"):
        LUKVCache(ratio)


@pytest.mark.parametrize("ratio", [0, 0.0, 0.5, 0.999])
def test_ratio_in_zero_to_one_is_accepted(ratio):
    assert LUKVCache(ratio).ratio == ratio


def test_configuration_error_is_a_value_error_and_a_lukv_error():
    with pytest.raises(ValueError):
        LUKVCache(1.0)
    with pytest.raises(LUKVError):
        LUKVCache(1.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sink": -1},
        {"window": -1},
        {"sink": 2.5},
        {"prefill_chunk_size": 0},
        {"prefill_chunk_size": -8},
        {"min_keep": 1.0},
        {"min_keep": -0.1},
    ],
)
def test_bad_cache_option_raises_configuration_error(kwargs):
    with pytest.raises(ConfigurationError):
        LUKVCache(0.5, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sink": None}, "sink must be a non-negative integer"),  # was a TypeError inside torch.full
        ({"allocator_kwargs": "profile"}, "allocator_kwargs must be a dict"),
        ({"allocator_kwargs": 3}, "allocator_kwargs must be a dict"),
        # a saved context stores it and refuses anything but a bool when loaded: refuse it here already
        ({"keep_scores": "yes"}, "keep_scores must be True or False"),
        # evict_ratio= belongs to the 'profile' allocator; with the default one it was a raw TypeError
        ({"evict_ratio": np.full((2, 2), 0.5)}, "Allocator 'uniform' has no option 'evict_ratio'"),
        ({"allocator": "adakv", "allocator_kwargs": {"alpha": 0.1}}, "its options: alpha_safeguard"),
    ],
)
def test_options_that_cannot_apply_are_refused_when_the_cache_is_built(kwargs, message):
    ratio = None if "evict_ratio" in kwargs else 0.5
    with pytest.raises(ConfigurationError, match=message):
        LUKVCache(ratio, **kwargs)


def test_a_registered_allocator_missing_a_required_option_is_refused_by_name(monkeypatch):
    from lukv_cache.allocation import ALLOCATORS, register_allocator

    monkeypatch.setattr(ALLOCATORS, "_items", dict(ALLOCATORS._items))  # the registration ends with the test

    @register_allocator("needs_weights")
    def needs_weights(weights):
        return lambda request: None

    with pytest.raises(ConfigurationError, match=r"Allocator 'needs_weights' needs \['weights'\]"):
        LUKVCache(0.5, allocator="needs_weights")


def test_unknown_scorer_raises_unknown_name_error_listing_known_names():
    with pytest.raises(UnknownNameError) as info:
        LUKVCache(0.5, scorer="h2o")
    message = str(info.value)
    assert "'h2o'" in message
    for name in ("keydiff", "snapkv", "expected_attention", "knorm", "tova", "streaming", "random"):
        assert name in message
    assert isinstance(info.value, KeyError) and isinstance(info.value, LUKVError)


def test_unknown_allocator_raises_unknown_name_error_listing_known_names():
    with pytest.raises(UnknownNameError, match="uniform.*|.*adakv"):
        LUKVCache(0.5, allocator="lukv")


def test_profile_allocator_without_a_table_raises_configuration_error():
    with pytest.raises(ConfigurationError, match="evict_ratio"):
        LUKVCache(0.5, allocator="profile")


@pytest.mark.parametrize(
    "table",
    [
        [0.5, 0.5],  # 1-D
        [[[0.5, 0.5]]],  # 3-D
        [[0.5, 1.5], [0.5, 0.5]],  # ratio > 1
        [[0.5, float("nan")], [0.5, 0.5]],
    ],
)
def test_profile_table_malformed_raises_configuration_error_at_construction(table):
    with pytest.raises(ConfigurationError, match="evict_ratio"):
        LUKVCache(allocator="profile", evict_ratio=table)


def _prefill(cache, model=None):
    model = model or tiny_model("llama", "sdpa")  # 2 layers, 2 KV heads
    with torch.no_grad():
        model(prompt(1, 30), past_key_values=cache)


@pytest.mark.parametrize(
    "shape",
    [(2, 3), (2, 1), (1, 2)],  # wrong KV heads, too few heads, too few layers
)
def test_profile_table_of_the_wrong_shape_for_the_model_raises_configuration_error(shape):
    cache = LUKVCache(allocator="profile", evict_ratio=torch.full(shape, 0.5))
    with pytest.raises(ConfigurationError, match=r"shape"):
        _prefill(cache)


def test_profile_table_with_more_layers_than_the_model_raises_configuration_error():
    """A [3, 2] table on a 2-layer model was built for another model: budgets would be wrong."""
    cache = LUKVCache(allocator="profile", evict_ratio=torch.full((3, 2), 0.5))
    with pytest.raises(ConfigurationError, match=r"shape"):
        _prefill(cache)


def test_profile_table_of_the_right_shape_works():
    cache = LUKVCache(allocator="profile", evict_ratio=[[0.0, 0.9], [0.5, 0.5]], sink=0, window=1)
    _prefill(cache)
    stored = cache.stored_tokens()[:, 0]  # 29 evictable tokens per head, plus the window of 1
    assert stored[0].tolist() == [30, 4]
    assert sorted(stored[1].tolist()) == [15, 16]  # 14.5 each: the largest remainder breaks the tie


@pytest.fixture
def compressed():
    """A copy of the tiny Llama (its attention implementation gets switched) and a compressed cache."""
    model = tiny_model("llama", "sdpa", seed=3)
    original = model.config._attn_implementation
    cache = LUKVCache(0.5)
    _prefill(cache, model)
    yield model, cache
    model.set_attn_implementation(original)


def _custom_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    # a user's attention written against the dense tensors it is handed: it would only see the suffix
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
    )


def test_custom_attention_registered_after_compression_raises_incompatible_attention_error(
    monkeypatch, compressed
):
    model, cache = compressed
    monkeypatch.setitem(AttentionInterface._global_mapping, "test_custom", _custom_attention)
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "test_custom", sdpa_mask)
    model.set_attn_implementation("test_custom")
    with pytest.raises(IncompatibleAttentionError, match="sdpa"):
        with torch.no_grad():
            model(prompt(1, 3, seed=1), past_key_values=cache)


def test_flex_attention_with_a_compressed_cache_raises_incompatible_attention_error(compressed):
    """flex_attention is what transformers would call; called directly here because building its block
    mask compiles for ~15 s on CPU. The cache's keys must make it raise, not attend to the suffix only."""
    model, cache = compressed
    module = model.model.layers[0].self_attn
    query = torch.randn(1, 4, 1, 16)
    key, value = cache.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), 0)
    flex = AttentionInterface._global_mapping["flex_attention"]
    with pytest.raises(IncompatibleAttentionError, match="flex_attention"):
        flex(module, query, key, value, None, scaling=0.25)


def test_generate_with_an_incompatible_attention_raises_instead_of_answering(monkeypatch, compressed):
    model, cache = compressed
    monkeypatch.setitem(AttentionInterface._global_mapping, "test_custom", _custom_attention)
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "test_custom", sdpa_mask)
    model.set_attn_implementation("test_custom")
    ids = torch.cat([prompt(1, 30), prompt(1, 2, seed=4)], dim=1)
    with pytest.raises(IncompatibleAttentionError):
        model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)


def test_a_fresh_cache_with_an_incompatible_attention_raises_at_the_first_forward(monkeypatch):
    model = tiny_model("llama", "sdpa", seed=4)
    monkeypatch.setitem(AttentionInterface._global_mapping, "test_custom", _custom_attention)
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "test_custom", sdpa_mask)
    model.set_attn_implementation("test_custom")
    try:
        with pytest.raises(IncompatibleAttentionError):
            _prefill(LUKVCache(0.8), model)
    finally:
        model.set_attn_implementation("sdpa")


def test_positive_crop_is_rejected_like_dynamic_cache():
    cache = LUKVCache(0.5)
    _prefill(cache)
    with pytest.raises(ValueError):
        cache.layers[0].crop(3)


def test_no_ratio_and_no_token_budget_means_the_default_ratio():
    assert LUKVCache().ratio == LUKVCache(None).ratio == 0.5


@pytest.mark.parametrize("max_bytes", [10**30, 10**400, 2**50 + 1, 1e30, 1e400], ids=str)
def test_an_absurd_max_bytes_is_refused_when_the_cache_is_built(max_bytes):
    """Issue 54, item 8: 10**30 and 10**400 overflowed at the first forward (a float is not a count)."""
    with pytest.raises(ConfigurationError) as info:
        LUKVCache(max_bytes=max_bytes)
    message = str(info.value)
    assert message.startswith("max_bytes") and len(message) < 300  # 10**400 is not printed digit by digit
    assert "at most 2**50 bytes" in message or "must be a positive integer" in message


def test_a_max_bytes_of_a_petabyte_is_accepted_and_bounds_nothing_a_tiny_model_holds():
    cache = LUKVCache(max_bytes=2**50)
    _prefill(cache)
    assert cache.max_bytes == 2**50 and int(cache.stored_tokens().min()) == 30  # the prompt kept whole


def test_the_own_attention_message_names_falcon_only_before_transformers_5_25():
    """A model whose attention is its own code (Bloom) at ratio 0.5: the message lists the families that do
    this, each true on every supported release (Falcon goes through the attention interface from 5.25)."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    config = BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4, pad_token_id=0)
    model = BloomForCausalLM(config).eval()
    with pytest.raises(IncompatibleAttentionError, match="own code") as raised:
        _prefill(LUKVCache(0.5), model)
    message = str(raised.value)
    assert "Bloom" in message and "only ratio=0 works" in message, message
    # every family named with the releases it holds for
    assert re.findall(r"Falcon[^,)]*", message) == ["Falcon before transformers 5.25"], message
    assert re.findall(r"GPT-J and CodeGen[^,)]*", message) == ["GPT-J and CodeGen before transformers 5.24"]


SINCE_5_24 = Version(transformers.__version__) >= Version("5.24")  # the cache argument is named cache


def _tiny_xlstm():
    from transformers import xLSTMConfig, xLSTMForCausalLM

    torch.manual_seed(0)
    config = xLSTMConfig(
        vocab_size=128, hidden_size=128, embedding_dim=128, num_hidden_layers=2, num_blocks=2, num_heads=4
    )
    return xLSTMForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.mark.skipif(not SINCE_5_24, reason="before transformers 5.24 xLSTM's forward takes no cache at all")
def test_a_model_keeping_a_cache_class_of_its_own_is_refused_before_anything_runs():
    """xLSTM from transformers 5.24 takes ``cache: xLSTMCache`` and reads ``cache.rnn_state``: a LUKVCache
    passed there was a raw AttributeError; from_pretrained(model) and prefill(model) say so, typed, first
    (before any profile lookup: the model has no name to look up)."""
    model = _tiny_xlstm()
    ids = prompt(1, 12)
    with pytest.raises(AttributeError, match="rnn_state"):  # what the model itself does with any passed cache
        model(ids, cache=DynamicCache())
    for build in (
        lambda: LUKVCache.from_pretrained(model, 0.5),
        lambda: LUKVCache.from_pretrained(model, 0.0, local_files_only=True),
        lambda: LUKVCache(0.5).prefill(model, ids),
    ):
        with pytest.raises(IncompatibleAttentionError) as raised:
            build()
        message = str(raised.value)
        assert "xLSTMForCausalLM keeps its state in a cache class of its own (xLSTMCache)" in message, message
        assert "Generate without passing a cache" in message, message
    # the model's own cache still works
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 15)


@pytest.mark.skipif(SINCE_5_24, reason="from transformers 5.24 xLSTM takes a cache (of its own class)")
def test_a_model_taking_no_cache_is_warned_about_not_refused():
    """Before 5.24 xLSTM's forward takes no cache (cache_params): the cache would stay empty, a warning."""
    model = _tiny_xlstm()
    model.config.name_or_path = "tiny-random/xlstm"  # no profile: the profile-free line, offline
    with pytest.warns(UserWarning, match="takes no cache"):
        LUKVCache.from_pretrained(model, 0.5, local_files_only=True)


class _OwnCache:  # a model's own cache class, no transformers Cache
    pass


class _CacheSubclass(DynamicCache):
    pass


def _forward_taking(annotation):
    """An object whose forward declares ``annotation`` for its past_key_values (as a module's would)."""

    def forward(input_ids, past_key_values=None):
        return input_ids

    forward.__annotations__ = {"past_key_values": annotation}  # this file's annotations are strings
    return type("Model", (), {"forward": staticmethod(forward)})()


@pytest.mark.parametrize(
    "annotation, own",
    [
        (_OwnCache | None, "_OwnCache"),
        (Optional[_OwnCache], "_OwnCache"),  # noqa: UP045 - the older spelling, as remote code writes it
        ("_OwnCache | None", "_OwnCache"),  # a string annotation that resolves
        (Cache | None, None),
        (_CacheSubclass | None, None),
        (_OwnCache | Cache | None, None),  # a transformers cache is admitted
        (tuple[tuple[torch.Tensor]] | None, None),  # the legacy format: nothing to tell
        (dict[str, torch.Tensor] | None, None),
        ("NoSuchName | None", None),
        (inspect.Parameter.empty, None),
    ],
    ids=str,
)
def test_own_cache_class_reads_the_declared_cache_type(annotation, own):
    assert own_cache_class(_forward_taking(annotation)) == own
