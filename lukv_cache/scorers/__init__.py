"""Intra-head scorers: which tokens a head keeps. Higher score = keep.

A scorer is a function ``fn(keys, values, queries, **params) -> scores``:

* ``keys``, ``values``: ``[B, H_kv, T, D]``, the prefill KV of one layer (keys after RoPE, as cached);
* ``queries``: ``[B, H_q, W, D]``, the post-RoPE queries of the last ``W = n_queries`` prefill tokens,
  or ``None`` when the scorer does not declare ``n_queries``;
* returns ``[B, H_kv, T]`` (any float dtype). Sinks and the recent window are handled by the cache, not
  by scorers, and a scorer never sees padding: the rows of a left-padded batch are scored on their own
  real tokens (and queries), so a row gets the scores it would get alone.

A *reconstruction* scorer (``kvzip``, ``kvzip_plus``) scores the whole context at once by running extra
tokens through the model after the prefill; :meth:`lukv_cache.LUKVCache.prefill` runs it.

Register your own with :func:`register_scorer`; look one up with :func:`get_scorer`.
"""

from __future__ import annotations

from . import builtin as _builtin  # noqa: F401  (registers the built-ins)
from .base import (
    SCORERS,
    Reconstruction,
    Scorer,
    check_scores,
    get_scorer,
    kvzip_scorer,
    register_scorer,
)
from .base import ScoreFn as ScoreFn  # a type, not in __all__; importable from here as before
from .kvzap import KVZAP_PLACEHOLDER, kvzap_scorer

# A 32-token recent window, as SnapKV protects: chosen on tuning texts (news articles, not the benchmark's
# Wikipedia); it halved the excess NLL at ratio 0.9 and kept retrieval (benchmarks/results/tuning/README.md).
SCORERS.add("kvzip", kvzip_scorer(window=32))
SCORERS.add("kvzip_plus", kvzip_scorer(weighted=True, name="kvzip_plus", window=32))
SCORERS.add("kvzap", KVZAP_PLACEHOLDER)

__all__ = [
    "SCORERS",
    "Reconstruction",
    "Scorer",
    "check_scores",
    "get_scorer",
    "kvzap_scorer",
    "kvzip_scorer",
    "register_scorer",
]
