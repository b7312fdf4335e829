"""The cache's options are declared once, as the fields of its policy (``LUKVCache.policy_class``): the
constructor, its signature, the read-only properties, ``from_pretrained``, saving and loading, and
docs/usage.md's table all read the fields. A subclass that adds one field gets it on every surface."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
import torch
from helpers import tiny_model
from safetensors import safe_open

from lukv_cache import LUKVCache
from lukv_cache.cache import save_load
from lukv_cache.cache.options.docs import options_args, options_table
from lukv_cache.cache.options.policy import CompressionPolicy
from lukv_cache.cache.options.spec import option, option_spec
from lukv_cache.cache.options.values import count
from lukv_cache.errors import ConfigurationError, SavedContextError
from lukv_cache.testing import flat_profile, prompt

USAGE = Path(__file__).resolve().parents[2] / "docs" / "usage.md"

# the keys a saved context writes under "options" (files written before the options were declared once
# have exactly these, so they must stay)
SAVED_KEYS = {
    "ratio",
    "memory",
    "max_bytes",
    "scorer",
    "allocator",
    "allocator_kwargs",
    "max_tokens",
    "decode_max_tokens",
    "sink",
    "window",
    "min_keep",
    "prefill_chunk_size",
    "fold_interval",
    "decode_window",
    "keep_scores",
    "kv_bits",
    "sliding",
    "split",
    "memory_floor",
    "profiles",
}


@dataclasses.dataclass(frozen=True)
class TaggedPolicy(CompressionPolicy):
    """The stock policy and one more option, declared the way every option is."""

    tag: int = option(
        3, "A test option: a positive count.", check=count(positive=True), kinds=(int,), low=1, before=3
    )


class TaggedCache(LUKVCache):
    policy_class = TaggedPolicy


def _saved_options(path: Path) -> dict:
    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()[save_load.METADATA_KEY])["options"]


def _filled(cache: LUKVCache) -> tuple[LUKVCache, object]:
    model = tiny_model("llama")
    with torch.no_grad():
        model(prompt(1, 40, seed=3), past_key_values=cache)
    return cache, model


def test_docs_usage_holds_the_table_rendered_from_the_policys_fields():
    table = options_table()
    assert table in USAGE.read_text(), f"docs/usage.md's options table is stale; paste this:\n{table}"
    assert table.count("\n| `") == len(dataclasses.fields(CompressionPolicy))


def test_every_option_has_a_one_line_doc_and_a_default_in_the_signature():
    signature = inspect.signature(LUKVCache)
    for f in dataclasses.fields(CompressionPolicy):
        doc = option_spec(f).doc
        assert doc and "\n" not in doc and doc.endswith("."), f.name
        assert signature.parameters[f.name].default == f.default, f.name
        assert getattr(LUKVCache, f.name).__doc__ == doc, f.name
    assert list(signature.parameters)[:3] == ["ratio", "scorer", "allocator"]
    assert {"config", "keep_scores", "device_mesh"} <= set(signature.parameters)
    assert inspect.signature(LUKVCache.__init__).parameters.keys() == {"self", *signature.parameters}


def test_positional_options_and_python_like_type_errors():
    cache = LUKVCache(0.8, "snapkv", "adakv", sink=2)
    assert (cache.ratio, cache.scorer.name, cache.allocator_name, cache.sink) == (0.8, "snapkv", "adakv", 2)
    with pytest.raises(TypeError, match=r"LUKVCache\(\) got an unexpected keyword argument 'tag'"):
        LUKVCache(0.5, tag=4)
    with pytest.raises(TypeError, match=r"LUKVCache\(\) multiple values for argument 'ratio'"):
        LUKVCache(0.5, ratio=0.4)
    with pytest.raises(TypeError, match="too many positional arguments"):
        LUKVCache(0.5, "keydiff", "uniform", 4)


def test_a_saved_context_writes_todays_keys(tmp_path):
    cache, _ = _filled(LUKVCache(0.5, "keydiff"))
    assert set(_saved_options(cache.save(tmp_path / "c.safetensors"))) == SAVED_KEYS


def test_a_policy_field_added_in_a_subclass_reaches_the_constructor_signature_and_property():
    assert TaggedCache(0.5).tag == 3 and TaggedCache(0.5, tag=5).tag == 5
    assert TaggedCache(0.5, tag=5).policy.ratio == 0.5  # the stock options as before
    with pytest.raises(ConfigurationError, match="tag must be a positive integer, got 0"):
        TaggedCache(0.5, tag=0)
    parameter = inspect.signature(TaggedCache).parameters["tag"]
    assert parameter.default == 3 and parameter.kind is inspect.Parameter.KEYWORD_ONLY
    assert TaggedCache.tag.__doc__ == "A test option: a positive count."
    assert not hasattr(LUKVCache, "tag")  # the base class is left as it was


def test_a_policy_field_added_in_a_subclass_reaches_from_pretrained(tmp_path):
    path = tmp_path / "keydiff.safetensors"
    flat_profile(2, 2).save(path)
    cache = TaggedCache.from_pretrained(path, ratio=0.5, tag=7)
    assert type(cache) is TaggedCache and cache.tag == 7 and cache.profile is not None
    with pytest.raises(ConfigurationError, match="tag must be a positive integer"):
        TaggedCache.from_pretrained(path, ratio=0.5, tag=-1)


def test_a_policy_field_added_in_a_subclass_is_saved_and_loaded(tmp_path):
    cache, model = _filled(TaggedCache(0.5, "keydiff", tag=7))
    path = cache.save(tmp_path / "c.safetensors")
    assert _saved_options(path)["tag"] == 7 and set(_saved_options(path)) == SAVED_KEYS | {"tag"}
    loaded = TaggedCache.load(path, model, allow_other_model_id=True)
    assert type(loaded) is TaggedCache and loaded.tag == 7
    assert torch.equal(loaded.stored_tokens(), cache.stored_tokens())
    with pytest.raises(SavedContextError, match="saved with tag=7, which this LUKVCache does not support"):
        LUKVCache.load(path, model, allow_other_model_id=True)


def test_a_policy_field_added_in_a_subclass_is_in_the_docs_table_and_the_args():
    row = "| `tag` | `3` | A test option: a positive count. |"
    assert row in options_table(TaggedPolicy) and row not in options_table()
    assert "        tag: A test option: a positive count." in options_args(TaggedPolicy)
    # the cache's docstring lists the stock ones under its Args (indented as Python keeps docstrings: 3.13
    # strips their common indentation)
    args = inspect.cleandoc(LUKVCache.__doc__ or "").split("Args:\n", 1)[1]
    assert "\n    sliding: " in args and "\n    kv_bits: " in args


def _without(src: Path, dst: Path, *keys: str) -> Path:
    """``src`` re-signed with ``keys`` removed from its options: a file written before those options."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(src)
    with safe_open(str(src), "pt") as f:
        metadata = dict(f.metadata())
    meta = json.loads(metadata[save_load.METADATA_KEY])
    for key in keys:
        del meta["options"][key]
    text = json.dumps(meta, sort_keys=True)
    metadata[save_load.METADATA_KEY], metadata[save_load.CHECKSUM_KEY] = (
        text,
        save_load.checksum(text, tensors),
    )
    save_file(tensors, dst, metadata=metadata)
    return dst


def test_a_file_written_before_an_option_loads_with_what_it_meant(tmp_path):
    cache, model = _filled(LUKVCache(0.5, "keydiff"))
    path = cache.save(tmp_path / "c.safetensors")
    old = _without(path, tmp_path / "old.safetensors", "sliding", "kv_bits")
    loaded = LUKVCache.load(old, model, allow_other_model_id=True)
    assert loaded.sliding == "keep" and loaded.kv_bits is None  # the field's before=, and kv_bits' default
    tagged = TaggedCache.load(path, model, allow_other_model_id=True)  # a file from before 'tag' existed
    assert tagged.tag == 3 and torch.equal(tagged.stored_tokens(), cache.stored_tokens())
