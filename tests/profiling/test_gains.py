"""The score-to-gain table: measured from calibration, stored in the profile (format version 2), read by the
``calibrated`` allocator."""

import numpy as np
import pytest
import torch

from lukv_cache import LUKVCache
from lukv_cache.errors import ConfigurationError
from lukv_cache.profiles.profile import Profile
from lukv_cache.profiling import build_profile
from lukv_cache.profiling.gains import score_gain_table, with_score_gains


def _context(seed: int, t: int = 300, noise=(0.1, 5.0)):
    """Scores [2, 2, t] and two questions' importances: head 0 of each layer faithful (importance follows
    its scores), head 1 not (noise only), at ``noise`` levels."""
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(2, 2, t))
    importances = []
    for _ in range(2):
        faithful = np.exp(2 * scores[:, :1] + noise[0] * rng.normal(size=(2, 1, t)))
        random = np.exp(noise[1] * rng.normal(size=(2, 1, t)))
        importances.append(np.concatenate([faithful, random], axis=1))
    return scores, importances


def test_a_faithful_head_gets_a_steep_table_and_an_unfaithful_one_a_flat_one():
    knots, gains = score_gain_table([_context(0), _context(1)], layers=[0, 1], sink=4, window=2, knots=8)
    assert knots.shape == gains.shape == (2, 2, 8) and knots.dtype == gains.dtype == np.float32
    assert (
        (np.diff(knots, axis=-1) >= 0).all() and (np.diff(gains, axis=-1) >= 0).all() and (gains >= 0).all()
    )
    for layer in range(2):
        steep = gains[layer, 0, -1] / max(gains[layer, 0, 0], 1e-9)
        flat = gains[layer, 1, -1] / max(gains[layer, 1, 0], 1e-9)
        assert steep > 50 and flat < steep / 10, (steep, flat)


def test_a_contexts_overall_score_level_cancels_out():
    scores, importances = _context(0)
    base = score_gain_table([(scores, importances)], [0, 1], 4, 2, knots=8)
    shifted = score_gain_table([(scores + 7.0, importances)], [0, 1], 4, 2, knots=8)
    np.testing.assert_allclose(base[0], shifted[0], atol=1e-4)
    np.testing.assert_allclose(base[1], shifted[1], rtol=1e-6)


def test_layers_not_compressed_keep_zero_rows_and_bad_settings_are_refused():
    knots, gains = score_gain_table([_context(0)], layers=[1], sink=4, window=2, knots=4)
    assert not knots[0].any() and not gains[0].any() and gains[1].any()
    with pytest.raises(ConfigurationError, match="centre must be one of model, head, got 'median'"):
        score_gain_table([_context(0)], [0], 4, 2, centre="median")
    with pytest.raises(ConfigurationError, match="knots must be at least 2"):
        score_gain_table([_context(0)], [0], 4, 2, knots=1)
    with pytest.raises(ConfigurationError, match="nothing to evict"):
        score_gain_table([_context(0, t=6)], [0], 4, 2)
    with pytest.raises(ConfigurationError, match="cannot make 64 knots"):
        score_gain_table([_context(0, t=40)], [0], 4, 2, knots=64)


def _tiny_profile(model, tokenizer, calibration, tmp_path):
    return build_profile(
        model,
        tokenizer,
        "keydiff",
        calibration,
        k_max=4,
        model_id="org/tiny",
        cache_dir=tmp_path / "cache",
        show_progress=False,
    )


def test_with_score_gains_adds_a_table_that_round_trips_as_format_version_2(
    tiny_model, byte_tokenizer, tiny_calibration, tmp_path
):
    profile = _tiny_profile(tiny_model, byte_tokenizer, tiny_calibration, tmp_path)
    assert not profile.has_gains and profile.file_format_version == 1
    new = with_score_gains(
        profile,
        tiny_model,
        byte_tokenizer,
        [tiny_calibration],
        knots=4,
        cache_dir=tmp_path / "cache",
        show_progress=False,
    )
    assert new.has_gains and new.gain_scores.shape == (2, 2, 4) and new.extra["gains"]["knots"] == 4
    np.testing.assert_array_equal(new.evict_ratio, profile.evict_ratio)  # the budgets are unchanged
    loaded = Profile.load(new.save(tmp_path / "keydiff.safetensors"))
    assert loaded.format_version == 2
    np.testing.assert_array_equal(loaded.gain_scores, new.gain_scores)
    np.testing.assert_array_equal(loaded.gain_values, new.gain_values)
    # and the one line reads it
    cache = LUKVCache.from_pretrained(tmp_path / "keydiff.safetensors", 0.5, allocator="calibrated")
    with torch.no_grad():
        tiny_model(torch.randint(3, 120, (1, 80)), past_key_values=cache)
    stored = cache.stored_tokens()  # [L, B, H]: sinks 4 + window 1 + the shared half of 75
    assert int((stored - 5).sum()) == pytest.approx(0.5 * 75 * 4, abs=2)


def test_an_old_profile_is_refused_by_the_calibrated_allocator_with_what_to_do(
    tiny_model, byte_tokenizer, tiny_calibration, tmp_path
):
    path = _tiny_profile(tiny_model, byte_tokenizer, tiny_calibration, tmp_path).save(
        tmp_path / "p.safetensors"
    )
    with pytest.raises(ConfigurationError, match="score-to-gain table.*with_score_gains"):
        LUKVCache.from_pretrained(path, 0.5, allocator="calibrated")
    LUKVCache.from_pretrained(path, 0.5, allocator="profile")  # every other allocator still reads it
