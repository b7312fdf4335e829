"""Saved contexts that must not go silently wrong (issue 42): a cache half-filled by an interrupted forward
is neither saved nor loaded, kept prefill scores follow the batch operations' rows into the file, a context
refuses a model with the same shapes but other weights, and a bad path or device is a typed error."""

from __future__ import annotations

import copy
import json
import os
import stat

import pytest
import torch
from helpers import tiny_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lukv_cache import LUKVCache, SavedContextError, SavedContextMismatchError, load_cache, save_cache
from lukv_cache.cache import save_load
from lukv_cache.cache.saved import file as saved_file
from lukv_cache.errors import ConfigurationError
from lukv_cache.testing import prompt


class _Stop(Exception):
    pass


def _half_filled(model, stop_at: int) -> LUKVCache:
    """A cache whose forward raised in decoder layer ``stop_at``: the layers before it hold the prompt,
    the others nothing."""
    cache = LUKVCache(0.5, "keydiff", config=model.config)

    def stop(module, args):
        raise _Stop

    hook = model.model.layers[stop_at].register_forward_pre_hook(stop)
    try:
        with torch.no_grad(), pytest.raises(_Stop):
            model(prompt(1, 40), past_key_values=cache, use_cache=True)
    finally:
        hook.remove()
    assert [layer.get_seq_length() for layer in cache.layers] == [40] * stop_at + [0] * (4 - stop_at)
    return cache


def test_a_cache_a_forward_left_half_filled_is_not_saved(tmp_path):
    cache = _half_filled(tiny_model("llama", "sdpa", num_hidden_layers=4), stop_at=2)
    with pytest.raises(
        SavedContextError, match=r"layers 0-1: 40 tokens, layers 2-3: 0 tokens.*Re-run the prompt"
    ):
        save_cache(cache, tmp_path / "context.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_a_file_of_a_half_filled_cache_is_not_loaded(tmp_path, monkeypatch):
    model = tiny_model("llama", "sdpa", num_hidden_layers=4)
    cache = _half_filled(model, stop_at=3)
    # written as lukv_cache did before save refused such a cache: only the empty layer tells
    monkeypatch.setattr(saved_file, "check_savable", lambda cache, path: None)
    path = save_cache(cache, tmp_path / "context.safetensors")
    monkeypatch.undo()
    with pytest.raises(
        SavedContextError, match=r"layers 0-2: 40 tokens, layer 3: 0 tokens.*Re-run the prompt"
    ):
        load_cache(path, model)


# ---------------------------------------------------------------------------------- kept scores, batch rows
BATCH_OPS = {
    "reorder_cache": (lambda cache: cache.reorder_cache(torch.tensor([2, 0, 1])), [2, 0, 1]),
    "batch_repeat_interleave": (lambda cache: cache.batch_repeat_interleave(2), [0, 0, 1, 1, 2, 2]),
    "batch_select_indices": (lambda cache: cache.batch_select_indices([0, 2]), [0, 2]),
}


def _scored():
    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(0.5, "keydiff", keep_scores=True, config=model.config)
    with torch.no_grad():
        model(torch.cat([prompt(1, 40, seed=s) for s in range(3)]), past_key_values=cache, use_cache=True)
    return model, cache


@pytest.mark.parametrize("op", list(BATCH_OPS))
def test_a_batch_operation_moves_the_kept_prefill_scores_with_their_rows(op):
    _, cache = _scored()
    before = {idx: scores.clone() for idx, scores in cache.prefill_scores.items()}
    apply, rows = BATCH_OPS[op]
    apply(cache)
    assert cache.prefill_scores.keys() == before.keys()
    for idx, scores in cache.prefill_scores.items():
        assert torch.equal(scores, before[idx][rows])


@pytest.mark.parametrize("op", list(BATCH_OPS))
def test_a_cache_with_kept_scores_saves_and_loads_after_a_batch_operation(op, tmp_path):
    model, cache = _scored()
    BATCH_OPS[op][0](cache)
    loaded = load_cache(save_cache(cache, tmp_path / "context.safetensors"), model)
    assert torch.equal(loaded.stored_tokens(), cache.stored_tokens())
    for idx, scores in cache.prefill_scores.items():
        assert torch.equal(loaded.prefill_scores[idx], scores)


# ---------------------------------------------------------------------------------------------- weights
def _filled_file(model, tmp_path):
    cache = LUKVCache(0.5, "keydiff", config=model.config)
    with torch.no_grad():
        model(prompt(1, 40), past_key_values=cache, use_cache=True)
    return save_cache(cache, tmp_path / "context.safetensors")


def _other_checkpoint(model):
    """The same architecture, id and shapes, other weights (as two checkpoints of one fine-tune)."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1e-3 * torch.randn_like(p))
    return other


@pytest.mark.parametrize("allow_other_model_id", [False, True])
def test_a_context_refuses_a_model_with_the_same_shapes_and_other_weights(allow_other_model_id, tmp_path):
    model = tiny_model("llama", "sdpa")
    path = _filled_file(model, tmp_path)
    with pytest.raises(SavedContextMismatchError, match="other weights") as err:
        load_cache(path, _other_checkpoint(model), allow_other_model_id=allow_other_model_id)
    assert err.value.field == "weights" and err.value.saved != err.value.got
    load_cache(path, copy.deepcopy(model))  # the same weights in another object load


def test_a_cache_that_no_module_read_takes_the_weights_from_the_model_given_to_save(tmp_path):
    model = tiny_model("llama", "sdpa")
    loaded = load_cache(_filled_file(model, tmp_path), model)  # no forward yet: no attention module read it
    path = save_cache(loaded, tmp_path / "again.safetensors", model=model)
    with pytest.raises(SavedContextMismatchError, match="other weights"):
        load_cache(path, _other_checkpoint(model))


def test_a_file_without_a_weight_fingerprint_still_loads(tmp_path):
    # files written before the weight fingerprint have shapes and the model id only
    model = tiny_model("llama", "sdpa")
    path = _filled_file(model, tmp_path)
    tensors = load_file(path)
    with safe_open(str(path), "pt") as f:
        metadata = dict(f.metadata())
    meta = json.loads(metadata[save_load.METADATA_KEY])
    del meta["model"]["weights"]
    text = json.dumps(meta, sort_keys=True)
    metadata[save_load.METADATA_KEY], metadata[save_load.CHECKSUM_KEY] = (
        text,
        save_load.checksum(text, tensors),
    )
    save_file(tensors, tmp_path / "old.safetensors", metadata=metadata)
    loaded = load_cache(tmp_path / "old.safetensors", _other_checkpoint(model))
    assert loaded.get_seq_length() == 40


# ------------------------------------------------------------------------------------------ paths, devices
@pytest.mark.parametrize(
    "name,message",
    [
        ("a\0b.safetensors", "NUL byte"),
        ("x" * 300 + ".safetensors", "too long"),
        ("no/c.safetensors", "no' does not exist"),
    ],
)
def test_a_path_the_os_cannot_take_is_a_typed_error(name, message, tmp_path):
    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(0.5, "keydiff", config=model.config)
    with torch.no_grad():
        model(prompt(1, 40), past_key_values=cache, use_cache=True)
    with pytest.raises(SavedContextError, match=message):
        save_cache(cache, str(tmp_path) + "/" + name)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("device", ["nonsense", 3.5])
def test_a_device_load_cannot_use_is_a_typed_error(device, tmp_path):
    model = tiny_model("llama", "sdpa")
    with pytest.raises(ConfigurationError, match="not a device this process can use"):
        load_cache(_filled_file(model, tmp_path), model, device=device)


@pytest.mark.parametrize("device", ["meta", torch.device("meta")])
def test_the_meta_device_is_a_typed_error_naming_the_devices_that_work(device, tmp_path):
    """The meta device allocates (shapes without values), so it passed the device check and failed in the
    store's checks with a raw RuntimeError."""
    model = tiny_model("llama", "sdpa")
    with pytest.raises(ConfigurationError, match="not a device this process can use") as err:
        load_cache(_filled_file(model, tmp_path), model, device=device)
    assert "shapes without values" in str(err.value) and "'cpu'" in str(err.value)


# ---------------------------------------------------------------------------------------- non-finite values
@pytest.mark.parametrize("kv_bits", [None, 8])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_cache_holding_non_finite_keys_is_not_saved(kv_bits, value, tmp_path):
    """What load refuses is not written: keys or scales that are not finite (a float16 overflow) are a
    SavedContextError naming the tensor, and no file is left."""
    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(0.5, "keydiff", kv_bits=kv_bits, config=model.config)
    with torch.no_grad():
        model(prompt(1, 40), past_key_values=cache, use_cache=True)
    store = cache.layers[1].store
    target = store.keys if kv_bits is None else store.keys.scale
    target.view(-1)[0] = value
    name = "layers.1.store.keys" if kv_bits is None else "layers.1.store.keys.scale"
    with pytest.raises(SavedContextError, match="float16 overflow") as err:
        save_cache(cache, tmp_path / "context.safetensors")
    assert err.value.field == name and name in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_kept_prefill_scores_with_padding_at_minus_inf_save_and_load(tmp_path):
    """Scores are the one kind of tensor that may hold non-finite values: a padded row's are -inf."""
    from lukv_cache.testing import left_padded

    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(0.5, "keydiff", keep_scores=True, config=model.config)
    ids, mask = left_padded((40, 31))
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert bool(cache.prefill_scores[0].isneginf().any())
    loaded = load_cache(save_cache(cache, tmp_path / "context.safetensors"), model)
    for idx, scores in cache.prefill_scores.items():
        assert torch.equal(loaded.prefill_scores[idx], scores)


# ---------------------------------------------------------------------------------------------- file mode
@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002], ids=["022", "077", "002"])
def test_a_saved_context_gets_the_mode_open_gives_under_the_umask_as_a_profile_does(umask, tmp_path):
    """0o666 less the umask, as open() and profiles: safetensors wrote its own 0600 file, renamed over the
    temp file, so contexts came out 0600 whatever the umask. A file already at the path is replaced."""
    from lukv_cache.profiles.files import atomic_write

    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(0.5, "keydiff", config=model.config)
    with torch.no_grad():
        model(prompt(1, 40), past_key_values=cache, use_cache=True)
    old = tmp_path / "old.safetensors"
    old.write_bytes(b"")
    old.chmod(0o600)
    before = os.umask(umask)
    try:
        for path in (tmp_path / "context.safetensors", old):
            save_cache(cache, path)
        atomic_write(tmp_path / "profile.safetensors", b"profile")
        with open(tmp_path / "plain", "w"):
            pass
    finally:
        os.umask(before)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == dict.fromkeys(
        ("context.safetensors", "old.safetensors", "profile.safetensors", "plain"), 0o666 & ~umask
    )
    assert load_cache(old, model).get_seq_length() == 40
