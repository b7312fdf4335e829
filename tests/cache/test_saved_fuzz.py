"""A crafted saved context is not trusted input: every field of its metadata, edited and re-signed with the
public ``checksum()`` (so that only the checks after the checksum can refuse it), either loads into a cache
that decodes exactly as the saved one (next-token logits within 1e-6) or raises a SavedContextError naming
the field. Never a raw exception (at load or at the first forwards after it), never a silent change, and
never a buffer beyond what the file's tensors imply.

The edits, for every key of the JSON metadata, recursively: numbers to 0, -1, 2**23, 2**50, NaN, a string,
None, a bool, a list, one more, twice as much and 0.5; strings to "", "x", 0, None and one letter longer;
bools flipped, to 0, None and "true"; None to numbers, a string, True and []; lists shortened, lengthened,
None and {}; objects emptied, None and []; every key removed. An edit inside a layer is also made in every
layer at once (a consistent edit, which the layers' agreement cannot catch).

Two kinds of field decide what a cache does next without leaving a trace in its tensors, so an edit of
them loads and may decode differently: the cache's options that the file records as they were passed
(``sink``, ``decode_window``, ``decode_max_tokens``, ... : the loaded cache then holds the edited option,
as ``LUKVCache(...)`` with it would) and the logical length of every layer at once (evicted tokens leave
none; it is bounded by the model's positions and by the stored ones). Both are checked to be what the
loaded cache reports, not silent.

The tensors' values are edited too: NaN, +inf and -inf in each float tensor of fp32, bf16, kv_bits=8 and
kv_bits=4 contexts (keys, values, scales, zeros, suffixes, stock layers' keys and values, queries, scores,
a kvzap surrogate, an allocator's table), re-signed: a SavedContextError naming the tensor, except for
scores, which may hold such values (the library writes -inf for padding) and then decode finite logits.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import greedy_with_logits, json_leaves, scorer_for, tiny_model, with_question
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lukv_cache import LUKVCache, load_cache, save_cache
from lukv_cache.cache import save_load
from lukv_cache.errors import LUKVError, SavedContextError
from lukv_cache.testing import flat_profile, left_padded, prompt

# options a file records as passed and its tensors cannot contradict: an edit loads as that option
REPORTED_OPTIONS = {
    "decode_max_tokens",
    "decode_window",
    "max_tokens",
    "min_keep",
    "prefill_chunk_size",
    "ratio",
    "sink",
    "window",
}
_DELETE = object()  # the edit that removes a key


def _filled(name: str):
    """A model, a cache it filled (a prompt and 4 generated tokens), the tokens so far and their mask."""
    mask = None
    if name == "llama-profile-scores":  # an embedded profile, prefill scores, one row
        model = tiny_model("llama", "sdpa")
        profile = flat_profile(2, 2, model_id="org/tiny", head_dim=16)
        cache = LUKVCache(0.5, "keydiff", "profile", allocator_kwargs={"profile": profile}, keep_scores=True)
        ids = prompt(1, 24)
    elif name == "llama-padded-kv8-folds":  # a quantized store, two padded rows, eviction at fold time
        model = tiny_model("llama", "sdpa")
        cache = LUKVCache(None, "keydiff", decode_max_tokens=20, fold_interval=4, kv_bits=8)
        ids, mask = left_padded((40, 31))
    else:  # gemma2: compressed sliding-window layers that fold
        model = tiny_model("gemma2", "eager")
        cache = LUKVCache(None, "keydiff", decode_max_tokens=12, fold_interval=4, config=model.config)
        ids = prompt(1, 8)
    seq, _ = greedy_with_logits(model, ids, cache, new_tokens=4, attention_mask=mask)
    return model, cache, seq, mask


def _edits(value) -> list:
    if isinstance(value, bool):
        return [not value, 0, None, "true"]
    if isinstance(value, int | float):
        return [
            0,
            -1,
            2**23,
            2**50,
            math.nan,
            str(value),
            None,
            True,
            [value],
            value + 1,
            2 * value or 1,
            0.5,
        ]
    if isinstance(value, str):
        return ["", "x", 0, None, value + "x"]
    if value is None:
        return [0, -1, 2**23, "x", True, []]
    if isinstance(value, list):
        return [value[:-1], value + value[-1:] if value else [0], None, {}]
    return [{}, None, []]


def _cases(meta: dict) -> list[tuple[tuple, object]]:
    """(path, new value) for every edit; a path starting with "every layer" edits that field in each layer."""
    cases = []
    for path, value in json_leaves(meta):
        cases += [(path, edit) for edit in _edits(value)]
        if path and isinstance(path[-1], str):
            cases.append((path, _DELETE))
        if path[:2] == ("layers", 0) and len(path) > 2:
            cases += [(("every layer", *path[2:]), edit) for edit in _edits(value)]
    return cases


def _edited(meta: dict, path: tuple, value: object) -> object:
    if path[:1] == ("every layer",):
        for i, layer in enumerate(meta["layers"]):
            if _has(layer, path[1:-1]):
                meta = _edited(meta, ("layers", i, *path[1:]), value)
        return meta
    if not path:
        return value
    meta = copy.deepcopy(meta)
    target = meta
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return meta


def _has(value, path: tuple) -> bool:
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return False
        value = value[key]
    return isinstance(value, dict)


def _resigned(src: Path, dst: Path, meta: object, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """``src`` with the metadata ``meta`` (and ``tensors``, when given, instead of its own), signed again
    with the public ``checksum()``."""
    tensors = load_file(src) if tensors is None else tensors
    with safe_open(str(src), "pt") as f:
        metadata = dict(f.metadata())
    text = json.dumps(meta, sort_keys=True)
    metadata[save_load.METADATA_KEY], metadata[save_load.CHECKSUM_KEY] = (
        text,
        save_load.checksum(text, tensors),
    )
    save_file(tensors, dst, metadata=metadata)
    return dst


def _held_bytes(cache) -> int:
    """Bytes of every distinct tensor storage the cache's layers (and their stores) and prefill scores hold."""
    storages: dict[int, int] = {}

    def walk(value) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                walk(getattr(value, field.name))

    for layer in cache.layers:
        for value in vars(layer).values():
            walk(value)
    for value in (cache.prefill_scores or {}).values():
        walk(value)
    return sum(storages.values())


def _reported(loaded, path: tuple, value: object) -> bool:
    """Whether an accepted edit that decodes differently is one the loaded cache reports as the file says."""
    if len(path) == 2 and path[0] == "options" and path[1] in REPORTED_OPTIONS:
        return getattr(loaded.policy, path[1]) == value
    if path == ("every layer", "attrs", "cumulative_length"):
        return loaded.get_seq_length() == value
    return False


@pytest.mark.parametrize("name", ["llama-profile-scores", "llama-padded-kv8-folds", "gemma2-sliding-folds"])
def test_every_resigned_metadata_edit_is_a_typed_error_or_an_exact_round_trip(name, tmp_path, capsys):
    model, cache, seq, mask = _filled(name)
    src = save_cache(cache, tmp_path / "context.safetensors")
    tensor_bytes = sum(t.numel() * t.element_size() for t in load_file(src).values())
    with safe_open(str(src), "pt") as f:
        meta = json.loads(f.metadata()[save_load.METADATA_KEY])
    ids, full_mask = with_question(seq, mask)
    _, want = greedy_with_logits(model, ids, load_cache(src, model), new_tokens=5, attention_mask=full_mask)
    counts, failures = {"typed error": 0, "exact round trip": 0, "reported option or length": 0}, []
    for path, value in _cases(meta):
        where = f"{'.'.join(map(str, path))} = {'<removed>' if value is _DELETE else repr(value)[:40]}"
        bad = _resigned(src, tmp_path / "edited.safetensors", _edited(meta, path, value))
        try:
            loaded = load_cache(bad, model)
        except LUKVError:
            counts["typed error"] += 1
            continue
        except Exception as err:  # noqa: BLE001 - the property: nothing but the library's errors
            failures.append(f"{where}: raw {type(err).__name__} at load: {err}")
            continue
        if _held_bytes(loaded) > 4 * tensor_bytes + (1 << 16):  # suffix buffers have room to decode
            failures.append(f"{where}: holds {_held_bytes(loaded)} bytes for {tensor_bytes} bytes of tensors")
            continue
        reported = _reported(loaded, path, value)  # before decoding moves it on
        try:
            _, got = greedy_with_logits(model, ids, loaded, new_tokens=5, attention_mask=full_mask)
        except LUKVError as err:
            failures.append(f"{where}: loaded, then {type(err).__name__} at decode: {err}")
            continue
        except Exception as err:  # noqa: BLE001
            failures.append(f"{where}: loaded, then raw {type(err).__name__} at decode: {err}")
            continue
        if got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=1e-6):
            counts["exact round trip"] += 1
        elif reported:
            counts["reported option or length"] += 1
        else:
            failures.append(f"{where}: loaded and decodes differently (a silent change)")
    with capsys.disabled():
        print(f"\n{name}: {sum(counts.values()) + len(failures)} edits: {counts}")
    assert not failures, "\n".join(failures[:40])


def _saved(name: str, tmp_path: Path):
    model, cache, _, _ = _filled(name)
    src = save_cache(cache, tmp_path / "context.safetensors")
    with safe_open(str(src), "pt") as f:
        return model, src, json.loads(f.metadata()[save_load.METADATA_KEY])


@pytest.mark.parametrize("capacity", [2**23, 2**50])
def test_a_suffix_capacity_beyond_the_layers_length_is_refused_before_allocating(capacity, tmp_path):
    model, src, meta = _saved("llama-profile-scores", tmp_path)
    meta["layers"][0]["suffix_capacity"] = capacity
    with pytest.raises(SavedContextError, match="suffix capacity") as err:
        load_cache(_resigned(src, tmp_path / "edited.safetensors", meta), model)
    assert err.value.field == "layers.0.suffix_capacity"


def test_a_large_suffix_capacity_allocates_only_what_the_stored_suffix_implies(tmp_path):
    model, src, meta = _saved("llama-profile-scores", tmp_path)
    attrs = meta["layers"][0]["attrs"]
    meta["layers"][0]["suffix_capacity"] = 2 * attrs["cumulative_length"] + attrs["fold_at"]  # in range
    layer = load_cache(_resigned(src, tmp_path / "edited.safetensors", meta), model).layers[0]
    assert layer.suffix_buffers[0].shape[-2] == max(2 * layer.suffix_length, layer.suffix_length + 16)


@pytest.mark.parametrize(
    ("field", "value"),
    [("keys.fields.bits", 4), ("values.fields.bits", 4), ("values.fields.dim", 8), ("keys.fields.dim", 8)],
)
def test_a_quantized_store_whose_bits_or_size_do_not_fit_its_codes_is_refused(field, value, tmp_path):
    model, src, meta = _saved("llama-padded-kv8-folds", tmp_path)
    target = meta["layers"][0]["store"]["fields"]
    *parents, key = field.split(".")
    for name in parents:
        target = target[name]
    target[key]["value"] = value
    with pytest.raises(SavedContextError) as err:
        load_cache(_resigned(src, tmp_path / "edited.safetensors", meta), model)
    assert err.value.field == f"layers.0.store.{field.split('.')[0]}"


def test_a_length_past_the_models_positions_in_every_layer_is_refused(tmp_path):
    model, src, meta = _saved("llama-profile-scores", tmp_path)
    for layer in meta["layers"]:
        layer["attrs"]["cumulative_length"] = 2**40
    with pytest.raises(SavedContextError, match="max_position_embeddings") as err:
        load_cache(_resigned(src, tmp_path / "edited.safetensors", meta), model)
    assert err.value.field == "layers.0.cumulative_length"


# ------------------------------------------------------------------------------ non-finite tensor values
# contexts that between them hold every kind of float tensor a file can: fp32 and bf16 stores, kv_bits 8
# and 4 (scales and zeros), dense suffixes, stock sliding layers' keys and values, recorded queries, a
# store's scores and kept prefill scores, a kvzap surrogate and an allocator's table
VALUE_CASES = ["fp32-padded-kvzap-scores", "bf16-table", "kv8-padded-folds", "kv4-bf16-gemma2-stock-sliding"]
# the kinds the cases above must hold, so that a change to what a file holds cannot empty the test
FLOAT_KINDS = (
    ".store.keys",
    ".store.values",
    ".store.keys.scale",
    ".store.keys.zero",
    ".store.values.scale",
    ".store.values.zero",
    ".store.scores",
    ".suffix_keys",
    ".suffix_values",
    ".queries",
    ".keys",  # a stock layer's
    "prefill_scores.",
    "scorer.kvzap.",
    "allocator.evict_ratio",
)


def _value_case(name: str):
    """A model, a cache it filled (a prompt and 4 generated tokens), the tokens so far and their mask."""
    mask = None
    if name == "fp32-padded-kvzap-scores":  # store scores (folds reuse them), prefill scores, queries
        model = tiny_model("llama", "sdpa")
        kvzap = scorer_for("kvzap", model)
        cache = LUKVCache(
            None, kvzap, "global", window=4, decode_max_tokens=20, fold_interval=4, keep_scores=True
        )
        ids, mask = left_padded((40, 31))
    elif name == "bf16-table":
        model = tiny_model("llama", "sdpa", dtype=torch.bfloat16)
        table = np.array([[0.3, 0.6], [0.5, 0.7]])
        cache = LUKVCache(None, "keydiff", allocator="profile", evict_ratio=table)
        ids = prompt(1, 24)
    elif name == "kv8-padded-folds":
        model = tiny_model("llama", "sdpa")
        cache = LUKVCache(None, "keydiff", decode_max_tokens=20, fold_interval=4, kv_bits=8)
        ids, mask = left_padded((40, 31))
    else:  # layers 0 and 2 are transformers' sliding layers (the prompt is beyond their window)
        model = tiny_model("gemma2", "eager", dtype=torch.bfloat16)
        cache = LUKVCache(0.5, "keydiff", kv_bits=4, sliding="keep", config=model.config)
        ids = prompt(1, 24)
    seq, _ = greedy_with_logits(model, ids, cache, new_tokens=4, attention_mask=mask)
    return model, cache, seq, mask


def _is_scores(name: str) -> bool:
    """Scores may hold non-finite values (-inf: padding, NaN: a token stored without a score, a scorer's
    own): eviction ranks them, nothing decodes them."""
    return name.startswith("prefill_scores.") or name.endswith(".store.scores")


@pytest.fixture(scope="module")
def value_cases(tmp_path_factory):
    """name -> (model, saved file, tokens with a question, their mask, the float tensors' names)."""
    out = {}
    for name in VALUE_CASES:
        model, cache, seq, mask = _value_case(name)
        src = save_cache(cache, tmp_path_factory.mktemp(name) / "context.safetensors")
        floats = sorted(n for n, t in load_file(src).items() if t.is_floating_point())
        out[name] = (model, src, *with_question(seq, mask), floats)
    return out


def test_the_value_cases_hold_every_kind_of_float_tensor(value_cases):
    names = [n for case in value_cases.values() for n in case[4]]
    assert [
        kind for kind in FLOAT_KINDS if not any(n.endswith(kind) or n.startswith(kind) for n in names)
    ] == []


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("name", VALUE_CASES)
def test_a_non_finite_value_in_any_float_tensor_is_refused_or_decodes_finite(
    name, value, value_cases, tmp_path
):
    """NaN, +inf or -inf in one value of each float tensor (its last, a real token's in every row), the file
    re-signed: a SavedContextError naming the tensor, never a raw error nor NaN logits. Only scores load
    (they may hold such values: eviction ranks them), and the cache then decodes finite logits."""
    model, src, ids, mask, floats = value_cases[name]
    with safe_open(str(src), "pt") as f:
        meta = json.loads(f.metadata()[save_load.METADATA_KEY])
    failures = []
    for tensor in floats:
        tensors = load_file(src)
        tensors[tensor].view(-1)[-1] = value
        bad = _resigned(src, tmp_path / "edited.safetensors", meta, tensors)
        try:
            loaded = load_cache(bad, model)
        except SavedContextError as err:
            if err.field != tensor or tensor not in str(err) or "Save the context again" not in str(err):
                failures.append(f"{tensor}: refused without naming it or what to do: {err}")
            elif _is_scores(tensor):
                failures.append(f"{tensor}: scores refused, though the library writes non-finite ones: {err}")
            continue
        except Exception as err:  # noqa: BLE001 - the property: nothing but the library's errors
            failures.append(f"{tensor}: raw {type(err).__name__} at load: {err}")
            continue
        if not _is_scores(tensor):
            failures.append(f"{tensor}: loaded")
        try:
            _, got = greedy_with_logits(model, ids, loaded, new_tokens=5, attention_mask=mask)
        except Exception as err:  # noqa: BLE001
            failures.append(f"{tensor}: loaded, then {type(err).__name__} at decode: {err}")
            continue
        if not bool(torch.isfinite(got).all()):
            failures.append(f"{tensor}: loaded and decodes non-finite logits")
    assert not failures, "\n".join(failures)
