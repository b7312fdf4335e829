"""The resumable results file of ``lukv ruler``: one JSON line per finished (length, task, sample, method),
after a first line naming the run (model, seed); a rerun reads it and runs only what is missing. Also the
samples' files (``<stem>.samples/seed<seed>/<length>/<task>.jsonl``), which a rerun reads instead of
generating again, and which another library's run can read (kvpress's RULER columns). JSON only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...errors import ConfigurationError

Key = tuple[int, str, int, str]  # length, task, sample index, method name


def key(record: dict[str, Any]) -> Key:
    return int(record["length"]), str(record["task"]), int(record["index"]), str(record["method"])


class Store:
    """``path``'s records; :meth:`append` writes one line and flushes it (a killed run loses at most the
    sample it was on). A file begun for another model or seed is refused (a :class:`ConfigurationError`)."""

    def __init__(self, path: str | Path, run: dict[str, Any]) -> None:
        self.path = Path(path)
        self.records: list[dict[str, Any]] = []
        if self.path.is_file():
            lines = list(self._read())
            head = lines[0] if lines else None
            if head is not None and {k: head.get(k) for k in run} != run:
                raise ConfigurationError(
                    f"{self.path} holds a run of {head.get('model')!r} with seed {head.get('seed')!r}, not "
                    f"{run.get('model')!r} with seed {run.get('seed')!r}: pass another --out or --name."
                )
            self.records = [r for r in lines[1:] if r.get("kind") == "sample"]
            if head is None:
                self._write({"kind": "run", **run})
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._write({"kind": "run", **run})
        self.done = {key(r) for r in self.records}

    def _read(self) -> Iterator[dict[str, Any]]:
        text = self.path.read_text(encoding="utf-8")
        whole = _whole_lines(text)
        if len(whole) != len(text):  # a line cut by a killed run: dropped from the file too
            self.path.write_text(whole, encoding="utf-8")
        return _records(whole)

    def _write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()

    def append(self, record: dict[str, Any]) -> None:
        record = {"kind": "sample", **record}
        self._write(record)
        self.records.append(record)
        self.done.add(key(record))


def _whole_lines(text: str) -> str:
    """``text`` without a last line cut by a killed run (one with no newline yet)."""
    return text if not text or text.endswith("\n") else text[: text.rfind("\n") + 1]


def _records(text: str) -> Iterator[dict[str, Any]]:
    return (json.loads(line) for line in text.splitlines() if line.strip())


def read_results(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A results file's run header (``model``, ``seed``) and its finished samples, read only (a line cut by a
    killed run is skipped, the file left as it is); a missing or empty file is a :class:`ConfigurationError`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigurationError(f"No results file {path}: run lukv ruler without --report first.")
    rows = list(_records(_whole_lines(path.read_text(encoding="utf-8"))))
    if not rows or rows[0].get("kind") != "run":
        raise ConfigurationError(f"{path} is not a lukv ruler results file (its first line names no run).")
    return rows[0], [r for r in rows[1:] if r.get("kind") == "sample"]


def read_samples(path: Path, wanted: int) -> list[dict[str, Any]] | None:
    """The first ``wanted`` samples saved at ``path``, or ``None`` when the file holds fewer."""
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows[:wanted] if len(rows) >= wanted else None


def write_samples(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
