"""``max_tokens=N`` is a hard bound: after a prefill, every batch row holds at most N tokens per
(full-attention layer, KV head) on average (sinks, kept tokens and the protected window all count),
whatever the allocator, the profile, the prompt's length, padding or chunking."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import PROFILE_FAMILY, tiny_model

from lukv_cache import LUKVCache
from lukv_cache.allocation import ALLOCATORS
from lukv_cache.errors import ConfigurationError
from lukv_cache.profiles import Profile
from lukv_cache.profiles.download import BUNDLED_DIR
from lukv_cache.testing import array_profile, left_padded, prompt, with_gains

LAYERS, HEADS = 2, 2


def _profile(grid, evict) -> Profile:
    return with_gains(array_profile(grid, evict, head_dim=16))


def _shipped_curves() -> Profile:
    """The shipped SmolLM2 keydiff profile's curves, its first layers and heads (a real profile's shape)."""
    real = Profile.load(BUNDLED_DIR / "HuggingFaceTB/SmolLM2-135M-Instruct/keydiff.safetensors")
    return _profile(real.grid, real.evict_ratio[:, :LAYERS, :HEADS])


PROFILES = {
    "shipped": _shipped_curves,
    "all_zero": lambda: _profile([0.5], np.zeros((1, LAYERS, HEADS))),  # "keep everything" at every ratio
    "stops_early": lambda: _profile(
        [0.2, 0.4], [np.full((LAYERS, HEADS), 0.2), np.full((LAYERS, HEADS), 0.4)]
    ),
    "lopsided": lambda: _profile([0.5, 0.9], [[[0.0, 1.0], [1.0, 0.0]], [[0.0, 1.0], [1.0, 0.9]]]),
}

# shape -> (lengths of the rows, chunk size of a chunked prefill or None)
SHAPES = {
    "single": ((150,), None),
    "chunked": ((300,), 64),
    "padded": ((200, 90, 31, 12), None),
    "padded_chunked": ((260, 70), 48),
    "long": ((500,), None),
}


def _fill(cache: LUKVCache, lengths, chunk) -> None:
    model = tiny_model("llama", "sdpa")
    ids, mask = left_padded(lengths, seed=11)
    step = chunk or ids.shape[1]
    with torch.no_grad():
        for start in range(0, ids.shape[1], step):
            end = start + step
            model(input_ids=ids[:, start:end], attention_mask=mask[:, :end], past_key_values=cache)


def _assert_capped(cache: LUKVCache, lengths, n: int) -> None:
    per_row = cache.stored_tokens().double().mean(dim=(0, 2))  # [B]
    for row, length in enumerate(lengths):
        assert per_row[row] <= n, f"row {row} ({length} tokens) holds {float(per_row[row]):.2f} > {n}"
        if length <= n:
            assert per_row[row] >= length - 0.5 or length <= cache.sink + cache.window  # fits: kept whole


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("allocator", [a for a in ALLOCATORS.names() if a not in PROFILE_FAMILY])
@pytest.mark.parametrize("n", [5, 16, 48])
def test_the_cap_holds_for_allocators_without_a_profile(n, allocator, shape):
    lengths, chunk = SHAPES[shape]
    kwargs = {"value": -10.0} if allocator == "threshold" else None  # keeps everything: the cap must trim
    cache = LUKVCache(
        max_tokens=n, allocator=allocator, sink=4, window=1, prefill_chunk_size=chunk, allocator_kwargs=kwargs
    )
    _fill(cache, lengths, chunk)
    _assert_capped(cache, lengths, n)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("profile", list(PROFILES))
@pytest.mark.parametrize("allocator", PROFILE_FAMILY)
@pytest.mark.parametrize("n", [5, 16, 48])
def test_the_cap_holds_for_every_profile(n, allocator, profile, shape):
    lengths, chunk = SHAPES[shape]
    cache = LUKVCache(
        max_tokens=n,
        allocator=allocator,
        sink=4,
        window=1,
        prefill_chunk_size=chunk,
        allocator_kwargs={"profile": PROFILES[profile]()},
    )
    _fill(cache, lengths, chunk)
    _assert_capped(cache, lengths, n)


def test_the_cap_holds_through_from_pretrained(tmp_path):
    path = _shipped_curves().save(tmp_path / "p.safetensors")
    cache = LUKVCache.from_pretrained(path, max_tokens=16)
    _fill(cache, (400,), None)
    _assert_capped(cache, (400,), 16)


def test_a_cap_that_binds_still_uses_most_of_it():
    """Trimming is a safety net, not the rule: a well-behaved allocator lands on the cap (within a token)."""
    cache = LUKVCache(max_tokens=32, allocator="uniform")
    _fill(cache, (300, 120), None)
    per_row = cache.stored_tokens().double().mean(dim=(0, 2))
    assert ((per_row > 31) & (per_row <= 32)).all()


def test_a_cap_below_sink_and_window_is_refused():
    with pytest.raises(ConfigurationError, match="at least 5"):
        LUKVCache(max_tokens=2)
    with pytest.raises(ConfigurationError, match="at least 36"):
        LUKVCache(max_tokens=35, scorer="snapkv")  # 4 sinks + snapkv's 32-token window
    assert LUKVCache(max_tokens=2, sink=1, window=1).max_tokens == 2


@pytest.mark.parametrize("value", [np.int64(64), np.int32(64), torch.tensor(64)])
def test_numpy_and_torch_integers_are_accepted(value):
    assert LUKVCache(max_tokens=value).max_tokens == 64


@pytest.mark.parametrize("value", [10**30, 2**41, 1.5, True, "64", np.float64(64.0)])
def test_absurd_caps_are_refused_at_construction(value):
    with pytest.raises(ConfigurationError, match="max_tokens"):
        LUKVCache(max_tokens=value)


def test_a_table_with_a_ratio_or_a_cap_is_refused_and_alone_sets_the_ratio():
    table = torch.full((LAYERS, HEADS), 0.3)
    with pytest.raises(ConfigurationError, match="ratio= cannot also apply"):
        LUKVCache(0.8, allocator="profile", evict_ratio=table)
    with pytest.raises(ConfigurationError, match="max_tokens= cannot also apply"):
        LUKVCache(max_tokens=16, allocator="hybrid", allocator_kwargs={"evict_ratio": table})
    assert LUKVCache(allocator="profile", evict_ratio=table).ratio == pytest.approx(0.3)


@pytest.mark.parametrize("allocator", PROFILE_FAMILY)
def test_from_pretrained_reads_the_curve_at_the_asked_ratio(tmp_path, allocator):
    """The ratio asked for is the ratio kept: the profile is a curve, read at it (never a fixed table)."""
    curves = _shipped_curves()  # the first layers of a real profile keep more than its average
    path = curves.save(tmp_path / "p.safetensors")
    kept = {}
    for ratio in (0.3, 0.8):
        cache = LUKVCache.from_pretrained(path, ratio=ratio, allocator=allocator, sink=4, window=1)
        _fill(cache, (205,), None)
        kept[ratio] = float((cache.stored_tokens() - 5).double().mean())  # evictable tokens kept per head
        assert cache.ratio == ratio
        assert kept[ratio] == pytest.approx((1 - curves.at(ratio).mean()) * 200, abs=1.5)
    assert kept[0.3] > kept[0.8] + 20


def test_prompt_long_enough_for_the_tiny_model():
    assert max(max(lengths) for lengths, _ in SHAPES.values()) <= 512
    assert prompt(1, 5).shape == (1, 5)
