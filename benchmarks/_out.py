"""Where a benchmark script writes when ``--out`` is not given: outside the repository, as ``lukv bench``.

Each script has a folder of its own under the lukv cache, ``<cache>/bench/<script>`` (``$LUKV_CACHE_DIR``,
else ``$XDG_CACHE_HOME/lukv_cache``, else ``~/.cache/lukv_cache``); the scripts print what they wrote. A
run meant for a published figure says where it goes: ``--out benchmarks/results/<name>`` (one folder per
figure, with a README that gives the command; ``benchmarks/README.md``).

Standard library only: ``kvpress_efficiency.py`` runs in a virtual environment without lukv_cache, so the
cache root's rule is written here too (``tests/benchmarks`` checks it is ``lukv_cache._paths.cache_root``'s).
"""

from __future__ import annotations

import os
from pathlib import Path


def default_out(script: str) -> Path:
    """``<lukv cache>/bench/<script>``: the folder a script writes into by default (not created here)."""
    if os.environ.get("LUKV_CACHE_DIR"):
        root = Path(os.environ["LUKV_CACHE_DIR"]).expanduser()
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lukv_cache"
    return root / "bench" / script


def write_table(path: str | os.PathLike, lines: list[str]) -> None:
    """Print a result table's ``lines`` and write them to ``path`` (its folder made if needed). The
    experiments in ``benchmarks/results/kvzap_surrogate/`` write with it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {path}")
