"""JSON read from profile files and ``index.json``: one parser, bounded in depth.

These files come from a shared repository, so a hostile or corrupt one must fail like any malformed JSON:
deep nesting would otherwise exhaust Python's recursion while parsing it or writing it back (``RecursionError``).
"""

from __future__ import annotations

import json
from typing import Any

# a profile's metadata and index.json nest at most 4 levels; anything this deep is corrupt
MAX_DEPTH = 32


def parse_json(text: str | bytes) -> Any:
    """``json.loads``, raising :class:`ValueError` (as for any malformed JSON) when the value nests deeper
    than :data:`MAX_DEPTH`; the callers turn it into a ``ProfileFormatError`` naming the file.

    >>> parse_json('{"a": [1, 2]}')
    {'a': [1, 2]}
    >>> parse_json("[" * 100_000 + "]" * 100_000)
    Traceback (most recent call last):
    ...
    ValueError: JSON nested more than 32 levels deep
    """
    try:
        value = json.loads(text)
    except RecursionError:
        value = None
    else:
        if _depth_within(value, MAX_DEPTH):
            return value
    raise ValueError(f"JSON nested more than {MAX_DEPTH} levels deep")


def _depth_within(value: Any, limit: int) -> bool:
    """Whether ``value``'s lists and objects nest at most ``limit`` levels (walked without recursion)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth >= limit:
            return False
        stack.extend((child, depth + 1) for child in children)
    return True
