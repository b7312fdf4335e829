"""Saved compressed contexts: save_cache writes a filled LUKVCache to one safetensors file, load_cache reads it
back, and generation from the loaded cache is the saved cache's, token for token (logits within 1e-6), in
this process or a fresh one; every kind of bad file, other model or unsavable cache is a typed error."""

from __future__ import annotations

import copy
import inspect
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import greedy_with_logits, scorer_for, tiny_model, with_question
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lukv_cache import LUKVCache, SavedContextError, SavedContextMismatchError, load_cache, save_cache
from lukv_cache.cache import save_load
from lukv_cache.cache.storage.layer import LUKVLayer
from lukv_cache.scorers.kvzip import RepeatPrompt
from lukv_cache.testing import flat_profile, left_padded, prompt

HERE = Path(__file__).resolve().parent
REPEAT = RepeatPrompt((5, 6), (7,), (8,))

# name -> (arch, attention, batch, prompt length, cache kwargs); kvzap and the bounded caches fold after load
CASES = {
    "llama-keydiff": ("llama", "sdpa", 1, 24, dict(scorer="keydiff")),
    "llama-padded-snapkv": ("llama", "sdpa", 2, 40, dict(scorer="snapkv")),
    "llama-padded-kvzap-folds": (
        "llama",
        "sdpa",
        2,
        40,
        dict(scorer="kvzap", decode_max_tokens=20, fold_interval=4, window=4, allocator="global"),
    ),
    "llama-keydiff-folds": (
        "llama",
        "sdpa",
        1,
        30,
        dict(scorer="keydiff", decode_max_tokens=14, fold_interval=4),
    ),
    "llama-kvzip": ("llama", "sdpa", 1, 48, dict(scorer="kvzip", allocator="global", ratio=0.8)),
    "llama-profile-table": (
        "llama",
        "sdpa",
        1,
        24,
        dict(allocator="profile", evict_ratio=np.array([[0.3, 0.6], [0.5, 0.7]]), keep_scores=True),
    ),
    "gemma2-stock-sliding": ("gemma2", "eager", 1, 24, dict(scorer="keydiff")),
    "gemma2-padded-compressed-sliding-folds": (
        "gemma2",
        "eager",
        2,
        8,
        dict(scorer="keydiff", decode_max_tokens=12, fold_interval=4),
    ),
    # a quantized store (kv_bits): its rows are a dataclass of codes, scales and zeros, saved field by field
    "llama-padded-kv8-folds": (
        "llama",
        "sdpa",
        2,
        40,
        dict(scorer="keydiff", decode_max_tokens=20, fold_interval=4, kv_bits=8),
    ),
    "gemma2-kv4": ("gemma2", "eager", 1, 24, dict(scorer="keydiff", kv_bits=4)),
}
QUANTIZES = "kv_bits" in inspect.signature(LUKVCache.__init__).parameters


def _settled(layer) -> int:
    """A layer's length at its last eviction or refold (its eviction record's), 0 for a stock layer."""
    return layer.eviction.settled_length if isinstance(layer, LUKVLayer) else 0


def _case(name: str):
    quantized = "kv_bits" in CASES[name][4]
    return pytest.param(
        name, marks=pytest.mark.skipif(quantized and not QUANTIZES, reason="this LUKVCache has no kv_bits")
    )


def _inputs(batch: int, length: int):
    if batch == 1:
        return prompt(1, length), None
    return left_padded((length, length - 9))


def _filled(name: str):
    """The model, a cache filled by its prompt and 4 generated tokens, the tokens so far and their mask."""
    arch, attn, batch, length, kwargs = CASES[name]
    model = tiny_model(arch, attn)
    kwargs = dict(kwargs)
    kwargs["scorer"] = scorer_for(kwargs.get("scorer", "keydiff"), model)
    ratio = kwargs.pop("ratio", None if "evict_ratio" in kwargs or "decode_max_tokens" in kwargs else 0.5)
    cache = LUKVCache(ratio, config=model.config, **kwargs)
    ids, mask = _inputs(batch, length)
    if cache.scorer.reconstruction is not None:
        cache.prefill(model, ids, mask, repeat_prompt=REPEAT)
        seq = ids
    else:
        seq, _ = greedy_with_logits(model, ids, cache, new_tokens=4, attention_mask=mask)
    return model, cache, seq, mask


@pytest.mark.parametrize("name", [_case(name) for name in CASES])
def test_a_loaded_cache_continues_as_the_saved_one(name, tmp_path):
    model, cache, seq, mask = _filled(name)
    path = save_cache(cache, tmp_path / "context.safetensors")
    loaded = load_cache(path, model)
    assert [type(layer) for layer in loaded.layers] == [type(layer) for layer in cache.layers]
    assert torch.equal(loaded.stored_tokens(), cache.stored_tokens())
    assert loaded.memory_bytes() == cache.memory_bytes()
    settled = [_settled(layer) for layer in loaded.layers]
    ids, full_mask = with_question(seq, mask)
    want, want_logits = greedy_with_logits(model, ids, cache, new_tokens=12, attention_mask=full_mask)
    got, got_logits = greedy_with_logits(model, ids, loaded, new_tokens=12, attention_mask=full_mask)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=1e-6)
    assert torch.equal(loaded.stored_tokens(), cache.stored_tokens())
    if cache.decode_max_tokens is not None:  # eviction at fold time ran after the load
        after = [_settled(layer) for layer in loaded.layers]
        assert any(a > b for a, b in zip(after, settled))
    if cache.prefill_scores is not None:
        assert loaded.prefill_scores.keys() == cache.prefill_scores.keys()
    if cache.kv_bits if QUANTIZES else False:
        stores = [layer.store for layer in loaded.layers if getattr(layer, "store", None) is not None]
        assert stores and all(store.kv_bits == cache.kv_bits for store in stores)


_CHILD = """
import sys
sys.path.insert(0, {here!r})
import torch
from lukv_cache.testing import prompt
from helpers import greedy_with_logits, tiny_model
from safetensors.torch import save_file
from lukv_cache import load_cache
torch.set_num_threads(1)
model = tiny_model("llama", "sdpa")
ids = torch.cat([prompt(1, 30), prompt(1, 3, seed=9)], 1)
seq, logits = greedy_with_logits(model, ids, load_cache({path!r}, model), new_tokens=12)
save_file({{"seq": seq, "logits": logits.contiguous()}}, {out!r})
"""


def test_a_fresh_process_continues_as_the_saved_cache(tmp_path):
    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(None, "keydiff", decode_max_tokens=14, fold_interval=4, config=model.config)
    with torch.no_grad():
        model(prompt(1, 30), past_key_values=cache, use_cache=True)
    path = save_cache(cache, tmp_path / "context.safetensors")
    out = tmp_path / "child.safetensors"
    code = _CHILD.format(here=str(HERE.parent), path=str(path), out=str(out))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parents[1])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
    child = load_file(out)
    ids = torch.cat([prompt(1, 30), prompt(1, 3, seed=9)], 1)
    want, want_logits = greedy_with_logits(model, ids, cache, new_tokens=12)
    assert torch.equal(child["seq"], want)
    torch.testing.assert_close(child["logits"], want_logits, rtol=0, atol=1e-6)


def test_the_file_holds_the_documented_metadata_and_only_the_used_suffix(tmp_path):
    model, cache, _, _ = _filled("llama-padded-kvzap-folds")
    path = save_cache(cache, tmp_path / "context.safetensors")
    with safe_open(str(path), "pt") as f:
        metadata, names = f.metadata(), set(f.keys())
    assert metadata["format"] == save_load.FORMAT_NAME and len(metadata[save_load.CHECKSUM_KEY]) == 64
    meta = json.loads(metadata[save_load.METADATA_KEY])
    assert meta["format_version"] == save_load.FORMAT_VERSION
    assert set(meta["model"]["fields"]) == {
        "model_type",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "layer_types",
        "sliding_window",
        "dtype",
    }
    options = meta["options"]
    assert options["scorer"]["name"] == "kvzap" and options["decode_max_tokens"] == 20
    assert options["allocator"] == "global" and options["kv_bits"] is None
    layer = cache.layers[0]
    assert {
        "layers.0.store.keys",
        "layers.0.store.offsets",
        "layers.0.suffix_keys",
        "scorer.kvzap.weight",
    } <= names
    assert "layers.0.store.offsets_list" not in names
    with safe_open(str(path), "pt") as f:
        assert f.get_slice("layers.0.suffix_keys").get_shape()[2] == layer.suffix_length
    assert meta["layers"][0]["suffix_capacity"] == layer.suffix_buffers[0].shape[-2] >= layer.suffix_length


# ------------------------------------------------------------------------------------------ bad files
@pytest.fixture(scope="module")
def saved_file(tmp_path_factory):
    model, cache, _, _ = _filled("llama-keydiff")
    return save_cache(cache, tmp_path_factory.mktemp("saved") / "context.safetensors")


def _rewrite(src: Path, dst: Path, meta_edit=None, tensor_edit=None) -> Path:
    """A copy of ``src`` with its metadata or tensors edited and a valid checksum (only the checks after
    the checksum can refuse it)."""
    tensors = load_file(src)
    with safe_open(str(src), "pt") as f:
        metadata = dict(f.metadata())
    meta = json.loads(metadata[save_load.METADATA_KEY])
    if meta_edit:
        meta_edit(meta)
    if tensor_edit:
        tensor_edit(tensors)
    text = json.dumps(meta, sort_keys=True)
    metadata[save_load.METADATA_KEY], metadata[save_load.CHECKSUM_KEY] = (
        text,
        save_load.checksum(text, tensors),
    )
    save_file(tensors, dst, metadata=metadata)
    return dst


def _bytes_edit(edit):
    def write(src: Path, dst: Path) -> Path:
        dst.write_bytes(edit(src.read_bytes()))
        return dst

    return write


def _flip_last(data: bytes) -> bytes:
    return data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:]


def _foreign(src: Path, dst: Path) -> Path:
    save_file({"x": torch.zeros(3)}, dst, metadata={"format": "something else"})
    return dst


def _edit_meta(meta_edit):
    return lambda src, dst: _rewrite(src, dst, meta_edit=meta_edit)


def _edit_tensors(tensor_edit):
    return lambda src, dst: _rewrite(src, dst, tensor_edit=tensor_edit)


def _set(key, value):
    def edit(tensors):
        tensors[key] = value(tensors[key]).contiguous()

    return edit


BAD_FILES = {
    "empty": (_bytes_edit(lambda data: b""), "not a safetensors file"),
    "random bytes": (_bytes_edit(lambda data: os.urandom(64)), "not a safetensors file"),
    "json text": (_bytes_edit(lambda data: b'{"a": 1}' * 4), "not a safetensors file"),
    "another safetensors file": (_foreign, "not a saved LUKV context"),
    "truncated": (_bytes_edit(lambda data: data[:-100]), "truncated"),
    "truncated in the header": (_bytes_edit(lambda data: data[:40]), "truncated inside its header"),
    "bytes appended": (_bytes_edit(lambda data: data + b"\0" * 8), "bytes after its last tensor"),
    "a tensor byte changed": (_bytes_edit(_flip_last), "checksum mismatch"),
    "metadata changed": (
        _bytes_edit(lambda data: data.replace(b'\\"sink\\":4', b'\\"sink\\":5', 1)),
        "checksum mismatch",
    ),
    "another format version": (_edit_meta(lambda m: m.update(format_version=3)), "format version 3"),
    "offsets not ending at the store's length": (
        _edit_tensors(_set("layers.0.store.offsets", lambda t: torch.cat([t[:-1], t[-1:] - 1]))),
        "offsets do not run from 0",
    ),
    "positions beyond the logical length": (
        _edit_tensors(_set("layers.1.store.positions", lambda t: t + 1000)),
        "positions are not ascending",
    ),
    "positions out of order": (
        _edit_tensors(_set("layers.1.store.positions", lambda t: t.flip(0))),
        "positions are not ascending",
    ),
    "a suffix of another shape": (
        _edit_tensors(_set("layers.0.suffix_keys", lambda t: t[:, :, :-1])),
        "does not fit the metadata",
    ),
    "a suffix of another dtype": (
        _edit_tensors(_set("layers.0.suffix_values", lambda t: t.double())),
        "does not fit the metadata",
    ),
    "a length out of range": (
        _edit_meta(lambda m: m["layers"][0]["attrs"].update(cumulative_length=-3)),
        "out of range",
    ),
    "an unknown layer attribute": (
        _edit_meta(lambda m: m["layers"][0]["attrs"].update(surprise=1)),
        "does not know",
    ),
    "a tensor the metadata does not name": (
        _edit_tensors(lambda tensors: tensors.update(extra=torch.zeros(2))),
        "does not name",
    ),
    "a class outside lukv_cache's cache": (
        _edit_meta(
            lambda m: m["layers"][0]["store"]["fields"].update(
                keys={"dataclass": "os.PathLike", "fields": {}}
            )
        ),
        "which this lukv_cache's format does not have",
    ),
    "a store field this version lacks": (
        _edit_meta(lambda m: m["layers"][0]["store"]["fields"].update(codebook=3)),
        "RaggedStore does not have",
    ),
}


@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_a_bad_file_is_refused_with_a_typed_error(kind, saved_file, tmp_path):
    make, message = BAD_FILES[kind]
    bad = make(saved_file, tmp_path / "bad.safetensors")
    with pytest.raises(SavedContextError, match=message) as err:
        load_cache(bad, tiny_model("llama", "sdpa"))
    assert err.value.path == str(bad)
    assert not isinstance(err.value, SavedContextMismatchError)


@pytest.mark.parametrize("name", ["llama-keydiff", "llama-kvzip", "llama-padded-kvzap-folds"])
@pytest.mark.parametrize("window", [-1, "4", 2.5, True, None])
def test_a_scorer_window_that_is_not_a_count_is_refused(name, window, tmp_path):
    # kvzip's and kvzap's scorers are rebuilt from the file with its window: it must be checked first
    model, cache, _, _ = _filled(name)
    good = save_cache(cache, tmp_path / "good.safetensors")
    bad = _rewrite(
        good, tmp_path / "bad.safetensors", meta_edit=lambda m: m["options"]["scorer"].update(window=window)
    )
    with pytest.raises(SavedContextError, match="not a count of tokens") as err:
        load_cache(bad, model)
    assert err.value.field == "options.scorer.window"


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(SavedContextError, match="no such file"):
        load_cache(tmp_path / "nothing.safetensors", tiny_model("llama", "sdpa"))


def _renamed(model, name):
    other = copy.deepcopy(model)
    other.config._name_or_path = name
    return other


@pytest.mark.parametrize(
    "other,field",
    [
        (lambda: tiny_model("llama", "sdpa", num_hidden_layers=3), "num_hidden_layers"),
        (lambda: tiny_model("llama", "sdpa", num_key_value_heads=4), "num_key_value_heads"),
        (lambda: tiny_model("llama", "sdpa", dtype=torch.bfloat16), "dtype"),
        (lambda: tiny_model("gemma2", "eager"), "model_type"),
        (lambda: _renamed(tiny_model("llama", "sdpa"), "org/another-model"), "model_id"),
    ],
)
def test_another_model_is_refused_naming_the_field_that_differs(other, field, saved_file):
    with pytest.raises(SavedContextMismatchError, match=field) as err:
        load_cache(saved_file, other())
    assert err.value.field == field and err.value.saved != err.value.got


def test_the_same_model_under_another_name_loads_when_allowed(saved_file):
    loaded = load_cache(
        saved_file, _renamed(tiny_model("llama", "sdpa"), "org/a-copy"), allow_other_model_id=True
    )
    assert loaded.get_seq_length() == 27  # 24 prompt tokens and 3 of the 4 generated


# ------------------------------------------------------------------------------------------ unsavable caches
def test_an_empty_cache_is_refused(tmp_path):
    with pytest.raises(SavedContextError, match="empty"):
        save_cache(LUKVCache(0.5), tmp_path / "x.safetensors")
    with pytest.raises(SavedContextError, match="LUKVCache"):
        save_cache(object(), tmp_path / "x.safetensors")
    assert not list(tmp_path.iterdir())


def test_a_cache_inside_a_forward_or_a_holding_block_is_refused(tmp_path):
    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(0.5, allocator="global", config=model.config)  # layers wait for the whole prefill
    seen = []

    def save_now(module, args):
        with pytest.raises(SavedContextError, match="wait for the end of the prefill") as err:
            save_cache(cache, tmp_path / "x.safetensors")
        seen.append(err.value)

    hook = model.model.layers[1].register_forward_pre_hook(save_now)
    try:
        with torch.no_grad():
            model(prompt(1, 24), past_key_values=cache, use_cache=True)
    finally:
        hook.remove()
    assert seen
    held = LUKVCache(0.5, config=model.config)
    with held.holding(), torch.no_grad():
        model(prompt(1, 24), past_key_values=held, use_cache=True)
        with pytest.raises(SavedContextError, match="holding"):
            save_cache(held, tmp_path / "x.safetensors")
    assert not list(tmp_path.iterdir())


def test_a_failed_write_leaves_no_file_behind_and_keeps_the_old_one(tmp_path, monkeypatch):
    model, cache, _, _ = _filled("llama-keydiff")
    path = save_cache(cache, tmp_path / "context.safetensors")
    before = path.read_bytes()

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(save_load.os, "replace", fail)
    with pytest.raises(SavedContextError, match="No space left"):
        save_cache(cache, path)
    monkeypatch.undo()

    import safetensors.torch

    def interrupted(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_cache(cache, path)
    assert [p.name for p in tmp_path.iterdir()] == ["context.safetensors"]
    assert path.read_bytes() == before
    with pytest.raises(SavedContextError, match="folder"):
        save_cache(cache, tmp_path)


def test_the_long_context_example_answers_from_the_saved_context(monkeypatch, capsys, tmp_path):
    import runpy

    examples = HERE.parents[1] / "examples"
    monkeypatch.syspath_prepend(str(examples))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(
        sys, "argv", ["long_context.py", "--smoke", "--save", str(tmp_path / "ctx.safetensors")]
    )
    runpy.run_path(str(examples / "long_context.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "saved:" in out and "loaded" in out and out.count("A: ") == 3
    assert (tmp_path / "ctx.safetensors").is_file()
    assert isinstance(load_cache(tmp_path / "ctx.safetensors", _tiny_model()).layers[0], LUKVLayer)


def _tiny_model():
    sys.path.insert(0, str(HERE.parents[1] / "examples"))
    import _tiny

    return _tiny.load()[0]


@pytest.mark.parametrize("allocator", ["global", "profile"])
def test_a_cache_from_a_kvzap_profile_carries_the_profile_once(allocator, tmp_path):
    model = tiny_model("llama", "sdpa")
    surrogate = scorer_for("kvzap", model).params["surrogate"]
    profile = flat_profile(
        2, 2, grid=[0.25, 0.5, 0.75], scorer="kvzap", head_dim=16, window=8, surrogate=surrogate
    )
    source = profile.save(tmp_path / "kvzap.safetensors")
    # no config=: the layout is learned from the model at the first forward
    cache = LUKVCache.from_pretrained(
        source, ratio=0.5, allocator=allocator, decode_max_tokens=24, fold_interval=4
    )
    ids = prompt(1, 40)
    seq, _ = greedy_with_logits(model, ids, cache, new_tokens=4)
    path = save_cache(cache, tmp_path / "context.safetensors")
    with safe_open(str(path), "pt") as f:
        names = set(f.keys())
    assert "profile.profile" in names and not any(n.startswith("scorer.") for n in names)
    loaded = load_cache(path, model)
    assert loaded.profile.model_id == "org/tiny" and loaded.allocator_name == allocator
    assert loaded.scorer.params["surrogate"] is loaded.profile.surrogate
    if allocator == "profile":
        assert loaded.allocator.params["profile"] is loaded.profile
    ids, _ = with_question(seq, None)
    want, want_logits = greedy_with_logits(model, ids, cache, new_tokens=12)
    got, got_logits = greedy_with_logits(model, ids, loaded, new_tokens=12)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=1e-6)


def test_cache_save_and_load_are_the_module_functions(tmp_path):
    model = tiny_model("llama")
    ids = prompt(1, 80, seed=11)
    cache = LUKVCache(0.5, "keydiff", kv_bits=4)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    path = cache.save(tmp_path / "c.safetensors")
    loaded = LUKVCache.load(path, model)
    assert loaded.kv_bits == 4 and loaded.layers[0].store.kv_bits == 4
    full = torch.cat([ids, prompt(1, 1, seed=12)], dim=1)  # generate continues after the cached prompt
    _, want = greedy_with_logits(model, full, cache, new_tokens=4)
    _, got = greedy_with_logits(model, full, loaded, new_tokens=4)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_a_subclass_loads_as_itself_and_load_takes_only_load_caches_keywords(tmp_path):
    class MyCache(LUKVCache):
        pass

    model = tiny_model("llama")
    cache = MyCache(0.5, "keydiff")
    with torch.no_grad():
        model(prompt(1, 40, seed=3), past_key_values=cache)
    path = cache.save(tmp_path / "c.safetensors")
    loaded = MyCache.load(path, model, allow_other_model_id=True)
    assert type(loaded) is MyCache and torch.equal(loaded.stored_tokens(), cache.stored_tokens())
    with pytest.raises(TypeError, match="ratio"):
        MyCache.load(path, model, ratio=0.5)


@pytest.mark.parametrize("sliding", ["keep", "compress"])
def test_a_model_whose_layers_have_different_kv_heads_saves_and_loads(tmp_path, sliding):
    # MiMo-V2-Flash's sliding layers project to twice the KV heads of its global layers; the file was
    # written but refused at load ("layer 1's keys do not fit the model's KV heads"). Compressed too, its
    # sliding layers are allocated apart (one allocator call stacks the scores of layers with equal heads)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "families"))
    import families

    built = families.build_model("mimo_v2_flash", "eager")
    model = built[0] if isinstance(built, tuple) else built
    ids, mask = families.inputs()
    cache = LUKVCache(0.5, allocator="global", sliding=sliding)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seq, _ = greedy_with_logits(model, ids, cache, new_tokens=2, attention_mask=mask)
    warned = any("leaves some layers of this model alone" in str(w.message) for w in caught)
    assert warned == (sliding == "keep")
    assert cache.layers[0].store.num_heads == 2
    if sliding == "keep":
        assert cache.layers[1].keys.shape[1] == 4  # transformers' sliding layer
    else:
        assert cache.layers[1].store.num_heads == 4
    loaded = load_cache(save_cache(cache, tmp_path / "context.safetensors"), model)
    full_mask = torch.cat(
        [mask, torch.ones(mask.shape[0], seq.shape[1] - mask.shape[1], dtype=mask.dtype)], 1
    )
    want, want_logits = greedy_with_logits(model, seq, cache, new_tokens=4, attention_mask=full_mask)
    got, got_logits = greedy_with_logits(model, seq, loaded, new_tokens=4, attention_mask=full_mask)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=1e-6)
