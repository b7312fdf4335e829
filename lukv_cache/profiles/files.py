"""What the profile modules write with: :func:`atomic_write` (a file replaced whole, never half written) and
:func:`library_version` (stamped in what they write). A leaf that :mod:`.profile`, :mod:`.index` and
:mod:`.publish` import: index and publish then need no :class:`~lukv_cache.profiles.Profile` at run time, and
``Profile.push_to_hub`` imports :mod:`.publish` without an import cycle."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from .._version import __version__
from ..errors import ConfigurationError


def library_version() -> str:
    """The library's version, as stamped in the files it writes."""
    return __version__


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one, never half of one.

    An unwritable target (a folder, a read-only place, a parent that is a file) raises
    :class:`~lukv_cache.errors.ConfigurationError` naming it; nothing is left behind.
    """
    write_atomically(
        path,
        lambda tmp: Path(tmp).write_bytes(data),
        lambda message: ConfigurationError(message),
        example="x.safetensors",
    )


def write_atomically(
    path: Path, write: Callable[[str], object], error: Callable[[str], Exception], example: str
) -> None:
    """``write(tmp)`` fills a temp file beside ``path``, which is then synced, given the mode a plain
    ``open()`` would give it and renamed over ``path``: a reader sees the old file or the new one. A folder
    at ``path`` or an ``OSError`` raises ``error(message)`` (``example``: a file name the message suggests);
    nothing is left behind, whatever is raised."""
    path = Path(path)
    if path.is_dir():
        raise error(f"Cannot write {str(path)!r}: it is a folder. Give a file name (e.g. {example}).")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
    except OSError as err:
        raise error(f"Cannot write {str(path)!r}: {err.strerror or err}. Choose another path.") from None
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        # mkstemp creates 0600; give the file the mode a plain open() would (0666 minus the umask)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise error(f"Cannot write {str(path)!r}: {err.strerror or err}. Choose another path.") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
