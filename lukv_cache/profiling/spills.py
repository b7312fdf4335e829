"""Spill folders for the kvzap MLP's training rows: one fresh folder per build, removed on the way out and
on SIGTERM, and swept at the next build once the build that made it is gone."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from .result_store import pid_running

_SPILL_PREFIX = "kvzap-rows-"  # + the owning build's pid + "-" + a random suffix


def _spill_owner(name: str) -> int | None:
    """The pid in a spill folder's name (``kvzap-rows-<pid>-<random>``); ``None`` for a folder of the
    release before, which put no pid in it."""
    pid, sep, _ = name.removeprefix(_SPILL_PREFIX).partition("-")
    return int(pid) if sep and pid.isdigit() else None


def _sweep_spills(root: Path) -> None:
    """Remove the row folders of builds that no longer run (killed, or stopped before they could clean):
    those whose pid is not a live process, and those of the release before (no pid in the name). Another
    build running now keeps its own."""
    for folder in root.glob(f"{_SPILL_PREFIX}*"):
        pid = _spill_owner(folder.name)
        if folder.is_dir() and (pid is None or not pid_running(pid)):
            shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _on_sigterm(cleanup: Callable[[], None]):
    """While inside: a SIGTERM first runs ``cleanup``, then does what it did before (the default: the
    process dies of the signal). Only the main thread can install handlers; elsewhere, and where SIGTERM
    was ignored, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN:
        yield
        return

    def handler(signum, frame):
        cleanup()
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        else:  # SIG_DFL (or set outside Python): die of the signal, as without this handler
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


@contextlib.contextmanager
def spill_folder(root: Path | None):
    """A fresh folder ``<root>/kvzap-rows-<pid>-<random>`` (``root=None``: the system's temporary folder)
    for the MLP's training rows, removed on the way out, on SIGTERM too; the stale folders of earlier
    builds are swept first (:func:`_sweep_spills`). A SIGKILL leaves it for the next build to sweep."""
    base = Path(tempfile.gettempdir()) if root is None else root
    base.mkdir(parents=True, exist_ok=True)
    _sweep_spills(base)
    folder = Path(tempfile.mkdtemp(prefix=f"{_SPILL_PREFIX}{os.getpid()}-", dir=base))
    try:
        with _on_sigterm(lambda: shutil.rmtree(folder, ignore_errors=True)):
            yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
