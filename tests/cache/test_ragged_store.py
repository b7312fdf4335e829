"""The ragged store's batched operations (top-k per head with per-head budgets, gathers, merges, row
selection) match simple per-segment loops."""

from __future__ import annotations

import pytest
import torch

from lukv_cache.cache.storage.ragged import (
    RaggedMerge,
    RaggedStore,
    flat_index_from_mask,
    gather_ragged,
    keep_mask_evicting_few,
    keep_mask_from_counts,
    offsets_from_counts,
    segment_ids_from_offsets,
)


def select_ragged(scores, counts, total=None):
    """Top-k per (row, head) as a store's gather plan: flat indices (segment-major) and offsets."""
    counts = counts.long().clamp(0, scores.shape[-1])
    return flat_index_from_mask(keep_mask_from_counts(scores, counts), total), offsets_from_counts(counts)


def loop_select(scores: torch.Tensor, counts: torch.Tensor) -> tuple[list[int], list[int]]:
    b, h, t = scores.shape
    flat, offsets = [], [0]
    for i in range(b):
        for j in range(h):
            k = int(min(max(int(counts[i, j]), 0), t))
            top = sorted(scores[i, j].topk(k).indices.tolist())
            flat += [(i * h + j) * t + p for p in top]
            offsets.append(offsets[-1] + k)
    return flat, offsets


@pytest.mark.parametrize("with_total", [False, True])
def test_select_ragged_matches_per_head_topk_loop(with_total):
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 4, 50, generator=gen)
    counts = torch.randint(0, 51, (3, 4), generator=gen)
    counts[0, 0], counts[1, 2], counts[2, 3] = 0, 50, 1
    total = int(counts.sum()) if with_total else None
    flat, offsets = select_ragged(scores, counts, total=total)
    want_flat, want_offsets = loop_select(scores, counts)
    assert flat.tolist() == want_flat
    assert offsets.tolist() == want_offsets
    assert flat.dtype == offsets.dtype == torch.int64


def test_select_ragged_clamps_counts_to_the_sequence():
    scores = torch.tensor([[[0.3, 0.1, 0.2], [1.0, 2.0, 3.0]]])
    flat, offsets = select_ragged(scores, torch.tensor([[5, -2]]))
    assert flat.tolist() == [0, 1, 2]
    assert offsets.tolist() == [0, 3, 3]


def test_keep_mask_breaks_ties_towards_earlier_positions():
    scores = torch.tensor([[[1.0, 1.0, 1.0, 0.0]]])
    assert keep_mask_from_counts(scores, torch.tensor([[2]])).tolist() == [[[True, True, False, False]]]


def test_flat_index_without_sync_equals_nonzero():
    gen = torch.Generator().manual_seed(1)
    keep = torch.rand(2, 3, 40, generator=gen) < 0.3
    expected = keep.flatten().nonzero().squeeze(-1)
    assert torch.equal(flat_index_from_mask(keep, total=int(keep.sum())), expected)
    assert torch.equal(flat_index_from_mask(keep), expected)
    assert flat_index_from_mask(torch.zeros(2, 5, dtype=torch.bool), total=0).numel() == 0


def test_segment_ids_and_offsets_round_trip():
    counts = torch.tensor([[2, 0, 3], [0, 0, 1]])
    offsets = offsets_from_counts(counts)
    assert offsets.tolist() == [0, 2, 2, 5, 5, 5, 6]
    assert segment_ids_from_offsets(offsets, 6).tolist() == [0, 0, 2, 2, 2, 5]


def test_gather_ragged_reads_a_transposed_view_like_a_contiguous_copy():
    gen = torch.Generator().manual_seed(2)
    dense = torch.randn(2, 7, 3, 5, generator=gen).transpose(1, 2)  # [B, H, T, D] view, as in transformers
    scores = torch.randn(2, 3, 7, generator=gen)
    flat, _ = select_ragged(scores, torch.tensor([[1, 7, 0], [3, 2, 4]]))
    got = gather_ragged(dense, flat)
    assert torch.equal(got, dense.contiguous().reshape(-1, 5)[flat])
    assert got.is_contiguous() and got.untyped_storage().data_ptr() != dense.untyped_storage().data_ptr()


def _store(counts, seed=3, heads=3):
    gen = torch.Generator().manual_seed(seed)
    n = sum(counts)
    positions = torch.cat([torch.arange(c, dtype=torch.int32) for c in counts])
    return RaggedStore.build(
        torch.randn(n, 4, generator=gen), torch.randn(n, 4, generator=gen), positions,
        torch.tensor(counts), num_heads=heads,
    )  # fmt: skip


@pytest.mark.parametrize("sliced", [64, 0])  # one cat of views (few segments), or the merge's index
def test_extend_appends_each_segments_rows_after_its_own(sliced, monkeypatch):
    import lukv_cache.cache.storage.ragged as ragged

    monkeypatch.setattr(ragged, "SLICED_SEGMENTS", sliced)
    store = _store([2, 0, 4, 1, 0, 3])  # B = 2, H = 3
    gen = torch.Generator().manual_seed(4)
    new = torch.randn(2 * 6, 4, generator=gen)  # two rows per segment
    grown = store.extend(new, new, torch.full((12,), 50, dtype=torch.int32), torch.full((6,), 2))
    bounds = store.offsets_list
    for got, old in ((grown.keys, store.keys), (grown.values, store.values)):
        want = torch.cat(
            [torch.cat([old[bounds[s] : bounds[s + 1]], new[2 * s : 2 * s + 2]]) for s in range(6)]
        )
        assert torch.equal(got, want)
    assert grown.offsets_list == (0, 4, 6, 12, 15, 17, 22)
    assert grown.positions.dtype == torch.int32 and grown.positions[2:4].tolist() == [50, 50]


def test_select_rows_repeats_and_reorders_whole_rows():
    store = _store([2, 0, 4, 1, 0, 3])
    picked = store.select_rows(torch.tensor([1, 1, 0]))
    assert picked.counts().tolist() == [1, 0, 3, 1, 0, 3, 2, 0, 4]
    row1 = store.keys[6:]
    assert torch.equal(picked.keys[:4], row1) and torch.equal(picked.keys[4:8], row1)
    assert torch.equal(picked.keys[8:], store.keys[:6])


def test_select_drops_rows_and_keeps_segments():
    store = _store([2, 0, 4])
    kept = store.select(store.positions < 1)
    assert kept.counts().tolist() == [1, 0, 1]
    assert torch.equal(kept.keys, store.keys[[0, 2]])


@pytest.mark.parametrize(
    ("first_counts", "second_counts"),
    [([3, 0, 2, 0], [1, 2, 0, 0]), ([0, 0, 0, 0], [1, 2, 0, 3]), ([2, 1, 0, 4], [0, 0, 0, 0])],
)
def test_ragged_merge_matches_per_segment_concatenation(first_counts, second_counts):
    gen = torch.Generator().manual_seed(5)
    first_offsets = offsets_from_counts(torch.tensor(first_counts))
    second_offsets = offsets_from_counts(torch.tensor(second_counts))
    first = torch.randn(sum(first_counts), 3, generator=gen)
    second = torch.randn(sum(second_counts), 3, generator=gen, dtype=torch.float64)  # takes first's dtype
    merge = RaggedMerge.of(first_offsets, first.shape[0], second_offsets, second.shape[0])
    rows, offsets = merge.apply(first, second), merge.offsets
    a, b = first_offsets.tolist(), second_offsets.tolist()
    second = second.float()
    want = torch.cat([torch.cat([first[a[s] : a[s + 1]], second[b[s] : b[s + 1]]]) for s in range(4)])
    assert rows.dtype == torch.float32
    assert torch.equal(rows, want)
    assert (
        offsets.tolist()
        == offsets_from_counts(torch.tensor(first_counts) + torch.tensor(second_counts)).tolist()
    )


@pytest.mark.parametrize("seed", range(4))
def test_the_folds_partial_selection_keeps_what_the_stable_sort_keeps(seed):
    # few distinct scores (many ties), -inf slots (protected), counts from 0 to every finite slot
    gen = torch.Generator().manual_seed(seed)
    for _ in range(200):
        t = int(torch.randint(1, 40, (1,), generator=gen))
        scores = torch.randint(0, 6, (3, 2, t), generator=gen).float()
        scores[torch.rand(3, 2, t, generator=gen) < 0.3] = float("-inf")
        finite = scores > float("-inf")
        n = finite.sum(-1)
        counts = (torch.rand(3, 2, generator=gen) * (n + 1)).long().clamp_max(n)
        want = keep_mask_from_counts(scores, counts) & finite
        assert torch.equal(keep_mask_evicting_few(scores, counts), want)
