"""crop, reorder_cache, batch_repeat_interleave, batch_select_indices and reset: the stored tokens are the
ones they should be, and what comes next is computed as it should be."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_model
from transformers import DynamicCache

from lukv_cache import LUKVCache
from lukv_cache.cache.storage.layer import LUKVLayer
from lukv_cache.testing import prompt

ATOL = 1e-5
B, T = 3, 40


def forward(model, cache, ids):
    with torch.no_grad():
        return model(ids, past_key_values=cache).logits


def segments(layer: LUKVLayer) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per (row, head) segment of the ragged store: (positions, keys, values)."""
    bounds = layer.store.offsets.tolist()
    return [
        (layer.store.positions[lo:hi], layer.store.keys[lo:hi], layer.store.values[lo:hi])
        for lo, hi in zip(bounds[:-1], bounds[1:])
    ]


def assert_same_segments(actual: list, expected: list) -> None:
    assert len(actual) == len(expected)
    for (pa, ka, va), (pe, ke, ve) in zip(actual, expected):
        assert torch.equal(pa, pe) and torch.equal(ka, ke) and torch.equal(va, ve)


def compressed(ratio=0.5, arch="llama", steps=3, seed=0):
    """A batch of 3 unpadded rows, compressed, then ``steps`` decode tokens appended to the suffix."""
    model = tiny_model(arch, "sdpa")
    cache = LUKVCache(ratio, "keydiff", sink=2)
    forward(model, cache, prompt(B, T, seed=seed))
    for step in range(steps):
        forward(model, cache, prompt(B, 1, seed=100 + step))
    return model, cache


def rows_of(layer: LUKVLayer, rows: list[int]) -> tuple[list, torch.Tensor]:
    """What a layer holding only ``rows`` (in that order) must hold: its segments and its suffix keys."""
    h = layer.suffix_keys.shape[1]
    segs = segments(layer)
    return [segs[r * h + head] for r in rows for head in range(h)], layer.suffix_keys[rows]


def assert_layer_holds_rows(after: LUKVLayer, before: LUKVLayer, rows: list[int]) -> None:
    expected_segments, expected_suffix = rows_of(before, rows)
    assert_same_segments(segments(after), expected_segments)
    assert torch.equal(after.suffix_keys, expected_suffix)
    assert after.cumulative_length == before.cumulative_length


@pytest.mark.parametrize(
    ("op", "rows"),
    [
        (lambda c: c.reorder_cache(torch.tensor([2, 0, 0])), [2, 0, 0]),
        (lambda c: c.batch_repeat_interleave(2), [0, 0, 1, 1, 2, 2]),
        (lambda c: c.batch_select_indices(torch.tensor([2, 0])), [2, 0]),
        (lambda c: c.batch_select_indices(torch.tensor([False, True, True])), [1, 2]),
    ],
    ids=["reorder_cache", "batch_repeat_interleave", "batch_select_indices", "batch_select_bool_mask"],
)
def test_batch_op_keeps_exactly_the_selected_rows_and_their_next_logits(op, rows):
    model, cache = compressed()
    before = copy.deepcopy(cache)
    op(cache)
    for after_layer, before_layer in zip(cache.layers, before.layers):
        assert_layer_holds_rows(after_layer, before_layer, rows)
    assert torch.equal(cache.stored_tokens(), before.stored_tokens()[:, rows])
    # the next token: row r of the new cache answers like row rows[r] of the old one
    nxt = prompt(B, 1, seed=200)
    expected = forward(model, before, nxt)[rows]
    actual = forward(model, cache, nxt[rows])
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


def test_crop_into_the_suffix_equals_never_having_decoded_those_tokens():
    model, cache = compressed(steps=1)
    earlier = copy.deepcopy(cache)
    forward(model, cache, prompt(B, 1, seed=300))
    forward(model, cache, prompt(B, 1, seed=301))
    cache.crop(-2)
    assert cache.get_seq_length() == earlier.get_seq_length() == T + 1
    assert torch.equal(cache.stored_tokens(), earlier.stored_tokens())
    for layer, ref in zip(cache.layers, earlier.layers):
        assert_same_segments(segments(layer), segments(ref))
        assert torch.equal(layer.suffix_keys, ref.suffix_keys)
        assert torch.equal(layer.suffix_values, ref.suffix_values)
    nxt = prompt(B, 2, seed=302)
    torch.testing.assert_close(forward(model, cache, nxt), forward(model, earlier, nxt), atol=ATOL, rtol=0)


def test_crop_into_the_store_drops_exactly_the_tokens_past_the_new_length():
    model, cache = compressed(steps=2)
    before = copy.deepcopy(cache)
    keep_len = T - 12
    cache.crop(-(cache.get_seq_length() - keep_len))
    assert cache.get_seq_length() == keep_len
    for layer, ref in zip(cache.layers, before.layers):
        assert layer.suffix_keys.shape[2] == 0  # the whole suffix was past the new length
        expected = []
        for pos, keys, values in segments(ref):
            kept = pos < keep_len
            expected.append((pos[kept], keys[kept], values[kept]))
        assert_same_segments(segments(layer), expected)
    # and the cache is usable again: decoding continues at the cropped length
    forward(model, cache, prompt(B, 2, seed=303))
    assert cache.get_seq_length() == keep_len + 2


@pytest.mark.parametrize(("arch", "attn"), [("llama", "sdpa"), ("gemma3", "eager")])
@pytest.mark.parametrize("cut", [2, 15])  # into the suffix / deep into the store
def test_keep_all_crop_then_decode_matches_dynamic_cache(arch, attn, cut):
    model = tiny_model(arch, attn)
    ids, more = prompt(1, 30, seed=4), prompt(1, 4, seed=5)
    results = []
    for cache in (DynamicCache(config=model.config), LUKVCache(0.0)):
        cache.activate_past_recording()  # transformers' sliding layers can only roll back when recording
        forward(model, cache, ids)
        forward(model, cache, more[:, :1])
        forward(model, cache, more[:, 1:2])
        cache.crop(-cut)
        results.append((cache.get_seq_length(), forward(model, cache, more[:, 2:])))
    (ref_len, ref_logits), (length, logits) = results
    assert length == ref_len
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)


def test_reset_empties_the_cache_and_it_then_behaves_like_a_fresh_one():
    model, cache = compressed(steps=2)
    cache.reset()
    assert cache.get_seq_length() == 0
    assert cache.memory_bytes() == 0
    assert cache.stored_tokens().sum() == 0
    ids = prompt(1, 33, seed=7)
    fresh = LUKVCache(0.5, "keydiff", sink=2)
    torch.testing.assert_close(forward(model, cache, ids), forward(model, fresh, ids), atol=0, rtol=0)
    assert torch.equal(cache.stored_tokens(), fresh.stored_tokens())


def test_beam_search_with_eviction_runs_and_keeps_the_compressed_counts():
    model = tiny_model("llama", "sdpa")
    ids = prompt(2, T, seed=8)
    cache = LUKVCache(0.5, "keydiff")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=4, num_beams=3, do_sample=False)
    assert out.shape == (2, T + 4)
    stored = cache.stored_tokens()
    assert stored.shape[1] == 6  # 2 prompts x 3 beams
    # every beam of a prompt inherited that prompt's compressed store: far fewer than T + 3 tokens
    assert (stored < T).all()
