"""Compression really frees memory: what the cache holds is the kept tokens plus a short suffix, and no
tensor of prefill size stays alive (a slice of the prefill KV would pin all of it)."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import tiny_model
from transformers import DynamicCache

from lukv_cache import LUKVCache
from lukv_cache.attention import lukv_aware, peek_attention
from lukv_cache.cache.storage.layer import LUKVLayer
from lukv_cache.testing import prompt

PROMPT = 601  # odd, so no unrelated tensor dimension matches it by accident
HEAD_DIM = 64


def model_with_head_dim_64(dtype=torch.float32):
    return tiny_model(
        "llama",
        "sdpa",
        dtype,
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=1024,
    )


def compressed_cache(ratio=0.8, scorer="keydiff", generate=False, dtype=torch.float32):
    model = model_with_head_dim_64(dtype)
    ids = prompt(1, PROMPT, seed=21)
    cache = LUKVCache(ratio, scorer)
    with torch.no_grad():
        if generate:
            model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
        else:
            model(ids, past_key_values=cache)
    return model, cache


def tensors_reachable_from(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor in the attributes, lists, tuples and dicts reachable from ``obj`` (not following modules)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, torch.nn.Module):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    children = []
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(
        ("lukv_cache", "transformers.cache_utils")
    ):
        children = list(vars(obj).values())
    out = []
    for child in children:
        out.extend(tensors_reachable_from(child, seen))
    return out


def unique_storage_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def suffix_buffer_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for t in layer.suffix_buffers:
            total += t.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_after_compression_is_at_most_ideal_bytes_plus_suffix(dtype):
    _, cache = compressed_cache(0.8, dtype=dtype)
    size = torch.empty(0, dtype=dtype).element_size()
    kept_in_store = sum(layer.store.keys.shape[0] for layer in cache.layers)
    ideal = kept_in_store * HEAD_DIM * 2 * size
    assert cache.memory_bytes() <= 1.02 * ideal + suffix_buffer_bytes(cache)
    # the store is ~20% of a full cache: 20% of the evictable tokens plus the 4 sinks, per head
    full = 2 * size * HEAD_DIM * PROMPT * 2 * len(cache.layers)
    evictable = PROMPT - cache.sink - cache.window
    assert kept_in_store == len(cache.layers) * 2 * (round(0.2 * evictable) + cache.sink)
    assert cache.memory_bytes() - suffix_buffer_bytes(cache) < 0.21 * full


def test_memory_bytes_counts_every_tensor_the_cache_holds():
    _, cache = compressed_cache(0.8, generate=True)
    held = tensors_reachable_from(cache)
    assert held
    assert cache.memory_bytes() >= unique_storage_bytes(held)


def test_memory_bytes_counts_the_kept_prefill_scores():
    model = model_with_head_dim_64()
    ids = prompt(1, PROMPT, seed=21)
    plain, keeping = LUKVCache(0.8), LUKVCache(0.8, keep_scores=True)
    with torch.no_grad():
        model(ids, past_key_values=plain)
        model(ids, past_key_values=keeping)
    scores = len(keeping.layers) * 2 * PROMPT * 4  # fp32 [1, 2, PROMPT] per layer
    assert sum(t.numel() * t.element_size() for t in keeping.prefill_scores.values()) == scores
    assert keeping.memory_bytes() == plain.memory_bytes() + scores


def test_store_tensors_are_compact_and_not_views_of_the_prefill():
    _, cache = compressed_cache(0.8)
    for layer in cache.layers:
        assert isinstance(layer, LUKVLayer) and layer.compressed
        for name in ("keys", "values", "positions", "offsets"):
            t = getattr(layer.store, name)
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), f"{name} is a view of more"
        assert layer.store.positions.dtype == torch.int16  # every position below 32768
        # the suffix is its own small buffer (protected window + room to decode), not the prefill tensor
        for buf, view in zip(layer.suffix_buffers, (layer.suffix_keys, layer.suffix_values)):
            assert buf.untyped_storage().nbytes() == buf.numel() * buf.element_size()
            assert view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
            assert buf.shape[-2] < PROMPT // 4


def test_every_tensor_the_cache_references_has_the_compressed_size():
    _, cache = compressed_cache(0.8, generate=True)
    for t in tensors_reachable_from(cache):
        assert PROMPT not in t.shape, f"a tensor of prefill size {tuple(t.shape)} is still referenced"
        assert t.untyped_storage().nbytes() < PROMPT * HEAD_DIM * 2 * 4


def test_no_tensor_of_prefill_size_stays_alive_after_compression():
    model, cache = compressed_cache(0.8, generate=True)
    gc.collect()
    prefill_sized = [
        tuple(obj.shape)
        for obj in gc.get_objects()
        if issubclass(type(obj), torch.Tensor)
        and obj.is_floating_point()
        and obj.dim() >= 3
        and PROMPT in obj.shape
    ]
    assert prefill_sized == []
    assert cache.get_seq_length() == PROMPT + 2


def test_keep_all_cache_holds_about_what_dynamic_cache_holds():
    """Ratio 0 moves everything into the ragged store: no duplicate copy, only the small suffix on top."""
    model = model_with_head_dim_64()
    ids = prompt(1, PROMPT, seed=21)
    full, lukv = DynamicCache(config=model.config), LUKVCache(0.0)
    with torch.no_grad():
        model(ids, past_key_values=full)
        model(ids, past_key_values=lukv)
    dense = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in full.layers)
    assert dense <= lukv.memory_bytes() <= 1.02 * dense + suffix_buffer_bytes(lukv)
    assert torch.equal(lukv.stored_tokens(), torch.full((2, 1, 2), PROMPT))


def test_each_layer_is_compressed_before_the_next_layer_attends(monkeypatch):
    """Only one layer's full KV is alive at a time: when layer i attends, layers < i hold compressed stores."""
    from transformers import AttentionInterface

    seen: list[tuple[int, list[int]]] = []
    stock = AttentionInterface._global_mapping["sdpa"]

    model = tiny_model("llama", "sdpa", num_hidden_layers=4)
    cache = LUKVCache(0.8)

    def attention(module, query, key, *args, **kwargs):
        call = peek_attention(key)
        if call is not None and not cache.layers[call.layer_idx].compressed:
            earlier = cache.layers[: call.layer_idx]
            seen.append((call.layer_idx, [int(e.stored_counts().sum()) for e in earlier]))
        return stock(module, query, key, *args, **kwargs)

    # delegates to lukv's routing: the guard must let it be
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", lukv_aware(attention))
    with torch.no_grad():
        model(prompt(1, 200, seed=22), past_key_values=cache)
    assert [idx for idx, _ in seen] == [0, 1, 2, 3]
    for _, stored in seen:
        # per head: 20% of the 195 evictable tokens + 4 sinks + 1 window = 44; 2 heads
        assert stored == [88] * len(stored), seen


def test_suffix_buffers_are_the_whole_buffers_the_suffix_views_read():
    layer = LUKVLayer()
    assert layer.suffix_buffers is None  # nothing held yet
    layer.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    layer.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))  # decoding appends into the room left
    buffers = layer.suffix_buffers
    assert buffers is not None
    for buffer, view in zip(buffers, (layer.suffix_keys, layer.suffix_values)):
        assert buffer.shape[:2] == (1, 2) and buffer.shape[-2] >= layer.suffix_length == 4
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert torch.equal(buffer[:, :, :4], view)
