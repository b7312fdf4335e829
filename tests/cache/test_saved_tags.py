"""The saved format names the classes it holds by tags of its own (``saved_layers.DATACLASS_TAGS``), never by
the module the code lives in: moving a module changes no file; a file of format version 1 (which named its one
class, a quantized store's rows, by module path) still loads; a tag outside the table is refused."""

from __future__ import annotations

import json
import time

import pytest
import torch
from helpers import greedy_with_logits, with_question
from safetensors import safe_open
from test_saved_contexts import _filled, _rewrite

from lukv_cache import SavedContextError, load_cache, save_cache
from lukv_cache.cache import save_load
from lukv_cache.cache.saved import layers as saved_layers
from lukv_cache.cache.storage.quant import PackedRows

QUANTIZED = "llama-padded-kv8-folds"  # its stores' keys and values are PackedRows


def _classes(path) -> set[str]:
    """Every class name a saved file's metadata holds."""
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()[save_load.METADATA_KEY])
    found: set[str] = set()

    def walk(value):
        if isinstance(value, dict):
            if "dataclass" in value:
                found.add(value["dataclass"])
            for each in value.values():
                walk(each)
        elif isinstance(value, list):
            for each in value:
                walk(each)

    walk(meta)
    return found


def test_a_file_names_its_classes_by_the_formats_tags(tmp_path):
    _, cache, _, _ = _filled(QUANTIZED)
    path = save_cache(cache, tmp_path / "context.safetensors")
    assert _classes(path) == {"packed_rows"}
    assert saved_layers.DATACLASS_TAGS == {"packed_rows": PackedRows}


def _content(path) -> tuple[dict, bytes]:
    """A safetensors file's header (its metadata strings and tensor entries) and its data bytes: the file
    itself, but for the order safetensors writes the metadata's keys in (not fixed from one save to the
    next, whatever is saved)."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def test_moving_a_module_does_not_change_a_saved_files_bytes(tmp_path, monkeypatch):
    _, cache, _, _ = _filled(QUANTIZED)
    monkeypatch.setattr(time, "gmtime", lambda *args: time.struct_time((2026, 12, 5, 0, 0, 0, 5, 339, 0)))
    before = _content(save_cache(cache, tmp_path / "before.safetensors"))
    # PackedRows moved to another module (as a reorganisation of lukv_cache/cache/ would move it)
    monkeypatch.setattr(PackedRows, "__module__", "lukv_cache.cache.storage.quantized")
    after = _content(save_cache(cache, tmp_path / "after.safetensors"))
    assert after == before


def test_a_format_1_file_naming_its_class_by_module_path_still_loads(tmp_path):
    model, cache, seq, mask = _filled(QUANTIZED)
    path = save_cache(cache, tmp_path / "context.safetensors")

    def as_version_1(meta):
        meta["format_version"] = 1
        text = json.dumps(meta).replace('"packed_rows"', '"lukv_cache.cache.quant.PackedRows"')
        meta.clear()
        meta.update(json.loads(text))

    old = _rewrite(path, tmp_path / "version1.safetensors", meta_edit=as_version_1)
    assert _classes(old) == {"lukv_cache.cache.quant.PackedRows"}
    loaded = load_cache(old, model)
    assert torch.equal(loaded.stored_tokens(), cache.stored_tokens())
    assert loaded.memory_bytes() == cache.memory_bytes()
    ids, full_mask = with_question(seq, mask)
    want, _ = greedy_with_logits(model, ids, cache, new_tokens=6, attention_mask=full_mask)
    got, _ = greedy_with_logits(model, ids, loaded, new_tokens=6, attention_mask=full_mask)
    assert torch.equal(got, want)
    # and saved again, it is written in the current form
    again = save_cache(loaded, tmp_path / "again.safetensors")
    assert _classes(again) == {"packed_rows"}


@pytest.mark.parametrize(
    "name",
    [
        "lukv_cache.cache.storage.quant.RaggedStore",  # a real class under the old prefix, not in the table
        "lukv_cache.cache.storage.PackedRows",  # the class at a path no version wrote
        "PackedRows",
        "subprocess.Popen",
        "",
    ],
)
def test_a_class_not_in_the_table_is_refused(tmp_path, name):
    model, cache, _, _ = _filled(QUANTIZED)
    path = save_cache(cache, tmp_path / "context.safetensors")

    def rename(meta):
        text = json.dumps(meta).replace('"packed_rows"', json.dumps(name))
        meta.clear()
        meta.update(json.loads(text))

    bad = _rewrite(path, tmp_path / "bad.safetensors", meta_edit=rename)
    with pytest.raises(SavedContextError, match="format does not have"):
        load_cache(bad, model)
