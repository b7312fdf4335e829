"""Convert LU-KV / kvpress budget curves (``.npy``) into profiles.

The official LU-KV code and kvpress's ``LUKVPress`` ship one ``.npy`` per (model, scorer): an array
``[99, L, H_kv]`` of each head's local prune ratio at the global compression ratios
rho = 0.01, 0.02, ..., 0.99. That is exactly Phi(rho) in a profile, without the metadata.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ProfileFormatError, ProfileNotFoundError
from .profile import Profile

KVPRESS_GRID = np.round(np.arange(1, 100, dtype=np.float64) / 100.0, 2).astype(np.float32)
"""rho = 0.01 ... 0.99, the grid of the LU-KV / kvpress curves."""


def _default_window(scorer: str) -> int:
    """The scorer's registered protected window (LU-KV: 1, SnapKV: 32), or 1 for an unknown name."""
    try:
        from ..scorers import SCORERS

        return SCORERS.get(scorer).window if scorer in SCORERS else 1
    except ImportError:  # the scorers need torch; a converter should not
        return 1


def _check_claimed_size(path: Path) -> None:
    """A ``.npy`` file's header names its array's shape and dtype: refuse an array larger than the bytes the
    file holds after the header (a truncated or crafted file) before numpy allocates it. Other files
    (``.npz``, not numpy at all) are left to ``np.load``."""
    fmt = np.lib.format
    with open(path, "rb") as f:
        try:
            version = fmt.read_magic(f)
        except ValueError:
            return
        try:
            read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, _, dtype = read(f)
        except (ValueError, SyntaxError, TypeError) as err:
            raise ProfileFormatError(f"{path} has a malformed .npy header ({err}). Check the file.") from None
        held = path.stat().st_size - f.tell()
    claimed = math.prod(shape) * dtype.itemsize
    if claimed > held and not dtype.hasobject:  # an object array is pickled: np.load refuses it below
        raise ProfileFormatError(
            f"{path}: its header describes a {dtype} array of shape {list(shape)} ({claimed:,} bytes) but the "
            f"file holds {held:,} bytes of data: it is truncated or damaged. Save the curve again (np.save)."
        )


def convert_curve(
    path: str | os.PathLike,
    model_id: str,
    scorer: str,
    *,
    grid: np.ndarray | list[float] | None = None,
    calibration: str = "",
    scorer_params: dict | None = None,
    head_dim: int | None = None,
    sink: int = 4,
    window: int | None = None,
    min_keep: float = 0.01,
    k_max: int = 64,
    extra: dict[str, Any] | None = None,
) -> Profile:
    """Read a LU-KV / kvpress curve ``[G, L, H_kv]`` (``G = 99`` at rho = 0.01 ... 0.99 unless ``grid``).

    The file is read with ``allow_pickle=False``: an object array (which needs pickle) is refused.

    >>> profile = convert_curve("llama3.1-8b_ea.npy", "meta-llama/Llama-3.1-8B-Instruct",  # doctest: +SKIP
    ...                         "expected_attention")
    >>> profile.save("expected_attention.safetensors")  # doctest: +SKIP
    """
    path = Path(path)
    if not path.is_file():
        raise ProfileNotFoundError(f"No curve file at {str(path)!r}. Check the path.")
    _check_claimed_size(path)
    try:
        curve = np.load(path, allow_pickle=False)
    except ValueError as err:
        if "pickle" in str(err).lower():
            raise ProfileFormatError(
                f"{path} holds a pickled (object) array, which is never loaded: pickle can run code. "
                "Save the curve as a plain float array (np.save(path, curve.astype(np.float32))) and retry."
            ) from None
        raise ProfileFormatError(f"{path} is not a readable .npy file ({err}). Check the file.") from None
    except (OSError, EOFError) as err:
        raise ProfileFormatError(f"{path} is not a readable .npy file ({err}). Check the file.") from None
    if not isinstance(curve, np.ndarray):  # an .npz archive
        curve.close()
        raise ProfileFormatError(
            f"{path} is an .npz archive; expected one .npy array [99, layers, KV heads]. "
            "Extract the curve array and save it with np.save."
        )
    if curve.dtype.kind not in "fiu":
        raise ProfileFormatError(f"{path}: expected a numeric array, got dtype {curve.dtype}.")
    grid = KVPRESS_GRID.copy() if grid is None else np.array(grid, dtype=np.float32)
    if curve.ndim != 3 or curve.shape[0] != grid.size:
        raise ProfileFormatError(
            f"{path}: expected a curve of shape [{grid.size}, layers, KV heads] (local prune ratios at "
            f"{grid.size} global ratios), got {list(curve.shape)}. Pass grid= if it uses other ratios."
        )
    curve = curve.astype(np.float32)
    where = f"{path} (curve for {model_id!r} / {scorer!r})"
    return Profile(
        grid=grid,
        evict_ratio=curve,
        model_id=model_id,
        scorer=scorer,
        head_dim=head_dim,
        scorer_params=dict(scorer_params or {}),
        sink=sink,
        window=_default_window(scorer) if window is None else window,
        min_keep=min_keep,
        k_max=k_max,
        calibration=calibration,
        extra={"converted_from": path.name, "source_format": "LU-KV/kvpress .npy curve", **(extra or {})},
        source=where,
    )
