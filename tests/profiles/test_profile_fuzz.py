"""Fuzzing the profile reader: a mutated file either loads as a profile that drives a tiny model's cache
within its memory bound, or raises a ProfileError. Never another exception, never a large allocation.

The default run is short (CI); ``LUKV_FUZZ_EXAMPLES=5000 python -m pytest tests/profiles/test_profile_fuzz.py``
runs longer.
"""

from __future__ import annotations

import json
import os
import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save

from lukv_cache import LUKVCache
from lukv_cache.errors import ProfileError
from lukv_cache.profiles import Profile
from lukv_cache.testing import flat_profile, tiny_model

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
