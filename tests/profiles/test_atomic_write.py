"""write_atomically, under every file the library writes (profiles, indexes, saved contexts): the process umask
is never touched, the file gets the mode open() would give it, a symlink is written through, a missing
folder or a name the OS cannot take is a typed error, and temp files of killed writers are swept."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lukv_cache.errors import ConfigurationError
from lukv_cache.profiles.files import atomic_write, write_atomically


def _write(path, data=b"new"):
    write_atomically(
        path, lambda tmp: Path(tmp).write_bytes(data), lambda message: ConfigurationError(message), "x.bin"
    )


def test_a_write_never_changes_the_process_umask(tmp_path, monkeypatch):
    # the umask is process-wide: while it is 0, any thread's new file is world-writable
    real, calls = os.umask, []

    def umask(mask):
        calls.append(mask)
        return real(mask)

    monkeypatch.setattr(os, "umask", umask)
    _write(tmp_path / "a.bin")
    atomic_write(tmp_path / "b.bin", b"x")
    assert calls == []


@pytest.mark.skipif(os.name == "nt", reason="POSIX modes")
def test_the_written_file_gets_the_mode_open_gives_a_new_file(tmp_path):
    old = os.umask(0o027)
    try:
        _write(tmp_path / "a.bin")
        with open(tmp_path / "b.bin", "w"):
            pass
    finally:
        os.umask(old)
    assert (tmp_path / "a.bin").stat().st_mode & 0o777 == (tmp_path / "b.bin").stat().st_mode & 0o777 == 0o640


@pytest.mark.skipif(os.name == "nt", reason="symlinks")
def test_a_symlink_is_written_through_to_its_target(tmp_path):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "file.bin"
    target.write_bytes(b"old")
    link = tmp_path / "link.bin"
    link.symlink_to(target)
    _write(link)
    assert link.is_symlink() and target.read_bytes() == b"new"
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["file.bin"]


def test_a_missing_folder_is_refused_naming_it_and_nothing_is_created(tmp_path):
    with pytest.raises(ConfigurationError, match="'.*missing' does not exist. Create it first"):
        _write(tmp_path / "missing" / "a.bin")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigurationError, match="is not a folder"):
        _write(tmp_path / "file" / "a.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_atomic_write_creates_missing_folders_for_the_profile_writers(tmp_path):
    atomic_write(tmp_path / "a" / "b" / "x.bin", b"x")
    assert (tmp_path / "a" / "b" / "x.bin").read_bytes() == b"x"


@pytest.mark.parametrize("name", ["a\0b.bin", "x" * 300 + ".bin"])
def test_a_name_the_os_cannot_take_is_a_typed_error(name, tmp_path):
    with pytest.raises(ConfigurationError, match="Cannot write"):
        _write(tmp_path / name)
    assert list(tmp_path.iterdir()) == []


def test_a_long_name_the_os_takes_is_written(tmp_path):
    path = tmp_path / ("x" * 240 + ".bin")  # its temp file's name would not fit uncut
    _write(path)
    assert path.read_bytes() == b"new" and list(tmp_path.iterdir()) == [path]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_write_sweeps_the_temp_files_of_killed_writers_of_that_path_only(tmp_path):
    dead = tmp_path / f".a.bin.{_dead_pid()}.0123abcd.tmp"  # its writer was SIGKILLed
    live = tmp_path / f".a.bin.{os.getpid()}.4567abcd.tmp"  # another thread is writing a.bin now
    old = tmp_path / ".a.bin.k2j4h5g6.tmp"  # an older version's name, untouched for two hours
    other = tmp_path / f".b.bin.{_dead_pid()}.89abcdef.tmp"  # another file's
    for tmp in (dead, live, old, other):
        tmp.write_bytes(b"half")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    _write(tmp_path / "a.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name, "a.bin"])
