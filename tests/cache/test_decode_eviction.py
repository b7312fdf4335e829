"""Eviction at fold time (``decode_max_tokens=N``): memory stays under the documented bound however long the
generation, a bound above the length changes nothing, every generation path keeps the bound, a row of a
left-padded batch keeps what it keeps alone, and a scorer that cannot decode is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import PROFILE_FAMILY, greedy_with_logits, scorer_for, tiny_model
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from lukv_cache import LUKVCache
from lukv_cache.allocation import largest_remainder
from lukv_cache.allocation.budget import fit_counts
from lukv_cache.cache.compression import fold
from lukv_cache.cache.compression.fold_plan import gather_held, held_tokens
from lukv_cache.cache.storage.report import kv_cache_bytes
from lukv_cache.errors import ConfigurationError
from lukv_cache.profiles import Profile
from lukv_cache.profiles.download import BUNDLED_DIR
from lukv_cache.scorers import SCORERS, Scorer, get_scorer, register_scorer
from lukv_cache.testing import PAD, VOCAB, array_profile, curve_profile, left_padded, prompt, with_gains


def _model():
    return tiny_model("llama", "sdpa", max_position_embeddings=4096)


def _profile(model) -> Profile:
    """Uneven heads, read at each row's ratio (as in test_batch_rows)."""
    text = model.config.get_text_config()
    layers, heads = text.num_hidden_layers, text.num_key_value_heads
    return with_gains(curve_profile(layers, heads, grid=[0.25, 0.5, 0.75, 0.95], spread=0.2, head_dim=16))


def _cache(model, scorer="keydiff", allocator="uniform", **kwargs) -> LUKVCache:
    extra = {"profile": _profile(model)} if allocator in PROFILE_FAMILY else None
    if allocator == "threshold":
        extra = {"value": 0.0}
    return LUKVCache(scorer=scorer_for(scorer, model), allocator=allocator, allocator_kwargs=extra, **kwargs)


def bound_bytes(cache: LUKVCache, model, batch: int) -> int:
    """The bound docs/usage.md states, per full-attention layer: N tokens per KV head on average in the
    store (keys, values, an int32 position, an fp32 score for scorers that keep theirs), a suffix buffer of
    ``window + max(fold_interval + 1, 16)`` tokens, the queries a scorer reads, offsets and sinks."""
    text = model.config.get_text_config()
    layers, heads, q_heads = text.num_hidden_layers, text.num_key_value_heads, text.num_attention_heads
    dim, elt = text.head_dim, model.dtype.itemsize
    per_token = 2 * dim * elt + 4 + (4 if cache.scorer.keeps_scores else 0)
    suffix = cache.window + max(cache.fold_interval + 1, 16)
    per_layer = (
        batch * heads * cache.decode_max_tokens * per_token
        + batch * heads * suffix * 2 * dim * elt
        + batch * q_heads * cache.scorer.n_queries * dim * elt
        + (batch * heads + 1) * 8
        + batch * 8
    )
    return layers * per_layer


class Watch(LogitsProcessor):
    """Reads the cache after every forward of ``generate``."""

    def __init__(self, cache: LUKVCache):
        self.cache, self.bytes, self.stored, self.folded = cache, [], [], []

    def __call__(self, input_ids, scores):
        self.folded.append(self.cache.layers[0].suffix_length == 0)  # this forward folded
        self.bytes.append(self.cache.memory_bytes())
        self.stored.append(self.cache.stored_tokens().double().mean((0, 2)))  # per row
        return scores


def _watched_generate(model, cache, ids, mask=None, **kwargs):
    watch = Watch(cache)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            past_key_values=cache,
            logits_processor=LogitsProcessorList([watch]),
            **kwargs,
        )
    return out, watch


# ---------------------------------------------------------------------------------------------- the bound
def test_memory_stays_under_the_bound_for_2000_generated_tokens():
    model = _model()
    ids, mask = left_padded((60, 41), seed=3)
    cache = _cache(model, "keydiff", "profile", decode_max_tokens=128)
    out, watch = _watched_generate(model, cache, ids, mask, max_new_tokens=2000, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 2000
    limit = bound_bytes(cache, model, batch=2)
    assert max(watch.bytes) <= limit, (max(watch.bytes), limit)
    # every row, at every step: at most N per head in the store plus the suffix since the last fold
    per_row = torch.stack(watch.stored)
    assert (per_row <= 128 + cache.fold_interval - 1).all(), per_row.max()
    folds = torch.tensor(watch.folded)
    assert int(folds.sum()) == 2000 // cache.fold_interval
    # right after a fold each row holds its whole budget: heads that hold less hand theirs to the others
    assert (per_row[folds] == 128).all(), per_row[folds]
    # flat: the last 1,000 steps hold no more than the first 1,000 did at their largest
    assert max(watch.bytes[1000:]) <= max(watch.bytes[:1000])
    dense = DynamicCache()
    with torch.no_grad():
        model(torch.cat([ids, out[:, ids.shape[1] : -1]], 1), past_key_values=dense, use_cache=True)
    assert cache.memory_bytes() < 0.25 * kv_cache_bytes(dense)


@pytest.mark.parametrize(("scorer", "allocator"), [("snapkv", "uniform"), ("kvzap", "adakv")])
def test_the_bound_holds_with_queries_or_scores_kept(scorer, allocator):
    """snapkv keeps the last 32 queries for the fold; kvzap keeps every token's score in the store."""
    model = _model()
    ids, mask = left_padded((30, 12), seed=2)
    cache = _cache(model, scorer, allocator, decode_max_tokens=48, fold_interval=40, sink=2, window=8)
    _, watch = _watched_generate(model, cache, ids, mask, max_new_tokens=200, do_sample=False)
    assert max(watch.bytes) <= bound_bytes(cache, model, batch=2)
    assert (torch.stack(watch.stored) <= 48 + 40 - 1).all()
    # 230 tokens seen; the bound is on the mean per head (adakv may give one head more than 100)
    assert float(cache.stored_tokens().double().mean()) < 100


# ------------------------------------------------------------------ a bound above the length: DynamicCache


@pytest.mark.parametrize(("scorer", "ratio"), [("keydiff", None), ("kvzap", 0.0)])
def test_a_bound_above_the_length_reproduces_dynamic_cache(scorer, ratio):
    model = _model()
    ids = prompt(1, 40, seed=4)
    want_tokens, want_logits = greedy_with_logits(model, ids, DynamicCache(), 100)
    cache = _cache(model, scorer, ratio=ratio, decode_max_tokens=1000, fold_interval=32)
    tokens, logits = greedy_with_logits(model, ids, cache, 100)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=0)
    assert int(cache.stored_tokens().min()) == 139  # nothing evicted
    assert all(layer.suffix_length == 3 for layer in cache.layers)  # folded at 72, 104 and 136 tokens


def test_off_by_default_nothing_generated_is_evicted():
    model = _model()
    assert LUKVCache(0.5).decode_max_tokens is None and LUKVCache(0.5).fold_interval == 256
    cache = LUKVCache(0.5, fold_interval=32)
    greedy_with_logits(model, prompt(1, 40, seed=4), cache, 100)
    stored = cache.stored_tokens()
    assert (stored >= 99 + 18).all()  # the prompt's evictable half went, every generated token stays
    assert all(layer.store.scores is None and layer.suffix_length < 34 for layer in cache.layers)


# ------------------------------------------------------------------------------------ generation paths
def _check_bound(cache, model, watch, batch):
    assert max(watch.bytes) <= bound_bytes(cache, model, batch)
    assert (torch.stack(watch.stored) <= cache.decode_max_tokens + cache.fold_interval - 1).all()


def test_sampling_and_beam_search_keep_the_bound():
    model = _model()
    ids = prompt(1, 30, seed=6)
    cache = _cache(model, decode_max_tokens=32, fold_interval=24)
    torch.manual_seed(0)
    _, watch = _watched_generate(model, cache, ids, max_new_tokens=120, do_sample=True, top_k=20)
    _check_bound(cache, model, watch, batch=1)
    beams = _cache(model, "snapkv", "adakv", decode_max_tokens=40, fold_interval=24, window=4)
    _, watch = _watched_generate(model, beams, ids, max_new_tokens=100, num_beams=3, do_sample=False)
    _check_bound(beams, model, watch, batch=3)
    assert int(beams.stored_tokens().max()) < 40 + 24


def test_prefill_then_a_copy_per_question_each_bounded_on_its_own():
    model = _model()
    context = prompt(1, 120, seed=7)
    base = _cache(model, "kvzap", "uniform", decode_max_tokens=48, fold_interval=32)
    with torch.no_grad():
        base.prefill(model, context)
    assert int(base.stored_tokens().max()) <= 48
    answers = []
    for seed in (1, 2):
        question = prompt(1, 5, seed=seed)
        cache = copy.deepcopy(base)
        out, watch = _watched_generate(
            model, cache, torch.cat([context, question], 1), max_new_tokens=100, do_sample=False
        )
        _check_bound(cache, model, watch, batch=1)
        answers.append(out[0, -100:])
    assert int(base.stored_tokens().max()) <= 48  # the copies did not touch the original
    assert not torch.equal(answers[0], answers[1])


def test_chunked_prefill_then_generate_keeps_the_bound():
    model = _model()
    ids, mask = left_padded((150, 70), seed=8)
    cache = _cache(model, "keydiff", "pyramid", decode_max_tokens=40, fold_interval=32, prefill_chunk_size=32)
    with torch.no_grad():
        for start in range(0, ids.shape[1], 50):
            model(
                input_ids=ids[:, start : start + 50],
                attention_mask=mask[:, : start + 50],
                past_key_values=cache,
            )
    assert int(cache.stored_tokens().double().mean((0, 2)).max()) <= 40
    _, watch = _watched_generate(model, cache, ids, mask, max_new_tokens=90, do_sample=False)
    _check_bound(cache, model, watch, batch=2)


# ------------------------------------------------------------------------- a row keeps what it keeps alone
CONTINUATION = torch.randperm(VOCAB - 3, generator=torch.Generator().manual_seed(0))[:70] + 3  # no repeats
LENGTHS = (50, 30, 9)


def _teacher_forced(model, cache, ids, mask):
    """Logits ``[B, steps, V]`` and store positions per step, feeding CONTINUATION token by token."""
    logits = []
    steps = CONTINUATION.expand(ids.shape[0], -1)
    with torch.no_grad():
        cache.prefill(model, ids, mask)
        for t in range(steps.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            out = model(
                input_ids=steps[:, t : t + 1],
                attention_mask=mask,
                position_ids=mask.sum(-1, keepdim=True) - 1,
                past_key_values=cache,
                use_cache=True,
            )
            logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


def _segments(cache, row, shift):
    out = []
    for layer in cache.layers:
        store, heads = layer.store, layer.num_heads
        for h in range(heads):
            seg = row * heads + h
            out.append((store.positions[store.offsets[seg] : store.offsets[seg + 1]] - shift).tolist())
    return out


@pytest.mark.parametrize(
    ("scorer", "allocator"),
    [
        ("keydiff", "uniform"),
        ("keydiff", "profile"),
        ("keydiff", "threshold"),
        ("snapkv", "adakv"),
        ("kvzap", "global"),
        ("kvzap", "pyramid"),
    ],
)
def test_a_left_padded_row_keeps_what_it_keeps_alone(scorer, allocator):
    model = _model()
    ids, mask = left_padded(LENGTHS, seed=5)
    settings = dict(decode_max_tokens=24, fold_interval=16, sink=2, window=3)
    batch = _cache(model, scorer, allocator, **settings)
    logits = _teacher_forced(model, batch, ids, mask)
    assert int(batch.stored_tokens().max()) < ids.shape[1] + 20  # evicted at fold time
    for row, n in enumerate(LENGTHS):
        alone = _cache(model, scorer, allocator, **settings)
        want = _teacher_forced(model, alone, ids[row : row + 1, -n:], torch.ones(1, n, dtype=torch.long))
        torch.testing.assert_close(logits[row : row + 1], want, atol=1e-4, rtol=0)
        assert _segments(batch, row, ids.shape[1] - n) == _segments(alone, 0, 0), f"row {row} ({n} tokens)"


@pytest.mark.parametrize("recent", [None, 7])
def test_a_fold_keeps_each_rows_sinks_and_recent_window(recent):
    model = _model()
    ids, mask = left_padded(LENGTHS, seed=5)
    cache = _cache(
        model,
        "knorm",
        "uniform",
        decode_max_tokens=12,
        fold_interval=16,
        sink=3,
        window=2,
        decode_window=recent,
    )
    kept_recent = 3 if recent is None else recent  # by default a quarter of the bound (at least the window)
    assert cache.decode_window == kept_recent
    steps = CONTINUATION[:32].expand(3, -1)  # folds after 16 and 32 tokens
    with torch.no_grad():
        cache.prefill(model, ids, mask)
        for t in range(steps.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            model(
                input_ids=steps[:, t : t + 1],
                attention_mask=mask,
                position_ids=mask.sum(-1, keepdim=True) - 1,
                past_key_values=cache,
            )
    assert all(layer.suffix_length == 0 for layer in cache.layers)
    width = mask.shape[1]
    for row, n in enumerate(LENGTHS):
        start = ids.shape[1] - n
        for positions in _segments(cache, row, 0):
            assert len(positions) == 12, positions
            assert positions[:3] == [start, start + 1, start + 2], positions
            assert positions[-kept_recent:] == list(range(width - kept_recent, width)), positions


def test_a_left_padded_row_generates_what_it_generates_alone():
    model = _model()
    ids, mask = left_padded(LENGTHS, seed=5)
    settings = dict(decode_max_tokens=24, fold_interval=16, sink=2, window=3)
    with torch.no_grad():
        batch = _cache(model, **settings)
        tokens = model.generate(
            ids, attention_mask=mask, past_key_values=batch, max_new_tokens=60, do_sample=False
        )
        for row, n in enumerate(LENGTHS):
            alone = _cache(model, **settings)
            want = model.generate(
                ids[row : row + 1, -n:], past_key_values=alone, max_new_tokens=60, do_sample=False
            )
            assert torch.equal(tokens[row, -60:], want[0, -60:]), f"row {row}"
            assert torch.equal(batch.stored_tokens()[:, row], alone.stored_tokens()[:, 0])
    assert (ids[mask == 0] == PAD).all()


@pytest.mark.parametrize("scorer", ["snapkv", "kvzap"])
def test_a_fold_intervals_tokens_in_one_forward_attend_as_token_by_token(scorer):
    """Nothing is evicted between folds and the fold runs after the forward that completes the interval,
    so teacher forcing ``fold_interval`` tokens per forward (benchmarks/decode_nll.py) is decoding."""
    model = _model()
    ids = prompt(1, 40 + 96, seed=2)
    logits = []
    for step in (1, 32):
        cache = _cache(model, scorer, "adakv", decode_max_tokens=24, fold_interval=32, window=8)
        with torch.no_grad():
            out = [cache.prefill(model, ids[:, :40]).logits[0, -1:]]
            for start in range(40, ids.shape[1], step):
                out.append(model(input_ids=ids[:, start : start + step], past_key_values=cache).logits[0])
        logits.append(torch.cat(out)[:-1])
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------ which scorers decode
DECODING = [name for name in SCORERS.names() if get_scorer(name).decodes]


def test_each_registered_scorer_declares_whether_it_decodes_and_how():
    assert {"kvzip", "kvzip_plus"} <= set(SCORERS.names()) - set(DECODING)
    assert {"keydiff", "snapkv", "tova", "expected_attention", "knorm", "streaming", "random"} <= set(
        DECODING
    )
    assert not get_scorer("keydiff").keeps_scores  # keydiff's anchor is the current tokens'
    assert get_scorer(scorer_for("kvzap", _model())).keeps_scores  # reads every KV head of a token


@pytest.mark.parametrize("scorer", DECODING)
def test_every_decoding_scorer_keeps_the_bound(scorer):
    model = _model()
    cache = _cache(model, scorer, "adakv", decode_max_tokens=24, fold_interval=16, sink=2, window=2)
    _, watch = _watched_generate(model, cache, prompt(1, 20, seed=9), max_new_tokens=50, do_sample=False)
    _check_bound(cache, model, watch, batch=1)


@pytest.mark.parametrize("scorer", ["kvzip", "kvzip_plus"])
def test_a_scorer_that_cannot_decode_is_a_typed_error_naming_what_to_use(scorer):
    with pytest.raises(ConfigurationError, match="kvzap") as err:
        LUKVCache(scorer=scorer, decode_max_tokens=64)
    assert "repeat passes" in str(err.value)
    LUKVCache(scorer=scorer, max_tokens=64)  # the prompt alone is fine


def test_custom_scorers_declare_it_too():
    name = "test_no_decoding"

    @register_scorer(name, decodes=False, overwrite=True)
    def no_decoding(keys, values, queries):
        return keys.float().norm(dim=-1)

    try:
        with pytest.raises(ConfigurationError, match="decodes=False"):
            LUKVCache(scorer=name, decode_max_tokens=64)
    finally:
        SCORERS._items.pop(name, None)
    context = Scorer("ctx", lambda k, v, q, **kw: k.float().norm(dim=-1), context=True, rescores=True)
    with pytest.raises(ConfigurationError, match="rescores=False"):
        LUKVCache(scorer=context, decode_max_tokens=64)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(decode_max_tokens=3), "at least 5"),
        (dict(decode_max_tokens=0), "positive"),
        (dict(decode_max_tokens=2**41), "beyond any context"),
        (dict(decode_max_tokens=64, fold_interval=0), "fold_interval"),
        (dict(decode_max_tokens=64, fold_interval=2.5), "fold_interval"),
        (dict(decode_window=16), "pass decode_max_tokens"),
        (dict(decode_max_tokens=64, decode_window=61), "at most 60"),
        (dict(decode_max_tokens=64, decode_window=-1), "decode_window"),
    ],
)
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        LUKVCache(**kwargs)


def test_the_decode_window_defaults_to_a_quarter_of_the_bound():
    assert LUKVCache(decode_max_tokens=512).decode_window == 128
    assert LUKVCache(decode_max_tokens=512, window=200).decode_window == 200  # at least the prompt's window
    assert LUKVCache(decode_max_tokens=8, sink=4).decode_window == 2
    assert LUKVCache(decode_max_tokens=512, decode_window=0).decode_window == 0
    assert LUKVCache(ratio=0.5).decode_window == 0  # no eviction at fold time


def test_from_pretrained_reads_a_real_profiles_curve_at_each_folds_ratio(tmp_path):
    real = Profile.load(BUNDLED_DIR / "HuggingFaceTB/SmolLM2-135M-Instruct/keydiff.safetensors")
    curves = array_profile(real.grid, real.evict_ratio[:, :2, :2], head_dim=16)
    cache = LUKVCache.from_pretrained(curves.save(tmp_path / "p.safetensors"), decode_max_tokens=40)
    assert cache.max_tokens == 40 and cache.allocator_name == "profile"
    model = _model()
    _, watch = _watched_generate(model, cache, prompt(1, 100, seed=1), max_new_tokens=150, do_sample=False)
    _check_bound(cache, model, watch, batch=1)
    assert (torch.stack(watch.stored)[torch.tensor(watch.folded)] == 40).all()


def test_the_prompt_is_bounded_too_unless_a_ratio_is_given():
    assert LUKVCache(decode_max_tokens=64).max_tokens == 64
    assert LUKVCache(0.5, decode_max_tokens=64).max_tokens is None
    assert LUKVCache(max_tokens=200, decode_max_tokens=64).max_tokens == 200


def test_a_fold_hands_the_budget_a_head_cannot_use_to_the_others():
    """An allocator that flips its favourite head at every fold: the new favourite holds fewer tokens than
    its budget (it was evicted hard the fold before), so the rest of the row's total goes to the other."""
    calls = []

    def flipping(req):
        calls.append(req)
        weights = torch.tensor([[3.0, 1.0]] if len(calls) % 2 else [[1.0, 3.0]])
        return req.per_layer(lambda layer, scores: largest_remainder(weights, req.layer_total(), req))

    model = _model()
    cache = LUKVCache(scorer="keydiff", allocator=flipping, decode_max_tokens=64, fold_interval=16)
    _, watch = _watched_generate(model, cache, prompt(1, 60, seed=3), max_new_tokens=100, do_sample=False)
    per_row = torch.stack(watch.stored)[torch.tensor(watch.folded)]
    assert len(calls) >= 4 and (per_row == 64).all(), per_row


def test_fit_counts_trims_and_hands_unused_budget_to_heads_that_hold_more():
    counts = torch.tensor([[[10, 10, 10]], [[10, 10, 10]]])
    held = torch.tensor([[[2, 30, 30]], [[30, 30, 0]]])
    fitted = fit_counts(counts, held, torch.tensor([60]), fill=True)
    assert int(fitted.sum()) == 60 and (fitted <= held).all()
    assert fitted[0, 0, 0] == 2 and fitted[1, 0, 2] == 0
    assert int(fit_counts(counts, held, torch.tensor([20]), fill=True).sum()) == 20
    assert torch.equal(fit_counts(counts, held, torch.tensor([60]), fill=False), torch.minimum(counts, held))


# ------------------------------------------------------------------ what a fold reads and writes
def _store_tensors(layer) -> list[torch.Tensor]:
    """Every tensor of a layer's store (a quantized store's codes, scales and zeros), positions, offsets."""
    store = layer.store
    rows = [
        t
        for part in (store.keys, store.values)
        for t in (part.tensors() if hasattr(part, "tensors") else [part])
    ]
    return [*rows, store.positions, store.offsets]


def test_a_fold_gathers_no_values_for_a_scorer_that_does_not_read_them(monkeypatch):
    # keydiff is registered reads_values=False: its folds dequantize and gather the held keys alone, and keep
    # what the same scores keep with the values gathered
    monkeypatch.setattr(SCORERS, "_items", dict(SCORERS._items))  # undo the registration afterwards
    register_scorer("test_keydiff_reading_values", get_scorer("keydiff").fn)
    gathered = []
    original = fold.gather_held
    monkeypatch.setattr(fold, "gather_held", lambda *a: gathered.append(1) or original(*a))
    model = _model()
    ids, mask = left_padded((60, 41), seed=5)
    runs = []
    for name in ("keydiff", "test_keydiff_reading_values"):
        gathered.clear()
        cache = LUKVCache(scorer=name, decode_max_tokens=48, fold_interval=8, kv_bits=8)
        tokens, logits = greedy_with_logits(model, ids, cache, 40, attention_mask=mask)
        runs.append((tokens, logits, [_store_tensors(layer) for layer in cache.layers], len(gathered)))
    (tokens, logits, stores, keys_only), (want_tokens, want_logits, want_stores, both) = runs
    assert keys_only > 0 and both == 2 * keys_only  # every evicting fold: keys alone, then keys and values
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)
    for got, want in zip(stores, want_stores):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("kv_bits", [None, 8, 4])
@pytest.mark.parametrize("padded", [False, True])
def test_a_fold_that_evicts_nothing_appends_what_a_rebuild_would_hold(kv_bits, padded):
    # a fold whose held tokens all fit joins each suffix to its store (Layer.fold, one merge) instead of
    # rebuilding the store from the held frame: the same store, bit for bit, padding dropped alike
    model = _model()
    ids, mask = left_padded((30, 17), seed=4)
    cache = LUKVCache(ratio=0.5, scorer="keydiff", decode_max_tokens=1000, fold_interval=8, kv_bits=kv_bits)
    greedy_with_logits(model, ids, cache, 5, attention_mask=mask)
    for layer in cache.layers:
        valid = torch.ones(layer.batch_size, layer.suffix_length, dtype=torch.bool)
        if padded:  # as if row 1's first suffix token were padding
            valid[1, 0] = False
        appended, rebuilt = copy.deepcopy(layer), copy.deepcopy(layer)
        appended.fold(room=8, valid=valid)
        frame = held_tokens(rebuilt, valid, cache.sink, cache.window)
        rebuilt.refold(frame.source[frame.slots], frame.slots.sum(-1), None, capacity=8)
        assert (
            appended.suffix_length == rebuilt.suffix_length == 0
            and appended.compressed
            and rebuilt.compressed
        )
        got, want = _store_tensors(appended), _store_tensors(rebuilt)
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))
        assert (
            int(appended.store.num_tokens) == int(layer.store.num_tokens) + int(valid.sum()) * layer.num_heads
        )


@pytest.mark.parametrize("kv_bits", [None, 4])
@pytest.mark.parametrize("padded", [False, True])
def test_a_fold_that_evicts_nothing_appends_the_scores_a_rebuild_would_keep(kv_bits, padded, monkeypatch):
    # a store that keeps each token's first score (a scorer registered rescores=False, as kvzap): the
    # appending fold stores the suffix's scores after each segment's, as the rebuild from the held frame did
    monkeypatch.setattr(SCORERS, "_items", dict(SCORERS._items))  # undo the registration afterwards
    register_scorer("test_keydiff_keeping", get_scorer("keydiff").fn, rescores=False, reads_values=False)
    model = _model()
    ids, mask = left_padded((30, 17), seed=4)
    cache = LUKVCache(
        ratio=0.5, scorer="test_keydiff_keeping", decode_max_tokens=1000, fold_interval=8, kv_bits=kv_bits
    )
    greedy_with_logits(model, ids, cache, 5, attention_mask=mask)
    for i, layer in enumerate(cache.layers):
        assert layer.store.scores is not None  # the prefill's eviction kept them
        valid = torch.ones(layer.batch_size, layer.suffix_length, dtype=torch.bool)
        if padded:  # as if row 1's first suffix token were padding
            valid[1, 0] = False
        suffix = torch.randn(
            layer.batch_size, layer.num_heads, layer.suffix_length, generator=torch.Generator().manual_seed(i)
        )
        appended, rebuilt = copy.deepcopy(layer), copy.deepcopy(layer)
        appended.fold(room=8, valid=valid, scores=suffix)
        frame = held_tokens(rebuilt, valid, cache.sink, cache.window)
        held = gather_held(frame, rebuilt.store.scores.unsqueeze(-1), suffix.unsqueeze(-1)).squeeze(-1)
        rebuilt.refold(frame.source[frame.slots], frame.slots.sum(-1), held[frame.slots], capacity=8)
        got, want = _store_tensors(appended), _store_tensors(rebuilt)
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))
        assert torch.equal(appended.store.scores, rebuilt.store.scores)
        assert appended.store.scores.shape[0] == appended.store.num_tokens


def test_a_fold_that_evicts_nothing_keeps_scores_without_building_the_held_frame(monkeypatch):
    # decoding under decode_max_tokens with a scorer that keeps scores, every fold fitting: each scores its
    # suffix alone and appends (no held frame, no store rescored); every stored token keeps a real score
    monkeypatch.setattr(SCORERS, "_items", dict(SCORERS._items))  # undo the registration afterwards
    register_scorer("test_keydiff_keeping", get_scorer("keydiff").fn, rescores=False, reads_values=False)
    frames, folds = [], []
    original = fold.held_tokens
    monkeypatch.setattr(fold, "held_tokens", lambda *a: frames.append(1) or original(*a))
    model = _model()
    ids, mask = left_padded((60, 41), seed=5)
    cache = LUKVCache(
        ratio=0.5, scorer="test_keydiff_keeping", decode_max_tokens=1000, fold_interval=8, kv_bits=8
    )
    cache.compressor.observe(lambda step: step.kind == "fold" and folds.append(1))
    greedy_with_logits(model, ids, cache, 24, attention_mask=mask)
    assert len(folds) >= 2 and not frames
    for layer in cache.layers:
        scores = layer.store.scores
        assert scores.shape[0] == layer.store.num_tokens and not scores.isnan().any()


def test_a_fold_into_an_empty_store_keeps_its_own_rows_when_the_suffix_buffer_is_reused():
    # a full suffix buffer reshapes into a view of itself; the fold reuses that buffer for what comes next
    from lukv_cache.cache.storage.layer import LUKVLayer

    layer = LUKVLayer(fold_at=3)
    keys, values = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    layer.update(keys, values)
    assert layer.store is None and layer.suffix.capacity == layer.suffix_length == 4
    layer.fold(room=4)
    held = layer.store.keys.clone()
    layer.update(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8))  # written into the reused buffer
    assert torch.equal(layer.store.keys, held) and torch.equal(held, keys.reshape(8, 8))
