"""The memory budget (``LUKVCache(memory=f)`` / ``max_bytes=N``): the cache chooses the bits and the tokens,
and what it holds after the prompt never exceeds the budget, for every scorer and allocator, padded batch
rows, chunked prefill and ``decode_max_tokens``; the choice is deterministic, refused when mixed with the
knobs it sets, and kept by saved contexts."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from helpers import scorer_for, tiny_model
from test_registry_contracts import PROMPT, _cache_args
from transformers import DynamicCache

from lukv_cache import LUKVCache
from lukv_cache._compat import cache_kwarg
from lukv_cache.allocation import ALLOCATORS
from lukv_cache.cache.compression import fold
from lukv_cache.cache.compression.fold import keeps_scores
from lukv_cache.cache.options.memory import MemoryChoice, Shapes, kept_queries, layer_shapes
from lukv_cache.errors import ConfigurationError
from lukv_cache.profiles import MemoryTable
from lukv_cache.scorers import SCORERS
from lukv_cache.testing import flat_profile, left_padded, prompt


def _full_bytes(model, ids, mask=None) -> int:
    """Bytes a full DynamicCache holds for the prompt (every row, padding included)."""
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def _shapes(cache: LUKVCache) -> Shapes:
    """The budget's shapes: with a scorer that reads queries, the queries each layer keeps between folds
    while decoding count (reserved from the prompt on)."""
    layer = cache.layers[0]
    queries = kept_queries(cache.policy, cache.layout.query_heads, layer.num_heads)
    return layer_shapes(layer, len(cache.layers), layer.num_heads, queries)


def _row_bytes(cache: LUKVCache) -> list[int]:
    """Each row's bytes: the tokens of its stores at the chosen bits (with their scores when the stores keep
    them: a scorer whose folds reuse each token's first score), plus the fixed decode room (which holds the
    suffix's tokens) and offsets."""
    shapes = _shapes(cache)
    bits = cache.kv_bits  # per-layer widths: each layer's tokens at its own bits
    rows = sum(
        (layer.stored_counts() - layer.suffix_length)
        * shapes.stored_token(bits[i] if isinstance(bits, tuple) else bits, scores=keeps_scores(cache.policy))
        for i, layer in enumerate(cache.layers)
    ).sum(-1)  # [B]
    return [int(n) + shapes.fixed() for n in rows]


def _check_bound(cache: LUKVCache, budget_per_row: int, batch: int) -> None:
    assert cache.memory_bytes() <= budget_per_row * batch
    assert max(_row_bytes(cache)) <= budget_per_row


@pytest.mark.parametrize("memory", [0.3, 0.12])
@pytest.mark.parametrize("name", SCORERS.names())
def test_every_scorer_fits_the_budget_on_padded_rows(name, memory):
    model = tiny_model("llama", "sdpa")
    ids, mask = left_padded((300, 211), seed=3)
    cache = LUKVCache(memory=memory, scorer=scorer_for(name, model))
    cache.prefill(model, ids, mask, repeat_prompt=PROMPT)
    budget = int(memory * _full_bytes(model, ids, mask)) // 2  # per row: the padded row's full bytes
    _check_bound(cache, budget, batch=2)
    # it evicted what it had to, and used the budget: no more than one stored token per slot below it
    slack = budget - max(_row_bytes(cache))
    per_token = _shapes(cache).stored_token(cache.kv_bits, scores=keeps_scores(cache.policy))
    assert slack < _shapes(cache).slots * per_token * 2


@pytest.mark.parametrize("name", ALLOCATORS.names())
def test_every_allocator_fits_the_budget(name):
    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 400, seed=5)
    cache = LUKVCache(memory=0.1, scorer="keydiff", allocator=name, allocator_kwargs=_cache_args(name))
    cache.prefill(model, ids)
    _check_bound(cache, int(0.1 * _full_bytes(model, ids)), batch=1)


def test_max_bytes_is_a_bound_per_row_whatever_the_prompts_length():
    model = tiny_model("llama", "sdpa")
    for length in (150, 600):
        cache = LUKVCache(max_bytes=20_000, scorer="snapkv")
        cache.prefill(model, prompt(2, length, seed=length))
        _check_bound(cache, 20_000, batch=2)
    short = LUKVCache(max_bytes=10**7)  # a prompt that fits at the model's precision is kept whole
    short.prefill(model, prompt(1, 50))
    assert short.kv_bits is None and bool((short.stored_tokens() == 50).all())


def test_the_choice_follows_the_budget_and_is_logged(caplog):
    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 500, seed=2)
    chosen = {}
    for memory in (0.3, 0.1, 0.05):
        cache = LUKVCache(memory=memory)
        with caplog.at_level(logging.INFO, logger="lukv_cache"):
            cache.prefill(model, ids)
        choice = cache.memory_choice
        assert isinstance(choice, MemoryChoice) and choice.by == "rule" and choice.kv_bits == cache.kv_bits
        assert choice.length == 500 and 0 < choice.kept[cache.kv_bits] <= 1
        assert (
            f"keeping {100 * choice.kept[cache.kv_bits]:.1f}% of the tokens"
            in caplog.records[-1].getMessage()
        )
        chosen[memory] = cache.kv_bits
    order = [None, 8, 4]
    assert order.index(chosen[0.3]) <= order.index(chosen[0.1]) <= order.index(chosen[0.05]) == 2
    cache.reset()
    assert cache.memory_choice is None and cache.kv_bits is None
    cache.prefill(model, prompt(1, 900))  # a new prompt chooses again, for its own length
    assert cache.memory_choice is not None and cache.memory_choice.length == 900


def test_the_choice_is_deterministic():
    model = tiny_model("llama", "sdpa")
    ids = prompt(2, 300, seed=7)
    caches = [LUKVCache(memory=0.1, scorer="snapkv", allocator="adakv") for _ in range(2)]
    for cache in caches:
        cache.prefill(model, ids)
    assert caches[0].memory_choice == caches[1].memory_choice
    assert torch.equal(caches[0].stored_tokens(), caches[1].stored_tokens())
    for row in range(2):
        assert torch.equal(
            caches[0].layers[1].head_tokens(row, 1)[0], caches[1].layers[1].head_tokens(row, 1)[0]
        )


def _table(loss_none: float, loss_8: float, loss_4: float) -> MemoryTable:
    """A measured table whose loss at every ratio is the one given per precision (flat in the ratio)."""
    ratios = np.array([0.5, 0.9], dtype=np.float32)
    loss = np.array([[loss_none] * 2, [loss_8] * 2, [loss_4] * 2], dtype=np.float32)
    return MemoryTable((None, 8, 4), ratios, loss, "test")


@pytest.mark.parametrize("losses, bits", [((0.01, 0.5, 0.5), None), ((0.5, 0.5, 0.01), 4)])
def test_a_profiles_measured_table_chooses_the_bits(tmp_path, losses, bits):
    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 400, seed=1)
    ruled = LUKVCache(memory=0.2)
    ruled.prefill(model, ids)
    path = tmp_path / "keydiff.safetensors"
    dataclasses.replace(flat_profile(2, 2), memory_table=_table(*losses)).save(path)
    tabled = LUKVCache.from_pretrained(path, memory=0.2, config=model.config)
    tabled.prefill(model, ids)
    assert ruled.memory_choice.by == "rule" and ruled.kv_bits == 8
    assert tabled.memory_choice.by == "table" and tabled.kv_bits == bits
    _check_bound(tabled, int(0.2 * _full_bytes(model, ids)), batch=1)


def test_one_precision_can_be_fixed_for_comparisons_at_the_same_bytes():
    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 400, seed=1)
    for bits in (None, 8, 4):
        cache = LUKVCache(memory=0.2)
        cache.compressor.precisions = (bits,)
        cache.prefill(model, ids)
        assert cache.kv_bits == bits
        _check_bound(cache, int(0.2 * _full_bytes(model, ids)), batch=1)


def test_chunked_prefill_holds_the_bound_after_every_chunk():
    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 480, seed=4)
    cache = LUKVCache(memory=0.15, prefill_chunk_size=120)
    with torch.no_grad():
        for start in range(0, 480, 120):
            model(ids[:, start : start + 120], use_cache=True, **{cache_kwarg(model): cache})
            _check_bound(cache, int(0.15 * _full_bytes(model, ids[:, : start + 120])), batch=1)
    assert cache.get_seq_length() == 480


@pytest.mark.parametrize("name, max_bytes", [("keydiff", 24_000), ("snapkv", 60_000), ("kvzap", 60_000)])
def test_decode_max_tokens_keeps_max_bytes_while_generating(name, max_bytes):
    # snapkv and kvzap keep the last queries between folds (their bytes count) and a 32-token window
    model = tiny_model("llama", "sdpa")
    ids = prompt(2, 300, seed=6)
    cache = LUKVCache(max_bytes=max_bytes, decode_max_tokens=400, scorer=scorer_for(name, model))
    with torch.no_grad():
        out = model(ids, use_cache=True, **{cache_kwarg(model): cache})
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(120):
            _check_bound(cache, max_bytes, batch=2)
            out = model(token, use_cache=True, **{cache_kwarg(model): cache})
            token = out.logits[:, -1:].argmax(-1)
    assert cache.get_seq_length() == 420


def test_bf16_models_fit_too():
    model = tiny_model("llama", "sdpa", dtype=torch.bfloat16)
    ids = prompt(1, 400, seed=8)
    cache = LUKVCache(memory=0.4)
    cache.prefill(model, ids)
    _check_bound(cache, int(0.4 * _full_bytes(model, ids)), batch=1)
    assert cache.kv_bits == 8  # at bf16, 8-bit rows cost about half a token: they keep most of the prompt


@pytest.mark.parametrize(
    "options, match",
    [
        ({"memory": 0.1, "ratio": 0.5}, "ratio= cannot also apply"),
        ({"memory": 0.1, "max_tokens": 64}, "max_tokens= cannot also apply"),
        ({"max_bytes": 10_000, "kv_bits": 4}, "kv_bits= cannot also apply"),
        ({"memory": 0.1, "evict_ratio": [[0.5, 0.5]] * 2, "allocator": "profile"}, "evict_ratio="),
        ({"memory": 0.1, "max_bytes": 10_000}, "either memory= .* or max_bytes="),
        ({"memory": 0.0}, r"memory must be a fraction in \(0, 1\]"),
        ({"memory": 1.5}, r"memory must be a fraction in \(0, 1\]"),
        ({"memory": True}, r"memory must be a fraction"),
        ({"max_bytes": 0}, "max_bytes must be a positive integer"),
    ],
)
def test_mixing_the_budget_with_the_knobs_it_sets_is_refused(options, match):
    with pytest.raises(ConfigurationError, match=match):
        LUKVCache(**options)


def test_a_budget_too_small_for_the_protected_tokens_is_a_typed_error():
    model = tiny_model("llama", "sdpa")
    with pytest.raises(ConfigurationError, match="even at 4 bits the cache needs"):
        LUKVCache(memory=0.01, window=32).prefill(model, prompt(1, 200))


def test_saved_contexts_keep_the_choice(tmp_path):
    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 400, seed=9)
    cache = LUKVCache(memory=0.06)
    cache.prefill(model, ids)
    path = cache.save(tmp_path / "c.safetensors")
    loaded = LUKVCache.load(path, model)
    assert loaded.memory_choice == cache.memory_choice and loaded.kv_bits == cache.kv_bits == 4
    assert loaded.memory_bytes() == cache.memory_bytes()
    with torch.no_grad():
        step = prompt(1, 1, seed=10)
        want = model(step, use_cache=True, **{cache_kwarg(model): cache}).logits
        got = model(step, use_cache=True, **{cache_kwarg(model): loaded}).logits
    assert torch.equal(got, want)


def _resaved(src, dst, edit):
    """``src`` with its metadata edited by ``edit(meta)`` and signed again (only the checks after the
    checksum can refuse it)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from lukv_cache.cache import save_load

    tensors = load_file(src)
    with safe_open(str(src), "pt") as f:
        metadata = dict(f.metadata())
    meta = json.loads(metadata[save_load.METADATA_KEY])
    edit(meta)
    text = json.dumps(meta, sort_keys=True)
    metadata[save_load.METADATA_KEY], metadata[save_load.CHECKSUM_KEY] = (
        text,
        save_load.checksum(text, tensors),
    )
    save_file(tensors, dst, metadata=metadata)
    return dst


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda meta: meta["cache"]["memory_choice"].update(kv_bits=3),
            "memory budget's choice is malformed",
        ),
        (
            lambda meta: meta["cache"]["memory_choice"].update(by="guess"),
            "memory budget's choice is malformed",
        ),
        (lambda meta: meta["cache"]["memory_choice"].update(kv_bits=8), "kv_bits=4"),
        (lambda meta: meta["options"].update(memory=None, split="ratio"), "without memory= or max_bytes="),
    ],
)
def test_a_saved_choice_that_does_not_fit_the_file_is_a_typed_error(tmp_path, edit, match):
    from lukv_cache.errors import SavedContextError

    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(memory=0.06)
    cache.prefill(model, prompt(1, 400, seed=9))
    assert cache.kv_bits == 4
    path = _resaved(cache.save(tmp_path / "c.safetensors"), tmp_path / "edited.safetensors", edit)
    with pytest.raises(SavedContextError, match=match):
        LUKVCache.load(path, model)


def test_the_one_line_on_a_model_without_a_profile_uses_the_rule():
    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 400, seed=3)
    cache = LUKVCache.from_pretrained("org/no-profile-here", memory=0.1, local_files_only=True)
    assert cache.profile is None and cache.memory == 0.1
    cache.prefill(model, ids)
    assert cache.memory_choice.by == "rule"
    _check_bound(cache, int(0.1 * _full_bytes(model, ids)), batch=1)


@pytest.mark.parametrize("deeper", [fold.DEEPER_FOLDS, 0])
def test_an_evicting_fold_makes_room_for_the_next_folds(monkeypatch, deeper):
    # under a budget every fold would evict (every held token scored again, the allocator, a rebuilt store);
    # evicting `DEEPER_FOLDS` folds' tokens deeper lets that many next folds only append, within the bound
    monkeypatch.setattr(
        fold, "DEEPER_SHARE", 1
    )  # its cap (small budgets evict at most 1/32 deeper) out of the way
    monkeypatch.setattr(fold, "DEEPER_FOLDS", deeper)
    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 300, seed=6)
    cache = LUKVCache(max_bytes=24_000, scorer="keydiff")
    held = []
    with torch.no_grad():
        token = model(ids, use_cache=True, **{cache_kwarg(model): cache}).logits[:, -1:].argmax(-1)
        for _ in range(160):
            token = model(token, use_cache=True, **{cache_kwarg(model): cache}).logits[:, -1:].argmax(-1)
            _check_bound(cache, 24_000, batch=1)
            held.append(sum(int(layer.stored_counts().sum()) for layer in cache.layers))
    evicting = sum(after < before for before, after in zip(held, held[1:]))
    folds = 160 // cache.policy.fold_interval
    assert abs(evicting - folds / (deeper + 1)) <= 1, (evicting, folds)


@pytest.mark.parametrize(
    "options",
    [dict(memory=0.2), dict(kv_bits=4, ratio=0.5, decode_max_tokens=400)],
    ids=["memory", "kv_bits"],
)
def test_the_prompts_window_joins_the_store_with_its_scores(options):
    # a scorer that keeps each token's first score (kvzap): where the prompt's protected window joins the
    # store right after its eviction (a budget, kv_bits), its tokens keep the scores the prefill gave them;
    # unscored (NaN) they would rank below every other token at the next evicting fold
    model = tiny_model("llama", "sdpa")
    ids, mask = left_padded((300, 211), seed=3)
    cache = LUKVCache(scorer=scorer_for("kvzap", model), keep_scores=True, **options)
    assert keeps_scores(cache.policy)
    cache.prefill(model, ids, mask)
    for idx, layer in enumerate(cache.layers):
        store = layer.store
        assert layer.suffix_length == 0 and not store.scores.isnan().any()
        raw = cache.prefill_scores[idx]  # [B, H, T]: the prefill's own scores of every token
        window = cache.window
        for segment in range(store.offsets.numel() - 1):
            lo, hi = int(store.offsets[segment]), int(store.offsets[segment + 1])
            row, head = divmod(segment, layer.num_heads)
            # the segment's last `window` tokens are the window's (positions index the padded prompt)
            want = raw[row, head, store.positions[hi - window : hi].long()]
            assert torch.equal(store.scores[hi - window : hi], want), (idx, segment)
            assert lo < hi - window
