"""The build's results kept on disk: where (:func:`default_cache_dir`), for which model
(:func:`model_fingerprint`), under which key (:func:`short_sha`), and the store itself (:class:`ResultStore`:
safetensors files, written atomically)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from .._paths import cache_root
from ..errors import ConfigurationError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


def default_cache_dir() -> Path:
    """Per-question results: ``<lukv_cache's cache root>/profiling`` (``$LUKV_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/lukv_cache``, else ``~/.cache/lukv_cache``).

    >>> default_cache_dir().name
    'profiling'
    """
    return cache_root() / "profiling"


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of the model's config and a sample of every weight (fast even for 8B models): cached
    results of another model, or of other weights under the same name, are never reused."""
    h = hashlib.sha256(cast("PreTrainedConfig", model.config).to_json_string(use_diff=False).encode())
    with torch.no_grad():
        for name, param in model.state_dict().items():
            flat = param.detach().reshape(-1)
            sample = torch.cat([flat[:256], flat[:: max(1, flat.numel() // 256)][:256]])
            h.update(f"{name}{tuple(param.shape)}{param.dtype}".encode())
            h.update(sample.float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def short_sha(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ResultStore:
    """Per-question results as safetensors files (no pickle), written atomically."""

    def __init__(self, root: Path | None):
        self.root = root
        if root is None:
            return
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigurationError(
                f"Cannot use {str(root)!r} for per-question results: {err.strerror or err}. Pass another "
                "cache_dir (--cache-dir), or cache_dir=False to keep nothing."
            ) from None
        for stale in root.glob(".*.tmp"):  # left by an interrupted build, unless that build still runs
            pid = stale.name.rsplit(".", 2)[-2]
            if not (pid.isdigit() and pid_running(int(pid))):
                stale.unlink(missing_ok=True)

    def has(self, key: str) -> bool:
        """Whether a result is kept under ``key`` (a torn one is found when :meth:`load` reads it)."""
        return self.root is not None and (self.root / f"{key}.safetensors").is_file()

    def load(self, key: str) -> dict[str, np.ndarray] | None:
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        if self.root is None or not (self.root / f"{key}.safetensors").is_file():
            return None
        try:
            return load_file(self.root / f"{key}.safetensors")
        except (SafetensorError, OSError, ValueError):
            return None  # a torn or foreign file: recompute it

    def save(self, key: str, tensors: dict[str, np.ndarray]) -> None:
        from safetensors.numpy import save_file

        if self.root is None:
            return
        path = self.root / f"{key}.safetensors"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, tmp)
        os.replace(tmp, path)
