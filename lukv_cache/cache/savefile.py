"""The saved-context file: a filled cache's layers and options written to one safetensors file
(:func:`write_context`), and read back, checked, into a cache of the class it is given (:func:`read_context`).
:mod:`.saved` gives the public functions (``save_cache``, ``load_cache``) and ``LUKVCache.save`` / ``load``
call these directly, so this module never imports the cache class (no import cycle). The file layout is
described in docs/saved.md; the layers' entries are :mod:`.savedlayers`'s, the model's identity
:mod:`.fingerprint`'s."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch

from ..errors import (
    ConfigurationError,
    LUKVError,
    SavedContextError,
    UnknownNameError,
)
from ..profiles.files import write_atomically
from ..scorers import SCORERS, Reconstruction, Scorer, get_scorer, kvzip_scorer
from .fingerprint import check_model, fields_hash, fingerprint_fields, layer_kv_heads, weights_entry
from .savedlayers import check_savable, restore_layers, save_layer
from .savedlayers import put_tensor as _put
from .statecheck import StateCheck

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


# ---------------------------------------------------------------------------------------------- saving
def write_context(cache: LUKVCache, path: Path, model: Any = None) -> Path:
    """Write ``cache`` to ``path`` (see :func:`lukv_cache.cache.saved.save_cache`); ``cache`` is a LUKVCache."""
    check_savable(cache, path)
    config = _config_of(cache, model, path)
    tensors: dict[str, torch.Tensor] = {}
    layers = [save_layer(i, layer, tensors, path) for i, layer in enumerate(cache.layers)]
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
    restore_layers(cache, meta, reader, devices, max_length, heads)
    unused = set(reader.tensors) - reader.used
    if unused:
        reader.fail(
            f"tensors {sorted(unused)[:5]} that its metadata does not name (altered file).", sorted(unused)[0]
        )
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
