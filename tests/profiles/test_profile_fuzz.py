"""Fuzzing the profile reader: a mutated file either loads as a profile that drives a tiny model's cache
within its memory bound, or raises a ProfileError. Never another exception, never a large allocation.

The default run is short (CI); ``LUKV_FUZZ_EXAMPLES=5000 python -m pytest tests/profiles/test_profile_fuzz.py``
runs longer.
"""

from __future__ import annotations

import json
import math
import os
import tracemalloc

import numpy as np
import pytest
import torch
from helpers import json_leaves
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save

from lukv_cache import LUKVCache
from lukv_cache.errors import LUKVError, ProfileError
from lukv_cache.profiles import Profile
from lukv_cache.testing import flat_profile, random_surrogate, tiny_model, with_gains

EXAMPLES = int(os.environ.get("LUKV_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same examples every run: a CI failure reproduces
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _valid() -> Profile:
    return flat_profile(2, 2, grid=[0.25, 0.5, 0.75], model_id="org/tiny-llama", head_dim=16)


VALID = _valid()
VALID_BYTES = VALID.to_bytes()
_HEADER_LEN = int.from_bytes(VALID_BYTES[:8], "little")
HEADER = json.loads(VALID_BYTES[8 : 8 + _HEADER_LEN])
PAYLOAD = VALID_BYTES[8 + _HEADER_LEN :]

_MODEL = None


def _model():
    global _MODEL
    if _MODEL is None:
        _MODEL = tiny_model(vocab_size=64, hidden_size=32, intermediate_size=64, max_position_embeddings=256)
    return _MODEL


def _check(data: bytes) -> None:
    """The property: ProfileError, or a profile whose cache stays within its bound."""
    tracemalloc.start()
    try:
        profile = Profile.from_bytes(data)
    except ProfileError:
        return
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 50 * len(data) + (1 << 20), f"reading {len(data)} bytes peaked at {peak} bytes"
    # it validates again, and drives a cache within the model's own cache size
    Profile.from_bytes(profile.to_bytes())
    model = _model()
    try:
        profile.validate_for(model.config)
    except ProfileError:
        return
    cache = LUKVCache(
        0.5,
        "keydiff",
        "profile",
        sink=profile.sink,
        window=profile.window,
        allocator_kwargs={"profile": profile},
    )
    with torch.no_grad():
        model(
            torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(0)), past_key_values=cache
        )
    dense = 2 * 2 * 2 * 40 * 16 * 4  # layers x (K, V) x heads x tokens x dim x fp32
    assert cache.memory_bytes() <= dense + 2 * 2 * 2 * 16 * 16 * 4 + 1024


def _with_header(header: dict, payload: bytes = PAYLOAD) -> bytes:
    blob = json.dumps(header).encode()
    return len(blob).to_bytes(8, "little") + blob + payload


_TEXT = st.one_of(
    st.text(max_size=12),
    st.integers(-(10**15), 10**15).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["true", "null", "[]", "{}", "1e309", "-0", "0x10", "1_000", " 7 "]),
)
_KEYS = sorted(HEADER["__metadata__"])


@FUZZ
@given(
    key=st.sampled_from(_KEYS),
    value=st.one_of(_TEXT, st.integers(), st.none(), st.lists(st.integers(), max_size=3)),
)
def test_mutated_metadata_loads_cleanly_or_raises_a_profile_error(key, value):
    header = json.loads(json.dumps(HEADER))
    header["__metadata__"][key] = value
    _check(_with_header(header))


@FUZZ
@given(
    tensor=st.sampled_from(["grid", "evict_ratio"]),
    dtype=st.sampled_from(["F32", "F16", "BF16", "F64", "I64", "U8", "BOOL", "F8_E4M3", "XYZ"]),
    shape=st.lists(st.integers(0, 70), min_size=0, max_size=4),
    offsets=st.lists(st.integers(-5, 10**9), min_size=2, max_size=2),
)
def test_mutated_tensor_entries_load_cleanly_or_raise_a_profile_error(tensor, dtype, shape, offsets):
    header = json.loads(json.dumps(HEADER))
    header[tensor] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
    _check(_with_header(header))


@FUZZ
@given(
    cut=st.integers(0, len(VALID_BYTES)),
    flips=st.lists(st.tuples(st.integers(0, len(VALID_BYTES) - 1), st.integers(0, 255)), max_size=6),
)
def test_truncated_or_corrupted_bytes_load_cleanly_or_raise_a_profile_error(cut, flips):
    data = bytearray(VALID_BYTES[:cut])
    for at, byte in flips:
        if at < len(data):
            data[at] = byte
    _check(bytes(data))


@FUZZ
@given(values=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=15, max_size=15))
def test_any_float_values_load_cleanly_or_raise_a_profile_error(values):
    grid = np.array(values[:3], dtype=np.float32)
    ratios = np.array(values[3:], dtype=np.float32).reshape(3, 2, 2)
    _check(save({"grid": grid, "evict_ratio": ratios}, metadata=VALID._metadata()))


@pytest.mark.parametrize("header_len", [0, 7, 2**63, len(VALID_BYTES)])
def test_absurd_header_lengths_raise_a_profile_error(header_len):
    with pytest.raises(ProfileError):
        Profile.from_bytes(header_len.to_bytes(8, "little") + VALID_BYTES[8:])


# ------------------------------------------------------------------ every metadata field, edited one by one
# A profile has no checksum: an edited file needs no re-signing, and a valid edit is a valid profile (its
# sink, window, ...). So the property is the one above, for every field of the metadata, recursively into
# its JSON values (scorer_params, extra, head_dim, a kvzap surrogate's features, layers and thresholds):
# a ProfileError, or a profile that saves back to itself and drives a cache (and, for kvzap, the threshold
# allocator) without a raw error, within its memory bound.
def _kvzap_profile() -> Profile:
    surrogate = random_surrogate(2, 2, 16)
    surrogate.meta["thresholds"] = {"grid": [0.25, 0.5, 0.75], "values": [-1.0, 0.0, 1.0]}
    return flat_profile(2, 2, scorer="kvzap", head_dim=16, window=32, surrogate=surrogate)


PROFILES = {
    "flat": VALID,
    "with a score-to-gain table": with_gains(VALID),
    "kvzap with thresholds": _kvzap_profile(),
}
_TEXT_EDITS = ["", "x", "0", "-1", str(2**23), str(2**50), "nan", "inf", "null", "true", "[]", "{}", "1.5"]


def _json_edits(value) -> list:
    if isinstance(value, bool):
        return [not value, 0, None]
    if isinstance(value, int | float):
        return [0, -1, 2**23, 2**50, math.nan, str(value), None, True, [value], 0.5]
    if isinstance(value, str):
        return ["", "x", 0, None]
    if value is None:
        return [0, "x", True, []]
    if isinstance(value, list):
        return [value[:-1], value + value[-1:] if value else [0], None, {}]
    return [{}, None, []]


def _replaced(value, path: tuple, new):
    if not path:
        return new
    value = json.loads(json.dumps(value))
    target = value
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = new
    return value


def _metadata_edits(metadata: dict) -> list[tuple[str, str | None]]:
    """(key, new text or None to remove it) for every metadata entry and every leaf of a JSON entry."""
    edits: list[tuple[str, str | None]] = []
    for key, text in metadata.items():
        edits += [(key, edit) for edit in [*_TEXT_EDITS, text + "x", None]]
        try:
            parsed = json.loads(text)
        except ValueError:
            continue
        if isinstance(parsed, dict | list):
            for path, value in json_leaves(parsed):
                edits += [(key, json.dumps(_replaced(parsed, path, new))) for new in _json_edits(value)]
    return edits


@pytest.mark.parametrize("name", list(PROFILES))
def test_every_metadata_field_edited_loads_cleanly_or_raises_a_profile_error(name, capsys):
    from lukv_cache.allocation.builtin import threshold

    data = PROFILES[name].to_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    payload = data[8 + int.from_bytes(data[:8], "little") :]
    counts = {"profile error": 0, "loads": 0}
    for key, text in _metadata_edits(header["__metadata__"]):
        edited = json.loads(json.dumps(header))
        if text is None:
            del edited["__metadata__"][key]
        else:
            edited["__metadata__"][key] = text
        blob = _with_header(edited, payload)
        try:
            profile = Profile.from_bytes(blob)
        except ProfileError:
            counts["profile error"] += 1
            continue
        counts["loads"] += 1
        again = Profile.from_bytes(profile.to_bytes())  # it saves back to itself
        assert again._metadata() == profile._metadata(), (key, text)
        assert np.array_equal(again.evict_ratio, profile.evict_ratio), (key, text)
        _check(blob)
        if profile.surrogate is not None:
            try:
                threshold(profile=profile)
            except LUKVError:
                pass
    with capsys.disabled():
        print(f"\nprofile {name}: {sum(counts.values())} edits: {counts}")
