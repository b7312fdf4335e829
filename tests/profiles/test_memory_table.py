"""The memory table (loss at a grid of (kv_bits, ratio)): lookups, choices, and its place in the profile file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save

from lukv_cache.errors import ConfigurationError, ProfileFormatError
from lukv_cache.profiles import Profile
from lukv_cache.profiles.memory_table import MemoryTable

ROOT = Path(__file__).resolve().parents[2]


def _table(**fields) -> MemoryTable:
    values = dict(
        bits=(None, 8, 4),
        ratios=np.array([0.5, 0.7, 0.9], dtype=np.float32),
        loss=np.array([[0.1, 0.2, 0.6], [0.15, 0.18, 0.3], [0.3, 0.31, 0.32]], dtype=np.float32),
        measure="continuation excess NLL, 4 contexts x 128 tokens",
    )
    return MemoryTable(**{**values, **fields})


# ------------------------------------------------------------------------------------------ loss_at


def test_loss_at_the_grid_is_the_table():
    table = _table()
    for i, bits in enumerate(table.bits):
        for j, ratio in enumerate(table.ratios):
            assert table.loss_at(bits, float(ratio)) == pytest.approx(float(table.loss[i, j]))


def test_loss_at_interpolates_linearly_between_ratios():
    assert _table().loss_at(None, 0.6) == pytest.approx(0.15)
    assert _table().loss_at(8, 0.8) == pytest.approx(0.24)


def test_below_the_first_ratio_full_precision_goes_to_zero_and_quantized_holds():
    table = _table()
    assert table.loss_at(None, 0.0) == 0.0
    assert table.loss_at(None, 0.25) == pytest.approx(0.05)
    assert table.loss_at(8, 0.0) == pytest.approx(0.15) and table.loss_at(8, 0.25) == pytest.approx(0.15)
    assert table.loss_at(4, 0.1) == pytest.approx(0.3)


def test_beyond_the_last_ratio_extrapolates_and_never_decreases():
    table = _table(loss=np.array([[0.1, 0.2, 0.6], [0.15, 0.18, 0.3], [0.3, 0.5, 0.4]], dtype=np.float32))
    assert table.loss_at(None, 1.0) == pytest.approx(0.6 + 2.0 * 0.1)  # slope (0.6 - 0.2) / 0.2
    assert table.loss_at(8, 0.95) == pytest.approx(0.3 + 0.6 * 0.05)
    assert table.loss_at(4, 1.0) == pytest.approx(0.4)  # a falling last segment is held, not followed


def test_a_one_ratio_table():
    table = MemoryTable((None, 4), np.array([0.5], dtype=np.float32), np.array([[0.2], [0.3]]))
    assert table.loss_at(None, 0.25) == pytest.approx(0.1)
    assert table.loss_at(None, 1.0) == pytest.approx(0.4)  # the segment from (0, 0)
    assert table.loss_at(4, 1.0) == pytest.approx(0.3)


@pytest.mark.parametrize("bits", [2, 16, True, "8"])
def test_loss_at_unknown_bits_is_a_configuration_error(bits):
    with pytest.raises(ConfigurationError, match="no row for kv_bits"):
        _table().loss_at(bits, 0.5)


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan")])
def test_loss_at_a_ratio_outside_0_1_is_a_configuration_error(ratio):
    with pytest.raises(ConfigurationError, match="ratio must be in"):
        _table().loss_at(None, ratio)


# ------------------------------------------------------------------------------------------ choose


def test_choose_takes_the_least_loss():
    table = _table()
    # None at 0.9: 0.6; 8 at 0.8: 0.24; 4 at 0.7: 0.31
    assert table.choose({None: 0.9, 8: 0.8, 4: 0.7}) == 8
    assert table.choose({None: 0.5, 8: 0.8, 4: 0.7}) is None  # 0.1
    assert table.choose({None: 0.95, 8: 0.95, 4: 0.9}) == 4  # 0.7, 0.33, 0.32


def test_choose_breaks_ties_towards_more_bits():
    flat = np.full((3, 2), 0.2, dtype=np.float32)
    table = _table(ratios=np.array([0.5, 0.9], dtype=np.float32), loss=flat)
    assert table.choose({4: 0.6, 8: 0.6, None: 0.9}) is None
    assert table.choose({4: 0.6, 8: 0.6}) == 8
    reordered = MemoryTable((4, 8, None), table.ratios, flat)
    assert reordered.choose({4: 0.6, 8: 0.6}) == 8


def test_choose_ignores_bits_not_in_the_table_and_refuses_when_none_is_left():
    table = _table(bits=(None, 8), loss=np.array([[0.1, 0.2, 0.6], [0.9, 0.9, 0.9]], dtype=np.float32))
    assert table.choose({4: 0.0, 8: 0.5}) == 8
    with pytest.raises(ConfigurationError, match="None of the precisions 4, 2"):
        table.choose({4: 0.5, 2: 0.5})
    with pytest.raises(ConfigurationError):
        table.choose({})


# ------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"bits": ()}, "non-empty sequence"),
        ({"bits": (None, 8, 8)}, "distinct"),
        ({"bits": (None, 8, 0)}, r"integers in \[1, 32\]"),
        ({"bits": (None, 8, 4.0)}, r"integers in \[1, 32\]"),
        ({"bits": (None, True, 4)}, r"integers in \[1, 32\]"),
        ({"bits": "84"}, "non-empty sequence"),
        ({"ratios": np.array([0.5, 0.5, 0.9])}, "strictly increasing"),
        ({"ratios": np.array([0.0, 0.5, 0.9])}, "strictly increasing"),
        ({"ratios": np.array([0.5, 0.7, 1.0])}, "strictly increasing"),
        ({"ratios": np.array([0.5, np.nan, 0.9])}, "strictly increasing"),
        ({"ratios": np.zeros((3, 1))}, "1-D"),
        ({"loss": np.zeros((3, 2))}, r"shape \[bits=3, ratios=3\]"),
        ({"loss": np.zeros(9)}, "shape"),
        ({"loss": np.array([[0, 0, np.inf], [0, 0, 0], [0, 0, 0]])}, "NaN or infinite"),
        ({"loss": np.full((3, 3), 1e39)}, "float32"),
        ({"loss": np.array([["a"] * 3] * 3)}, "numeric"),
        ({"measure": 3}, "measure must be a string"),
    ],
)
def test_a_bad_table_is_a_profile_format_error(fields, message):
    with pytest.raises(ProfileFormatError, match=message):
        _table(**fields)


def test_the_table_is_frozen_and_its_arrays_are_its_own():
    loss = np.zeros((3, 3), dtype=np.float32)
    table = _table(loss=loss)
    loss[0, 0] = 5.0
    assert table.loss[0, 0] == 0.0
    with pytest.raises(ValueError):
        table.loss[0, 0] = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        table.measure = "x"  # type: ignore[misc]


# ------------------------------------------------------------------------------------------ the file


def test_a_profile_round_trips_with_its_table(tmp_path, make_profile):
    table = _table()
    loaded = Profile.load(make_profile(memory_table=table).save(tmp_path / "p.safetensors"))
    assert loaded.memory_table == table
    assert loaded.memory_table.bits == (None, 8, 4) and loaded.memory_table.loss.dtype == np.float32
    np.testing.assert_array_equal(loaded.memory_table.loss, table.loss)  # exact, through JSON
    assert loaded.memory_table.choose({None: 0.9, 8: 0.8, 4: 0.7}) == 8


def test_a_profile_without_a_table_round_trips_without_one(tmp_path, make_profile):
    path = make_profile().save(tmp_path / "p.safetensors")
    assert Profile.load(path).memory_table is None
    with safe_open(str(path), framework="np") as f:
        assert "memory_table" not in f.metadata()


def test_the_table_adds_no_tensor_and_no_format_version(tmp_path, make_profile):
    """Older readers refuse tensors they do not know and ignore metadata they do not know: the table lives
    in metadata, so a file with one reads in them as the same profile without it."""
    plain = make_profile().save(tmp_path / "plain.safetensors")
    with_table = make_profile(memory_table=_table()).save(tmp_path / "table.safetensors")
    with safe_open(str(plain), framework="np") as a, safe_open(str(with_table), framework="np") as b:
        assert sorted(a.keys()) == sorted(b.keys()) == ["evict_ratio", "grid"]
        extra = set(b.metadata()) - set(a.metadata())
        assert (
            extra == {"memory_table"}
            and a.metadata()["format_version"] == b.metadata()["format_version"] == "1"
        )
        assert json.loads(b.metadata()["memory_table"])["bits"] == [None, 8, 4]


def test_summary_mentions_the_table(make_profile):
    assert "memory_table" not in make_profile().summary()
    summary = make_profile(memory_table=_table()).summary()
    assert summary["memory_table"] == {
        "bits": [None, 8, 4],
        "ratios": [0.5, 0.7, 0.9],
        "measure": "continuation excess NLL, 4 contexts x 128 tokens",
    }
    json.dumps(summary)


def test_show_prints_the_table(make_profile):
    from lukv_cache.profiling.diagnostics import profile_summary

    text = profile_summary(make_profile(memory_table=_table()), [0.5])
    assert "memory    loss of model, int8, int4 at ratios 0.50 0.70 0.90" in text
    assert "int4  +0.300 +0.310 +0.320" in text
    assert "memory " not in profile_summary(make_profile(), [0.5])


def test_every_shipped_and_test_profile_still_loads():
    paths = sorted((ROOT / "profiles_hub").rglob("*.safetensors")) + sorted(
        (ROOT / "tests" / "data").glob("*.safetensors")
    )
    assert len(paths) >= 12
    # the one line's profiles of the three models benchmarked with memory= carry a measured table (Gemma's
    # measured after the 0.25 ratio was added: six ratios)
    hub = ROOT / "profiles_hub"
    with_table = {
        hub / "HuggingFaceTB" / "SmolLM2-135M-Instruct" / "kvzap.safetensors": 5,
        hub / "Qwen" / "Qwen2.5-Coder-0.5B-Instruct" / "kvzap.safetensors": 5,
        hub / "google" / "gemma-3-270m" / "kvzap.safetensors": 6,
    }
    for path in paths:
        table = Profile.load(path).memory_table
        assert (table is not None) == (path in with_table), path
        if table is not None:
            assert table.bits == (None, 8, 4) and table.loss.shape == (3, with_table[path]), path


def _write_table(path: Path, profile: Profile, text: str) -> Path:
    metadata = {**profile._metadata(), "memory_table": text}
    path.write_bytes(save({"grid": profile.grid, "evict_ratio": profile.evict_ratio}, metadata=metadata))
    return path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"bits": [null, 8], "ratios": [0.5], "loss": [[0.1], [0.2]], "meas', "malformed memory_table"),
        ("[1, 2]", "expected a JSON object"),
        ('{"bits": [null, 8], "ratios": [0.5], "loss": [[0.1], [0.2]]}', "no measure"),
        ('{"bits": [null, 8], "ratios": [0.5], "loss": [[0.1]], "measure": ""}', "loss must have shape"),
        ('{"bits": [null, 8], "ratios": [0.5, 0.7], "loss": [[0.1, 0.2], [0.3]], "measure": ""}', "lengths"),
        ('{"bits": [null, 8], "ratios": [0.5], "loss": [[NaN], [0.2]], "measure": ""}', "NaN or infinite"),
        ('{"bits": [null, 8], "ratios": [0.5], "loss": [[1e999], [0.2]], "measure": ""}', "NaN or infinite"),
        ('{"bits": [null, 8], "ratios": [1e999], "loss": [[0.1], [0.2]], "measure": ""}', "strictly"),
        ('{"bits": [null, 8], "ratios": [0.5], "loss": [["x"], [0.2]], "measure": ""}', "lists of numbers"),
        ('{"bits": [null, "8"], "ratios": [0.5], "loss": [[0.1], [0.2]], "measure": ""}', "integers in"),
        ('{"bits": null, "ratios": [0.5], "loss": [[0.1], [0.2]], "measure": ""}', "must be lists"),
        ('{"bits": [null, 8], "ratios": [0.5], "loss": [[0.1], [0.2]], "measure": 7}', "measure must be"),
        (
            '{"bits": [null, 8], "ratios": [' + "9" * 400 + '], "loss": [[0.1], [0.2]], "measure": ""}',
            "malformed",
        ),
        ("[" * 100 + "]" * 100, "malformed memory_table"),
    ],
)
def test_a_corrupt_table_is_a_profile_format_error(tmp_path, make_profile, text, message):
    path = _write_table(tmp_path / "p.safetensors", make_profile(), text)
    with pytest.raises(ProfileFormatError, match=message) as info:
        Profile.load(path)
    assert info.value.field == "memory_table" and str(path) in str(info.value)


def test_a_truncated_file_with_a_table_is_a_profile_format_error(tmp_path, make_profile):
    data = make_profile(memory_table=_table()).to_bytes()
    with pytest.raises(ProfileFormatError):
        Profile.from_bytes(data[: len(data) // 2])


def test_memory_table_must_be_a_memory_table(make_profile):
    with pytest.raises(ProfileFormatError, match="memory_table must be a MemoryTable"):
        make_profile(memory_table={"bits": [None]})
