"""An LU-KV profile: each (layer, KV head)'s local evict ratio at each global compression ratio.

One safetensors file holds two float32 tensors, ``grid`` ``[G]`` (the global ratios rho) and
``evict_ratio`` ``[G, L, H_kv]`` (Phi(rho)[l, h]), plus string metadata (``__metadata__``) that
says which model and scorer it was built for and how. No pickle anywhere.

Format version 2 adds an optional score-to-gain table (``gain_scores`` and ``gain_values``, float32
``[L, H_kv, Q]``, what the ``calibrated`` allocator reads); a profile without it is written as version 1,
so older readers still read it. A kvzap profile also holds its surrogate's tensors.

An optional measured loss table (:class:`~lukv_cache.profiles.memory_table.MemoryTable`: the loss at a grid
of (kv_bits, eviction ratio), what a memory budget chooses its precision by) is one JSON metadata entry,
``memory_table``, not tensors: every lukv_cache reader ignores metadata it does not know, while it refuses
tensors it does not know, so a profile with a table still loads, without it, in older releases; it changes
no format version.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigurationError, ProfileFormatError, ProfileMismatchError, ProfileNotFoundError
from . import surrogate as surrogate_format
from .files import atomic_write, library_version
from .jsonfile import parse_json
from .memory_table import METADATA_KEY as _MEMORY_TABLE_KEY
from .memory_table import MemoryTable

FORMAT_VERSION = 2  # written when the profile holds a score-to-gain table; 1 otherwise (see to_bytes)
SUPPORTED_FORMAT_VERSIONS = (1, 2)
# the largest sink, window, K_max or head dim a profile may carry: far beyond any real setting, and small
# enough that nothing sized by one of them can exhaust memory
MAX_COUNT = 1 << 16
_FORMAT_NAME = (
    "lukv_cache.profile"  # metadata["format"]: tells a profile apart from any other safetensors file
)
_TENSORS = ("grid", "evict_ratio")
_GAIN_TENSORS = ("gain_scores", "gain_values")  # format version 2, optional: both or neither

# metadata key -> how to parse its string value
_INT_KEYS = ("format_version", "num_layers", "num_kv_heads", "sink", "window", "k_max")
_FLOAT_KEYS = ("min_keep",)
_STR_KEYS = ("model_id", "scorer", "calibration", "library_version", "created")
_JSON_DICT_KEYS = ("scorer_params", "extra")
_REQUIRED_KEYS = ("format", *_INT_KEYS, *_FLOAT_KEYS, *_STR_KEYS, *_JSON_DICT_KEYS, "head_dim")


def _utc_now() -> str:
    return datetime.now(UTC).replace(microsecond=0).isoformat()


@dataclass(eq=False)
class Profile:
    """Phi(rho)[l, h]: the local evict ratio of each (layer, KV head) at each global ratio rho.

    ``grid`` is float32 ``[G]``, strictly increasing inside (0, 1); ``evict_ratio`` is float32
    ``[G, L, H_kv]`` in [0, 1]. The rest says what it was built for (model id, scorer and its
    parameters, protected sink/window, min keep, K_max) and how (calibration text, library version,
    date). Invalid values raise :class:`~lukv_cache.errors.ProfileFormatError` at construction.

    >>> import numpy as np
    >>> grid = np.array([0.25, 0.75], dtype=np.float32)
    >>> ratios = np.stack([np.full((2, 3), 0.2), np.full((2, 3), 0.6)]).astype(np.float32)
    >>> p = Profile(grid, ratios, model_id="org/tiny", scorer="keydiff")
    >>> p.num_layers, p.num_kv_heads, round(float(p.at(0.5)[0, 0]), 4)
    (2, 3, 0.4)
    """

    grid: np.ndarray
    evict_ratio: np.ndarray
    model_id: str
    scorer: str
    head_dim: int | None = None
    scorer_params: dict = field(default_factory=dict)
    sink: int = 4
    window: int = 1
    min_keep: float = 0.01
    k_max: int = 64
    calibration: str = ""
    library_version: str = field(default_factory=library_version)
    created: str = field(default_factory=_utc_now)
    format_version: int = 1
    extra: dict = field(default_factory=dict)
    # the KVzap surrogate (lukv_cache.scorers.kvzap.Surrogate) for scorer "kvzap", stored in the same file
    surrogate: Any = field(default=None, repr=False)
    # the score-to-gain table (format version 2): for each (layer, KV head), Q knots of the scorer's score
    # (centred on the context's mean, non-decreasing) and the oracle gain expected of a token scoring that
    # much (non-decreasing, >= 0), both float32 [L, H_kv, Q]; built by lukv_cache.profiling.gains
    gain_scores: np.ndarray | None = field(default=None, repr=False)
    gain_values: np.ndarray | None = field(default=None, repr=False)
    # the measured loss at a grid of (kv_bits, eviction ratio) (lukv_cache.profiling.memory_table), stored as
    # the JSON metadata entry "memory_table"; what a memory budget picks its precision by
    memory_table: MemoryTable | None = field(default=None, repr=False)
    # where this profile was read from, for error messages; not part of the file
    source: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        where = self.source or f"profile for {self.model_id!r} / scorer {self.scorer!r}"
        for name in ("sink", "window", "k_max", "head_dim"):
            if isinstance(getattr(self, name), np.integer):
                setattr(self, name, int(getattr(self, name)))
        self.grid = _as_float32(self.grid, "grid", where)
        self.evict_ratio = _as_float32(self.evict_ratio, "evict_ratio", where)
        _check_values(self, where)
        _check_gains(self, where)
        if self.memory_table is not None and not isinstance(self.memory_table, MemoryTable):
            raise ProfileFormatError(
                f"{where}: memory_table must be a MemoryTable or None, got {type(self.memory_table).__name__}.",
                source=self.source,
                field="memory_table",
            )
        layer_loss = None if self.memory_table is None else self.memory_table.layer_loss
        if layer_loss is not None and layer_loss.size != self.num_layers:
            raise ProfileFormatError(
                f"{where}: its memory table's layer_loss has {layer_loss.size} entries but the profile has "
                f"{self.num_layers} layers (damaged file: measure it again with `lukv memory-table --replace`).",
                source=self.source,
                field="memory_table",
            )
        if self.surrogate is not None:
            surrogate_format.check(
                self.surrogate, self.num_layers, self.num_kv_heads, self.head_dim, where, self.source
            )

    def __repr__(self) -> str:  # the arrays are large: summarise them
        return (
            f"Profile(model_id={self.model_id!r}, scorer={self.scorer!r}, num_layers={self.num_layers}, "
            f"num_kv_heads={self.num_kv_heads}, grid={self.grid.size} ratios in "
            f"[{self.grid[0]:.2f}, {self.grid[-1]:.2f}], created={self.created!r})"
        )

    # ------------------------------------------------------------------------------------ shape

    @property
    def num_layers(self) -> int:
        """L: every decoder layer, sliding-window ones included (their rows are unused)."""
        return int(self.evict_ratio.shape[1])

    @property
    def num_kv_heads(self) -> int:
        """H_kv: key/value heads per layer."""
        return int(self.evict_ratio.shape[2])

    # ------------------------------------------------------------------------------------ lookup

    def at(self, ratio: float) -> np.ndarray:
        """Local evict ratios ``[L, H_kv]`` at global ratio ``ratio``.

        Linear interpolation between the two grid points around ``ratio``. Below the first grid point
        it interpolates towards ratio 0, where every head keeps everything; above the last one the last
        row is used (the profile says nothing beyond it).

        >>> profile.at(0.8).shape
        (2, 2)
        >>> float(profile.at(0.0).max())
        0.0
        """
        ratio = float(ratio)
        if not 0.0 <= ratio <= 1.0 or math.isnan(ratio):
            raise ConfigurationError(
                f"ratio must be in [0, 1] (the fraction of KV entries removed), got {ratio}."
            )
        grid = self.grid.astype(np.float64)
        if ratio <= grid[0]:
            return np.clip(self.evict_ratio[0] * (ratio / grid[0]), 0.0, 1.0).astype(np.float32)
        if ratio >= grid[-1]:
            return self.evict_ratio[-1].copy()
        hi = int(np.searchsorted(grid, ratio, side="right"))
        lo = hi - 1
        w = (ratio - grid[lo]) / (grid[hi] - grid[lo])
        out = (1.0 - w) * self.evict_ratio[lo].astype(np.float64) + w * self.evict_ratio[hi].astype(
            np.float64
        )
        return np.clip(out, 0.0, 1.0).astype(np.float32)

    def validate_for(self, config: Any) -> None:
        """Raise :class:`~lukv_cache.errors.ProfileMismatchError` unless this profile fits ``config``.

        A profile has a row for every decoder layer (sliding-window layers included: the cache keeps
        them stock and ignores their rows) and one column per KV head.

        >>> profile.validate_for(model.config)
        """
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        layers = getattr(text, "num_hidden_layers", None)
        kv_heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
        name = getattr(config, "name_or_path", "") or getattr(text, "model_type", "this model")
        problems = []
        if layers is not None and int(layers) != self.num_layers:
            problems.append(f"{self.num_layers} layers but the model has {layers}")
        if kv_heads is not None and int(kv_heads) != self.num_kv_heads:
            problems.append(f"{self.num_kv_heads} KV heads but the model has {kv_heads}")
        head_dim = getattr(text, "head_dim", None)
        if self.head_dim is not None and isinstance(head_dim, int) and head_dim != self.head_dim:
            problems.append(f"head_dim {self.head_dim} but the model has {head_dim}")
        positions = getattr(text, "max_position_embeddings", None)
        if isinstance(positions, int) and self.sink + self.window >= positions:
            problems.append(
                f"sink {self.sink} + window {self.window} protect more tokens than the model's {positions} positions"
            )
        if problems:
            where = f" ({self.source})" if self.source else ""
            raise ProfileMismatchError(
                f"The profile for {self.model_id!r} / scorer {self.scorer!r}{where} does not fit {name!r}: "
                f"{'; '.join(problems)}. Use the profile built for this model (lukv pull <model id>) "
                "or build one for it."
            )

    # ------------------------------------------------------------------------------------ files

    def to_bytes(self) -> bytes:
        """The safetensors bytes of this profile (what :meth:`save` writes)."""
        from safetensors.numpy import save

        tensors, metadata = {"grid": self.grid, "evict_ratio": self.evict_ratio}, self._metadata()
        if self.gain_scores is not None and self.gain_values is not None:
            tensors |= {"gain_scores": self.gain_scores, "gain_values": self.gain_values}
        if self.surrogate is not None:
            arrays, metadata[surrogate_format.METADATA_KEY] = surrogate_format.to_file(self.surrogate)
            tensors |= arrays
        if self.memory_table is not None:
            metadata[_MEMORY_TABLE_KEY] = self.memory_table.to_json()
        return save(tensors, metadata=metadata)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the profile to ``path`` (safetensors) atomically: a temp file in the same folder, then rename.

        >>> profile.save("keydiff.safetensors")
        PosixPath('keydiff.safetensors')
        """
        path = Path(path)
        atomic_write(path, self.to_bytes())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        """Read and validate a profile file; any problem raises :class:`~lukv_cache.errors.ProfileFormatError`.

        >>> path = profile.save("keydiff.safetensors")
        >>> Profile.load(path).scorer
        'keydiff'
        """
        path = Path(path)
        if not path.is_file():
            raise ProfileNotFoundError(
                f"No profile file at {str(path)!r}. Check the path, or pass a model id to fetch the shared profile."
            )
        return cls.from_bytes(path.read_bytes(), source=str(path))

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str = "<bytes>") -> Profile:
        """Parse and validate the safetensors bytes of a profile (``source`` names it in errors)."""
        tensors, metadata = _read_safetensors(data, source)
        values = _parse_metadata(metadata, source)
        for name in _TENSORS + tuple(n for n in _GAIN_TENSORS if n in tensors):
            if tensors[name].dtype != np.float32:
                raise ProfileFormatError(
                    f"{source}: tensor {name!r} is {tensors[name].dtype}, profiles store float32. {_REBUILD}"
                )
        grid, ratios = tensors["grid"], tensors["evict_ratio"]
        layers, kv_heads = values.pop("num_layers"), values.pop("num_kv_heads")
        if ratios.ndim == 3 and ratios.shape[1:] != (layers, kv_heads):
            raise ProfileFormatError(
                f"{source}: evict_ratio has shape {list(ratios.shape)} but the metadata says "
                f"{layers} layers and {kv_heads} KV heads. {_REBUILD}"
            )
        surrogate = None  # validated with the rest in __post_init__
        if surrogate_format.TENSORS[0] in tensors:
            surrogate = surrogate_format.from_file(
                tensors, metadata.get(surrogate_format.METADATA_KEY, ""), source
            )
        gains: dict[str, Any] = {name: tensors[name] for name in _GAIN_TENSORS if name in tensors}
        if gains and values["format_version"] < 2:
            raise ProfileFormatError(
                f"{source}: a score-to-gain table needs format version 2, the file says "
                f"{values['format_version']}. {_REBUILD}",
                source=source,
                field="format_version",
            )
        memory_table = None
        if _MEMORY_TABLE_KEY in metadata:
            memory_table = MemoryTable.from_json(metadata[_MEMORY_TABLE_KEY], source)
        return cls(
            grid=grid,
            evict_ratio=ratios,
            source=source,
            surrogate=surrogate,
            memory_table=memory_table,
            **gains,
            **values,
        )

    def _metadata(self) -> dict[str, str]:
        return {
            "format": _FORMAT_NAME,
            "format_version": str(self.file_format_version),
            "model_id": self.model_id,
            "scorer": self.scorer,
            "num_layers": str(self.num_layers),
            "num_kv_heads": str(self.num_kv_heads),
            "head_dim": json.dumps(self.head_dim),
            "scorer_params": _to_json(self.scorer_params),
            "sink": str(self.sink),
            "window": str(self.window),
            "min_keep": repr(float(self.min_keep)),
            "k_max": str(self.k_max),
            "calibration": self.calibration,
            "library_version": self.library_version,
            "created": self.created,
            "extra": _to_json(self.extra),
        }

    @property
    def has_gains(self) -> bool:
        """Whether the profile holds a score-to-gain table (what the ``calibrated`` allocator reads)."""
        return self.gain_scores is not None

    @property
    def file_format_version(self) -> int:
        """The format version :meth:`to_bytes` writes: 2 with a score-to-gain table, else 1 (which every
        lukv_cache reads)."""
        return 2 if self.has_gains else 1

    def summary(self) -> dict[str, Any]:
        """A JSON-able description (the shared repository's ``index.json`` entry for this profile)."""
        return {
            "model_id": self.model_id,
            "scorer": self.scorer,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "grid": {"size": int(self.grid.size), "min": float(self.grid[0]), "max": float(self.grid[-1])},
            "calibration": self.calibration,
            "created": self.created,
            "library_version": self.library_version,
            "format_version": self.file_format_version,
            **({"memory_table": self.memory_table_summary()} if self.memory_table is not None else {}),
        }

    def memory_table_summary(self) -> dict[str, Any] | None:
        """What :meth:`summary` says of the memory table: its bits, ratios and measure (``None``: no table).

        >>> profile.memory_table_summary() is None
        True
        """
        table = self.memory_table
        if table is None:
            return None
        return {
            "bits": list(table.bits),
            "ratios": [round(float(r), 4) for r in table.ratios],
            "measure": table.measure,
            **(
                {}
                if table.layer_loss is None
                else {"layer_loss": [round(float(v), 4) for v in table.layer_loss]}
            ),
        }

    def push_to_hub(
        self,
        model_id: str | None = None,
        *,
        repo_id: str | None = None,
        token: str | bool | None = None,
        endpoint: str | None = None,
        revision: str | None = None,
        commit_message: str | None = None,
    ) -> str:
        """Publish to the shared repository at ``<model_id>/<scorer>.safetensors`` and update ``index.json``.

        Both files go in one commit. Returns the new commit sha (pin it with ``revision=``).
        Raises :class:`~lukv_cache.errors.PublishError` if the upload fails; nothing local is written.

        >>> Profile.load("keydiff.safetensors").push_to_hub("meta-llama/Llama-3.1-8B-Instruct")  # doctest: +SKIP
        '3f1c...'
        """
        from .location import HubLocation
        from .publish import push_profile

        hub = HubLocation(repo_id=repo_id, revision=revision, token=token, endpoint=endpoint)
        return push_profile(self, model_id, hub=hub, commit_message=commit_message)


_REBUILD = "Rebuild the profile, or fetch it again (lukv pull <model id>)."


def _json_default(value: Any) -> Any:
    # numpy scalars and arrays turn up in scorer parameters and provenance; store them as plain JSON
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _to_json(value: dict) -> str:
    return json.dumps(value, sort_keys=True, default=_json_default)


def _as_float32(value: Any, name: str, where: str) -> np.ndarray:
    try:
        array = np.asarray(value)
        if array.dtype == object or not np.issubdtype(array.dtype, np.number):
            raise TypeError(array.dtype)
        return np.ascontiguousarray(array, dtype=np.float32)
    except (TypeError, ValueError) as err:
        raise ProfileFormatError(f"{where}: {name} must be a numeric array, got {err}.") from None


def _check_values(p: Profile, where: str) -> None:
    """Shapes and values: the checks every profile passes, loaded or built."""
    grid, ratios = p.grid, p.evict_ratio
    if grid.ndim != 1 or grid.size == 0:
        raise ProfileFormatError(
            f"{where}: grid must be a non-empty 1-D array, got shape {list(grid.shape)}."
        )
    if ratios.ndim != 3 or ratios.shape[0] != grid.size or 0 in ratios.shape:
        raise ProfileFormatError(
            f"{where}: evict_ratio must have shape [G={grid.size}, layers, KV heads], got {list(ratios.shape)}."
        )
    if not np.isfinite(grid).all():
        raise ProfileFormatError(f"{where}: grid contains NaN or infinite values. {_REBUILD}")
    if not ((grid > 0.0).all() and (grid < 1.0).all() and (np.diff(grid) > 0).all()):
        shown = np.round(grid.astype(np.float64), 4).tolist()  # in float32, rounding a huge value overflows
        raise ProfileFormatError(
            f"{where}: grid must be strictly increasing inside (0, 1), got {shown}. {_REBUILD}"
        )
    bad = ~np.isfinite(ratios)
    if bad.any():
        g, layer, head = (int(i) for i in np.argwhere(bad)[0])
        raise ProfileFormatError(
            f"{where}: evict_ratio has {int(bad.sum())} NaN/infinite values (first at grid point {g}, "
            f"layer {layer}, KV head {head}). {_REBUILD}"
        )
    lo, hi = float(ratios.min()), float(ratios.max())
    if lo < 0.0 or hi > 1.0:
        raise ProfileFormatError(
            f"{where}: evict ratios must lie in [0, 1], found values in [{lo!r}, {hi!r}]. {_REBUILD}",
            source=p.source,
            field="evict_ratio",
        )
    if p.format_version not in SUPPORTED_FORMAT_VERSIONS:
        raise ProfileFormatError(
            f"{where}: unknown profile format version {p.format_version}; this lukv_cache reads "
            f"{', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))}. Upgrade lukv_cache (pip install -U lukv_cache)."
        )
    for name in ("model_id", "scorer"):
        if not isinstance(getattr(p, name), str) or not getattr(p, name):
            raise ProfileFormatError(
                f"{where}: {name} must be a non-empty string.", source=p.source, field=name
            )
    for name in ("calibration", "library_version", "created"):
        if not isinstance(getattr(p, name), str):
            raise ProfileFormatError(f"{where}: {name} must be a string.", source=p.source, field=name)
    for name in ("scorer_params", "extra"):
        try:
            if not isinstance(getattr(p, name), dict):
                raise TypeError(f"expected a dict, got {type(getattr(p, name)).__name__}")
            _to_json(getattr(p, name))
        except (TypeError, ValueError, RecursionError) as err:  # RecursionError: nested too deep
            raise ProfileFormatError(f"{where}: {name} must be a JSON-serialisable dict ({err}).") from None
    for name, low in (("sink", 0), ("window", 0), ("k_max", 1), ("head_dim", 1)):
        value = getattr(p, name)
        if name == "head_dim" and value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, np.integer))
            or not low <= value <= MAX_COUNT
        ):
            raise ProfileFormatError(
                f"{where}: {name} must be an integer in [{low}, {MAX_COUNT}], got {value!r}. {_REBUILD}",
                source=p.source,
                field=name,
            )
    min_keep = p.min_keep
    if (
        isinstance(min_keep, bool)
        or not isinstance(min_keep, (int, float, np.floating))
        or not 0.0 <= min_keep < 1.0
    ):
        raise ProfileFormatError(
            f"{where}: min_keep must be a number in [0, 1), got {min_keep!r}. {_REBUILD}",
            source=p.source,
            field="min_keep",
        )


def _check_gains(p: Profile, where: str) -> None:
    """The score-to-gain table, if any: both tensors, float32 ``[L, H_kv, Q >= 2]``, finite, each row's
    knots and gains non-decreasing, gains >= 0."""
    if p.gain_scores is None and p.gain_values is None:
        return
    if p.gain_scores is None or p.gain_values is None:
        raise ProfileFormatError(
            f"{where}: a score-to-gain table needs both gain_scores and gain_values. {_REBUILD}",
            source=p.source,
            field="gain_values" if p.gain_values is None else "gain_scores",
        )
    p.gain_scores = _as_float32(p.gain_scores, "gain_scores", where)
    p.gain_values = _as_float32(p.gain_values, "gain_values", where)
    want = (p.num_layers, p.num_kv_heads)
    for name in _GAIN_TENSORS:
        table = getattr(p, name)
        if table.ndim != 3 or table.shape[:2] != want or table.shape[2] < 2:
            raise ProfileFormatError(
                f"{where}: {name} must have shape [layers={want[0]}, KV heads={want[1]}, knots >= 2], got "
                f"{list(table.shape)}. {_REBUILD}",
                source=p.source,
                field=name,
            )
        if not np.isfinite(table).all() or (np.diff(table, axis=-1) < 0).any():
            raise ProfileFormatError(
                f"{where}: {name} must be finite and non-decreasing along its knots. {_REBUILD}",
                source=p.source,
                field=name,
            )
    if p.gain_scores.shape != p.gain_values.shape or (p.gain_values < 0).any():
        raise ProfileFormatError(
            f"{where}: gain_values must match gain_scores' shape {list(p.gain_scores.shape)} and be >= 0. "
            f"{_REBUILD}",
            source=p.source,
            field="gain_values",
        )


def _read_safetensors(data: bytes, source: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    from safetensors import SafetensorError
    from safetensors.numpy import load

    broken = (
        f"{source} is not a readable profile (truncated or corrupt safetensors file). "
        "Delete it and fetch it again (lukv pull <model id>), or rebuild it."
    )
    # The header (8-byte length + JSON) is read and checked first: names, dtypes and metadata, before
    # safetensors is asked to decode anything (it does not know every dtype a file may declare).
    try:
        header_len = int.from_bytes(data[:8], "little")
        if len(data) < 8 or header_len > len(data) - 8:
            raise ValueError(f"header of {header_len} bytes in a file of {len(data)}")
        header = parse_json(data[8 : 8 + header_len])
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as err:
        raise ProfileFormatError(f"{broken} ({type(err).__name__}: {err})", source=source) from None
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict) or metadata.get("format") != _FORMAT_NAME:
        raise ProfileFormatError(
            f"{source} is a safetensors file but not an lukv_cache profile (no '__metadata__' with "
            f"format={_FORMAT_NAME!r}). Convert kvpress curves with `lukv convert`, or build a profile.",
            source=source,
        )
    names = {name for name in header if name != "__metadata__"}
    kvzap = names & set(surrogate_format.tensor_names("mlp"))
    family = "mlp" if kvzap & set(surrogate_format.MLP_TENSORS) else "linear"
    expected = set(_TENSORS) | (set(surrogate_format.tensor_names(family)) if kvzap else set())
    if names & set(_GAIN_TENSORS):  # the score-to-gain table: both tensors or neither
        expected |= set(_GAIN_TENSORS)
    missing = sorted(expected - names)
    unexpected = sorted(names - expected)
    if missing or unexpected:
        raise ProfileFormatError(
            f"{source}: a profile holds the tensors {list(_TENSORS)} (and, for kvzap, all of "
            f"{list(surrogate_format.TENSORS)}, plus {list(surrogate_format.MLP_TENSORS)} for an MLP); "
            f"missing {missing}, unexpected {unexpected}. {_REBUILD}",
            source=source,
        )
    for name in sorted(expected):
        dtype = header[name].get("dtype") if isinstance(header[name], dict) else None
        if dtype != "F32":
            raise ProfileFormatError(
                f"{source}: tensor {name!r} is stored as {dtype!r}; profiles store float32 (F32). {_REBUILD}",
                source=source,
                field=name,
            )
    try:
        tensors = load(data)
    except (SafetensorError, ValueError, KeyError, OverflowError) as err:
        raise ProfileFormatError(f"{broken} ({type(err).__name__}: {err})", source=source) from None
    return tensors, metadata


def _parse_metadata(metadata: dict[str, str], source: str) -> dict[str, Any]:
    missing = [key for key in _REQUIRED_KEYS if key not in metadata]
    if missing:
        raise ProfileFormatError(f"{source}: missing metadata {missing}. {_REBUILD}", source=source)
    not_text = sorted(key for key, value in metadata.items() if not isinstance(value, str))
    if not_text:
        raise ProfileFormatError(
            f"{source}: metadata values are strings, {not_text} are not. {_REBUILD}",
            source=source,
            field=not_text[0],
        )
    values: dict[str, Any] = {}
    key = ""
    try:
        key = "format_version"  # first: a newer format may change everything else
        values[key] = int(metadata[key])
        if values[key] not in SUPPORTED_FORMAT_VERSIONS:
            raise ProfileFormatError(
                f"{source}: unknown profile format version {values[key]}; this lukv_cache reads "
                f"{', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))}. Upgrade lukv_cache (pip install -U lukv_cache)."
            )
        for key in _INT_KEYS:
            values[key] = int(metadata[key])
        for key in _FLOAT_KEYS:
            values[key] = float(metadata[key])
            if math.isnan(values[key]):
                raise ValueError("NaN")
        for key in _STR_KEYS:
            values[key] = str(metadata[key])
        for key in _JSON_DICT_KEYS:
            values[key] = parse_json(metadata[key])
            if not isinstance(values[key], dict):
                raise TypeError(f"expected a JSON object, got {type(values[key]).__name__}")
        key = "head_dim"
        values[key] = parse_json(metadata[key])
        value = values[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise TypeError("expected a positive integer or null")
    except ProfileFormatError:
        raise
    except (ValueError, TypeError) as err:
        raise ProfileFormatError(
            f"{source}: malformed metadata {key}={metadata[key]!r:.120} ({err}). {_REBUILD}",
            source=source,
            field=key,
        ) from None
    return values
