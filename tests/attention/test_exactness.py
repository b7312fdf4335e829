"""With eviction, the ragged path is exact: it equals plain softmax attention over each head's kept tokens.

The reference here is written independently of ``lukv_cache.attention``: for each (row, query head) it
materialises the KV head's kept tokens densely (the layer's ragged segment, then its dense suffix), builds
the causal + padding mask from the test's own 2D padding mask and the tokens' original positions, and runs
``softmax(q k^T * scale) v`` in float64.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_model
from transformers import AttentionInterface, DynamicCache

from lukv_cache import LUKVCache, lukv_aware
from lukv_cache.attention import claim_attention, peek_attention
from lukv_cache.cache.storage.layer import LUKVLayer
from lukv_cache.testing import left_padded

ATOL = 2e-5


def snapshot(store, logical: int) -> dict:
    """A layer's ragged store as the attention call sees it (compression replaces, never mutates, it)."""
    return dict(
        keys=store.keys,
        values=store.values,
        positions=store.positions.clone(),
        offsets=store.offsets.clone(),
        logical=logical,
    )


def dense_reference(
    query, suffix_keys, suffix_values, store: dict, mask2d, scaling, softcap=None, sliding_window=None
):
    """fp64 attention ``[B, Q, Hq, D]`` of ``query [B, Hq, Q, D]`` over kept store tokens + suffix, per head
    (a sliding layer's query reads the kept tokens of its last ``sliding_window`` positions only)."""
    b, hq, q_len, _ = query.shape
    h, s = suffix_keys.shape[1], suffix_keys.shape[2]
    group = hq // h
    logical = store["logical"]
    query_pos = torch.arange(logical - q_len, logical)
    suffix_pos = torch.arange(logical - s, logical)
    bounds = store["offsets"].tolist()
    out = torch.zeros(b, q_len, hq, suffix_values.shape[-1], dtype=torch.float64)
    for row in range(b):
        for head in range(hq):
            kv = head // group
            lo, hi = bounds[row * h + kv], bounds[row * h + kv + 1]
            keys = torch.cat([store["keys"][lo:hi], suffix_keys[row, kv]]).double()
            values = torch.cat([store["values"][lo:hi], suffix_values[row, kv]]).double()
            pos = torch.cat([store["positions"][lo:hi].long(), suffix_pos])
            allowed = (pos[None, :] <= query_pos[:, None]) & mask2d[row, pos].bool()[None, :]
            if sliding_window is not None:
                allowed &= pos[None, :] > query_pos[:, None] - sliding_window
            logits = query[row, head].double() @ keys.T * scaling
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
            out[row, :, head] = probs @ values
    return out


class AttentionRecorder:
    """Wraps the registered ``sdpa``/``eager`` functions (lukv's routing) and records, for every call on a
    compressed layer, the library's output next to the dense fp64 reference."""

    def __init__(self, monkeypatch, mask2d_fn, cache):
        self.mask2d_fn = mask2d_fn  # () -> the [B, L] padding mask valid for the current forward
        self.cache = cache
        self.diffs: list[tuple[int, int, float]] = []
        mapping = AttentionInterface._global_mapping
        for name in ("sdpa", "eager"):
            monkeypatch.setitem(mapping, name, self._wrap(mapping[name]))

    def _wrap(self, inner):
        def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
            call = peek_attention(key)
            store = None
            if call is not None and call.store is not None:
                store = snapshot(call.store, self.cache.layers[call.layer_idx].cumulative_length)
            out, weights = inner(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
            if store is not None:
                window = self.cache.layers[call.layer_idx].sliding_window
                ref = dense_reference(
                    query, key, value, store, self.mask2d_fn(), scaling, kwargs.get("softcap"), window
                )
                # padding queries see no key at all (reference: NaN); their output is never used
                real = torch.isfinite(ref)
                diff = (out.double() - ref)[real].abs().max().item()
                self.diffs.append((call.layer_idx, query.shape[2], diff))
            return out, weights

        return lukv_aware(attention)  # reads a LUKVCache (through `inner`): lukv's guard must let it be


CASES = [
    ("llama", "sdpa", "keydiff", "uniform"),
    ("llama", "eager", "knorm", "adakv"),
    ("qwen3", "sdpa", "snapkv", "uniform"),
    ("mistral", "eager", "expected_attention", "pyramid"),
    ("phi3", "sdpa", "tova", "adakv"),
    ("gemma2", "eager", "random", "uniform"),  # attention softcap
    ("gemma3", "sdpa", "streaming", "uniform"),
]


@pytest.mark.parametrize("ratio", [0.5, 0.8])
@pytest.mark.parametrize(("arch", "attn", "scorer", "allocator"), CASES)
def test_ragged_attention_equals_dense_attention_over_kept_tokens(
    monkeypatch, arch, attn, scorer, allocator, ratio
):
    model = tiny_model(arch, attn)
    ids, mask = left_padded((60, 47, 40), seed=11)
    new = 4
    masks = {"current": mask}
    cache = LUKVCache(ratio, scorer, allocator)
    recorder = AttentionRecorder(monkeypatch, lambda: masks["current"], cache)
    # generate extends the mask by one column per step; the recorder's mask grows with it
    masks["current"] = torch.cat([mask, torch.ones(3, new, dtype=mask.dtype)], dim=1)
    model.generate(
        input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new, do_sample=False
    )
    compressed = [layer for layer in cache.layers if isinstance(layer, LUKVLayer)]
    # the stored count really shrank: evictable tokens (not sinks/window/padding) were removed
    real = mask.sum(-1)
    for layer in compressed:
        counts = layer.store.offsets.diff().view(3, -1)
        assert (counts < real.view(3, 1)).all()
    decode_calls = [d for d in recorder.diffs if d[1] == 1]
    assert len(decode_calls) == len(compressed) * (new - 1), recorder.diffs
    assert all(d[2] < ATOL for d in recorder.diffs), recorder.diffs


@pytest.mark.parametrize(("arch", "attn", "scorer", "allocator"), CASES[:4])
def test_ragged_store_holds_exact_copies_of_the_prefill_keys_at_their_positions(
    arch, attn, scorer, allocator
):
    model = tiny_model(arch, attn)
    ids, mask = left_padded((60, 47, 40), seed=12)
    full = DynamicCache(config=model.config)
    cache = LUKVCache(0.8, scorer, allocator, sink=4)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=full)
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    pad = (mask == 0).sum(-1)
    for idx, layer in enumerate(cache.layers):
        if not isinstance(layer, LUKVLayer):
            continue
        keys, values = full.layers[idx].keys, full.layers[idx].values
        b, h = keys.shape[:2]
        bounds = layer.store.offsets.tolist()
        for row in range(b):
            for head in range(h):
                lo, hi = bounds[row * h + head], bounds[row * h + head + 1]
                pos = layer.store.positions[lo:hi].long()
                assert torch.all(pos[1:] > pos[:-1]), "positions in a segment must be unique and ascending"
                assert (mask[row, pos] == 1).all(), "a padding token was kept"
                # the 4 sinks (first real tokens) are always kept
                sinks = torch.arange(pad[row], pad[row] + 4)
                assert torch.isin(sinks, pos).all()
                assert torch.equal(layer.store.keys[lo:hi], keys[row, head, pos])
                assert torch.equal(layer.store.values[lo:hi], values[row, head, pos])
        # the dense suffix is the protected window: the last `window` prompt tokens
        window = cache.window
        assert torch.equal(layer.suffix_keys, keys[:, :, keys.shape[2] - window :])


def _reference_attention(mask2d_fn, cache):
    """An attention function that ignores lukv's kernels: it claims the cache's call and computes dense
    fp64 attention over the snapshot of the store, per head (the same public contract lukv's own uses)."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        call = claim_attention(module, key)
        layer = cache.layers[call.layer_idx]
        store = snapshot(call.store, layer.cumulative_length)
        out = dense_reference(
            query, key, value, store, mask2d_fn(), scaling, kwargs.get("softcap"), layer.sliding_window
        )
        call.finish(module, query, attention_mask)
        return out.to(query.dtype), None

    return lukv_aware(attention)  # it reads the ragged store itself: lukv's guard must let it be


@pytest.mark.parametrize(
    ("arch", "scorer", "allocator", "ratio"),
    [
        ("llama", "keydiff", "uniform", 0.8),
        ("qwen2", "snapkv", "adakv", 0.5),
        ("gemma3", "tova", "pyramid", 0.8),
    ],
)
def test_next_token_logits_after_compression_equal_a_dense_per_head_reference_model(
    monkeypatch, arch, scorer, allocator, ratio
):
    """End to end: the question's logits through the compressed cache equal those of the same model whose
    every attention call is the dense fp64 reference over exactly the kept tokens."""
    model = tiny_model(arch, "sdpa")
    context, mask = left_padded((64, 50), seed=13)
    question = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(14))
    full_mask = torch.cat([mask, torch.ones_like(question)], dim=1)
    cache = LUKVCache(ratio, scorer, allocator)
    with torch.no_grad():
        model(input_ids=context, attention_mask=mask, past_key_values=cache)
    twin = copy.deepcopy(cache)
    with torch.no_grad():
        logits = model(input_ids=question, attention_mask=full_mask, past_key_values=cache).logits
        mapping = AttentionInterface._global_mapping
        reference = _reference_attention(lambda: full_mask, twin)
        # only keys the cache announced go to the reference (gemma3's sliding layers are compressed too)
        stock = mapping["sdpa"]

        def routed(module, query, key, *args, **kwargs):
            fn = reference if peek_attention(key) is not None else stock
            return fn(module, query, key, *args, **kwargs)

        monkeypatch.setitem(mapping, "sdpa", lukv_aware(routed))
        ref_logits = model(input_ids=question, attention_mask=full_mask, past_key_values=twin).logits
    assert cache.stored_tokens().sum() < DynamicCacheSize.of(model, context).sum()
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)


class DynamicCacheSize:
    @staticmethod
    def of(model, ids) -> torch.Tensor:
        """Tokens per (layer, row, head) a full cache would hold for ``ids``."""
        cfg = model.config.get_text_config(decoder=True)
        return torch.full((cfg.num_hidden_layers, ids.shape[0], cfg.num_key_value_heads), ids.shape[1])


@pytest.mark.parametrize("scorer", ["keydiff", "snapkv"])
def test_ragged_attention_is_exact_under_chunked_prefill_with_eviction(monkeypatch, scorer):
    model = tiny_model("llama", "sdpa")
    ids, mask = left_padded((60, 47, 40), seed=15)
    full_mask = torch.cat([mask, torch.ones(3, 3, dtype=mask.dtype)], dim=1)
    masks = {"current": mask}
    cache = LUKVCache(0.5, scorer, prefill_chunk_size=16)
    recorder = AttentionRecorder(monkeypatch, lambda: masks["current"], cache)
    # during chunked prefill the mask is the prompt's; the recorder only needs the columns seen so far
    masks["current"] = full_mask
    model.generate(
        input_ids=ids,
        attention_mask=mask,
        past_key_values=cache,
        max_new_tokens=3,
        do_sample=False,
        prefill_chunk_size=16,
    )
    assert len({d[1] for d in recorder.diffs}) > 1  # chunk forwards and decode steps both checked
    assert all(d[2] < ATOL for d in recorder.diffs), recorder.diffs


def test_chunked_prefill_keeps_the_sinks_of_left_padded_rows():
    """A row whose first chunk is all padding still keeps its first 4 real tokens as sinks."""
    model = tiny_model("llama", "sdpa")
    ids, mask = left_padded((40, 29, 20), seed=16)
    cache = LUKVCache(0.8, "keydiff", sink=4, prefill_chunk_size=8)
    model.generate(
        input_ids=ids,
        attention_mask=mask,
        past_key_values=cache,
        max_new_tokens=1,
        do_sample=False,
        prefill_chunk_size=8,
    )
    pad = (mask == 0).sum(-1).tolist()
    for layer in cache.layers:
        bounds = layer.store.offsets.tolist()
        h = layer.suffix_keys.shape[1]
        for row in range(3):
            for head in range(h):
                kept = layer.store.positions[bounds[row * h + head] : bounds[row * h + head + 1]].tolist()
                sinks = list(range(pad[row], pad[row] + 4))
                assert kept[:4] == sinks, f"layer {layer.layer_idx} row {row} head {head}: kept {kept[:6]}"


def test_ragged_attention_is_exact_in_beam_search_with_left_padding_and_eviction(monkeypatch):
    model = tiny_model("llama", "eager")
    ids, mask = left_padded((50, 37), seed=19)
    beams, new = 3, 3
    # generate expands every row to its beams before the prefill: the mask rows repeat likewise
    full_mask = torch.cat([mask, torch.ones(2, new, dtype=mask.dtype)], dim=1).repeat_interleave(beams, 0)
    cache = LUKVCache(0.5, "keydiff")
    recorder = AttentionRecorder(monkeypatch, lambda: full_mask, cache)
    model.generate(
        input_ids=ids,
        attention_mask=mask,
        past_key_values=cache,
        max_new_tokens=new,
        num_beams=beams,
        do_sample=False,
    )
    assert recorder.diffs
    assert all(d[2] < ATOL for d in recorder.diffs), recorder.diffs
