"""A saved context's layers: each written as an entry of the metadata plus its tensors (:func:`save_layer`;
a :class:`~lukv_cache.cache.storage.layer.LUKVLayer` through its own ``state_dict``, a transformers layer by its
attributes), and read back, checked, into a freshly built cache with the cache state around them: which
layers compress, the cache's flags, its prefill scores (:func:`restore_layers`; a LUKVLayer through
``load_state``). :mod:`.file` owns the file around them (format, checksum, model fingerprint, options);
this module reads it only through :class:`SavedFile`, so it never imports it. The layout is docs/saved.md's.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, NoReturn, Protocol, cast

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ...errors import SavedContextError, SavedContextMismatchError
from ..compression.contract import CompressedCache
from ..layers.factory import LayerFactory
from ..options.memory import MemoryChoice
from ..storage.layer import LUKVLayer
from ..storage.quant import PackedRows
from ..storage.ragged import RaggedStore
from ..storage.state_check import StateCheck, StateShape, dtype_name, put_tensor

# a stock layer's attributes that do not travel: its dtype and device, its sliding window's tensor (rebuilt
# from sliding_window, on the layer's device); a LUKVLayer's state is its own (LUKVLayer.state_dict)
_STOCK_SPECIAL = {"dtype", "device", "_sliding_window_tensor"}
# layer attributes that are None or a count (every other attribute whose default is None holds a tensor)
_OPTIONAL_COUNTS = {"kv_bits", "sliding_window"}
_KINDS = {"lukv": LUKVLayer, "sliding": DynamicSlidingWindowLayer, "dynamic": DynamicLayer}
_SCALARS = (bool, int, float, str, type(None))
# The classes a file may hold, by the tag the format owns (never where the code lives: moving a module
# changes no file). A file names nothing else; every class is rebuilt from exactly its fields.
DATACLASS_TAGS: dict[str, type] = {"packed_rows": PackedRows}
_TAG_OF = {cls: tag for tag, cls in DATACLASS_TAGS.items()}
# format version 1 named them by module path: read, never written
_VERSION_1_PATHS = {"lukv_cache.cache.quant.PackedRows": "packed_rows"}


class SavedFile(Protocol):
    """The saved-context file being read (saved/file.py's reader): its failure (a SavedContextError, or ``cls``,
    naming the file and ``field``), its tensors by name, and the :class:`StateCheck` that names it."""

    @property
    def check(self) -> StateCheck: ...

    def fail(self, why: str, field: str | None = None, cls: Any = ..., **kw: Any) -> NoReturn: ...

    def tensor(self, name: str, *, finite: bool = ...) -> torch.Tensor:
        """Tensor ``name`` of the file (a failure when it is missing, or unless ``finite=False`` when a
        value is not finite), counted as read."""
        ...


def check_savable(cache: CompressedCache, path: Path) -> None:
    """Refuse to save ``cache`` now: a forward in flight, a tensor-parallel shard, nothing held, or layers
    that have seen different numbers of tokens (a SavedContextError naming ``path``)."""
    why = cache.state.pending()
    if why:
        raise SavedContextError(
            f"Cannot save this LUKVCache now: {'; '.join(why)}. Save it between forwards, once the context is "
            "compressed (after cache.prefill(...), model(...) or model.generate(...) has returned; after "
            "cache.evict_held(...) for a holding() block).",
            path=str(path),
        )
    if cache.layout.head_shard is not None or cache.layout.mesh_shard is not None:
        raise SavedContextError(
            "Cannot save a tensor-parallel LUKVCache: each rank holds only its block of KV heads. Save the "
            "context from a single-process run of the model.",
            path=str(path),
        )
    if (
        not any(getattr(layer, "is_initialized", False) for layer in cache.layers)
        or not cache.get_seq_length()
    ):
        raise SavedContextError(
            "Cannot save an empty LUKVCache: fill it first (cache.prefill(model, input_ids, ...), or a forward "
            "or generate with past_key_values=cache), then save it.",
            path=str(path),
        )
    stored = [layer for layer in cache.layers if type(layer) in _KINDS.values()]
    lengths = [layer.get_seq_length() for layer in stored]
    if len(set(lengths)) > 1:
        raise SavedContextError(
            f"Cannot save this LUKVCache: its layers have seen different numbers of tokens ({_seen_tokens(lengths)}"
            "): a forward stopped part-way through the model (an exception, Ctrl-C or out of memory in a layer), "
            "so the later layers lack tokens the earlier ones hold. Re-run the prompt: cache.reset(), fill the "
            "cache again, then save it.",
            path=str(path),
            field="layers",
        )


def _seen_tokens(lengths: list[int]) -> str:
    """Per-layer token counts in words, runs of equal layers merged.

    >>> _seen_tokens([40, 40, 0, 0, 0])
    'layers 0-1: 40 tokens, layers 2-4: 0 tokens'
    """
    runs: list[list[int]] = []  # [first layer, last layer] of each run of equal counts
    for i, n in enumerate(lengths):
        if runs and lengths[runs[-1][0]] == n:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(
        f"layer {a}: {lengths[a]} tokens" if a == b else f"layers {a}-{b}: {lengths[a]} tokens"
        for a, b in runs
    )


def save_layer(i: int, layer: Any, tensors: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """Layer ``i``'s metadata entry (its kind, plain attributes, tensor names, dtype, and a LUKVLayer's suffix
    capacity and store fields); its tensors go into ``tensors`` as ``layers.<i>.<name>``."""
    kind = next((name for name, cls in _KINDS.items() if type(layer) is cls), None)
    if kind is None:
        raise SavedContextError(
            f"Cannot save layer {i} ({type(layer).__name__}): this format stores LUKVCache's compressed layers "
            "and transformers' DynamicLayer / DynamicSlidingWindowLayer, not linear-attention, SSM or other "
            "layer states. Recompute the context for this model instead of saving it.",
            path=str(path),
            field=f"layers.{i}",
        )
    entry: dict[str, Any] = {"kind": kind, "attrs": {}, "tensors": []}
    state = layer.state_dict() if kind == "lukv" else None
    own = {**state["attrs"], **state["tensors"]} if state is not None else _stock_state(layer)
    for name, value in own.items():
        if isinstance(value, torch.Tensor):
            entry["tensors"].append(name)
            put_tensor(tensors, f"layers.{i}.{name}", value)
        elif isinstance(value, _SCALARS) and not (isinstance(value, float) and not math.isfinite(value)):
            entry["attrs"][name] = value
        else:
            raise SavedContextError(
                f"Cannot save layer {i}: its attribute {name!r} is a {type(value).__name__}, which this format "
                "version does not store (tensors and plain numbers only).",
                path=str(path),
                field=f"layers.{i}.{name}",
            )
    initialized = bool(getattr(layer, "is_initialized", False))
    # transformers' own layers keep no dtype from 5.24 on (5.23's did): their keys have it
    dtype = (state["dtype"] if state is not None else layer.keys.dtype) if initialized else None
    entry["dtype"] = None if dtype is None else dtype_name(dtype)
    if state is not None and initialized:
        suffix, store = state["suffix"], state["store"]
        entry["suffix_capacity"] = suffix["capacity"]
        put_tensor(tensors, f"layers.{i}.suffix_keys", suffix["keys"])
        put_tensor(tensors, f"layers.{i}.suffix_values", suffix["values"])
        # every field of the store (RaggedStore.state_dict): see _encode
        where = f"layers.{i}.store"
        fields = (
            None
            if store is None
            else {k: _encode(v, f"{where}.{k}", tensors, path) for k, v in store.items()}
        )
        entry["store"] = None if fields is None else {"fields": fields}
    return entry


def _stock_state(layer: Any) -> dict[str, Any]:
    """A transformers layer's attributes that travel (its keys and values, lengths, flags)."""
    return {name: value for name, value in vars(layer).items() if name not in _STOCK_SPECIAL}


def _encode(value: Any, name: str, tensors: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """One field as the metadata holds it: ``{"tensor": name}`` (the tensor stored under ``name``),
    ``{"value": v}`` (a plain number, string or None), ``{"dtype": "float16"}``, or ``{"dataclass": <tag>,
    "fields": {...}}`` for one of the classes of :data:`DATACLASS_TAGS` (a quantized store's rows:
    ``"packed_rows"``, codes, scales and zeros), its fields encoded alike as ``name.<field>``."""
    if isinstance(value, torch.Tensor):
        return {"tensor": put_tensor(tensors, name, value)}
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, _SCALARS) and not (isinstance(value, float) and not math.isfinite(value)):
        return {"value": value}
    cls = type(value)
    if dataclasses.is_dataclass(value) and cls in _TAG_OF:
        return {
            "dataclass": _TAG_OF[cls],
            "fields": {
                f.name: _encode(getattr(value, f.name), f"{name}.{f.name}", tensors, path)
                for f in dataclasses.fields(value)
            },
        }
    raise SavedContextError(
        f"Cannot save {name}: a {cls.__name__}, which this format version does not store (tensors, plain "
        f"numbers, dtypes and the classes {sorted(DATACLASS_TAGS)} only).",
        path=str(path),
        field=name,
    )


def restore_layers(
    cache: CompressedCache,
    meta: dict,
    reader: SavedFile,
    devices: list[torch.device],
    max_length: int,
    heads: list[Any],
) -> None:
    """The file's layers into ``cache``, each checked against its tensors, the model and the cache's options;
    no layer may be longer than ``max_length`` (the model's ``max_position_embeddings``), and layer ``i``
    holds ``heads[i]`` KV heads."""
    layers, state = meta.get("layers"), meta.get("cache")
    if not isinstance(layers, list) or len(layers) != len(cache.layers) or not isinstance(state, dict):
        reader.fail(
            f"it holds {len(layers) if isinstance(layers, list) else '?'} layers, the model's cache has "
            f"{len(cache.layers)} (damaged file).",
            "layers",
        )
    fields = meta["model"]["fields"]
    dtype = getattr(torch, str(fields["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        reader.fail(f"unknown dtype {fields['dtype']!r} (damaged file).", "dtype")
    factory = LayerFactory.for_policy(cache.policy)  # the settings the cache's layers are built with
    choice = _memory_choice(cache, state, reader)  # a memory budget chose the layers' bits (below)
    fold_state = {"fold_at": factory.fold_at, "bounded": factory.bounded, "kv_bits": factory.kv_bits}
    shape = StateShape(
        fields["num_key_value_heads"],
        fields["head_dim"],
        fields["num_attention_heads"],
        dtype,
        max_length,
        fold_state,
    )
    for i, entry in enumerate(layers):
        shape.kv_heads = heads[i]
        if choice is not None:
            shape.fold_state = {**fold_state, "kv_bits": choice.bits_of(i)}
        cache.replace_layer(i, _restore_layer(cache, i, entry, reader, shape, devices[i]))
    # every layer, empty ones included: a cache saved after a forward that stopped part-way through the
    # model holds e.g. [40, 40, 0, 0] tokens
    lengths = [layer.get_seq_length() for layer in cache.layers]
    if len(set(lengths)) > 1:
        reader.fail(
            f"its layers have seen different numbers of tokens ({_seen_tokens(lengths)}): it was saved after a "
            "forward stopped part-way through the model, or damaged. Re-run the prompt and save the context "
            "again.",
            "layers",
        )
    full = state.get("full_layers")
    if not isinstance(full, list) or not all(
        isinstance(i, int) and 0 <= i < len(cache.layers) and isinstance(cache.layers[i], LUKVLayer)
        for i in full
    ):
        reader.fail("its list of compressed layers is malformed (damaged file).", "cache.full_layers")
    flags = {}
    for key in ("unrouted", "other_keys", "record_past"):
        value = state.get(key)
        if not isinstance(value, bool):
            reader.fail(f"malformed cache state {key}={value!r} (damaged file).", f"cache.{key}")
        flags[key] = value
    if flags["unrouted"] and any(getattr(layer, "compressed", False) for layer in cache.layers):
        reader.fail(
            "it says the model attends in its own code (unrouted), which only a cache that compressed nothing "
            "can have, but it holds compressed layers (altered file).",
            "cache.unrouted",
        )
    if not flags["record_past"] and any(getattr(layer, "keeps_past", False) for layer in cache.layers):
        reader.fail(
            "a layer keeps the past its window hides, which only assisted decoding (record_past) asks for, "
            "and the file says it did not (altered file).",
            "cache.record_past",
        )
    cache.compressor.set_unrouted(flags["unrouted"])
    cache.layout.restore(full, other_keys=flags["other_keys"], record_past=flags["record_past"])
    scores = state.get("prefill_scores") or []
    if scores and cache.prefill_scores is None:
        reader.fail(
            "it holds prefill scores but was saved without keep_scores (damaged file).",
            "cache.prefill_scores",
        )
    for idx in scores:
        layer = cache.layers[idx] if isinstance(idx, int) and 0 <= idx < len(cache.layers) else None
        if not isinstance(layer, LUKVLayer):
            reader.fail(
                f"prefill scores for layer {idx!r}, which is not a compressed layer.", "cache.prefill_scores"
            )
        name = f"prefill_scores.{idx}"
        # scores may be -inf (padding) or a scorer's own non-finite values: only the user reads them
        t = reader.check.tensor(
            reader.tensor(name, finite=False),
            name,
            dtype=torch.float32,
            shape=(shape.batch, heads[idx], None),
        )
        assert cache.prefill_scores is not None  # refused above when there are scores
        cache.prefill_scores[idx] = t.to(devices[idx])


def _fits(name: str, value: Any, default: Any) -> bool:
    """Whether a saved layer attribute has the type of a fresh layer's: an attribute that is ``None`` on a
    fresh layer is ``None`` in the file (a tensor travels as a tensor), or a count for ``kv_bits`` and
    ``sliding_window``."""
    if default is None:
        return value is None or (name in _OPTIONAL_COUNTS and type(value) is int)
    return type(value) is type(default)


def _memory_choice(cache: Any, state: Any, reader: Any) -> MemoryChoice | None:
    """What the saved cache's memory budget chose (``None``: no budget, or saved before its first
    compression), checked; the cache adopts it."""
    entry = state.get("memory_choice") if isinstance(state, dict) else None
    if entry is None:
        return None
    choice = MemoryChoice.from_json(entry)
    if choice is None or not cache.policy.in_bytes:
        why = "is malformed" if choice is None else "comes without memory= or max_bytes= in its options"
        reader.fail(f"its memory budget's choice {why} (damaged or altered file).", "cache.memory_choice")
    assert choice is not None  # refused above
    if choice.mixed and len(cast(tuple, choice.kv_bits)) != len(cache.layers):
        reader.fail(
            f"its memory budget's choice gives widths for {len(cast(tuple, choice.kv_bits))} layers, the "
            f"model's cache has {len(cache.layers)} (damaged or altered file).",
            "cache.memory_choice",
        )
    cache.compressor.adopt_choice(choice)
    return choice


def _restore_layer(
    cache: CompressedCache, i: int, entry: Any, reader: SavedFile, shape: StateShape, device: torch.device
) -> Any:
    where = f"layers.{i}"
    if (
        not isinstance(entry, dict)
        or entry.get("kind") not in _KINDS
        or not isinstance(entry.get("attrs"), dict)
    ):
        reader.fail(f"layer {i}'s entry is malformed (damaged file).", where)
    kind, attrs = entry["kind"], entry["attrs"]
    sliding = cache.layout.sliding_windows
    window = sliding.get(i)
    current = cache.layers[i]
    fresh: Any  # the restored layer, of the saved kind
    if i in sliding:  # a sliding layer: compressed (the prompt fit its window) or transformers' own
        assert window is not None  # i is in sliding
        allowed = kind == "sliding" or (kind == "lukv" and attrs.get("sliding_window") == window)
        fresh = (
            DynamicSlidingWindowLayer(sliding_window=window)
            if kind == "sliding"
            else LayerFactory.for_policy(cache.policy)(window)
        )
    else:
        allowed = type(current) is _KINDS[kind] and (kind != "lukv" or attrs.get("sliding_window") is None)
        fresh = current
    if not allowed:
        reader.fail(
            f"layer {i} was saved as a {_KINDS[kind].__name__}, the model's cache has a {type(current).__name__} "
            "there (another layer layout).",
            where,
            SavedContextMismatchError,
            saved=kind,
            got=type(current).__name__,
        )
    fresh_state = fresh.state_dict() if kind == "lukv" else None
    defaults = {**fresh_state["attrs"], **fresh_state["tensors"]} if fresh_state else _stock_state(fresh)
    initialized = attrs.get("is_initialized")
    tensors = entry.get("tensors")
    if not isinstance(initialized, bool) or not isinstance(tensors, list):
        reader.fail(f"layer {i}'s entry is malformed (damaged file).", where)
    for name, value in attrs.items():
        default = defaults.get(name, KeyError)
        if default is KeyError or not isinstance(value, _SCALARS) or not _fits(name, value, default):
            reader.fail(
                f"layer {i} has an attribute {name}={value!r} this lukv_cache does not know or expects of another "
                "type (written by another version, or altered).",
                f"{where}.{name}",
            )
    for name in tensors:
        default = defaults.get(name, KeyError)
        if (
            not isinstance(name, str)
            or name not in defaults
            or name in _OPTIONAL_COUNTS
            or not (default is None or isinstance(default, torch.Tensor))
        ):
            reader.fail(f"layer {i} has a tensor {name!r} this lukv_cache does not know.", f"{where}.{name}")
    values = dict(attrs)
    length = values.get("cumulative_length", 0)
    if not isinstance(length, int) or not 0 <= length <= shape.max_length:
        reader.fail(
            f"layer {i}'s length {length!r} is out of range [0, {shape.max_length}] (the model's "
            "max_position_embeddings: it has no positions beyond).",
            f"{where}.cumulative_length",
        )
    dims = (shape.kv_heads, shape.head_dim)
    if initialized:
        if entry.get("dtype") != dtype_name(shape.dtype):
            reader.fail(
                f"layer {i} holds {entry.get('dtype')!r}, the model's dtype is {shape.dtype}.",
                f"{where}.dtype",
            )
        values["dtype"], values["device"] = shape.dtype, device
    for name in tensors:
        values[name] = reader.tensor(f"{where}.{name}").to(device)
    if kind == "lukv":
        _restore_lukv(fresh, i, entry, values, reader, shape, device)
        for name, value in shape.fold_state.items():  # what the cache's policy fixes on its layers
            setattr(fresh, name, value)  # (a compressed layer's were checked equal)
        return fresh
    if initialized:
        for name in ("keys", "values"):
            t = values.get(name)
            if not isinstance(t, torch.Tensor) or t.ndim != 4 or tuple(t.shape[1:2]) != dims[:1]:
                reader.fail(f"layer {i}'s {name} do not fit the model's KV heads.", f"{where}.{name}")
            if (
                t.dtype != shape.dtype
                or t.shape[2] > length
                or t.shape[3] != shape.head_dim
                and name == "keys"
            ):
                reader.fail(
                    f"layer {i}'s {name} ({list(t.shape)}, {t.dtype}) do not fit its metadata.",
                    f"{where}.{name}",
                )
            shape.row_count(int(t.shape[0]), reader.check, f"{where}.{name}")
    for name, value in values.items():
        setattr(fresh, name, value)
    if hasattr(fresh, "_sliding_window_tensor"):
        fresh._sliding_window_tensor = fresh._sliding_window_tensor.to(device)
    return fresh


def _restore_lukv(
    layer: LUKVLayer,
    i: int,
    entry: dict,
    values: dict,
    reader: SavedFile,
    shape: StateShape,
    device: torch.device,
) -> None:
    """Layer ``i``'s state (:meth:`LUKVLayer.state_dict`) from its entry, its attributes ``values`` (checked
    by type) and its tensors, into ``layer`` (:meth:`LUKVLayer.load_state` checks it)."""
    where, names = f"layers.{i}", entry["tensors"]
    attrs = {
        name: value for name, value in values.items() if name not in names and name not in ("dtype", "device")
    }
    state: dict[str, Any] = {"attrs": attrs, "tensors": {name: values[name] for name in names}}
    state["dtype"], state["suffix"], state["store"] = shape.dtype, None, None
    if attrs.get("is_initialized"):
        keys, vals = reader.tensor(f"{where}.suffix_keys"), reader.tensor(f"{where}.suffix_values")
        state["suffix"] = {"keys": keys, "values": vals, "capacity": entry.get("suffix_capacity")}
    check = reader.check.at(f"layer {i}", where)
    if entry.get("store") is not None:
        state["store"] = _read_store(entry["store"], check, reader, device)
    layer.load_state(state, check, shape, device)


def _read_store(entry: Any, check: StateCheck, reader: SavedFile, device: torch.device) -> dict[str, Any]:
    """A store's fields (:meth:`RaggedStore.state_dict`) decoded from its entry, after checking their names;
    :meth:`RaggedStore.from_state` checks their values."""
    where = f"{check.where}.store"
    if not isinstance(entry, dict) or not isinstance(entry.get("fields"), dict):
        reader.fail(f"{check.label}'s store entry is malformed (damaged file).", where)
    fields = entry["fields"]
    RaggedStore.check_fields(fields, check)
    for name in ("offsets", "positions"):
        if not isinstance(fields.get(name), dict) or "tensor" not in fields[name]:
            reader.fail(f"{check.label}'s store has no {name} tensor (damaged file).", f"{where}.{name}")
    # every tensor finite but the scores: NaN marks a token stored without one, and eviction at fold time
    # ranks non-finite scores as a prefill does (masked_held); NaN keys, values or scales decode to NaN
    return {
        name: _decode(spec, f"{where}.{name}", reader, device, finite=name != "scores")
        for name, spec in fields.items()
    }


def _decode(spec: Any, name: str, reader: SavedFile, device: torch.device, finite: bool = True) -> Any:
    """A field encoded by :func:`_encode` (its tensors finite unless ``finite=False``); a dataclass is
    rebuilt only from a tag of :data:`DATACLASS_TAGS` (or a format-1 file's module path for it), from
    exactly its fields."""
    if isinstance(spec, dict) and len(spec) == 1 and isinstance(spec.get("tensor"), str):
        return reader.tensor(spec["tensor"], finite=finite).to(device)
    if isinstance(spec, dict) and len(spec) == 1 and "value" in spec and isinstance(spec["value"], _SCALARS):
        return spec["value"]
    if isinstance(spec, dict) and len(spec) == 1 and isinstance(spec.get("dtype"), str):
        dtype = getattr(torch, spec["dtype"], None)
        if isinstance(dtype, torch.dtype):
            return dtype
    if (
        isinstance(spec, dict)
        and isinstance(spec.get("dataclass"), str)
        and isinstance(spec.get("fields"), dict)
    ):
        named: str = spec["dataclass"]
        cls = DATACLASS_TAGS.get(_VERSION_1_PATHS.get(named, named))
        if cls is None:
            reader.fail(
                f"{name} is a {spec['dataclass']!r}, which this lukv_cache's format does not have (it knows "
                f"{sorted(DATACLASS_TAGS)}; written by another version?). Load it with the version that wrote "
                "it.",
                name,
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        if set(spec["fields"]) != fields:
            reader.fail(
                f"{name} ({cls.__name__}) has the fields {sorted(spec['fields'])}, this lukv_cache's has "
                f"{sorted(fields)} (written by another version). Load it with the version that wrote it.",
                name,
            )
        kwargs = {
            key: _decode(value, f"{name}.{key}", reader, device, finite)
            for key, value in spec["fields"].items()
        }
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as err:
            reader.fail(f"{name} does not rebuild: {err} (damaged file).", name)
    reader.fail(f"{name} is malformed in the metadata (damaged file). Save the context again.", name)
