"""Intra-head scorers: which tokens a head keeps. Higher score = keep.

A scorer is a function ``fn(keys, values, queries, **params) -> scores``:

* ``keys``, ``values``: ``[B, H_kv, T, D]``, the prefill KV of one layer (keys after RoPE, as cached);
* ``queries``: ``[B, H_q, W, D]``, the post-RoPE queries of the last ``W = n_queries`` prefill tokens,
  or ``None`` when the scorer does not declare ``n_queries``;
* returns ``[B, H_kv, T]`` (any float dtype). Sinks, the recent window and padding are handled by the
  cache, not by scorers.

Register your own with :func:`register_scorer`; look one up with :func:`get_scorer`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .._registry import Registry

ScoreFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Scorer:
    """A registered scorer: the function, and what the cache must give it.

    ``n_queries``: how many trailing prefill queries it reads (0 = none).
    ``window``: the recent window it protects by default (LU-KV: 1, SnapKV: 32).
    ``params``: keyword defaults passed to ``fn``.
    """

    name: str
    fn: ScoreFn
    n_queries: int = 0
    window: int = 1
    params: dict[str, Any] = field(default_factory=dict)

    def __call__(
        self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None = None, **params: Any
    ) -> torch.Tensor:
        return self.fn(keys, values, queries, **{**self.params, **params})


SCORERS: Registry[Scorer] = Registry("scorer")


def register_scorer(
    name: str,
    fn: ScoreFn | None = None,
    *,
    n_queries: int = 0,
    window: int = 1,
    overwrite: bool = False,
    **params: Any,
):
    """Register ``fn`` as scorer ``name``; usable as a decorator.

    >>> @register_scorer("vnorm")
    ... def vnorm(keys, values, queries):
    ...     return values.norm(dim=-1)
    """

    def add(f: ScoreFn) -> ScoreFn:
        SCORERS.add(name, Scorer(name, f, n_queries, window, dict(params)), overwrite=overwrite)
        return f

    return add(fn) if fn is not None else add


def get_scorer(name: str | Scorer) -> Scorer:
    """The registered scorer ``name`` (a :class:`Scorer` passes through)."""
    return name if isinstance(name, Scorer) else SCORERS.get(name)


from . import builtin as _builtin  # noqa: E402,F401  (registers the built-ins)

__all__ = ["SCORERS", "Scorer", "get_scorer", "register_scorer"]
