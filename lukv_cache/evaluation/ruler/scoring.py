"""RULER's scoring, as RULER and kvpress define it: the prediction stripped of control characters, then a
case-insensitive substring match of each reference string; ``string_match_all`` (the share of the references
found, x100) for niah, vt, cwe and fwe, ``string_match_part`` (100 if any reference is found) for qa.

>>> score("niah_multivalue", "The numbers are 1234567 and 7654321.", ["1234567", "7654321", "1111111", "2222222"])
50.0
>>> score("qa_1", " Answer: paris\\n", ["Paris", "the city of Paris"])
100.0
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from . import family

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str | None) -> str:
    """RULER's ``postprocess_pred``: stripped, every control character (``\\x00``-``\\x1f``) a newline, stripped.

    >>> postprocess("  a\\tb\\x07 ")
    'a\\nb'
    """
    if prediction is None:
        return ""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """The share of ``references`` found in ``prediction`` (case-insensitive), x100."""
    text = prediction.lower()
    return sum(1.0 if r.lower() in text else 0.0 for r in references) / len(references) * 100


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """100 if any of ``references`` is found in ``prediction`` (case-insensitive), else 0."""
    text = prediction.lower()
    return max(1.0 if r.lower() in text else 0.0 for r in references) * 100


def score(task: str, prediction: str | None, references: Sequence[str]) -> float:
    """``task``'s metric of the postprocessed ``prediction`` against its reference strings (a sample with no
    reference, which RULER's cwe can make at tiny lengths, scores 0)."""
    if not references:
        return 0.0
    metric = string_match_part if family(task) == "qa" else string_match_all
    return metric(postprocess(prediction), references)
