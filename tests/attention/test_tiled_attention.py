"""The CPU ragged attention in tiles (lukv_cache.attention.tiles) equals the per-segment reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import greedy_with_logits, tiny_model

from lukv_cache import LUKVCache
from lukv_cache.attention import limits, masked, tiles
from lukv_cache.attention.dispatch import ragged_attention
from lukv_cache.attention.partial import ragged_attention_reference
from lukv_cache.testing import prompt


def _case(counts: list[int], *, heads: int = 1, m: int = 3, d: int = 16, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.zeros(len(counts) + 1, dtype=torch.long)
    offsets[1:] = torch.tensor(counts).cumsum(0)
    n = int(offsets[-1])
    query = torch.randn(len(counts) // heads, heads, m, d, generator=gen).to(dtype)
    keys = (3 * torch.randn(n, d, generator=gen)).to(dtype)  # peaked softmax: errors would show
    values = torch.randn(n, d, generator=gen).to(dtype)
    return query, keys, values, offsets


@pytest.mark.parametrize(
    "counts",
    [
        [700, 300, 0, 1],  # shared tiles, an empty segment, a one-row segment
        [256, 512],  # every tile inside one segment: no bias at all
        [5, 7, 3],  # fewer rows than one tile: only gathered tiles
        [0, 0],  # nothing stored
        [1000, 17, 255, 257, 0, 1300],
    ],
)
def test_tiles_equal_the_reference(counts):
    query, keys, values, offsets = _case(counts, heads=2 if len(counts) % 2 == 0 else 1)
    out, lse = tiles.tiled_ragged_attention(query, keys, values, offsets, scaling=0.25)
    ref, ref_lse = ragged_attention_reference(query, keys, values, offsets.tolist(), scaling=0.25)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=1e-5)
    assert out.dtype == lse.dtype == torch.float32


def test_random_layouts_and_tile_sizes():
    gen = torch.Generator().manual_seed(1)
    for trial in range(20):
        counts = torch.randint(0, 90, (6,), generator=gen).tolist()
        query, keys, values, offsets = _case(counts, heads=3, m=4, seed=trial)
        size = int(torch.randint(1, 40, (1,), generator=gen))
        tile = limits.AttentionLimits(tile_rows=size)
        out, lse = tiles.tiled_ragged_attention(query, keys, values, offsets, scaling=0.3, limits=tile)
        ref, ref_lse = ragged_attention_reference(query, keys, values, offsets.tolist(), scaling=0.3)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4, msg=f"counts={counts} tile_rows={size}")
        torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=1e-5)


def test_plan_covers_every_row_once():
    offsets = torch.tensor([0, 5, 5, 12, 13, 40])
    plan = tiles.tile_plan(offsets, 40, size=8)
    seg = torch.repeat_interleave(torch.arange(5), offsets.diff())
    seen = torch.zeros(5, 40, dtype=torch.long)  # [segment, row]: how often a row is attended for it
    extra = plan.gather_owner.numel()
    for s, parts in enumerate(plan.grid.tolist()):
        for j, part in enumerate(parts):
            if plan.padding[s, j, 0]:
                continue  # padding: masked in the merge
            if part < plan.in_place:
                seen[s, part * 8 : (part + 1) * 8] += 1
                assert plan.owner[part] == s
            elif part < plan.in_place + extra:
                i = part - plan.in_place
                assert plan.gather_owner[i] == s
                rows = plan.gather_index.view(extra, 8)[i][plan.gather_bias[i, 0, 0] == 0]
                seen[s, rows] += 1
    expected = torch.zeros(5, 40, dtype=torch.long)
    expected[seg, torch.arange(40)] = 1
    assert torch.equal(seen, expected)
    assert plan.padding[1].all()  # segment 1 is empty: every entry of its row is padding
    assert not plan.suffix_padding[1, -1, 0]  # ... but it attends its suffix


def test_suffix_merges_like_the_reference():
    from lukv_cache.attention.kernels import ragged_with_suffix_reference

    query, keys, values, offsets = _case([600, 0, 90, 333], heads=2)
    gen = torch.Generator().manual_seed(5)
    sk, sv = torch.randn(2, 2, 7, 16, generator=gen), torch.randn(2, 2, 7, 16, generator=gen)
    out, lse = tiles.tiled_ragged_attention(
        query, keys, values, offsets, scaling=0.25, suffix_keys=sk, suffix_values=sv
    )
    ref, ref_lse = ragged_with_suffix_reference(query, keys, values, offsets.tolist(), sk, sv, scaling=0.25)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=1e-5)


def test_bf16_store():
    query, keys, values, offsets = _case([600, 90, 333], dtype=torch.bfloat16)
    out, lse = tiles.tiled_ragged_attention(query, keys, values, offsets, scaling=0.25)
    ref, ref_lse = ragged_attention_reference(
        query.float(), keys.float(), values.float(), offsets.tolist(), scaling=0.25
    )
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse, ref_lse, atol=3e-2, rtol=1e-2)


def test_dispatch_takes_the_tiles_on_cpu_and_the_reference_for_softcap(monkeypatch):
    query, keys, values, offsets = _case([300, 20])
    calls = []
    real = tiles.tiled_ragged_attention
    monkeypatch.setattr(tiles, "tiled_ragged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    ragged_attention(query, keys, values, offsets, scaling=0.25)
    assert calls == [1]
    out, _ = ragged_attention(query, keys, values, offsets, scaling=0.25, softcap=30.0)
    ref, _ = ragged_attention_reference(query, keys, values, offsets.tolist(), scaling=0.25, softcap=30.0)
    assert calls == [1]
    torch.testing.assert_close(out, ref)
    # a key bias that masks a stored row goes to the reference, which applies it
    bias = torch.zeros(keys.shape[0], 1)
    bias[3] = torch.finfo(torch.float32).min
    out, _ = ragged_attention(query, keys, values, offsets, scaling=0.25, key_bias=bias)
    ref, _ = ragged_attention_reference(query, keys, values, offsets.tolist(), scaling=0.25, key_bias=bias)
    assert calls == [1]
    torch.testing.assert_close(out, ref)


def test_plans_are_reused_per_store_and_released_with_it():
    query, keys, values, offsets = _case([400, 100])
    tiles.tiled_ragged_attention(query, keys, values, offsets, scaling=0.25)
    plan = tiles._PLANS[offsets]
    tiles.tiled_ragged_attention(query, keys, values, offsets, scaling=0.25)
    assert tiles._PLANS[offsets] is plan
    before = len(tiles._PLANS)
    del offsets
    assert len(tiles._PLANS) == before - 1


def test_generation_is_the_same_with_the_per_segment_reference(monkeypatch):
    """A 400-token prompt leaves stores of a few hundred rows per layer (in-place and gathered tiles):
    greedy decoding and its logits match the per-segment reference path."""
    # such small layers take the masked product otherwise
    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, masked_limit=0))
    model = tiny_model("llama")
    ids = prompt(batch=2, length=400, seed=3)

    def run():
        cache = LUKVCache(ratio=0.3, scorer="keydiff", allocator="adakv")
        result = greedy_with_logits(model, ids, cache)
        assert cache.is_compressed
        return result

    calls = []
    real = tiles.tiled_ragged_attention
    monkeypatch.setattr(tiles, "tiled_ragged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    seq, logits = run()
    assert calls, "the tiled path was not used"
    monkeypatch.setattr(tiles, "serves", lambda *a: False)
    monkeypatch.setattr(masked, "serves", lambda *a: False)
    ref_seq, ref_logits = run()
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


def test_a_non_contiguous_store_is_read_correctly():
    query, keys, values, offsets = _case([600, 90, 333])
    wide_k = torch.cat([keys, torch.randn_like(keys)], dim=1)[:, :16]  # a strided view: rows 32 apart
    wide_v = torch.cat([values, torch.randn_like(values)], dim=1)[:, :16]
    assert not wide_k.is_contiguous()
    out, lse = tiles.tiled_ragged_attention(query, wide_k, wide_v, offsets, scaling=0.25)
    ref, ref_lse = ragged_attention_reference(query, keys, values, offsets.tolist(), scaling=0.25)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=1e-5)
