"""Calibration sets for profile building: one context and the questions aimed at it (format in README.md).

>>> context, questions, description = load_calibration("default")
>>> len(questions)
30
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ...errors import CalibrationFormatError, ConfigurationError, UnknownNameError

# where the shipped sets are read from, by shipped_calibrations() and calibration_path() (benchmarks'
# smoke runs point it at tiny stand-ins under the same names)
SHIPPED_FOLDER = Path(__file__).resolve().parent


def shipped_calibrations() -> list[str]:
    """Names of the calibration sets shipped with the package.

    >>> "default" in shipped_calibrations()
    True
    """
    return sorted(p.stem for p in SHIPPED_FOLDER.glob("*.jsonl"))


def calibration_path(path_or_name: str | os.PathLike) -> Path:
    """The file behind a shipped set's name (``"default"``) or a user's path."""
    path = Path(path_or_name).expanduser()
    if path.is_file():
        return path
    if isinstance(path_or_name, str) and (SHIPPED_FOLDER / f"{path_or_name}.jsonl").is_file():
        return SHIPPED_FOLDER / f"{path_or_name}.jsonl"
    if isinstance(path_or_name, str) and os.sep not in path_or_name and not path.suffix:
        raise UnknownNameError(
            f"Unknown calibration set {path_or_name!r}. Shipped sets: {', '.join(shipped_calibrations())}; "
            "or pass the path of your own JSONL file (format: lukv_cache/profiling/calibration/README.md).",
            kind="calibration set",
            name=path_or_name,
            known=shipped_calibrations(),
        )
    raise ConfigurationError(f"Calibration file {str(path)!r} does not exist.")


def load_calibration(path_or_name: str | os.PathLike) -> tuple[str, list[str], str]:
    """Read a calibration set: ``(context, questions, description)``.

    ``path_or_name``: a shipped set (``"default"``, ``"expository"``) or a JSONL file whose first line is
    ``{"type": "context", "text": ...}`` and every later line ``{"type": "question", "text": ...}``
    (optional fields: ``title``, ``description`` on the context, ``answer``, ``where`` on questions).

    >>> context, questions, description = load_calibration("expository")
    >>> questions[0].endswith("?")
    True
    """
    path = calibration_path(path_or_name)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise CalibrationFormatError(f"{path}: not UTF-8 text ({exc}).", path=str(path)) from None
    rows: list[dict] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CalibrationFormatError(
                f"{path}, line {number}: not valid JSON ({exc.msg}).", path=str(path), line=number
            ) from None
        if not isinstance(row, dict):
            raise CalibrationFormatError(
                f"{path}, line {number}: expected a JSON object, got {row!r:.60}.",
                path=str(path),
                line=number,
            )
        text = row.get("text")
        if not isinstance(text, str) or not text.strip():
            raise CalibrationFormatError(
                f"{path}, line {number}: 'text' must be a non-empty string.", path=str(path), line=number
            )
        kind = row.get("type")
        expected = "context" if not rows else "question"
        if kind != expected:
            where = "the first line" if not rows else "every line after the first"
            raise CalibrationFormatError(
                f"{path}, line {number}: 'type' is {kind!r}, but {where} must be {expected!r} "
                "(one context, then the questions).",
                path=str(path),
                line=number,
            )
        rows.append(row)
    if not rows:
        raise CalibrationFormatError(
            f"{path}: empty file; expected a context line and question lines.", path=str(path)
        )
    if len(rows) < 2:
        raise CalibrationFormatError(
            f"{path}: a context but no questions; add at least one question line.", path=str(path)
        )
    head = rows[0]
    parts = [str(head[k]).strip() for k in ("title", "description") if str(head.get(k) or "").strip()]
    description = f"{path.name}: " + (". ".join(parts) if parts else f"{len(rows) - 1} questions")
    return head["text"], [r["text"] for r in rows[1:]], description


__all__ = [
    "CalibrationFormatError",
    "SHIPPED_FOLDER",
    "calibration_path",
    "load_calibration",
    "shipped_calibrations",
]
