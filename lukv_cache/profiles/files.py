"""What the profile modules write with: :func:`atomic_write` (a file replaced whole, never half written) and
:func:`library_version` (stamped in what they write). A leaf that :mod:`.profile`, :mod:`.index` and
:mod:`.publish` import: index and publish then need no :class:`~lukv_cache.profiles.Profile` at run time, and
``Profile.push_to_hub`` imports :mod:`.publish` without an import cycle."""

from __future__ import annotations

import errno
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from .._version import __version__
from ..errors import ConfigurationError


def library_version() -> str:
    """The library's version, as stamped in the files it writes."""
    return __version__


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one, never half of one.
    Missing parent folders are created.

    An unwritable target (a folder, a read-only place, a parent that is a file) raises
    :class:`~lukv_cache.errors.ConfigurationError` naming it; nothing is left behind.
    """
    write_atomically(
        path,
        lambda tmp: Path(tmp).write_bytes(data),
        lambda message: ConfigurationError(message),
        example="x.safetensors",
        parents=True,
    )


_STALE_SECONDS = 3600  # a temp file this old is a killed writer's, whatever its pid says (pids are reused)


def write_atomically(
    path: Path,
    write: Callable[[str], object],
    error: Callable[[str], Exception],
    example: str,
    *,
    parents: bool = False,
) -> None:
    """``write(tmp)`` fills a temp file beside ``path``, which is then synced and renamed over ``path``: a
    reader sees the old file or the new one. The temp file is created as a plain ``open()`` creates a file
    (mode 0666 less the umask, applied by the kernel: the process umask is never changed, so other threads
    are unaffected) and named ``.<name>.<pid>.<random>.tmp``; once ``path`` is written, temp files of
    ``path`` left by a writer that was killed (its pid no longer runs, or older than an hour) are removed.

    Like ``open(path, "w")``: a symlink at ``path`` is written through (its target is replaced), and a
    missing parent folder is refused unless ``parents=True`` (then it is created). A folder at ``path``, a
    name the OS cannot take (a NUL byte, too long) or an ``OSError`` raises ``error(message)``
    (``example``: a file name the message suggests); nothing is left behind, whatever is raised."""
    path = Path(path)
    if "\0" in str(path):
        raise error(f"Cannot write {str(path)!r}: the path holds a NUL byte. Choose another path.")
    try:
        if path.is_symlink():
            path = Path(os.path.realpath(path))  # write through, as open() does
        if path.is_dir():
            raise error(f"Cannot write {str(path)!r}: it is a folder. Give a file name (e.g. {example}).")
        if not parents and not path.parent.is_dir():
            why = "is not a folder" if path.parent.exists() else "does not exist"
            raise error(
                f"Cannot write {str(path)!r}: its folder {str(path.parent)!r} {why}. Create it first."
            )
        if parents:
            path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _create_temp(path)
    except OSError as err:
        raise error(f"Cannot write {str(path)!r}: {err.strerror or err}. Choose another path.") from None
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise error(f"Cannot write {str(path)!r}: {err.strerror or err}. Choose another path.") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _sweep_stale(path)


def _temp_prefix(path: Path) -> str:
    # the name is cut so that the temp name stays within the 255 bytes a file name may have
    return f".{path.name[:100]}."


def _create_temp(path: Path) -> str:
    """A new empty file beside ``path``, created with ``O_EXCL`` (never an existing file or a planted link)
    and mode 0666: the kernel applies the umask, as for ``open()``."""
    if len(os.fsencode(path.name)) > 255:
        raise OSError(errno.ENAMETOOLONG, "File name too long")
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = str(path.parent / f"{_temp_prefix(path)}{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, flags, 0o666))
            return tmp
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, "no free temporary file name")


def _sweep_stale(path: Path) -> None:
    """Remove temp files of ``path`` whose writer was killed (its pid is gone, or the file is over an hour
    old); a live writer's (another thread or process writing the same path) is left alone."""
    prefix = _temp_prefix(path)
    try:
        names = [n for n in os.listdir(path.parent) if n.startswith(prefix) and n.endswith(".tmp")]
    except OSError:
        return
    for name in names:
        pid = name[len(prefix) :].split(".")[0]
        tmp = path.parent / name
        try:
            old = time.time() - tmp.stat().st_mtime > _STALE_SECONDS
            if old or (pid.isdigit() and not _running(int(pid))):
                tmp.unlink()
        except OSError:
            continue


def _running(pid: int) -> bool:
    if os.name == "nt":  # os.kill would end the process there: go by age only
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # another user's process, or a platform without signals: assume it runs
    return True
