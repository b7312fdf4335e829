"""A KVzap surrogate inside a profile file: its tensors (``kvzap.*``, float32) and its metadata (``kvzap``,
JSON), validated like everything else a profile holds (shapes against the profile's layers and heads,
dtype, finite values, bounded sizes)."""

from __future__ import annotations

import json
import math
from typing import Any, cast

import numpy as np
import torch

from ..errors import ProfileFormatError
from ..scorers.kvzap import FEATURE_SETS, Surrogate, base_features, input_size
from .jsonfile import parse_json

TENSORS = ("kvzap.weight", "kvzap.bias", "kvzap.mean", "kvzap.std")
MLP_TENSORS = ("kvzap.hidden_weight", "kvzap.hidden_bias")  # only in an MLP surrogate
FAMILIES = ("linear", "mlp")
METADATA_KEY = "kvzap"
_MAX_FEATURES = 1 << 20  # 2 x KV heads x head dim: far beyond any model
_MAX_HIDDEN = 1 << 16  # an MLP's width (kvpress' KVzap: 512)


def tensor_names(family: str) -> tuple[str, ...]:
    """The tensors a surrogate of ``family`` stores."""
    return TENSORS + (MLP_TENSORS if family == "mlp" else ())


def to_file(surrogate: Surrogate) -> tuple[dict[str, np.ndarray], str]:
    """The arrays and the metadata string that store ``surrogate`` in a profile."""
    arrays = {name: t.numpy() for name, t in surrogate.tensors().items()}
    meta = {"features": surrogate.features, "family": surrogate.family, "layers": surrogate.layers}
    return arrays, json.dumps({**meta, "meta": surrogate.meta}, sort_keys=True, default=str)


def from_file(tensors: dict[str, np.ndarray], metadata: str, source: str) -> Surrogate:
    """The surrogate stored in a profile's ``tensors`` and ``metadata`` (its shapes and values are checked by
    :func:`check` when the profile is constructed)."""
    try:
        meta = parse_json(metadata)
        if not isinstance(meta, dict):
            raise TypeError(f"expected a JSON object, got {type(meta).__name__}")
    except (ValueError, TypeError, RecursionError) as err:
        raise ProfileFormatError(
            f"{source}: malformed kvzap metadata ({type(err).__name__}).", source=source
        ) from None
    family = meta.get("family")
    if family not in FAMILIES or (set(MLP_TENSORS) <= set(tensors)) != (family == "mlp"):
        raise ProfileFormatError(
            f"{source}: invalid kvzap surrogate: family {family!r} with tensors "
            f"{sorted(n for n in tensors if n.startswith('kvzap.'))} (this version reads {list(FAMILIES)}: "
            f"{list(TENSORS)}, plus {list(MLP_TENSORS)} for 'mlp'). Rebuild it: lukv build <model> --scorer kvzap.",
            source=source,
        )
    arrays = {
        name.removeprefix("kvzap."): torch.from_numpy(np.array(tensors[name], dtype=np.float32))
        for name in tensor_names(family)
    }
    return Surrogate(
        **arrays,
        layers=meta.get("layers", []),
        features=meta.get("features", ""),
        meta=meta.get("meta", {}) if isinstance(meta.get("meta"), dict) else {},
    )


def check(
    surrogate: Any, layers: int, heads: int, head_dim: int | None, where: str, source: str | None = None
) -> None:
    """Raise :class:`ProfileFormatError` unless ``surrogate`` fits a profile of ``layers`` x ``heads``."""
    if not isinstance(surrogate, Surrogate):
        raise ProfileFormatError(
            f"{where}: surrogate must be a kvzap Surrogate, got {type(surrogate).__name__}."
        )
    problems = []
    if surrogate.features not in FEATURE_SETS:
        problems.append(f"features {surrogate.features!r} (this version reads {list(FEATURE_SETS)})")
    f = int(surrogate.mean.shape[-1]) if surrogate.mean.ndim == 2 else -1
    m = f
    expected: dict[str, tuple[int, ...]] = {"bias": (layers, heads), "mean": (layers, f), "std": (layers, f)}
    if surrogate.hidden_weight is not None or surrogate.hidden_bias is not None:
        hidden = surrogate.hidden_weight
        m = int(hidden.shape[1]) if isinstance(hidden, torch.Tensor) and hidden.ndim == 3 else -1
        expected |= {"hidden_weight": (layers, m, f), "hidden_bias": (layers, m)}
        if not 0 < m <= _MAX_HIDDEN:
            problems.append(f"an MLP of width {m} (at most {_MAX_HIDDEN})")
    expected["weight"] = (layers, heads, m)
    for name, shape in expected.items():
        t = getattr(surrogate, name)
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name} is {type(t).__name__}, expected a float32 tensor {list(shape)}")
        elif tuple(t.shape) != shape or t.dtype != torch.float32:
            problems.append(f"{name} is {t.dtype} {list(t.shape)}, expected float32 {list(shape)}")
        elif not bool(torch.isfinite(t).all()):
            problems.append(f"{name} has NaN or infinite values")
    known = surrogate.features in FEATURE_SETS
    base = base_features(surrogate.features, heads, head_dim) if head_dim is not None and known else None
    wanted = input_size(surrogate.features, base) if base else None
    if not 0 < f <= _MAX_FEATURES or (wanted is not None and f != wanted):
        problems.append(
            f"{f} inputs ({wanted} expected for {surrogate.features!r}: KV heads {heads} x head dim {head_dim})"
        )
    elif not problems and bool((surrogate.std <= 0).any()):
        problems.append("std has values <= 0")
    layer_ids = surrogate.layers
    if not isinstance(layer_ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in layer_ids
    ):
        problems.append(f"layers must list layer indices below {layers}")
    if problems:
        raise ProfileFormatError(
            f"{where}: invalid kvzap surrogate: {'; '.join(problems)}. Rebuild it: lukv build <model> --scorer kvzap."
        )
    meta = surrogate.meta
    if not isinstance(meta, dict):
        raise ProfileFormatError(
            f"{where}: invalid kvzap surrogate: meta must be a dict, got {type(meta).__name__}. "
            "Rebuild it: lukv build <model> --scorer kvzap.",
            source=source,
            field="kvzap.meta",
        )
    if "thresholds" in meta:
        check_thresholds(meta["thresholds"], where, source)


def _numbers(value: Any) -> list[float] | None:
    """``value`` as a list of floats if it is a list (or tuple) of plain numbers (no bools, no strings, no
    nulls, no nesting), else ``None``."""
    if not isinstance(value, (list, tuple)):
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return None
    return [float(v) for v in value]


def check_thresholds(table: Any, where: str, source: str | None = None) -> tuple[list[float], list[float]]:
    """The score thresholds of a kvzap surrogate (``meta["thresholds"]``, which the ``threshold`` allocator
    reads): ``{"grid": [G], "values": [G]}``, ``grid`` strictly increasing inside (0, 1) (the global
    ratios), ``values`` finite and non-decreasing with the ratio (a higher ratio removes more tokens, so
    its threshold is no lower; :func:`lukv_cache.profiling.kvzap.score_thresholds` records quantiles,
    which are). Returns ``(grid, values)``; anything else raises :class:`ProfileFormatError` naming the
    field ``kvzap.thresholds``.

    >>> check_thresholds({"grid": [0.5, 0.9], "values": [-2.0, -1.0]}, "x.safetensors")
    ([0.5, 0.9], [-2.0, -1.0])
    """
    problem = None
    grid = values = None
    if not isinstance(table, dict) or not {"grid", "values"} <= set(table):
        problem = f"must be an object with 'grid' and 'values', got {str(table)[:80]!r}"
    else:
        grid, values = _numbers(table["grid"]), _numbers(table["values"])
        if grid is None or values is None:
            problem = (
                "'grid' and 'values' must be lists of numbers (no bools, strings, nulls or nested lists)"
            )
        elif not grid or len(grid) != len(values):
            problem = (
                f"'grid' and 'values' must be non-empty and of one length, got {len(grid)} and {len(values)}"
            )
        elif not all(math.isfinite(g) for g in grid + values):
            problem = "'grid' and 'values' must be finite (no NaN or infinity)"
        elif not (all(0.0 < g < 1.0 for g in grid) and all(a < b for a, b in zip(grid, grid[1:]))):
            problem = f"'grid' must be strictly increasing inside (0, 1), got {grid[:8]}"
        elif not all(a <= b for a, b in zip(values, values[1:])):
            problem = (
                "'values' must not decrease as the ratio grows (a higher ratio keeps fewer tokens, so its "
                f"score threshold is no lower), got {values[:8]}"
            )
    if problem is not None:
        raise ProfileFormatError(
            f"{where}: invalid kvzap score thresholds (kvzap.thresholds): {problem}. "
            "Rebuild it: lukv build <model> --scorer kvzap.",
            source=source,
            field="kvzap.thresholds",
        )
    return cast("list[float]", grid), cast("list[float]", values)  # lists when there is no problem
