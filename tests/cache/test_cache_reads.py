"""Reading a LUKVCache as transformers' code reads a DynamicCache (``layer.keys``, iterating the cache,
``batch_select_indices`` with a tuple, ``torch.export``): the logical content or a typed error, never the
dense suffix alone."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_model
from transformers import DynamicCache

from lukv_cache import (
    BatchIndexError,
    LUKVCache,
    LUKVError,
    RaggedCacheError,
    UnsupportedOperationError,
)
from lukv_cache.cache.storage.layer import LUKVLayer
from lukv_cache.testing import left_padded, prompt

ATOL = 1e-5
ATTN = {"llama": "sdpa", "gemma2": "eager"}  # gemma2 has sliding layers (stock) and no sdpa


def forward(model, cache, ids, mask=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)


def filled(ratio, arch="llama", batch=2, length=7, mask=None, ids=None, **kwargs):
    model = tiny_model(arch, ATTN[arch])
    ids = prompt(batch, length) if ids is None else ids
    cache, dense = LUKVCache(ratio, config=model.config, **kwargs), DynamicCache(config=model.config)
    forward(model, cache, ids, mask)
    forward(model, dense, ids, mask)
    return model, cache, dense


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_keys_values_and_iteration_are_the_logical_content_at_ratio_zero(arch):
    model, cache, dense = filled(0.0, arch)
    assert any(isinstance(layer, LUKVLayer) and layer.store is not None for layer in cache.layers)
    for mine, theirs in zip(cache.layers, dense.layers, strict=True):
        assert mine.keys.shape == theirs.keys.shape == (2, 2, 7, 16)
        torch.testing.assert_close(mine.keys, theirs.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(mine.values, theirs.values, atol=ATOL, rtol=0)
    for (k, v, sliding), (dk, dv, dsliding) in zip(cache, dense, strict=True):
        torch.testing.assert_close(k, dk, atol=ATOL, rtol=0)
        torch.testing.assert_close(v, dv, atol=ATOL, rtol=0)
        assert (sliding is None) == (dsliding is None)
    # a decode step: the new token is in the suffix, the prompt in the store, both in .keys
    nxt = prompt(2, 1, seed=5)
    forward(model, cache, nxt)
    forward(model, dense, nxt)
    for mine, theirs in zip(cache.layers, dense.layers, strict=True):
        torch.testing.assert_close(mine.keys, theirs.keys, atol=ATOL, rtol=0)


def test_left_padded_batch_at_ratio_zero_reads_zeros_in_the_padding_columns():
    ids, mask = left_padded((7, 5, 3))
    _, cache, dense = filled(0.0, ids=ids, mask=mask)
    real = mask.bool()[:, None, :, None]
    for mine, theirs in zip(cache.layers, dense.layers, strict=True):
        assert mine.keys.shape == theirs.keys.shape == (3, 2, 7, 16)
        assert not mine.keys.masked_select(~real).any() and not mine.values.masked_select(~real).any()
        torch.testing.assert_close(mine.keys * real, theirs.keys * real, atol=ATOL, rtol=0)
        torch.testing.assert_close(mine.values * real, theirs.values * real, atol=ATOL, rtol=0)


def test_a_dynamic_cache_rebuilt_from_the_iteration_continues_like_the_lukv_cache():
    """Legacy-style conversion (``DynamicCache(list(cache))``) gets the whole prompt, not the suffix."""
    model, cache, _ = filled(0.0, length=12)
    rebuilt = DynamicCache([(k, v) for k, v, _ in cache])
    assert rebuilt.get_seq_length() == cache.get_seq_length() == 12
    nxt = prompt(2, 1, seed=6)
    torch.testing.assert_close(
        forward(model, rebuilt, nxt).logits, forward(model, cache, nxt).logits, atol=ATOL, rtol=0
    )


def test_past_key_values_format_as_transformers_checks_it():
    """What transformers' ``test_past_key_values_format`` checks of a model's returned cache."""
    model = tiny_model("llama", "sdpa")
    ids = prompt(2, 9, seed=3)
    out = forward(model, LUKVCache(0.0), ids)
    cfg = model.config
    expected = (2, cfg.num_key_value_heads, 9, cfg.head_dim)
    assert [layer.keys.shape for layer in out.past_key_values.layers] == [expected] * cfg.num_hidden_layers
    assert [layer.values.shape for layer in out.past_key_values.layers] == [expected] * cfg.num_hidden_layers


@pytest.mark.parametrize(("ratio", "scorer"), [(0.5, "keydiff"), (0.5, "streaming")])
def test_a_layer_whose_heads_or_rows_lost_tokens_raises_naming_the_ragged_reads(ratio, scorer):
    """keydiff: heads hold different tokens; streaming: every head holds the same ones, but the middle of
    the prompt was evicted, which no mask hides: neither has a dense view."""
    _, cache, _ = filled(ratio, length=30, scorer=scorer)
    layer = cache.layers[0]
    assert layer.compressed
    for read in (lambda: layer.keys, lambda: layer.values, lambda: list(cache)):
        with pytest.raises(RaggedCacheError) as info:
            read()
        message = str(info.value)
        for name in (
            "layer.store",
            "layer.suffix_keys",
            "layer.head_tokens(row, head)",
            "cache.stored_tokens()",
        ):
            assert name in message
    assert isinstance(info.value, LUKVError) and isinstance(info.value, RuntimeError)
    assert not isinstance(info.value, AttributeError)  # getattr(layer, "keys", None) must not hide it


def test_head_tokens_reads_one_row_and_head_of_a_compressed_layer():
    _, cache, dense = filled(0.5, length=30)
    for idx, layer in enumerate(cache.layers):
        store, h = layer.store, layer.num_heads
        for row in range(2):
            for head in range(h):
                positions, keys, values = layer.head_tokens(row, head)
                a, b = store.offsets_list[row * h + head], store.offsets_list[row * h + head + 1]
                assert positions.tolist() == store.positions[a:b].tolist() + list(range(30 - 1, 30))
                assert torch.equal(keys[: b - a], store.keys[a:b])
                assert torch.equal(values[b - a :], layer.suffix_values[row, head])
                full = dense.layers[idx]
                torch.testing.assert_close(keys, full.keys[row, head, positions], atol=ATOL, rtol=0)
                torch.testing.assert_close(values, full.values[row, head, positions], atol=ATOL, rtol=0)
    assert int(cache.stored_tokens()[0, 0, 0]) == len(cache.layers[0].head_tokens(0, 0)[0])


def test_update_returns_the_dense_suffix_and_keys_cannot_be_assigned():
    layer = LUKVLayer()
    assert layer.keys is None and layer.values is None and layer.suffix_keys is None
    k, v = layer.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    assert k is layer.suffix_keys and v is layer.suffix_values
    assert torch.equal(layer.keys, k)
    with pytest.raises(UnsupportedOperationError, match="cannot be assigned"):
        layer.keys = torch.zeros(1, 2, 3, 4)
    with pytest.raises(UnsupportedOperationError):
        layer.values = None  # an initialised layer: None would lose its content silently
    layer.reset()
    assert layer.keys is None and not layer.is_initialized
    layer.keys = None  # what transformers' CacheLayerMixin.__init__ does: accepted


def test_decoding_never_builds_the_logical_content(monkeypatch):
    def refuse(self, *, values):
        raise AssertionError("the forward path read the logical content")

    monkeypatch.setattr(LUKVLayer, "_logical", refuse)
    model = tiny_model("gemma2", "eager")
    ids, mask = left_padded((20, 13))
    for ratio in (0.0, 0.5):
        cache = LUKVCache(ratio, config=model.config, decode_max_tokens=16, fold_interval=4)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=9, do_sample=False)
        cache.stored_tokens(), cache.memory_bytes(), cache.batch_size
        cache.batch_select_indices((1,))
        cache.reorder_cache(torch.tensor([0, 0]))


def test_offload_and_prefetch_move_the_layer_without_reading_it_dense():
    model, cache, _ = filled(0.5, length=30)
    before = copy.deepcopy(cache)
    for layer in cache.layers:
        layer.offload()  # a ragged layer: no .keys read
        assert layer.suffix_keys.device.type == "cpu" and layer.store.keys.device.type == "cpu"
        layer.prefetch()
    for layer, ref in zip(cache.layers, before.layers):
        assert torch.equal(layer.store.keys, ref.store.keys) and torch.equal(
            layer.suffix_keys, ref.suffix_keys
        )
    nxt = prompt(2, 1, seed=8)
    torch.testing.assert_close(
        forward(model, cache, nxt).logits, forward(model, before, nxt).logits, atol=ATOL, rtol=0
    )


@pytest.mark.parametrize(
    "indices",
    [(0, 2), [2, 0], torch.tensor([2, 0]), torch.tensor([True, False, True]), (-1, 0), range(2)],
    ids=["tuple", "list", "tensor", "bool_mask", "negative", "range"],
)
def test_batch_select_indices_accepts_what_dynamic_cache_accepts(indices):
    model, cache, dense = filled(0.0, arch="gemma2", batch=3)
    cache.batch_select_indices(indices)
    dense.batch_select_indices(indices)
    rows = dense.layers[0].keys.shape[0]
    assert cache.batch_size == rows
    for mine, theirs in zip(cache.layers, dense.layers, strict=True):
        torch.testing.assert_close(mine.keys, theirs.keys, atol=ATOL, rtol=0)
    nxt = prompt(rows, 1, seed=9)
    torch.testing.assert_close(
        forward(model, cache, nxt).logits, forward(model, dense, nxt).logits, atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("indices", [(0, 3), [-4], torch.tensor([5])])
def test_batch_select_indices_out_of_range_is_a_typed_error_and_changes_nothing(indices):
    _, cache, _ = filled(0.5, batch=3, length=30)
    before = cache.stored_tokens()
    with pytest.raises(BatchIndexError, match="out of range for a batch of 3 rows") as info:
        cache.batch_select_indices(indices)
    assert isinstance(info.value, IndexError) and isinstance(info.value, LUKVError)
    assert info.value.batch == 3
    assert torch.equal(cache.stored_tokens(), before)


def test_torch_export_with_a_lukv_cache_says_it_is_not_supported():
    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 7)
    with pytest.raises(UnsupportedOperationError, match="torch.export does not support LUKVCache"):
        torch.export.export(model, (ids,), kwargs={"past_key_values": LUKVCache(0.0), "use_cache": True})
    # the pytree registration hands the very cache back from a tree_map over model outputs
    cache = LUKVCache(0.0)
    out = forward(model, cache, ids)
    mapped = torch.utils._pytree.tree_map(lambda t: t, out)
    assert mapped.past_key_values is cache


def test_head_tokens_out_of_range_is_the_typed_index_error():
    from lukv_cache.cache.storage.layer import LUKVLayer
    from lukv_cache.errors import BatchIndexError

    layer = LUKVLayer()
    with pytest.raises(BatchIndexError, match="holds nothing yet"):
        layer.head_tokens(0, 0)
    layer.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    with pytest.raises(BatchIndexError, match="1 rows x 2 KV heads"):
        layer.head_tokens(0, 2)
