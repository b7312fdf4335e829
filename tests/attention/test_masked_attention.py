"""The CPU decode step over a small layer (lukv_cache.attention.masked) equals the per-segment reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import greedy_with_logits, tiny_model

from lukv_cache import LUKVCache
from lukv_cache.attention import compressed, limits, masked, tiles
from lukv_cache.attention.kernels import ragged_with_suffix_reference
from lukv_cache.cache.storage.ragged import RaggedStore
from lukv_cache.testing import prompt


def _case(counts: list[int], *, heads: int, m: int = 3, d: int = 16, suffix: int = 5, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(counts)
    store = RaggedStore.build(
        3 * torch.randn(n, d, generator=gen),  # peaked softmax: errors would show
        torch.randn(n, d, generator=gen),
        torch.arange(n),
        torch.tensor(counts),
        num_heads=heads,
    )
    b = len(counts) // heads
    query = torch.randn(b, heads, m, d, generator=gen)
    # the cache's suffix is a view of a longer buffer: read it as such
    sk = torch.randn(b, heads, suffix + 4, d, generator=gen)[:, :, :suffix]
    sv = torch.randn(b, heads, suffix + 4, d, generator=gen)[:, :, :suffix]
    return query, store, sk, sv


def _reference(query, store, sk, sv, softcap=None):
    return ragged_with_suffix_reference(
        query, store.keys, store.values, list(store.offsets_list), sk, sv, scaling=0.25, softcap=softcap
    )[0]


@pytest.mark.parametrize(
    ("counts", "heads"),
    [
        ([700, 300, 0, 1], 2),  # an empty segment, a one-row segment
        ([256, 512, 3], 3),
        ([0, 0], 1),  # nothing stored: the suffix alone
        ([0, 0, 0, 0], 2),
        ([90, 90, 90, 90], 2),  # equal segments: read alone, no mask
        ([1, 1, 1], 3),
        ([40, 17, 255, 257, 0, 130], 3),
    ],
)
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_masked_equals_the_reference(counts, heads, softcap):
    query, store, sk, sv = _case(counts, heads=heads)
    out = masked.masked_ragged_attention(query, store, sk, sv, scaling=0.25, softcap=softcap)
    torch.testing.assert_close(out, _reference(query, store, sk, sv, softcap), atol=2e-5, rtol=1e-4)
    assert out.dtype == torch.float32


def test_random_layouts():
    gen = torch.Generator().manual_seed(1)
    for trial in range(20):
        counts = torch.randint(0, 90, (6,), generator=gen).tolist()
        query, store, sk, sv = _case(counts, heads=3, m=4, suffix=1 + trial % 4, seed=trial)
        out = masked.masked_ragged_attention(query, store, sk, sv, scaling=0.25)
        torch.testing.assert_close(out, _reference(query, store, sk, sv), atol=2e-5, rtol=1e-4)


def test_masks_are_kept_per_store_and_released_with_it():
    query, store, sk, sv = _case([40, 60], heads=2)
    masked.masked_ragged_attention(query, store, sk, sv, scaling=0.25)
    mask = masked._MASKS[store.offsets]
    masked.masked_ragged_attention(query, store, sk, sv, scaling=0.25)
    assert masked._MASKS[store.offsets] is mask
    before = len(masked._MASKS), len(masked._EQUAL)
    del store, mask
    assert (len(masked._MASKS), len(masked._EQUAL)) == (before[0] - 1, before[1] - 1)


def test_equal_segments_need_no_mask():
    query, store, sk, sv = _case([50, 50, 50, 50], heads=2)
    out = masked.masked_ragged_attention(query, store, sk, sv, scaling=0.25)
    assert store.offsets not in masked._MASKS
    torch.testing.assert_close(out, _reference(query, store, sk, sv), atol=2e-5, rtol=1e-4)


def test_dispatch_small_fp32_layers_only(monkeypatch):
    query, store, sk, sv = _case([300, 20], heads=2)
    assert masked.serves(query, store, sk)
    assert not masked.serves(query, store, sk[:, :, :0])  # no suffix: a segment could have nothing
    assert not masked.serves(query.bfloat16(), store, sk)
    monkeypatch.setattr(
        limits, "LIMITS", replace(limits.LIMITS, masked_limit=2 * 320 - 1)
    )  # segments x rows = 640
    assert not masked.serves(query, store, sk)
    _, equal, esk, _ = _case([300, 300], heads=2)
    monkeypatch.setattr(
        limits, "LIMITS", replace(limits.LIMITS, masked_equal_limit=600)
    )  # equal segments: their rows count alone
    assert masked.serves(query, equal, esk)
    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, masked_equal_limit=599))
    assert not masked.serves(query, equal, esk)
    # compressed_attention takes the tiles above the limit, and gets the same result
    calls = []
    real = tiles.tiled_ragged_attention
    monkeypatch.setattr(tiles, "tiled_ragged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    hq_query = query.reshape(1, 2 * 3, 1, 16)  # [B, Hq, Q, D]: 3 query heads per KV head
    out = compressed.compressed_attention(store, hq_query, sk, sv, None, 0.25)
    assert calls == [1]
    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, masked_limit=640))
    again = compressed.compressed_attention(store, hq_query, sk, sv, None, 0.25)
    assert calls == [1]
    torch.testing.assert_close(again, out, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("arch", "attn", "budget"),
    [
        ("llama", "sdpa", {"ratio": 0.3, "allocator": "adakv"}),  # ragged segments: the masked product
        ("llama", "sdpa", {"max_tokens": 60, "allocator": "uniform"}),  # equal segments: each read alone
        ("gemma2", "eager", {"ratio": 0.3, "allocator": "adakv"}),  # soft-capped logits
    ],
)
def test_generation_is_the_same_with_the_per_segment_reference(monkeypatch, arch, attn, budget):
    """Greedy decoding over small compressed layers and its logits match the per-segment reference
    path, soft-capped logits included."""
    model = tiny_model(arch, attn=attn)
    ids = prompt(batch=2, length=120, seed=3)

    def run():
        cache = LUKVCache(scorer="keydiff", **budget)
        result = greedy_with_logits(model, ids, cache)
        assert cache.is_compressed
        return result

    calls = []
    real = masked.masked_ragged_attention
    calls_stores = []

    def spy(query, store, *args, **kwargs):
        calls.append(kwargs)
        calls_stores.append(store.offsets)
        return real(query, store, *args, **kwargs)

    monkeypatch.setattr(masked, "masked_ragged_attention", spy)
    seq, logits = run()
    assert calls, "the masked path was not used"
    assert masked._EQUAL[calls_stores[0]] == ("max_tokens" in budget)
    assert all((k["softcap"] is not None) == (arch == "gemma2") for k in calls)
    monkeypatch.setattr(tiles, "serves", lambda *a: False)
    monkeypatch.setattr(masked, "serves", lambda *a: False)
    ref_seq, ref_logits = run()
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
