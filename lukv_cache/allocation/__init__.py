"""Budget allocation: how many tokens each (layer, KV head) keeps.

An allocator is a callable ``allocator(request) -> keep_counts``: it receives an :class:`AllocationRequest`
for one layer and returns int64 ``[B, H_kv]`` keep counts over the *evictable* tokens (sinks, the
protected window and padding are not evictable; sinks and window are kept on top of the budget).
Register your own with :func:`register_allocator`; look one up with :func:`get_allocator`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._registry import Registry


@dataclass
class AllocationRequest:
    """What an allocator sees for one layer.

    ``scores``: fp32 ``[B, H_kv, R]``, the scorer's scores over the compressed region, ``-inf`` where a
    token is not evictable. ``n_evictable``: int64 ``[B]`` evictable tokens per batch row (the same for
    every head). ``ratio``: the fraction of evictable tokens to remove. ``min_keep``: fraction of a
    head's evictable tokens it keeps at least (and at least one token).
    """

    scores: torch.Tensor
    n_evictable: torch.Tensor
    ratio: float
    layer_idx: int
    num_layers: int
    min_keep: float = 0.01

    @property
    def num_heads(self) -> int:
        return self.scores.shape[1]

    def min_counts(self) -> torch.Tensor:
        """Per-row minimum keep count ``[B]``: ceil(min_keep * n), at least 1, at most n."""
        n = self.n_evictable
        return torch.minimum(torch.clamp(torch.ceil(self.min_keep * n.double()).long(), min=1), n)

    def layer_total(self) -> torch.Tensor:
        """Tokens this layer keeps in total per row ``[B]``: round((1 - ratio) * n * H)."""
        return torch.round((1.0 - self.ratio) * self.n_evictable.double() * self.num_heads).long()


Allocator = Callable[[AllocationRequest], torch.Tensor]
ALLOCATORS: Registry[Callable[..., Allocator]] = Registry("allocator")


def register_allocator(
    name: str, factory: Callable[..., Allocator] | None = None, *, overwrite: bool = False
):
    """Register an allocator *factory* (called with the cache's allocator kwargs) under ``name``.

    >>> @register_allocator("half_first_head")
    ... def half_first_head():
    ...     def allocate(req):
    ...         return largest_remainder(torch.ones(req.scores.shape[:2]), req.layer_total(), req)
    ...     return allocate
    """

    def add(f):
        ALLOCATORS.add(name, f, overwrite=overwrite)
        return f

    return add(factory) if factory is not None else add


def get_allocator(name: str, **kwargs) -> Allocator:
    """Build the registered allocator ``name`` with ``kwargs`` (e.g. ``evict_ratio=`` for "profile")."""
    return ALLOCATORS.get(name)(**kwargs)


def largest_remainder(weights: torch.Tensor, totals: torch.Tensor, req: AllocationRequest) -> torch.Tensor:
    """Integer keep counts ``[B, K]`` proportional to ``weights [B or 1, K]`` summing to ``totals [B]``.

    Each entry lies in ``[min_keep, n]``: a scale ``c`` is found (bisection, "water-filling") so that
    ``sum(clamp(c * w, min, n)) == total``; then floor, and the leftover tokens go to the largest
    remainders. The sum is exact whenever the total is feasible (between K * min and K * n).
    """
    n = req.n_evictable.double().unsqueeze(-1)
    lo = req.min_counts().double().unsqueeze(-1)
    w = weights.double().expand(n.shape[0], -1).clamp_min(0)
    total = totals.double().unsqueeze(-1)
    # at c = high every head with a positive weight is at n: the bisection bracket
    high = torch.where(w > 0, n / w.clamp_min(1e-300), torch.zeros_like(w)).amax(-1, keepdim=True) + 1
    low = torch.zeros_like(high)
    for _ in range(64):
        mid = (low + high) / 2
        too_small = torch.clamp(mid * w, lo, n).sum(-1, keepdim=True) < total
        low, high = torch.where(too_small, mid, low), torch.where(too_small, high, mid)
    target = torch.clamp(high * w, lo, n)
    counts = target.floor().long()
    left = (totals - counts.sum(-1)).clamp_min(0).unsqueeze(-1)
    n_long = req.n_evictable.unsqueeze(-1)
    remainder = torch.where(counts < n_long, target - counts.double(), torch.full_like(target, -1.0))
    order = remainder.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1]).expand_as(order))
    counts = counts + ((rank < left) & (counts < n_long)).long()
    return counts


from . import builtin as _builtin  # noqa: E402,F401  (registers the built-ins)

__all__ = ["ALLOCATORS", "AllocationRequest", "get_allocator", "largest_remainder", "register_allocator"]
