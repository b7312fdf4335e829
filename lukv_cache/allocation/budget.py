"""Budget arithmetic, in one place: integer keep counts from real-valued targets (floor, then the largest
remainders), the water-filling bisection, the proportional trim of a row that asks for more than its
total (in tokens, or weighed by each layer's bytes per token: :func:`trim_weighted`), and the ratio that
fills a room. A leaf module (torch only), used by
:func:`~lukv_cache.allocation.largest_remainder` (``allocation/base.py``), by :func:`fit_counts` and
:func:`trim_counts` (also importable from ``cache/compression/fold_plan.py`` and ``cache/compression/region.py``, where they
lived) and by the ``max_tokens`` / ``decode_max_tokens`` ratios (``cache/compression/cap.py``, ``cache/compression/fold.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MAX_RATIO = 0.999999  # a row's ratio never reaches 1: every head keeps at least its min_keep share


def fill_ratio(n: torch.Tensor, total: torch.Tensor, slots: float | torch.Tensor) -> torch.Tensor:
    """float64 ``[B]``: the ratio at which ``slots`` heads of ``n [B]`` evictable tokens each keep, on
    average, their share of ``total [B]`` (the room); 0 where the room holds all ``n``. Not clamped
    (clamp it to ``[0, MAX_RATIO]``). ``slots`` may be a weighted count (heads whose tokens cost more
    count more: a memory budget's per-layer widths).

    >>> fill_ratio(torch.tensor([10, 4]), torch.tensor([8, 8]), 2).tolist()
    [0.6, 0.0]
    """
    n = n.double()
    room = total.double() / slots  # per head
    return torch.where(n > room, 1.0 - room / n.clamp_min(1), torch.zeros_like(n))


def bisect(
    too_small: Callable[[torch.Tensor], torch.Tensor], low: torch.Tensor, high: torch.Tensor, steps: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, high)`` after ``steps`` halvings of the bracket: ``mid`` replaces ``low`` where
    ``too_small(mid)``, else ``high`` (elementwise, so one call bisects many rows at once)."""
    for _ in range(steps):
        mid = (low + high) / 2
        small = too_small(mid)
        low, high = torch.where(small, mid, low), torch.where(small, high, mid)
    return low, high


def round_counts(target: torch.Tensor, totals: torch.Tensor, cap: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[R, K]``: ``target [R, K]`` (float64) floored, then one more token to each of the largest
    remainders (ties: the first) until row ``r`` sums to ``totals [R]``; with ``cap [R or 1, K]``, never
    to an entry already at its cap.

    >>> round_counts(torch.tensor([[1.5, 2.5, 1.0]], dtype=torch.float64), torch.tensor([6])).tolist()
    [[2, 3, 1]]
    """
    counts = target.floor().long()
    left = (totals.to(counts.device) - counts.sum(-1)).clamp_min(0).unsqueeze(-1)
    remainder = target - counts.double()
    if cap is not None:
        below = counts < cap
        remainder = torch.where(below, remainder, torch.full_like(target, -1.0))
    order = remainder.argsort(dim=-1, descending=True, stable=True)
    positions = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, positions)
    more = rank < left
    return counts + (more if cap is None else more & below).long()


def water_fill(
    weights: torch.Tensor, totals: torch.Tensor, low: torch.Tensor, high: torch.Tensor
) -> torch.Tensor:
    """int64 ``[B, K]`` proportional to ``weights [B or 1, K]``, each in ``[low, high]`` (``[B]`` each),
    summing to ``totals [B]`` whenever feasible: the scale ``c`` with ``sum(clamp(c * w, low, high)) ==
    total`` (bisection), then :func:`round_counts`."""
    n = high.double().unsqueeze(-1)
    lo = low.double().unsqueeze(-1)
    w = weights.double().expand(n.shape[0], -1).clamp_min(0)
    total = totals.double().unsqueeze(-1)
    # at c = top every entry with a positive weight is at its high: the bisection bracket
    top = torch.where(w > 0, n / w.clamp_min(1e-300), torch.zeros_like(w)).amax(-1, keepdim=True) + 1
    _, scale = bisect(
        lambda mid: torch.clamp(mid * w, lo, n).sum(-1, keepdim=True) < total, torch.zeros_like(top), top
    )
    return round_counts(torch.clamp(scale * w, lo, n), totals, high.unsqueeze(-1))


def fit_counts(counts: torch.Tensor, held: torch.Tensor, allowed: torch.Tensor, fill: bool) -> torch.Tensor:
    """Keep counts ``[L, B, H]`` that each head can keep (at most ``held [L, B, H]``, its evictable tokens)
    and whose row totals fit ``allowed [B]``: trimmed proportionally where a row asks for more; with
    ``fill``, a row whose heads hold fewer tokens than their budgets hands the rest of its total to the
    heads that hold more, in proportion to their budgets (water-filling, largest remainder).

    >>> fit_counts(torch.tensor([[[4, 4]]]), torch.tensor([[[2, 9]]]), torch.tensor([8]), True).tolist()
    [[[2, 6]]]
    """
    counts = torch.minimum(counts, held)
    return _fit_rows(counts, held, allowed, fill)


def trim_counts(counts: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Keep counts ``[L, B, H]`` scaled down where a row's total exceeds ``allowed [B]`` (the hard cap of
    ``max_tokens``): proportionally, floored, the leftover tokens to the largest remainders.

    >>> trim_counts(torch.tensor([[[3, 6]]]), torch.tensor([4])).tolist()
    [[[1, 3]]]
    """
    return _fit_rows(counts, None, allowed.clamp_min(0), False)


def trim_weighted(counts: torch.Tensor, allowed: torch.Tensor, weights: list[int] | None) -> torch.Tensor:
    """Keep counts ``[L, B, H]`` whose row totals fit ``allowed [B]``, each token of layer ``l`` weighing
    ``weights[l]`` (``None``: one each, :func:`trim_counts`); a row that asks
    for more is scaled down proportionally, floored (so it never passes its room).

    >>> trim_weighted(torch.tensor([[[4, 4]], [[4, 4]]]), torch.tensor([12]), [2, 1]).tolist()
    [[[2, 2]], [[2, 2]]]
    """
    if weights is None:
        return trim_counts(counts, allowed)
    w = torch.tensor(weights, dtype=torch.long, device=counts.device).view(-1, 1, 1)
    total = (counts * w).sum((0, 2))  # [B]
    allowed = allowed.to(counts.device).clamp_min(0)
    over = (total > allowed).view(1, -1, 1)
    scaled = counts * allowed.view(1, -1, 1) // total.clamp_min(1).view(1, -1, 1)
    return torch.where(over, scaled, counts)


def _fit_rows(
    counts: torch.Tensor, held: torch.Tensor | None, allowed: torch.Tensor, fill: bool
) -> torch.Tensor:
    out = counts.clone()
    for row in range(counts.shape[1]):
        cap = None if held is None else held[:, row].flatten()
        kept = _fit_row(counts[:, row].flatten(), cap, float(allowed[row]), fill)
        if kept is not None:
            out[:, row] = kept.view(counts.shape[0], counts.shape[2])
    return out


def _fit_row(want: torch.Tensor, cap: torch.Tensor | None, allowed: float, fill: bool) -> torch.Tensor | None:
    """int64 ``[K]``: one row's counts ``want [K]`` fitted to ``allowed`` tokens in all (and to ``cap [K]``,
    each entry's most, where given): scaled down proportionally where the row asks for more; with
    ``fill``, a row asking for less hands the rest to the entries below their cap, in proportion to
    their counts (water-filling); ``None`` where the row stays as it is."""
    want = want.double()
    total = allowed if cap is None else min(allowed, float(cap.double().sum()))
    asked = float(want.sum())
    if asked > total:  # proportionally down (the max_tokens trim)
        target = want * total / asked
    elif cap is not None and fill and asked < total and bool((want > 0).any()):
        room = cap.double()
        top = (room / want.clamp_min(1e-9)).max() + 1.0
        scale, _ = bisect(
            lambda mid: torch.minimum(room, mid * want).sum() < total, torch.ones_like(top), top
        )
        target = torch.minimum(room, scale * want)  # just below the total: floors never exceed it
    else:
        return None
    totals = torch.tensor([int(total)], device=target.device)
    return round_counts(target.unsqueeze(0), totals, None if cap is None else cap.unsqueeze(0)).squeeze(0)
