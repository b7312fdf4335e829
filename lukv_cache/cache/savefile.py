"""The saved-context file: a filled cache's layers and options written to one safetensors file
(:func:`write_context`), and read back, checked, into a cache of the class it is given (:func:`read_context`).
:mod:`.saved` gives the public functions (``save_cache``, ``load_cache``) and ``LUKVCache.save`` / ``load``
call these directly, so this module never imports the cache class (no import cycle). The file layout is
described in docs/saved.md."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import numpy as np
import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ..errors import (
    ConfigurationError,
    LUKVError,
    SavedContextError,
    SavedContextMismatchError,
    UnknownNameError,
)
from ..profiles.files import write_atomically
from ..scorers import SCORERS, Reconstruction, Scorer, get_scorer, kvzip_scorer
from .fingerprint import check_model, fields_hash, fingerprint_fields, layer_kv_heads, weights_entry
from .folding import set_fold
from .layer import LUKVLayer
from .ragged import RaggedStore
from .statecheck import StateCheck, StateShape, dtype_name

if TYPE_CHECKING:
    from .cache import LUKVCache

FORMAT_NAME = "lukv-saved-context"
FORMAT_VERSION = 1
# safetensors metadata entries (str -> str): the format's name, the structured metadata (JSON), its checksum
FORMAT_KEY = "format"
METADATA_KEY = "lukv_saved_context"
CHECKSUM_KEY = "lukv_sha256"

_MAX_HEADER = 256 << 20  # a safetensors header longer than this is not one this library wrote
_MAX_LENGTH = 2**40  # logical lengths beyond any context
# safetensors dtype codes and their sizes in bytes
_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
# a stock layer's attributes that do not travel: its dtype and device, its sliding window's tensor (rebuilt
# from sliding_window, on the layer's device); a LUKVLayer's state is its own (LUKVLayer.state_dict)
_STOCK_SPECIAL = {"dtype", "device", "_sliding_window_tensor"}
# layer attributes that are None or a count (every other attribute whose default is None holds a tensor)
_OPTIONAL_COUNTS = {"kv_bits", "sliding_window"}
_KINDS = {"lukv": LUKVLayer, "sliding": DynamicSlidingWindowLayer, "dynamic": DynamicLayer}
_SCALARS = (bool, int, float, str, type(None))
_DATACLASS_MODULES = ("lukv_cache.cache.",)  # the only classes a file may name (rebuilt from their fields)


# ---------------------------------------------------------------------------------------------- saving
def write_context(cache: LUKVCache, path: Path, model: Any = None) -> Path:
    """Write ``cache`` to ``path`` (see :func:`lukv_cache.cache.saved.save_cache`); ``cache`` is a LUKVCache."""
    _check_savable(cache, path)
    config = _config_of(cache, model, path)
    tensors: dict[str, torch.Tensor] = {}
    layers = [_save_layer(i, layer, tensors, path) for i, layer in enumerate(cache.layers)]
    dtype = next(entry["dtype"] for entry in layers if entry.get("dtype"))
    fields = fingerprint_fields(config, dtype)
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "library_version": _library_version(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": {
            "model_id": str(getattr(config, "name_or_path", "") or ""),
            "fingerprint": fields_hash(fields),
            "fields": fields,
            "weights": weights_entry(cache.state.readers.values(), model),
        },
        "options": _save_options(cache, tensors, path),
        "cache": {
            "full_layers": list(cache.layout.full_layers),
            "unrouted": bool(cache.state.unrouted),
            "other_keys": bool(cache.layout.other_keys),
            "record_past": bool(cache.layout.record_past),
            "prefill_scores": _save_prefill_scores(cache, tensors),
        },
        "layers": layers,
    }
    text = json.dumps(meta, sort_keys=True, separators=(",", ":"))
    metadata = {FORMAT_KEY: FORMAT_NAME, METADATA_KEY: text, CHECKSUM_KEY: checksum(text, tensors)}
    _atomic_save(tensors, metadata, path)
    return path


def _check_savable(cache: LUKVCache, path: Path) -> None:
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
    stored = [layer for layer in cast("list[Any]", cache.layers) if type(layer) in _KINDS.values()]
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


def _config_of(cache: LUKVCache, model: Any, path: Path) -> Any:
    config = getattr(model, "config", None) if model is not None else None
    if config is None:
        for ref in cache.state.readers.values():
            module = ref()
            config = getattr(module, "config", None)
            if config is not None:
                break
    if config is None or not hasattr(config, "get_text_config"):
        raise SavedContextError(
            "save_cache cannot tell which model filled this cache (no attention module of the model read it): "
            "pass the model, save_cache(cache, path, model=model).",
            path=str(path),
        )
    return config


def checksum(metadata: str, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the structured metadata (the JSON string) and every tensor's name, dtype, shape and
    bytes, in name order: what the file's ``lukv_sha256`` entry holds."""
    digest = hashlib.sha256(metadata.encode())
    for name in sorted(tensors):
        t = tensors[name]
        digest.update(f"\0{name}\0{str(t.dtype).removeprefix('torch.')}\0{list(t.shape)}\0".encode())
        flat = t.detach().cpu().contiguous().reshape(-1)
        if flat.numel():
            digest.update(flat.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _put(tensors: dict[str, torch.Tensor], name: str, t: torch.Tensor) -> str:
    # a fresh, contiguous CPU tensor: safetensors refuses tensors that share memory
    tensors[name] = t.detach().to("cpu").clone(memory_format=torch.contiguous_format)
    return name


def _save_layer(i: int, layer: Any, tensors: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
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
            _put(tensors, f"layers.{i}.{name}", value)
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
        _put(tensors, f"layers.{i}.suffix_keys", suffix["keys"])
        _put(tensors, f"layers.{i}.suffix_values", suffix["values"])
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
    ``{"value": v}`` (a plain number, string or None), ``{"dtype": "float16"}``, or ``{"dataclass":
    "lukv_cache.cache.<module>.<Class>", "fields": {...}}`` for a dataclass of lukv_cache's cache (e.g. a
    quantized store's rows: codes, scales and zeros), its fields encoded alike as ``name.<field>``."""
    if isinstance(value, torch.Tensor):
        return {"tensor": _put(tensors, name, value)}
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, _SCALARS) and not (isinstance(value, float) and not math.isfinite(value)):
        return {"value": value}
    cls = type(value)
    if dataclasses.is_dataclass(value) and cls.__module__.startswith(_DATACLASS_MODULES):
        return {
            "dataclass": f"{cls.__module__}.{cls.__qualname__}",
            "fields": {
                f.name: _encode(getattr(value, f.name), f"{name}.{f.name}", tensors, path)
                for f in dataclasses.fields(value)
            },
        }
    raise SavedContextError(
        f"Cannot save {name}: a {cls.__name__}, which this format version does not store (tensors, plain "
        "numbers, dtypes and lukv_cache's own cache dataclasses only).",
        path=str(path),
        field=name,
    )


def _scorer_entry(scorer: Scorer, profile: Any, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    entry = {
        "name": scorer.name,
        "window": scorer.window,
        "n_queries": scorer.n_queries,
        "context": scorer.context,
        "decodes": scorer.decodes,
        "rescores": scorer.rescores,
        "reconstruction": None
        if scorer.reconstruction is None
        else dataclasses.asdict(scorer.reconstruction),
        "surrogate": None,
    }
    surrogate = scorer.params.get("surrogate") if scorer.from_surrogate is not None else None  # a learned one
    if surrogate is not None:
        if profile is not None and profile.surrogate is surrogate:
            entry["surrogate"] = "profile"  # the embedded profile holds it
        else:
            from ..profiles import surrogate as surrogate_format

            arrays, text = surrogate_format.to_file(surrogate)
            for name, array in arrays.items():
                _put(tensors, f"scorer.{name}", torch.from_numpy(np.ascontiguousarray(array)))
            entry["surrogate"] = {"metadata": text, "tensors": sorted(arrays)}
    return entry


def _save_options(cache: LUKVCache, tensors: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    from ..profiles import Profile

    policy = cache.policy
    profiles: dict[str, Any] = {}
    if cache.profile is not None:
        profiles["profile"] = cache.profile
    kwargs: dict[str, Any] = {}
    for key, value in policy.allocator.params.items():
        if isinstance(value, Profile):
            name = next((n for n, p in profiles.items() if p is value), f"allocator.{key}")
            profiles[name] = value
            kwargs[key] = {"profile": name}
        elif isinstance(value, torch.Tensor | np.ndarray):
            t = torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else value
            kwargs[key] = {
                "tensor": _put(tensors, f"allocator.{key}", t),
                "numpy": isinstance(value, np.ndarray),
            }
        else:
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError):
                raise SavedContextError(
                    f"Cannot save this cache's allocator option {key!r} (a {type(value).__name__}): the format "
                    "stores JSON values, tensors, arrays and profiles. Build the allocator from such options.",
                    path=str(path),
                    field=f"options.allocator_kwargs.{key}",
                ) from None
            kwargs[key] = {"json": value}
    for name, profile in profiles.items():
        _put(tensors, f"profile.{name}", torch.frombuffer(bytearray(profile.to_bytes()), dtype=torch.uint8))
    return {
        "ratio": policy.ratio,
        "scorer": _scorer_entry(policy.scorer, cache.profile, tensors),
        "allocator": policy.allocator.name,
        "allocator_kwargs": kwargs,
        "max_tokens": policy.max_tokens,
        "decode_max_tokens": policy.decode_max_tokens,
        "sink": policy.sink,
        "window": policy.window,
        "min_keep": policy.min_keep,
        "prefill_chunk_size": policy.prefill_chunk_size,
        "fold_interval": policy.fold_interval,
        "decode_window": policy.decode_window,
        "keep_scores": cache.prefill_scores is not None,
        "kv_bits": getattr(cache, "kv_bits", None),
        "sliding": policy.sliding,
        "profiles": sorted(profiles),
    }


def _save_prefill_scores(cache: LUKVCache, tensors: dict[str, torch.Tensor]) -> list[int]:
    if not cache.prefill_scores:
        return []
    for idx, scores in cache.prefill_scores.items():
        _put(tensors, f"prefill_scores.{idx}", scores)
    return sorted(int(i) for i in cache.prefill_scores)


def _atomic_save(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: Path) -> None:
    from safetensors.torch import save_file

    write_atomically(
        path,
        lambda tmp: save_file(tensors, tmp, metadata=metadata),
        lambda message: SavedContextError(message, path=str(path)),
        example="context.safetensors",
    )


def _library_version() -> str:
    from ..profiles.profile import library_version

    return library_version()


# ---------------------------------------------------------------------------------------------- loading
@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """What :func:`lukv_cache.cache.saved.load_cache` takes besides the path and the model (its keywords,
    documented there)."""

    device: Any = None
    scorer: str | Scorer | None = None
    allocator: Any = None
    allow_other_model_id: bool = False


def read_context(
    cache_class: type[LUKVCache], path: str | os.PathLike, model: Any, options: LoadOptions = LoadOptions()
) -> LUKVCache:
    """The ``cache_class`` (LUKVCache) saved at ``path`` (see :func:`lukv_cache.cache.saved.load_cache`)."""
    path = Path(path)
    reader = _Reader(path)
    meta = reader.read()
    check_model(meta, model, reader.fail, options.allow_other_model_id)
    cache = _build_cache(cache_class, meta, model, reader, options.scorer, options.allocator)
    devices = _layer_devices(model, len(cache.layers), options.device)
    text = model.config.get_text_config(decoder=True)
    positions = getattr(text, "max_position_embeddings", None)
    max_length = positions if isinstance(positions, int) and positions > 0 else _MAX_LENGTH
    # the fields check_model compared with the model's own
    heads = layer_kv_heads(model, len(cache.layers), meta["model"]["fields"]["num_key_value_heads"])
    _restore_layers(cache, meta, reader, devices, max_length, heads)
    return cache


class _Reader:
    """One saved-context file: its header checked against its size, its metadata, its tensors."""

    def __init__(self, path: Path):
        self.path = path
        self.tensors: dict[str, torch.Tensor] = {}
        self.used: set[str] = set()
        self.check = _FileCheck(path=str(path))  # a part's state checks, naming this file

    def fail(self, why: str, field: str | None = None, cls=SavedContextError, **kw) -> NoReturn:
        raise cls(f"{self.path}: {why}", path=str(self.path), field=field, **kw)

    def read(self) -> dict[str, Any]:
        if not self.path.is_file():
            self.fail("no such file. Check the path, or save the context first (save_cache(cache, path)).")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or n > min(size - 8, _MAX_HEADER):
                self.fail(
                    f"not a safetensors file, or truncated inside its header ({size} bytes). Save the context "
                    "again with save_cache."
                )
            raw = f.read(n)
        try:
            header = json.loads(raw)
            if not isinstance(header, dict):
                raise TypeError("not an object")
        except (ValueError, TypeError, RecursionError):
            self.fail(
                "not a safetensors file (its header is not JSON). Save the context again with save_cache."
            )
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or metadata.get(FORMAT_KEY) != FORMAT_NAME:
            got = metadata.get(FORMAT_KEY) if isinstance(metadata, dict) else None
            self.fail(
                f"a safetensors file but not a saved LUKV context (format {got!r}, expected {FORMAT_NAME!r}). "
                "Load files written by save_cache / cache.save.",
                field=FORMAT_KEY,
            )
        text = metadata.get(METADATA_KEY)
        try:
            meta = json.loads(text) if isinstance(text, str) else None
        except (ValueError, RecursionError):
            meta = None
        if not isinstance(meta, dict):
            self.fail(
                "its metadata is not a JSON object (damaged file). Save the context again.", METADATA_KEY
            )
        version = meta.get("format_version")
        if version != FORMAT_VERSION:
            self.fail(
                f"format version {version!r}, written by lukv_cache {meta.get('library_version', '?')}; this "
                f"lukv_cache ({_library_version()}) reads version {FORMAT_VERSION}. Load it with the lukv_cache "
                "version that wrote it, or save the context again with this one.",
                "format_version",
            )
        self._check_layout(header, size - 8 - n)
        self._load_tensors()
        assert isinstance(text, str)  # meta was parsed from it
        if checksum(text, self.tensors) != metadata.get(CHECKSUM_KEY):
            self.fail(
                "checksum mismatch: the file was altered or damaged after it was written. Save the context again.",
                CHECKSUM_KEY,
            )
        return meta

    def _check_layout(self, header: dict, data_size: int) -> None:
        """Every tensor's bytes lie inside the file, back to back, sized by its dtype and shape."""
        spans = []
        shape: Any  # lists of ints where ok (read below only then), as offsets
        offsets: Any
        for name, info in header.items():
            ok = isinstance(info, dict) and info.get("dtype") in _ITEMSIZE
            shape, offsets = (info.get("shape"), info.get("data_offsets")) if ok else (None, None)
            ok = ok and isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
            ok = ok and isinstance(offsets, list) and len(offsets) == 2
            ok = ok and all(isinstance(o, int) for o in offsets) and 0 <= offsets[0] <= offsets[1]
            if not ok or offsets[1] - offsets[0] != math.prod(shape) * _ITEMSIZE[info["dtype"]]:
                self.fail(f"tensor {name!r} has a malformed header entry. Save the context again.", name)
            spans.append((offsets[0], offsets[1], name))
        end = 0
        for start, stop, name in sorted(spans):
            if start != end:
                self.fail(f"tensor {name!r} does not follow the previous one (damaged file).", name)
            end = stop
        if end > data_size:
            self.fail(
                f"truncated: its header describes {end} bytes of tensors, the file holds {data_size}. The write "
                "was cut short or the file was damaged: save the context again."
            )
        if end < data_size:
            self.fail(
                f"{data_size - end} bytes after its last tensor (damaged or altered file). Save it again."
            )

    def _load_tensors(self) -> None:
        from safetensors import safe_open

        try:
            with safe_open(str(self.path), framework="pt", device="cpu") as f:
                self.tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        except Exception as err:  # safetensors raises its own SafetensorError (and OSError, ValueError)
            self.fail(
                f"not a readable safetensors file ({type(err).__name__}: {err}). Save the context again."
            )

    def tensor(
        self,
        name: str,
        *,
        dtype: torch.dtype | None = None,
        shape: tuple | None = None,
        ndim: int | None = None,
    ) -> torch.Tensor:
        """Tensor ``name``, checked: its dtype, its shape (``None`` entries match any size) or its rank."""
        t = self.tensors.get(name)
        if t is None:
            self.fail(f"tensor {name!r} is missing (damaged file). Save the context again.", name)
        self.used.add(name)
        return self.check.tensor(t, name, dtype=dtype, shape=shape, ndim=ndim)


@dataclasses.dataclass(frozen=True)
class _FileCheck(StateCheck):
    """The checks of a part's state read from the file at ``path``: its errors name the file."""

    path: str = ""

    def fail(self, why: str, field: str | None = None) -> NoReturn:
        raise SavedContextError(f"{self.path}: {why}", path=self.path, field=field)


def _option(options: dict, key: str, kinds: tuple, reader: _Reader, *, low: float | None = None) -> Any:
    value = options.get(key)
    bad = not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)
    if not bad and low is not None and value is not None and value < low:
        bad = True
    if bad:
        reader.fail(
            f"malformed option {key}={value!r} (damaged file). Save the context again.", f"options.{key}"
        )
    return value


def _build_cache(
    cache_class: type[LUKVCache], meta: dict, model: Any, reader: _Reader, scorer: Any, allocator: Any
) -> LUKVCache:
    from ..profiles import Profile

    options = meta.get("options")
    if not isinstance(options, dict):
        reader.fail("its options are missing (damaged file). Save the context again.", "options")
    profiles = {}
    for name in options.get("profiles") or []:
        data = reader.tensor(f"profile.{name}", dtype=torch.uint8, ndim=1)
        try:
            profiles[name] = Profile.from_bytes(
                data.numpy().tobytes(), source=f"{reader.path} [profile.{name}]"
            )
        except LUKVError as err:
            reader.fail(f"its embedded profile {name!r} is invalid: {err}", f"profile.{name}")
    kwargs: dict[str, Any] = {}
    saved_kwargs = options.get("allocator_kwargs")
    for key, spec in (saved_kwargs if isinstance(saved_kwargs, dict) else {}).items():
        if isinstance(spec, dict) and "json" in spec:
            kwargs[key] = spec["json"]
        elif isinstance(spec, dict) and spec.get("profile") in profiles:
            kwargs[key] = profiles[spec["profile"]]
        elif isinstance(spec, dict) and isinstance(spec.get("tensor"), str):
            t = reader.tensor(spec["tensor"])
            kwargs[key] = t.numpy() if spec.get("numpy") else t
        else:
            reader.fail(
                f"malformed allocator option {key!r} (damaged file).", f"options.allocator_kwargs.{key}"
            )
    ratio = _option(options, "ratio", (float, int), reader, low=0)
    max_tokens = _option(options, "max_tokens", (int, type(None)), reader, low=1)
    decode_max_tokens = _option(options, "decode_max_tokens", (int, type(None)), reader, low=1)
    args: dict[str, Any] = {
        "max_tokens": max_tokens,
        "sink": _option(options, "sink", (int,), reader, low=0),
        "window": _option(options, "window", (int,), reader, low=0),
        "min_keep": _option(options, "min_keep", (float, int), reader, low=0),
        "prefill_chunk_size": _option(options, "prefill_chunk_size", (int, type(None)), reader, low=1),
        "decode_max_tokens": decode_max_tokens,
        "fold_interval": _option(options, "fold_interval", (int,), reader, low=1),
        "keep_scores": _option(options, "keep_scores", (bool,), reader),
        "allocator_kwargs": kwargs,
        "config": model.config,
    }
    if decode_max_tokens is not None:
        args["decode_window"] = _option(options, "decode_window", (int,), reader, low=0)
    kv_bits = options.get("kv_bits")
    if kv_bits is not None:
        if "kv_bits" not in inspect.signature(cache_class.__init__).parameters:
            reader.fail(
                f"saved with kv_bits={kv_bits!r} (a quantized store), which this lukv_cache does not support. "
                "Load it with the version that wrote it.",
                "options.kv_bits",
            )
        args["kv_bits"] = kv_bits
    # files written before the option: their sliding layers were "keep"'s
    args["sliding"] = _option(options, "sliding", (str,), reader) if "sliding" in options else "keep"
    reads_ratio = max_tokens is None and kwargs.get("evict_ratio") is None
    scorer_obj = scorer if scorer is not None else _saved_scorer(options.get("scorer"), profiles, reader)
    allocator_name = allocator if allocator is not None else options.get("allocator")
    try:
        cache = cache_class(ratio if reads_ratio else None, scorer_obj, allocator_name, **args)
    except UnknownNameError as err:
        reader.fail(
            f"{err}. Register it in this process before loading (register_{err.kind or 'scorer'}(...)), or pass "
            f"{err.kind or 'scorer'}= to load_cache.",
            f"options.{err.kind or 'scorer'}",
        )
    except LUKVError as err:
        reader.fail(f"its options do not build a LUKVCache: {err}", "options")
    cache.profile = profiles.get("profile")
    return cache


def _saved_scorer(entry: Any, profiles: dict, reader: _Reader) -> Scorer:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        reader.fail("its scorer entry is malformed (damaged file).", "options.scorer")
    name, window = entry["name"], entry.get("window")  # save_cache writes the scorer's window, an int
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        reader.fail(
            f"its scorer's window is {window!r}, not a count of tokens (damaged file).",
            "options.scorer.window",
        )
    surrogate = entry.get("surrogate")
    learned = SCORERS.get(name).from_surrogate if name in SCORERS else None  # kvzap's kvzap_scorer
    if learned is not None and surrogate is not None:
        from ..profiles import surrogate as surrogate_format

        if surrogate == "profile":
            if "profile" not in profiles or profiles["profile"].surrogate is None:
                reader.fail(
                    f"its {name} scorer reads the embedded profile, which is missing.", "options.scorer"
                )
            return learned(profiles["profile"].surrogate, window=window)
        names = surrogate.get("tensors") if isinstance(surrogate, dict) else None
        if not isinstance(names, list):
            reader.fail(f"its {name} surrogate entry is malformed (damaged file).", "options.scorer")
        arrays = {n: reader.tensor(f"scorer.{n}").numpy() for n in names}
        try:
            surr = surrogate_format.from_file(arrays, surrogate.get("metadata", ""), str(reader.path))
            text = surr.weight.shape
            surrogate_format.check(surr, int(text[0]), int(text[1]), None, str(reader.path))
        except LUKVError as err:
            reader.fail(f"its {name} surrogate is invalid: {err}", "options.scorer")
        return learned(surr, window=window)
    try:
        registered = get_scorer(name)
    except UnknownNameError:
        reader.fail(
            f"it was saved with scorer {name!r}, which is not registered in this process. Register it "
            "(register_scorer) before loading, or pass scorer= to load_cache.",
            "options.scorer",
        )
    recon = entry.get("reconstruction")
    if isinstance(recon, dict):
        try:
            saved = Reconstruction(**recon)
        except TypeError:
            reader.fail("its scorer's reconstruction settings are malformed.", "options.scorer")
        if registered.reconstruction == saved and registered.window == window:
            return registered
        return kvzip_scorer(**dataclasses.asdict(saved), name=name, window=window)
    if registered.missing:  # e.g. kvzap without a surrogate: the cache refuses it with its own message
        return registered
    same = all(
        entry.get(key) == getattr(registered, key)
        for key in ("window", "n_queries", "context", "decodes", "rescores")
    )
    if not same:
        reader.fail(
            f"the scorer registered as {name!r} in this process is not the one the context was saved with "
            "(its window, queries or decoding settings differ). Pass the scorer it was saved with: "
            "load_cache(path, model, scorer=...).",
            "options.scorer",
        )
    return registered


def _layer_devices(model: Any, count: int, device: Any) -> list[torch.device]:
    if device is not None:
        try:
            where = torch.device(device)
            torch.empty(0, device=where)  # a device this torch has and can allocate on
        except (RuntimeError, TypeError, ValueError, AssertionError) as err:
            raise ConfigurationError(
                f"load_cache: device={device!r} is not a device this process can use ({err}). Pass a torch device "
                "such as 'cpu', 'cuda' or 'cuda:0', or None for each decoder layer's own device."
            ) from None
        return [where] * count
    default = getattr(model, "device", None) or torch.device("cpu")
    try:
        layers = list(model.get_decoder().layers)
        if len(layers) == count:
            return [next(layer.parameters()).device for layer in layers]
    except (AttributeError, StopIteration, TypeError):
        pass
    return [torch.device(default)] * count


def _restore_layers(
    cache: LUKVCache,
    meta: dict,
    reader: _Reader,
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
    folding = LUKVLayer()
    set_fold(folding, cache.policy)
    fold_state = {name: getattr(folding, name) for name in ("fold_at", "bounded", "kv_bits")}
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
        cache.layers[i] = _restore_layer(cache, i, entry, reader, shape, devices[i])
    # every layer, empty ones included: a cache saved after a forward that stopped part-way through the
    # model holds e.g. [40, 40, 0, 0] tokens
    lengths = [layer.get_seq_length() for layer in cast("list[Any]", cache.layers)]
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
    cache.layout.full_layers = sorted(full)
    cache.layout.last_full_layer = cache.layout.full_layers[-1] if full else None
    cache.layout.undecided = False
    cache.layout.layout_warning = None
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
    cache.state.unrouted = flags["unrouted"]
    cache.layout.other_keys, cache.layout.record_past = flags["other_keys"], flags["record_past"]
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
        t = reader.tensor(f"prefill_scores.{idx}", dtype=torch.float32, shape=(shape.batch, heads[idx], None))
        assert cache.prefill_scores is not None  # refused above when there are scores
        cache.prefill_scores[idx] = t.to(devices[idx])
    unused = set(reader.tensors) - reader.used
    if unused:
        reader.fail(
            f"tensors {sorted(unused)[:5]} that its metadata does not name (altered file).", sorted(unused)[0]
        )


def _fits(name: str, value: Any, default: Any) -> bool:
    """Whether a saved layer attribute has the type of a fresh layer's: an attribute that is ``None`` on a
    fresh layer is ``None`` in the file (a tensor travels as a tensor), or a count for ``kv_bits`` and
    ``sliding_window``."""
    if default is None:
        return value is None or (name in _OPTIONAL_COUNTS and type(value) is int)
    return type(value) is type(default)


def _restore_layer(
    cache: LUKVCache, i: int, entry: Any, reader: _Reader, shape: StateShape, device: torch.device
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
        fresh = DynamicSlidingWindowLayer(sliding_window=window) if kind == "sliding" else LUKVLayer(window)
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
    reader: _Reader,
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


def _read_store(entry: Any, check: StateCheck, reader: _Reader, device: torch.device) -> dict[str, Any]:
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
    return {name: _decode(spec, f"{where}.{name}", reader, device) for name, spec in fields.items()}


def _decode(spec: Any, name: str, reader: _Reader, device: torch.device) -> Any:
    """A field encoded by :func:`_encode`; a dataclass is rebuilt only if it is one of lukv_cache's cache
    classes, from exactly its fields."""
    if isinstance(spec, dict) and len(spec) == 1 and isinstance(spec.get("tensor"), str):
        return reader.tensor(spec["tensor"]).to(device)
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
        module, _, qualname = spec["dataclass"].rpartition(".")
        cls = None
        if module.startswith(_DATACLASS_MODULES) and module.removeprefix("lukv_cache.cache.").isidentifier():
            try:
                cls = getattr(importlib.import_module(module), qualname, None)
            except ImportError:
                cls = None
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            reader.fail(
                f"{name} is a {spec['dataclass']}, which this lukv_cache does not have (written by another "
                "version). Load it with the version that wrote it.",
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
            key: _decode(value, f"{name}.{key}", reader, device) for key, value in spec["fields"].items()
        }
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as err:
            reader.fail(f"{name} does not rebuild: {err} (damaged file).", name)
    reader.fail(f"{name} is malformed in the metadata (damaged file). Save the context again.", name)
