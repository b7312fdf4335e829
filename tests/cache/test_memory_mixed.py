"""Per-layer widths under a memory budget: a profile whose memory table measured each layer's loss at 4 bits
lets ``memory=`` keep the layers that lose most at 8 bits and the others at 4. The bound holds in bytes
(an 8-bit layer's token costs more than a 4-bit one's) for every scorer and allocator, padded rows, chunked
prefill and ``decode_max_tokens``; the choice is deterministic, logged, saved with a context and checked
when loaded."""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest
import torch
from helpers import scorer_for, tiny_model
from test_memory_budget import _check_bound, _full_bytes, _resaved, _row_bytes, _shapes
from test_registry_contracts import PROMPT

from lukv_cache import LUKVCache
from lukv_cache._compat import cache_kwarg
from lukv_cache.allocation import ALLOCATORS
from lukv_cache.cache.options.memory import MemoryChoice
from lukv_cache.errors import ProfileFormatError, SavedContextError
from lukv_cache.profiles import MemoryTable, Profile
from lukv_cache.scorers import SCORERS
from lukv_cache.testing import flat_profile, left_padded, prompt, with_gains

LAYERS = 4
# the 8-bit row loses more the more it evicts; layer 1 loses most at 4 bits, layer 3 a little
LOSS = np.array([[0.05, 0.4], [0.05, 0.4], [0.3, 0.6]], dtype=np.float32)
LAYER_LOSS = np.array([0.0, 0.3, -0.01, 0.01], dtype=np.float32)


def _model():
    return tiny_model("llama", "sdpa", num_hidden_layers=LAYERS)


def _table(layer_loss=LAYER_LOSS) -> MemoryTable:
    return MemoryTable((None, 8, 4), np.array([0.5, 0.9], dtype=np.float32), LOSS, "test", layer_loss)


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "keydiff.safetensors"
    heads = _model().config.num_key_value_heads
    dataclasses.replace(_flat(heads), memory_table=_table()).save(path)
    return path


def _flat(heads: int) -> Profile:
    """Every head evicts the global ratio at every ratio up to 0.99, with a score-to-gain table."""
    return with_gains(flat_profile(LAYERS, heads, grid=np.linspace(0.01, 0.99, 99, dtype=np.float32)))


def _cache(path, **options) -> LUKVCache:
    return LUKVCache.from_pretrained(path, config=_model().config, **options)


def _layer_bits(cache: LUKVCache) -> list[int | None]:
    """The bits each layer's store was really built in."""
    return [getattr(layer.store.keys, "bits", None) for layer in cache.layers]


def test_the_layers_that_lose_most_keep_8_bits_and_the_bound_holds_in_bytes(profile_path, caplog):
    model, ids = _model(), prompt(1, 400, seed=1)
    with caplog.at_level(logging.INFO, logger="lukv_cache"):
        cache = _cache(profile_path, memory=0.15)
        cache.prefill(model, ids)
    choice = cache.memory_choice
    assert choice.mixed and choice.by == "table" and cache.kv_bits == (4, 8, 4, 4)
    assert _layer_bits(cache) == [4, 8, 4, 4]  # the stores, not only the record
    assert "8-bit keys and values in layers 1, 4-bit in the other 3" in caplog.records[-1].getMessage()
    budget = int(0.15 * _full_bytes(model, ids))
    _check_bound(cache, budget, batch=1)
    # the budget is used: what is left would not hold one more token in every (layer, KV head)
    slack = budget - max(_row_bytes(cache))
    assert slack < _shapes(cache).slots * _shapes(cache).stored_token(8, scores=False)
    # the mix keeps more tokens than 8 bits everywhere would, fewer than 4 bits everywhere
    assert choice.kept[8] < 1 - choice.ratio < choice.kept[4]
    # at 8 bits everywhere each (layer, KV head) keeps about the tokens the choice says
    kept = cache.stored_tokens().double().mean().item()
    assert abs(kept / 400 - (1 - choice.ratio)) < 0.05


def test_a_budget_where_8_bits_keep_everything_keeps_one_width(profile_path):
    cache = _cache(profile_path, memory=0.3)
    cache.prefill(_model(), prompt(1, 400, seed=1))
    assert cache.kv_bits == 8 and not cache.memory_choice.mixed


def test_a_table_without_layer_losses_never_mixes(tmp_path):
    path = tmp_path / "keydiff.safetensors"
    heads = _model().config.num_key_value_heads
    dataclasses.replace(_flat(heads), memory_table=_table(None)).save(path)
    cache = _cache(path, memory=0.15)
    cache.prefill(_model(), prompt(1, 400, seed=1))
    assert cache.kv_bits in (None, 8, 4)


def test_a_benchmark_that_fixes_one_precision_gets_it(profile_path):
    cache = _cache(profile_path, memory=0.15)
    cache.compressor.precisions = (8,)
    cache.prefill(_model(), prompt(1, 400, seed=1))
    assert cache.kv_bits == 8


@pytest.mark.parametrize("name", SCORERS.names())
def test_every_scorer_fits_the_budget_with_mixed_widths_on_padded_rows(profile_path, name):
    model = _model()
    ids, mask = left_padded((300, 211), seed=3)
    cache = _cache(profile_path, memory=0.15, scorer=scorer_for(name, model), allocator="global")
    cache.prefill(model, ids, mask, repeat_prompt=PROMPT)
    assert cache.memory_choice.mixed
    _check_bound(cache, int(0.15 * _full_bytes(model, ids, mask)) // 2, batch=2)


@pytest.mark.parametrize("name", ALLOCATORS.names())
def test_every_allocator_fits_the_budget_with_mixed_widths(profile_path, name):
    model, ids = _model(), prompt(1, 400, seed=5)
    # keydiff scores are -cos in [-1, 1]: a threshold of its own, not the (keydiff) profile's
    kwargs = {"value": -0.6, "profile": None} if name == "threshold" else None
    cache = _cache(profile_path, memory=0.12, scorer="keydiff", allocator=name, allocator_kwargs=kwargs)
    cache.prefill(model, ids)
    assert cache.memory_choice.mixed
    _check_bound(cache, int(0.12 * _full_bytes(model, ids)), batch=1)


def test_chunked_prefill_holds_the_bound_after_every_chunk(profile_path):
    model, ids = _model(), prompt(1, 480, seed=4)
    cache = _cache(profile_path, memory=0.15, prefill_chunk_size=120)
    with torch.no_grad():
        for start in range(0, 480, 120):
            model(ids[:, start : start + 120], use_cache=True, **{cache_kwarg(model): cache})
            _check_bound(cache, int(0.15 * _full_bytes(model, ids[:, : start + 120])), batch=1)
    assert cache.memory_choice.mixed and _layer_bits(cache) == list(cache.kv_bits)


@pytest.mark.parametrize("allocator", ["global", "uniform"])
def test_decode_max_tokens_keeps_max_bytes_while_generating(profile_path, allocator):
    model, ids = _model(), prompt(2, 300, seed=6)
    cache = _cache(profile_path, max_bytes=40_000, decode_max_tokens=400, allocator=allocator)
    used = []
    with torch.no_grad():
        out = model(ids, use_cache=True, **{cache_kwarg(model): cache})
        assert cache.memory_choice.mixed
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(60):
            _check_bound(cache, 40_000, batch=2)
            out = model(token, use_cache=True, **{cache_kwarg(model): cache})
            token = out.logits[:, -1:].argmax(-1)
            used.append(min(_row_bytes(cache)) / 40_000)
    assert cache.get_seq_length() == 360 and _layer_bits(cache) == list(cache.kv_bits)
    # the folds count each layer's tokens at its own width: they keep what the bytes hold (counted at
    # the widest width, they held 0.88 of them here)
    assert min(used[20:]) > 0.98


def test_the_mixed_choice_is_deterministic(profile_path):
    caches = [_cache(profile_path, memory=0.1, scorer="snapkv", allocator="adakv") for _ in range(2)]
    for cache in caches:
        cache.prefill(_model(), prompt(2, 300, seed=7))
    assert caches[0].memory_choice == caches[1].memory_choice and caches[0].memory_choice.mixed
    assert torch.equal(caches[0].stored_tokens(), caches[1].stored_tokens())


def test_saved_contexts_keep_each_layers_width(profile_path, tmp_path):
    model, ids = _model(), prompt(1, 400, seed=9)
    cache = _cache(profile_path, memory=0.15)
    cache.prefill(model, ids)
    path = cache.save(tmp_path / "c.safetensors")
    loaded = LUKVCache.load(path, model)
    assert loaded.memory_choice == cache.memory_choice and loaded.kv_bits == (4, 8, 4, 4)
    assert _layer_bits(loaded) == [4, 8, 4, 4] and loaded.memory_bytes() == cache.memory_bytes()
    with torch.no_grad():
        step = prompt(1, 1, seed=10)
        want = model(step, use_cache=True, **{cache_kwarg(model): cache}).logits
        got = model(step, use_cache=True, **{cache_kwarg(model): loaded}).logits
    assert torch.equal(got, want)
    cache.reset()  # a reset cache chooses again, from the layers' widths of its options
    assert cache.memory_choice is None and all(layer.kv_bits is None for layer in cache.layers)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c.update(kv_bits=[4, 4, 8]), "widths for 3 layers, the model's cache has 4"),
        (lambda c: c.update(kv_bits=[4, 8, 4, 8]), "kv_bits=4"),  # the stores were built otherwise
        (lambda c: c.pop("mixed_kept"), "choice is malformed"),
        (lambda c: c.update(kv_bits=[4, 4, 4, 4]), "choice is malformed"),  # one width is not a list
        (lambda c: c.update(kv_bits=[4, 3, 4, 8]), "choice is malformed"),
        (lambda c: c.update(mixed_kept=1.5), "choice is malformed"),
    ],
)
def test_a_saved_mixed_choice_that_does_not_fit_the_file_is_a_typed_error(
    profile_path, tmp_path, edit, match
):
    model = _model()
    cache = _cache(profile_path, memory=0.15)
    cache.prefill(model, prompt(1, 400, seed=9))
    assert cache.memory_choice.mixed
    saved = cache.save(tmp_path / "c.safetensors")
    path = _resaved(saved, tmp_path / "edited.safetensors", lambda meta: edit(meta["cache"]["memory_choice"]))
    with pytest.raises(SavedContextError, match=match):
        LUKVCache.load(path, model)


def test_a_mixed_choice_round_trips_through_json_and_says_what_it_kept():
    choice = MemoryChoice((8, 4, 4), 1000, 100, {None: 0.1, 8: 0.2, 4: 0.3}, "table", 0.25)
    assert MemoryChoice.from_json(json.loads(json.dumps(choice.to_json()))) == choice
    assert choice.bits_of(0) == 8 and choice.bits_of(2) == 4 and choice.ratio == 0.75
    assert "8-bit keys and values in layers 0, 4-bit in the other 2, keeping 25.0%" in choice.describe()
    single = MemoryChoice(8, 1000, 100, {None: 0.1, 8: 0.2, 4: 0.3}, "rule")
    assert "mixed_kept" not in single.to_json() and MemoryChoice.from_json(single.to_json()) == single
    assert MemoryChoice.from_json({**single.to_json(), "mixed_kept": 0.2}) is None


def test_layer_losses_travel_in_the_profile_and_old_tables_still_read(tmp_path):
    table = _table()
    assert MemoryTable.from_json(table.to_json()) == table and "layer_loss" in table.to_json()
    old = json.loads(table.to_json())
    del old["layer_loss"]
    assert MemoryTable.from_json(json.dumps(old)).layer_loss is None
    path = tmp_path / "keydiff.safetensors"
    dataclasses.replace(flat_profile(LAYERS, 2), memory_table=table).save(path)
    loaded = Profile.load(path)
    assert loaded.memory_table == table and loaded.summary()["memory_table"]["layer_loss"][1] == 0.3
    assert table.layer_order() == [1, 3, 0, 2]


@pytest.mark.parametrize(
    "layer_loss, match",
    [
        (np.array([0.1, np.nan]), "layer_loss contains NaN"),
        (np.zeros((2, 2)), "layer_loss must be a 1-D array"),
        (np.zeros(0), "layer_loss must be a 1-D array"),
        (["a", "b"], "layer_loss must be a numeric array"),
    ],
)
def test_malformed_layer_losses_are_typed_errors(layer_loss, match):
    with pytest.raises(ProfileFormatError, match=match):
        MemoryTable((None, 8, 4), np.array([0.5, 0.9], dtype=np.float32), LOSS, "x", layer_loss)


def test_layer_losses_need_the_8_and_4_bit_rows_and_one_entry_per_layer(tmp_path):
    with pytest.raises(ProfileFormatError, match="needs rows for 8 and 4 bits"):
        MemoryTable((None, 8), np.array([0.5], dtype=np.float32), np.zeros((2, 1)), "x", np.zeros(2))
    with pytest.raises(ProfileFormatError, match="layer_loss has 3 entries but the profile has 4 layers"):
        dataclasses.replace(flat_profile(LAYERS, 2), memory_table=_table(np.zeros(3)))
    text = json.loads(_table().to_json())
    text["layer_loss"] = "0.1"
    with pytest.raises(ProfileFormatError, match="layer_loss must be a list of numbers"):
        MemoryTable.from_json(json.dumps(text))


def test_a_cache_built_without_the_models_config_gives_each_layer_its_width(profile_path):
    # without a config the cache has no layers until the first forward, which learns the layout (every
    # layer) before layer 0's eviction makes the choice
    model, ids = _model(), prompt(1, 400, seed=1)
    cache = LUKVCache.from_pretrained(profile_path, memory=0.15)
    assert len(cache.layers) < LAYERS
    cache.prefill(model, ids)
    assert cache.kv_bits == (4, 8, 4, 4) and _layer_bits(cache) == [4, 8, 4, 4]
    _check_bound(cache, int(0.15 * _full_bytes(model, ids)), batch=1)


def test_a_whole_model_allocator_that_skews_the_layers_is_asked_again_to_fill_the_bytes():
    from lukv_cache.allocation import AllocationRequest
    from lukv_cache.cache.compression.cap import refill_bytes

    def allocator(request):  # layer 0 (8 bits: 2 bytes a token here) gets a quarter of layer 1's share
        keep = (1 - request.ratio) * 100
        return torch.stack([(keep * 0.4).floor(), (keep * 1.6).floor()]).long().view(2, -1, 1)

    request = AllocationRequest(
        torch.zeros(2, 1, 1, 100), torch.tensor([100]), torch.tensor([0.5]), (0, 1), 2
    )
    cap = torch.tensor([150])  # 50 tokens in each layer at ratio 0.5: 2 * 50 + 50 bytes
    first = allocator(request)
    assert int(2 * first[0].sum() + first[1].sum()) == 120  # the skew leaves a fifth of the bytes unused
    got = refill_bytes(allocator, request, first, cap, [2, 1])
    assert int(2 * got[0].sum() + got[1].sum()) == 150
    full = torch.tensor([[[90]], [[90]]])  # a row already using its bytes is not asked again
    assert torch.equal(refill_bytes(allocator, request, full, torch.tensor([270]), [2, 1]), full)
