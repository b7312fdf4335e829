"""The LU-KV allocation solver (``docs/design.md``), pure numpy, no model.

For one calibration question and one (layer, KV head) ``h``:

* the scorer ranks the head's evictable tokens (sinks and the recent window excluded);
* keeping the top-``b`` tokens of that ranking loses the oracle mass of the rest: the **eviction loss**
  ``L_h(b) = sum(I_h) - sum(I_h[pi_h[:b]])``. Its marginal gains ``g_h(i) = L_h(i-1) - L_h(i)`` are simply
  the oracle importances read in the scorer's order;
* ``L_h`` is not convex wherever the scorer's order has oracle inversions. The **convex relaxation**
  projects the gains onto a non-negative, non-increasing sequence with the Pool-Adjacent-Violators
  algorithm (PAVA), i.e. takes the lower convex hull of ``L_h``;
* a **global greedy** hands out tokens by decreasing relaxed gain. On the relaxed problem it is optimal
  (:func:`exact_keep_counts` checks it), and because the relaxed gains are piecewise constant over the
  hull segments, *every* budget of the grid is read off one sort of the segment slopes.

Example::

    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> oracle, scores = rng.exponential(size=(2, 3, 100)), rng.normal(size=(2, 3, 100))
    >>> evict = solve_evict_ratios(oracle, scores, grid=np.array([0.5, 0.9]), sink=4, window=1)
    >>> evict.shape
    (2, 2, 3)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..errors import ConfigurationError

DEFAULT_GRID = np.round(np.arange(1, 100) / 100, 2).astype(np.float32)  # rho = 0.01 ... 0.99
_MAX_PARALLEL_PASSES = 64


# ----------------------------------------------------------------------------------------------------------
# loss curves


def scorer_order_gains(oracle: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Marginal gains ``g[..., i]`` = oracle importance of the i-th token in the scorer's order (best first).

    ``oracle`` and ``scores``: ``[..., n]`` over the evictable tokens of each head. Ties in the scores keep
    the token order, so the result is deterministic.

    >>> scorer_order_gains(np.array([1.0, 5.0, 2.0]), np.array([0.1, 0.3, 0.2]))
    array([5., 2., 1.])
    """
    order = np.argsort(-np.asarray(scores), axis=-1, kind="stable")  # float32 scores sort ~2x faster
    return np.take_along_axis(np.asarray(oracle, dtype=np.float64), order, axis=-1)


def loss_curve(gains: np.ndarray) -> np.ndarray:
    """Eviction loss ``L(b)`` for ``b = 0 ... n`` kept tokens, from gains in the scorer's order: ``[..., n + 1]``.

    >>> loss_curve(np.array([5.0, 2.0, 1.0]))
    array([8., 3., 1., 0.])
    """
    gains = np.asarray(gains, dtype=np.float64)
    kept = np.concatenate([np.zeros(gains.shape[:-1] + (1,)), np.cumsum(gains, axis=-1)], axis=-1)
    return kept[..., -1:] - kept


# ----------------------------------------------------------------------------------------------------------
# PAVA: projection onto non-negative, non-increasing sequences (the lower convex hull of the loss)


def _pava_rows_sequential(sums: list[float], counts: list[float]) -> tuple[list[float], list[float]]:
    """Textbook stack PAVA on one row of blocks (the fallback for rows that cascade)."""
    out_s: list[float] = []
    out_c: list[float] = []
    for s, c in zip(sums, counts):
        while out_s and out_s[-1] * c < s * out_c[-1]:  # previous mean < this mean: pool them
            s += out_s.pop()
            c += out_c.pop()
        out_s.append(s)
        out_c.append(c)
    return out_s, out_c


def pava_blocks(gains: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """PAVA of every row of ``gains [H, n]`` at once, as blocks: ``(values, lengths, rows)``, row-major.

    Each block is a run of equal relaxed gains (one segment of the convex hull of that row's loss).
    Pools all adjacent violators of all rows in parallel passes (any violating neighbours belong to the
    same final block, so pooling them is always safe); the rare row that needs a long cascade is finished
    with the sequential algorithm.

    >>> values, lengths, rows = pava_blocks(np.array([[3.0, 1.0, 2.0, 0.0]]))
    >>> values.tolist(), lengths.tolist()
    ([3.0, 1.5, 0.0], [1, 2, 1])
    """
    gains = np.asarray(gains, dtype=np.float64)
    if gains.ndim != 2:
        raise ConfigurationError(f"pava_blocks expects gains of shape [heads, n], got {gains.shape}.")
    h, n = gains.shape
    return _pava_flat(gains.ravel(), np.repeat(np.arange(h), n), h)


def _pava_flat(gains: np.ndarray, rows: np.ndarray, h: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`pava_blocks` of rows laid end to end (``rows``: each gain's row, non-decreasing; rows may
    differ in length)."""
    sums = np.maximum(gains, 0.0)  # gains are oracle masses; clip float noise below zero
    counts = np.ones_like(sums)
    for _ in range(_MAX_PARALLEL_PASSES):
        viol = (sums[:-1] * counts[1:] < sums[1:] * counts[:-1]) & (rows[:-1] == rows[1:])
        if not viol.any():
            return sums / counts, counts.astype(np.int64), rows
        starts = np.flatnonzero(np.concatenate([[True], ~viol]))
        sums, counts, rows = np.add.reduceat(sums, starts), np.add.reduceat(counts, starts), rows[starts]
    # a long cascade (e.g. one huge gain late in the order): finish the affected rows one by one
    viol = (sums[:-1] * counts[1:] < sums[1:] * counts[:-1]) & (rows[:-1] == rows[1:])
    bad = np.unique(rows[:-1][viol])
    parts_s, parts_c, parts_r = [], [], []
    bounds = np.searchsorted(rows, np.arange(h + 1))
    for r in range(h):
        s, c = sums[bounds[r] : bounds[r + 1]], counts[bounds[r] : bounds[r + 1]]
        if r in bad:
            s, c = (np.array(x) for x in _pava_rows_sequential(s.tolist(), c.tolist()))
        parts_s.append(s)
        parts_c.append(c)
        parts_r.append(np.full(len(s), r))
    sums, counts, rows = np.concatenate(parts_s), np.concatenate(parts_c), np.concatenate(parts_r)
    return sums / counts, counts.astype(np.int64), rows


def pava(gains: np.ndarray) -> np.ndarray:
    """The relaxed gains: PAVA projection of each row of ``gains`` onto non-negative, non-increasing sequences.

    >>> pava(np.array([3.0, 1.0, 2.0, 0.0]))
    array([3. , 1.5, 1.5, 0. ])
    """
    gains = np.asarray(gains, dtype=np.float64)
    flat = gains.reshape(-1, gains.shape[-1])
    values, lengths, _ = pava_blocks(flat)
    return np.repeat(values, lengths).reshape(gains.shape)


def relaxed_loss_curve(gains: np.ndarray, min_keep: int = 0) -> np.ndarray:
    """The convex relaxation of :func:`loss_curve` on ``b >= min_keep`` (PAVA of the gains after the forced
    prefix); equal to the original loss for ``b <= min_keep``.

    >>> relaxed_loss_curve(np.array([1.0, 3.0]))
    array([4., 2., 0.])
    """
    gains = np.asarray(gains, dtype=np.float64)
    relaxed = gains.copy()
    if min_keep < gains.shape[-1]:
        relaxed[..., min_keep:] = pava(gains[..., min_keep:])
    return loss_curve(relaxed)


# ----------------------------------------------------------------------------------------------------------
# budgets


def min_keep_count(n: int, min_keep: float) -> int:
    """Tokens a head of ``n`` evictable tokens always keeps: ``ceil(min_keep * n)``, at least 1, at most n.

    >>> min_keep_count(4096, 0.01), min_keep_count(10, 0.01)
    (41, 1)
    """
    if not 0.0 <= min_keep < 1.0:
        raise ConfigurationError(f"min_keep must be in [0, 1), got {min_keep}.")
    return int(min(n, max(1, math.ceil(min_keep * n - 1e-9))))


def total_keep(n_tokens: int, ratio: np.ndarray, floor: int) -> np.ndarray:
    """Tokens kept over a group of heads at global ratio(s) ``ratio``: ``round((1 - ratio) * n_tokens)``,
    never below the summed minimum keep ``floor``."""
    keep = np.rint((1.0 - np.asarray(ratio, dtype=np.float64)) * n_tokens).astype(np.int64)
    return np.clip(keep, floor, n_tokens)


def _greedy_extra(
    values: np.ndarray, lengths: np.ndarray, rows: np.ndarray, extra: np.ndarray, num_rows: int
) -> np.ndarray:
    """Greedy over hull segments for every budget at once: ``extra [G]`` tokens -> ``[G, num_rows]`` counts.

    Sorting the segment slopes once gives the greedy's order for all budgets (within a row the slopes are
    non-increasing and the sort is stable, so a row's segments are taken in order). Budget ``E`` takes every
    segment whose cumulative end is ``<= E`` plus a part of the next one.
    """
    order = np.argsort(-values, kind="stable")
    lengths, rows = lengths[order], rows[order]
    ends = np.cumsum(lengths)
    starts = ends - lengths
    nseg = len(lengths)
    budget_order = np.argsort(extra, kind="stable")
    sorted_extra = extra[budget_order]
    full = np.searchsorted(ends, sorted_extra, side="right")  # segments fully taken by each budget
    # segment i is fully taken by every budget g with full[g] > i: count it from the first such g on
    first = np.searchsorted(full, np.arange(nseg), side="right")
    g = len(extra)
    counts = np.bincount(first * num_rows + rows, weights=lengths, minlength=(g + 1) * num_rows)
    counts = np.cumsum(counts.reshape(g + 1, num_rows)[:g], axis=0)
    partial = full < nseg
    gi = np.flatnonzero(partial)
    counts[gi, rows[full[gi]]] += sorted_extra[gi] - starts[full[gi]]
    out = np.empty_like(counts)
    out[budget_order] = counts
    return np.rint(out).astype(np.int64)


def greedy_keep_counts(
    gains: np.ndarray, grid: np.ndarray | Sequence[float] = DEFAULT_GRID, min_keep: float = 0.01
) -> np.ndarray:
    """Keep counts ``[G, H]`` of the global greedy on the relaxed gains, for every ratio of ``grid``.

    ``gains [H, n]``: each head's oracle importances in its scorer's order. Every head keeps at least
    :func:`min_keep_count` tokens; the kept total at ratio ``rho`` is ``round((1 - rho) * H * n)``.

    >>> greedy_keep_counts(np.array([[5.0, 4.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]), [0.5], 0.0).tolist()
    [[2, 2]]
    """
    gains = np.asarray(gains, dtype=np.float64)
    h, n = gains.shape
    grid = check_grid(grid)
    m = min_keep_count(n, min_keep)
    keep = total_keep(h * n, grid, h * m)
    if m == n:
        return np.full((len(grid), h), n, dtype=np.int64)
    values, lengths, rows = pava_blocks(gains[:, m:])
    return m + _greedy_extra(values, lengths, rows, keep - h * m, h)


def ragged_keep_counts(
    gains: Sequence[np.ndarray], grid: np.ndarray | Sequence[float] = DEFAULT_GRID, min_keep: float = 0.01
) -> np.ndarray:
    """:func:`greedy_keep_counts` for heads of different lengths (``gains[h]``: head ``h``'s ``n_h`` gains in
    its scorer's order): every head keeps at least ``min_keep_count(n_h)``, the kept total at ratio ``rho``
    is ``round((1 - rho) * sum(n_h))``, handed out by decreasing relaxed gain. ``[G, H]``.

    >>> ragged_keep_counts([np.array([5.0, 4.0, 0.0, 0.0]), np.array([1.0, 1.0])], [0.5], 0.0).tolist()
    [[2, 1]]
    """
    grid = check_grid(grid)
    lengths = np.array([len(g) for g in gains], dtype=np.int64)
    if lengths.size == 0 or (lengths < 1).any():
        raise ConfigurationError("ragged_keep_counts needs at least one head, each with a token to rank.")
    mins = np.array([min_keep_count(int(n), min_keep) for n in lengths], dtype=np.int64)
    keep = total_keep(int(lengths.sum()), grid, int(mins.sum()))
    rest = [np.asarray(g, dtype=np.float64)[m:] for g, m in zip(gains, mins)]
    if not any(len(r) for r in rest):
        return np.broadcast_to(lengths, (len(grid), len(lengths))).copy()
    rows = np.repeat(np.arange(len(rest)), [len(r) for r in rest])
    values, blocks, block_rows = _pava_flat(np.concatenate(rest), rows, len(rest))
    return mins + _greedy_extra(values, blocks, block_rows, keep - int(mins.sum()), len(rest))


def exact_keep_counts(curves: Sequence[np.ndarray], budget: int, min_keep: Sequence[int] | int = 0):
    """Exact allocation by dynamic programming (multiple-choice knapsack); for small instances and tests.

    ``curves[h][b]``: loss of head ``h`` keeping ``b`` tokens (``b = 0 ... n_h``). Minimises the summed loss
    with exactly ``budget`` tokens kept and ``b_h >= min_keep[h]``. Returns ``(keep [H], objective)``.

    >>> exact_keep_counts([np.array([3.0, 1.0, 0.0]), np.array([2.0, 0.0, 0.0])], 2)
    (array([1, 1]), 1.0)
    """
    h = len(curves)
    mins = [min_keep] * h if isinstance(min_keep, int) else list(min_keep)
    best = np.full(budget + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((h, budget + 1), dtype=np.int64)
    for i, curve in enumerate(curves):
        new = np.full(budget + 1, np.inf)
        for b in range(mins[i], min(len(curve), budget + 1)):
            cand = np.full(budget + 1, np.inf)
            cand[b:] = best[: budget + 1 - b] + curve[b]
            better = cand < new
            new[better], choice[i, better] = cand[better], b
        best = new
    if not np.isfinite(best[budget]):
        raise ConfigurationError(f"No allocation keeps exactly {budget} tokens within the heads' limits.")
    keep, c = np.zeros(h, dtype=np.int64), budget
    for i in range(h - 1, -1, -1):
        keep[i] = choice[i, c]
        c -= keep[i]
    return keep, float(best[budget])


# ----------------------------------------------------------------------------------------------------------
# one calibration question -> local evict ratios


def check_grid(grid) -> np.ndarray:
    grid = np.asarray(grid, dtype=np.float64).reshape(-1)
    if grid.size == 0 or np.any(grid <= 0) or np.any(grid >= 1) or np.any(np.diff(grid) <= 0):
        raise ConfigurationError(
            "grid must be a non-empty, strictly increasing sequence of ratios in (0, 1)."
        )
    return grid


def solve_evict_ratios(
    oracle: np.ndarray,
    scores: np.ndarray,
    *,
    grid: np.ndarray | Sequence[float] = DEFAULT_GRID,
    sink: int = 4,
    window: int = 1,
    min_keep: float = 0.01,
    scope: str = "all",
    layers: Sequence[int] | None = None,
    held: dict[int, int] | None = None,
) -> np.ndarray:
    """Local evict ratios ``[G, L, H_kv]`` for one calibration question.

    ``oracle``, ``scores``: ``[L, H_kv, T]`` over the context. Positions ``[sink, T - window)`` are optimised;
    ``layers`` restricts the optimisation to some layers (the others, e.g. sliding-window layers, get the
    global ratio). ``scope="all"``: one budget for all heads of all layers; ``"layer"``: each layer keeps
    exactly ``1 - rho`` of its tokens and only the split between its heads is optimised.
    ``held``: layers that hold only the context's last ``held[l]`` tokens (a sliding window's ``W - 1`` at
    the end of the prompt, as the cache compresses it): their evictable tokens are ``[T - held + sink,
    T - window)``, and under ``scope="all"`` they share the one budget with the others, each head by its
    own number of tokens.

    Ratios are relative to the evictable tokens and lie in ``[0, 1 - min_keep]``.
    """
    oracle, scores = np.asarray(oracle), np.asarray(scores)
    if oracle.shape != scores.shape or oracle.ndim != 3:
        raise ConfigurationError(
            f"oracle {oracle.shape} and scores {scores.shape} must both be [L, H_kv, T]."
        )
    grid = check_grid(grid)
    num_layers, num_heads, t = oracle.shape
    n = t - sink - window
    if sink < 0 or window < 0 or n < 1:
        raise ConfigurationError(
            f"No evictable tokens: context of {t} tokens, {sink} sinks and a window of {window}."
        )
    layers = list(range(num_layers)) if layers is None else sorted(layers)
    evict = np.broadcast_to(grid[:, None, None], (len(grid), num_layers, num_heads)).astype(np.float64)
    if not layers:
        return evict.astype(np.float32)
    held = {layer: h for layer, h in (held or {}).items() if layer in layers and h < t}
    starts = [t - held[layer] + sink if layer in held else sink for layer in layers]
    for layer, start in zip(layers, starts):
        if t - window - start < 1:
            raise ConfigurationError(
                f"Layer {layer} holds {held[layer]} context tokens: nothing to evict after {sink} sinks "
                f"and a window of {window}."
            )
    gains = [
        scorer_order_gains(oracle[layer, :, start : t - window], scores[layer, :, start : t - window])
        for layer, start in zip(layers, starts)
    ]
    if scope == "all":  # one budget; heads of held layers counted by their own tokens
        heads = [g for layer_gains in gains for g in layer_gains]
        keep = ragged_keep_counts(heads, grid, min_keep).reshape(len(grid), len(layers), -1)
    elif scope == "layer":
        keep = np.stack([greedy_keep_counts(g, grid, min_keep) for g in gains], axis=1)
    else:
        raise ConfigurationError(f"scope must be 'all' or 'layer', got {scope!r}.")
    evictable = np.array([t - window - start for start in starts], dtype=np.float64)
    evict[:, layers] = 1.0 - keep / evictable[None, :, None]
    return evict.astype(np.float32)
