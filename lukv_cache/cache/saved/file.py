"""The saved-context file: a filled cache's layers and options written to one safetensors file
(:func:`write_context`), and read back, checked, into a cache of the class it is given (:func:`read_context`).
:mod:`lukv_cache.cache.save_load` gives the public functions (``save_cache``, ``load_cache``) and ``LUKVCache.save`` / ``load``
call these directly, so this module never imports the cache class (no import cycle). The file layout is
described in docs/saved.md; the layers' entries are :mod:`.layers`'s, the model's identity
:mod:`.fingerprint`'s."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import stat
import time
from pathlib import Path
from typing import Any, NoReturn

import torch

from ...errors import (
    ConfigurationError,
    SavedContextError,
)
from ...profiles.files import write_atomically
from ...scorers import Scorer
from ..compression.contract import CacheT, CompressedCache
from ..storage.state_check import StateCheck, put_tensor
from .fingerprint import check_model, fields_hash, fingerprint_fields, layer_kv_heads, weights_entry
from .layers import check_savable, restore_layers, save_layer
from .options_json import build_cache, save_options

FORMAT_NAME = "lukv-saved-context"
FORMAT_VERSION = (
    2  # 2: classes named by the format's tags (saved/layers.py: DATACLASS_TAGS), not module paths
)
READABLE_VERSIONS = (1, 2)  # what load reads: 1 named its one class by module path, read as its tag
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
def write_context(cache: CompressedCache, path: Path, model: Any = None) -> Path:
    """Write ``cache`` to ``path`` (see :func:`lukv_cache.cache.save_load.save_cache`); ``cache`` is a LUKVCache."""
    check_savable(cache, path)
    config = _config_of(cache, model, path)
    tensors: dict[str, torch.Tensor] = {}
    layers = [save_layer(i, layer, tensors, path) for i, layer in enumerate(cache.layers)]
    dtype = next(entry["dtype"] for entry in layers if entry.get("dtype"))
    fields = fingerprint_fields(config, dtype)
    choice = cache.memory_choice  # what a memory budget chose: the layers' bits
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
        "options": save_options(cache, tensors, path),
        "cache": {
            "full_layers": list(cache.layout.full_layers),
            "unrouted": bool(cache.state.unrouted),
            "other_keys": bool(cache.layout.other_keys),
            "record_past": bool(cache.layout.record_past),
            "prefill_scores": _save_prefill_scores(cache, tensors),
            "memory_choice": None if choice is None else choice.to_json(),
        },
        "layers": layers,
    }
    for name, t in tensors.items():  # what load refuses (non-finite keys, values, scales, ...) is not written
        if not _may_be_non_finite(name):
            why = non_finite(t)
            if why:
                raise SavedContextError(
                    f"Cannot save this cache: tensor {name!r} holds {why}. Non-finite keys, values or "
                    "quantization scales decode to NaN, so a file holding them is refused on load: the model "
                    "produced them (float16 overflow is the usual cause: load it in bfloat16 or float32), or "
                    "an allocator option holds them. Fill the cache again once its outputs are finite.",
                    path=str(path),
                    field=name,
                )
    text = json.dumps(meta, sort_keys=True, separators=(",", ":"))
    metadata = {FORMAT_KEY: FORMAT_NAME, METADATA_KEY: text, CHECKSUM_KEY: checksum(text, tensors)}
    _atomic_save(tensors, metadata, path)
    # the saved context is complete, as after cache.prefill: this cache and one loaded from the file (which
    # holds tokens, so no prompt is open in it) append a question alike, whole
    cache.state.end_prompt()
    return path


def _config_of(cache: CompressedCache, model: Any, path: Path) -> Any:
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


def non_finite(t: torch.Tensor) -> str | None:
    """What is not finite in float tensor ``t``, in words (``None``: every value is finite, or ``t`` holds
    integers).

    >>> non_finite(torch.tensor([1.0, float("nan"), float("-inf"), 2.0]))
    '2 non-finite values of 4 (NaN, -inf)'
    >>> non_finite(torch.arange(3)) is None
    True
    """
    if not t.is_floating_point() or not t.numel():
        return None
    bad = ~torch.isfinite(t)
    count = int(bad.sum())
    if not count:
        return None
    kinds = [
        word
        for word, found in (("NaN", t.isnan()), ("+inf", t.isposinf()), ("-inf", t.isneginf()))
        if bool(found.any())
    ]
    return f"{count} non-finite value{'s' if count > 1 else ''} of {t.numel()} ({', '.join(kinds)})"


def _may_be_non_finite(name: str) -> bool:
    """Whether tensor ``name`` of a file being written is scores, which may hold non-finite values:
    ``-inf`` for padding, ``NaN`` for a stored token without a score, a scorer's own non-finite scores
    (eviction ranks them: NaN and ``-inf`` lowest, ``+inf`` highest)."""
    return name.startswith("prefill_scores.") or (
        name.startswith("layers.") and name.endswith(".store.scores")
    )


def _save_prefill_scores(cache: CompressedCache, tensors: dict[str, torch.Tensor]) -> list[int]:
    if not cache.prefill_scores:
        return []
    for idx, scores in cache.prefill_scores.items():
        put_tensor(tensors, f"prefill_scores.{idx}", scores)
    return sorted(int(i) for i in cache.prefill_scores)


def _atomic_save(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: Path) -> None:
    """Write the file as profiles are written (:func:`~lukv_cache.profiles.files.write_atomically`): a temp
    file beside ``path``, renamed over it; the file gets the mode ``open()`` gives a new file (0o666 less the
    process umask)."""
    from safetensors.torch import save_file

    def write(tmp: str) -> None:
        mode = stat.S_IMODE(os.stat(tmp).st_mode)  # write_atomically created tmp as open() does
        save_file(tensors, tmp, metadata=metadata)
        # safetensors (0.8) writes a file of its own, mode 0600, and renames it over tmp: give the mode back
        os.chmod(tmp, mode)

    write_atomically(
        path,
        write,
        lambda message: SavedContextError(message, path=str(path)),
        example="context.safetensors",
    )


def _library_version() -> str:
    from ...profiles.profile import library_version

    return library_version()


# ---------------------------------------------------------------------------------------------- loading
@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """What :func:`lukv_cache.cache.save_load.load_cache` takes besides the path and the model (its keywords,
    documented there)."""

    device: Any = None
    scorer: str | Scorer | None = None
    allocator: Any = None
    allow_other_model_id: bool = False


def read_context(
    cache_class: type[CacheT], path: str | os.PathLike, model: Any, options: LoadOptions = LoadOptions()
) -> CacheT:
    """The ``cache_class`` (LUKVCache) saved at ``path`` (see :func:`lukv_cache.cache.save_load.load_cache`)."""
    path = Path(path)
    reader = _Reader(path)
    meta = reader.read()
    check_model(meta, model, reader.fail, options.allow_other_model_id)
    cache = build_cache(cache_class, meta, model, reader, options.scorer, options.allocator)
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
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            self.fail(
                f"format version {version!r}, written by lukv_cache {meta.get('library_version', '?')}; this "
                f"lukv_cache ({_library_version()}) reads versions {', '.join(map(str, READABLE_VERSIONS))}. "
                "Load it with the lukv_cache "
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
        finite: bool = True,
    ) -> torch.Tensor:
        """Tensor ``name``, checked: its dtype, its shape (``None`` entries match any size) or its rank,
        and unless ``finite=False`` (scores, where ``-inf`` marks padding) that every value is finite."""
        t = self.tensors.get(name)
        if t is None:
            self.fail(f"tensor {name!r} is missing (damaged file). Save the context again.", name)
        self.used.add(name)
        t = self.check.tensor(t, name, dtype=dtype, shape=shape, ndim=ndim)
        why = non_finite(t) if finite else None
        if why:
            self.fail(
                f"tensor {name!r} holds {why}. A saved context's keys, values, quantization scales and zeros "
                "and option tensors are finite (save_cache refuses others), so the file was altered or "
                "damaged, and loading it would decode NaN. Save the context again from the model.",
                name,
            )
        return t


@dataclasses.dataclass(frozen=True)
class _FileCheck(StateCheck):
    """The checks of a part's state read from the file at ``path``: its errors name the file."""

    path: str = ""

    def fail(self, why: str, field: str | None = None) -> NoReturn:
        raise SavedContextError(f"{self.path}: {why}", path=self.path, field=field)


def _layer_devices(model: Any, count: int, device: Any) -> list[torch.device]:
    if device is not None:
        try:
            where = torch.device(device)
            torch.empty(0, device=where)  # a device this torch has and can allocate on
            if where.type == "meta":
                raise ValueError("the meta device holds shapes without values, and a context is its values")
        except (RuntimeError, TypeError, ValueError, AssertionError) as err:
            raise ConfigurationError(
                f"load_cache: device={device!r} is not a device this process can use ({err}). Pass one that "
                f"holds data, here {' or '.join(repr(d) for d in _usable_devices())}, or None for each decoder "
                "layer's own device."
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


def _usable_devices() -> list[str]:
    """The devices this process can load a context onto, as load_cache's ``device=`` takes them."""
    found = ["cpu"]
    if torch.cuda.is_available():
        found += ["cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append("mps")
    return found
