"""Appending folds of a quantized store on CPU write into a tail beside it (``StoreTail``) instead of rebuilding
the store: the same tokens, codes and outputs as the rebuild, the CPU kernel reading store and tail in one
call, every other reader seeing the store with the tail joined, and the bytes still within the budget."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import scorer_for, tiny_model

from lukv_cache import LUKVCache, load_cache, save_cache
from lukv_cache._compat import cache_kwarg
from lukv_cache.attention import cpu_codes
from lukv_cache.cache.compression import fold
from lukv_cache.cache.compression.fold_plan import gather_held, held_tokens
from lukv_cache.cache.storage.layer import LUKVLayer
from lukv_cache.cache.storage.merge import append
from lukv_cache.cache.storage.ragged import RaggedStore
from lukv_cache.cache.storage.tail import StoreTail
from lukv_cache.testing import left_padded, prompt

needs_kernel = pytest.mark.skipif(
    cpu_codes.kernel() is None, reason="no C compiler builds the CPU kernel here"
)


@pytest.fixture(autouse=True)
def _folds_that_append(monkeypatch):
    """A tiny model's budgets are small: the cap on evicting deeper (1/32 of what the bytes hold) leaves no
    room, and every fold evicts. Out of the way, evicting folds leave room for the next folds to append."""
    monkeypatch.setattr(fold, "DEEPER_SHARE", 1)


def _no_tail(monkeypatch) -> None:
    """Every appending fold rebuilds the store (what they did before the tail)."""
    monkeypatch.setattr(LUKVLayer, "_tail_for", lambda self, *args: None)


def _decode(model, cache, ids, steps: int, watch=None):
    """Greedy steps over ``cache`` after the prompt ``ids``: the tokens and each step's logits."""
    tokens, logits = [], []
    with torch.no_grad():
        out = model(ids, use_cache=True, **{cache_kwarg(model): cache})
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            tokens.append(token)
            out = model(token, use_cache=True, **{cache_kwarg(model): cache})
            logits.append(out.logits[:, -1])
            if watch is not None:
                watch(cache)
    return torch.cat(tokens, 1), torch.stack(logits)


@pytest.mark.parametrize(
    "options",
    [
        dict(memory=0.1, scorer="keydiff"),
        dict(memory=0.15, scorer="kvzap"),
        dict(kv_bits=4, ratio=0.5, decode_max_tokens=400, fold_interval=8),
    ],
    ids=["memory-keydiff", "memory-kvzap", "kv_bits-decode_max_tokens"],
)
def test_appending_in_place_decodes_as_rebuilding_the_store(monkeypatch, options):
    model = tiny_model("llama", "sdpa")
    ids = prompt(2, 300, seed=6)
    options = dict(options, scorer=scorer_for(options.get("scorer", "keydiff"), model))
    tails = []

    def watch(cache):
        tails.append(sum(getattr(layer, "tail", None) is not None for layer in cache.layers))

    tokens, logits = _decode(model, LUKVCache(**options), ids, 70, watch)
    with monkeypatch.context() as patch:
        _no_tail(patch)
        ref_tokens, ref_logits = _decode(model, LUKVCache(**options), ids, 70)
    assert max(tails) == len(model.model.layers)  # the folds did append in place, every layer
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)


@needs_kernel
def test_the_kernel_reads_the_store_and_its_tail_in_one_call(monkeypatch):
    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(memory=0.1, scorer="keydiff")
    seen = []
    real = cpu_codes.codes_attention

    def spy(*args, tail=None, **kwargs):
        seen.append(0 if tail is None else tail.length)
        return real(*args, tail=tail, **kwargs)

    monkeypatch.setattr(cpu_codes, "codes_attention", spy)
    _decode(model, cache, prompt(1, 300, seed=3), 40)
    assert max(seen) > 0
    # the tails were read as they are: no store was rebuilt by the attention
    assert any(layer.tail is not None and layer.tail.length for layer in cache.layers)


def _quantized_store(g: int, n: int, bits: int, seed: int = 0) -> RaggedStore:
    gen = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(g * n, 64, generator=gen), torch.randn(g * n, 64, generator=gen)
    positions = torch.arange(n).repeat(g)
    return RaggedStore.build(
        keys, values, positions, torch.full((g,), n), num_heads=2, kv_bits=bits, last=n - 1
    )


@pytest.mark.parametrize("bits", [8, 4])
def test_a_joined_tail_is_the_store_the_rebuild_gives(bits):
    store = _quantized_store(4, 10, bits)
    gen = torch.Generator().manual_seed(1)
    blocks = [
        (torch.randn(2, 2, 3, 64, generator=gen), torch.randn(2, 2, 3, 64, generator=gen)) for _ in range(3)
    ]
    tail, rebuilt = StoreTail.beside(store, capacity=4), store
    for i, (k, v) in enumerate(blocks):
        if tail.room < 3:
            tail = tail.grown(tail.length + 3)
        tail.write(k, v, start=10 + 3 * i, store=store)
        rebuilt = append(rebuilt, k, v, start=10 + 3 * i, kv_bits=bits)
    joined = tail.join(store)
    assert joined.offsets_list == rebuilt.offsets_list
    assert torch.equal(joined.positions.long(), rebuilt.positions.long())
    for a, b in zip(
        joined.keys.tensors() + joined.values.tensors(), rebuilt.keys.tensors() + rebuilt.values.tensors()
    ):
        assert torch.equal(a, b)


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4])
def test_the_kernel_over_a_store_and_its_tail_equals_it_over_the_joined_store(bits):
    store = _quantized_store(4, 300, bits)  # 2 rows x 2 KV heads, more than one work item each
    gen = torch.Generator().manual_seed(2)
    tail = StoreTail.beside(store, capacity=24)
    tail.write(torch.randn(2, 2, 16, 64, generator=gen), torch.randn(2, 2, 16, 64, generator=gen), 300, store)
    query = torch.randn(2, 2, 3, 64, generator=gen)
    suffix = torch.randn(2, 2, 5, 64, generator=gen), torch.randn(2, 2, 5, 64, generator=gen)
    out, lse = cpu_codes.codes_attention(query, store, *suffix, scaling=0.125, tail=tail)
    ref, ref_lse = cpu_codes.codes_attention(query, tail.join(store), *suffix, scaling=0.125)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-6)


def _pending(cache) -> list[LUKVLayer]:
    return [layer for layer in cache.layers if isinstance(layer, LUKVLayer) and layer.tail is not None]


def _decode_until_a_tail(model, cache, ids):
    with torch.no_grad():
        out = model(ids, use_cache=True, **{cache_kwarg(model): cache})
        for _ in range(200):
            out = model(out.logits[:, -1:].argmax(-1), use_cache=True, **{cache_kwarg(model): cache})
            if _pending(cache) and _pending(cache)[0].tail.length:
                return out
    raise AssertionError("no fold appended in place")


def test_reading_the_store_joins_its_tail_and_counts_agree():
    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(memory=0.1, scorer="keydiff")
    _decode_until_a_tail(model, cache, prompt(2, 300, seed=4))
    layer = _pending(cache)[0]
    counts, before = layer.stored_counts(), layer.tail.length
    assert before > 0
    store = layer.store  # joins the tail
    assert layer.tail is None
    assert torch.equal(layer.stored_counts(), counts)
    assert torch.equal(store.counts().view_as(counts) + layer.suffix_length, counts)


def test_a_fork_with_a_pending_tail_leaves_the_parent_as_it_was(monkeypatch):
    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 300, seed=5)
    cache = LUKVCache(memory=0.1, scorer="keydiff")
    out = _decode_until_a_tail(model, cache, ids)
    reference = copy.deepcopy(cache)
    child = cache.fork()
    token = out.logits[:, -1:].argmax(-1)
    with torch.no_grad():
        for _ in range(30):  # the child folds (in place) on its own
            token = model(token, use_cache=True, **{cache_kwarg(model): child}).logits[:, -1:].argmax(-1)
        token = out.logits[:, -1:].argmax(-1)
        a = model(token, use_cache=True, **{cache_kwarg(model): cache}).logits
        b = model(token, use_cache=True, **{cache_kwarg(model): reference}).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # the tail joined on one side: rounding


def _steps(model, cache, ids, steps: int) -> None:
    with torch.no_grad():
        out = model(ids, use_cache=True, **{cache_kwarg(model): cache})
        for _ in range(steps):
            out = model(out.logits[:, -1:].argmax(-1), use_cache=True, **{cache_kwarg(model): cache})


@pytest.mark.parametrize("operation", ["crop", "reorder"])
def test_crop_and_beam_reorder_over_a_pending_tail_match_the_rebuild(monkeypatch, operation):
    model = tiny_model("llama", "sdpa")
    ids = prompt(2, 300, seed=7)
    probe = LUKVCache(memory=0.1, scorer="keydiff")
    steps = 0
    while not (_pending(probe) and _pending(probe)[0].tail.length):  # the first step with a tail pending
        steps += 1
        probe = LUKVCache(memory=0.1, scorer="keydiff")
        _steps(model, probe, ids, steps)

    def held(cache):
        if operation == "crop":  # into the tail (its last fold's tokens and the suffix)
            cache.crop(-5)
        else:
            cache.reorder_cache(torch.tensor([1, 0]))
        return [layer.head_tokens(0, 1) for layer in cache.layers]

    got = held(probe)
    with monkeypatch.context() as patch:
        _no_tail(patch)
        reference = LUKVCache(memory=0.1, scorer="keydiff")
        _steps(model, reference, ids, steps)
        want = held(reference)
    for (p, k, v), (p2, k2, v2) in zip(got, want):
        assert torch.equal(p, p2)
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_a_cache_saved_with_a_pending_tail_loads_and_continues_as_it(tmp_path):
    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(memory=0.1, scorer="keydiff")
    out = _decode_until_a_tail(model, cache, prompt(2, 300, seed=8))
    reference = copy.deepcopy(cache)  # its tail still pending
    assert _pending(reference)
    loaded = load_cache(save_cache(cache, tmp_path / "context.safetensors"), model)
    assert torch.equal(loaded.stored_tokens(), reference.stored_tokens())
    token = out.logits[:, -1:].argmax(-1)
    ids = [token, token.clone()]
    with torch.no_grad():
        for _ in range(20):  # appending and evicting folds after the load
            a = model(ids[0], use_cache=True, **{cache_kwarg(model): loaded}).logits[:, -1]
            b = model(ids[1], use_cache=True, **{cache_kwarg(model): reference}).logits[:, -1]
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # joined on one side: rounding
            ids = [a.argmax(-1, keepdim=True), b.argmax(-1, keepdim=True)]
            assert torch.equal(ids[0], ids[1])


@needs_kernel
@pytest.mark.parametrize(
    "options",
    [dict(memory=0.1, scorer="keydiff"), dict(memory=0.15, scorer="kvzap")],
    ids=["keydiff", "kvzap"],
)
def test_an_evicting_fold_reads_a_pending_tail_where_it_is(monkeypatch, options):
    """The fold scores and keeps the tail's rows without joining it first: the same stores, bit for bit, as the
    fold that joined it (what it did before), and no join (the kernel reads tails where they are too)."""
    model = tiny_model("llama", "sdpa")
    ids = prompt(2, 300, seed=9)
    options = dict(options, scorer=scorer_for(options["scorer"], model))
    with_tail, refold = [], LUKVLayer.refold

    def spy(self, *args, **kwargs):
        with_tail.append(self.tail is not None)
        return refold(self, *args, **kwargs)

    monkeypatch.setattr(LUKVLayer, "refold", spy)
    joins, join = [], StoreTail.join
    monkeypatch.setattr(StoreTail, "join", lambda self, store: joins.append(1) or join(self, store))
    cache = LUKVCache(**options)
    tokens, logits = _decode(model, cache, ids, 70)
    assert any(with_tail) and not joins  # evicting folds found tails pending and read them as they were
    with monkeypatch.context() as patch:  # the fold before: the tail joined, then the frame built
        patch.setattr(LUKVLayer, "store_parts", lambda self: (self.store, None))
        reference = LUKVCache(**options)
        ref_tokens, ref_logits = _decode(model, reference, ids, 70)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    for layer, ref in zip(cache.layers, reference.layers):
        a, b = layer.store, ref.store
        assert a.offsets_list == b.offsets_list
        assert torch.equal(a.positions.long(), b.positions.long())
        for x, y in zip(a.keys.tensors() + a.values.tensors(), b.keys.tensors() + b.values.tensors()):
            assert torch.equal(x, y)
        assert (a.scores is None) == (b.scores is None)
        if a.scores is not None:
            assert torch.equal(a.scores.nan_to_num(-1.0), b.scores.nan_to_num(-1.0))


def test_a_held_frame_takes_each_slot_from_the_store_its_tail_or_the_suffix():
    """``gather_held`` over a store, its pending tail and the suffix, segments holding different counts (a
    left-padded batch): every held slot's row, as the joined store and the suffix hold it."""
    model = tiny_model("llama", "sdpa")
    ids, mask = left_padded((300, 230), seed=2)
    cache = LUKVCache(memory=0.1, scorer="keydiff")
    layer = None
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})
        for _ in range(
            200
        ):  # no mask while decoding: the kernel reads tails where they are (a mask joins them)
            token = out.logits[:, -1:].argmax(-1)
            out = model(token, use_cache=True, **{cache_kwarg(model): cache})
            pending = [p for p in _pending(cache) if p.tail.length and p.suffix_length >= 3]
            if pending:
                layer = pending[0]
                break
    assert layer is not None, "no tail pending beside a suffix"
    store, tail = layer.store_parts()
    b, h, s = layer.batch_size, layer.num_heads, layer.suffix_length
    frame = held_tokens(layer, torch.ones(b, s, dtype=torch.bool), sink=4, window=16)
    assert len(set(frame.counts.tolist())) > 1  # ragged: slots past some segments' ends
    got = gather_held(frame, store.keys, layer.suffix_keys, tail.keys)
    joined = tail.join(store)
    keys, bounds = joined.keys.dequantize(), joined.offsets_list
    for g in range(b * h):
        want = torch.cat([keys[bounds[g] : bounds[g + 1]], layer.suffix_keys[g // h, g % h, :s]])
        assert torch.equal(got[g, : int(frame.counts[g])], want)
