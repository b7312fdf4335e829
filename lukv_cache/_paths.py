"""Where lukv_cache keeps files of its own (converted models, per-question profiling results)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "LUKV_CACHE_DIR"


def cache_root() -> Path:
    """``$LUKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/lukv_cache``, else ``~/.cache/lukv_cache``.

    >>> cache_root().name in ("lukv_cache", os.path.basename(os.environ.get(CACHE_DIR_ENV, "lukv_cache")))
    True
    """
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lukv_cache"
