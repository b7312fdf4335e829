"""How the benchmark scripts pass a cache to a model: under the keyword its forward takes it by.

transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns, and goes in 5.40); 5.23 has only
the old one. Standard library only (``tests/benchmarks/test_calls.py`` checks it agrees with the library's own
rule, and that the scripts use it).
"""

from __future__ import annotations

import inspect

_KNOWN: dict[type, str] = {}  # per model class: its forward's signature is read once


def cache_kw(model) -> str:
    """``"cache"`` when ``model``'s forward has a ``cache`` parameter (transformers 5.24 and later), else
    ``"past_key_values"``: ``model(input_ids=ids, **{cache_kw(model): cache})``. A dict lookup after the first
    call for a model class, so it costs nothing measurable inside a timed loop."""
    kind = type(model)
    if kind not in _KNOWN:
        names = inspect.signature(model.forward).parameters
        _KNOWN[kind] = "cache" if "cache" in names else "past_key_values"
    return _KNOWN[kind]
