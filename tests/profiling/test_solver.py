"""The allocation solver: PAVA, relaxation, greedy vs exact DP, budgets and limits."""

import itertools

import numpy as np
import pytest

from lukv_cache.errors import ConfigurationError
from lukv_cache.profiling.solver import (
    DEFAULT_GRID,
    exact_keep_counts,
    greedy_keep_counts,
    loss_curve,
    min_keep_count,
    pava,
    pava_blocks,
    ragged_keep_counts,
    relaxed_loss_curve,
    scorer_order_gains,
    solve_evict_ratios,
)


def _brute_force_isotonic(y):
    """Best non-increasing fit in squared error: over all partitions into contiguous blocks whose means
    are non-increasing (exhaustive; the isotonic solution is one of them)."""
    n = len(y)
    best, best_err = None, np.inf
    for cuts in itertools.product([0, 1], repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        means = [y[a:b].mean() for a, b in zip(bounds[:-1], bounds[1:])]
        if any(m1 < m2 - 1e-12 for m1, m2 in zip(means[:-1], means[1:])):
            continue
        fit = np.concatenate([np.full(b - a, m) for a, b, m in zip(bounds[:-1], bounds[1:], means)])
        err = ((fit - y) ** 2).sum()
        if err < best_err:
            best, best_err = fit, err
    return best


def test_pava_matches_brute_force_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(60):
        y = rng.exponential(size=rng.integers(1, 9))
        np.testing.assert_allclose(pava(y), _brute_force_isotonic(y), atol=1e-10)


def test_pava_rows_are_independent_and_non_increasing():
    rng = np.random.default_rng(1)
    gains = rng.lognormal(0, 2, size=(7, 50))
    fitted = pava(gains)
    assert np.all(np.diff(fitted, axis=1) <= 1e-12) and np.all(fitted >= 0)
    for row in range(7):
        np.testing.assert_allclose(fitted[row], pava(gains[row]))
    np.testing.assert_allclose(fitted.sum(axis=1), gains.sum(axis=1))  # PAVA preserves each row's mass


def test_pava_long_cascade_is_exact():
    # one huge gain at the end pools the whole row: beyond the parallel passes, the sequential fallback
    gains = np.concatenate([np.linspace(10, 1, 500)[None], np.ones((1, 500))])
    gains[0, -1] = 1e6
    values, lengths, rows = pava_blocks(gains)
    assert lengths[rows == 0].tolist() == [500]
    np.testing.assert_allclose(values[rows == 0], gains[0].mean())


def test_relaxed_loss_is_convex_and_below_the_original():
    rng = np.random.default_rng(2)
    for _ in range(20):
        gains = scorer_order_gains(rng.exponential(size=30), rng.normal(size=30))
        original, relaxed = loss_curve(gains), relaxed_loss_curve(gains)
        assert np.all(relaxed <= original + 1e-9)
        assert np.all(np.diff(relaxed, n=2) >= -1e-9)  # convex
        assert relaxed[0] == pytest.approx(original[0]) and relaxed[-1] == pytest.approx(0.0)


def test_greedy_objective_equals_exact_dp_on_relaxed_instances():
    # the paper's Figure 2a: on the relaxed problem the greedy is optimal
    rng = np.random.default_rng(3)
    for trial in range(40):
        h, n = rng.integers(2, 5), rng.integers(3, 9)
        gains = scorer_order_gains(rng.exponential(size=(h, n)) ** 2, rng.normal(size=(h, n)))
        min_keep = [0.0, 0.2][trial % 2]
        m = min_keep_count(n, min_keep)
        grid = np.array([0.1, 0.3, 0.5, 0.7, 0.9])
        keep = greedy_keep_counts(gains, grid, min_keep)
        curves = [relaxed_loss_curve(g, m) for g in gains]
        for g_idx in range(len(grid)):
            budget = int(keep[g_idx].sum())
            greedy_obj = sum(curves[i][keep[g_idx, i]] for i in range(h))
            _, dp_obj = exact_keep_counts(curves, budget, m)
            assert greedy_obj == pytest.approx(dp_obj, abs=1e-9)


def test_ragged_greedy_equals_exact_dp_on_heads_of_different_lengths():
    # sliding-window heads hold fewer tokens than full-attention ones: the one budget, still optimal
    rng = np.random.default_rng(13)
    for trial in range(40):
        lengths = rng.integers(2, 9, size=rng.integers(2, 5))
        gains = [scorer_order_gains(rng.exponential(size=n) ** 2, rng.normal(size=n)) for n in lengths]
        min_keep = [0.0, 0.3][trial % 2]
        mins = [min_keep_count(int(n), min_keep) for n in lengths]
        grid = np.array([0.1, 0.3, 0.5, 0.7, 0.9])
        keep = ragged_keep_counts(gains, grid, min_keep)
        total = lengths.sum()
        expected = np.maximum(np.rint((1 - grid) * total), sum(mins))
        np.testing.assert_array_equal(keep.sum(axis=1), expected)
        assert (keep >= mins).all() and (keep <= lengths).all()
        curves = [relaxed_loss_curve(g, m) for g, m in zip(gains, mins)]
        for g_idx in range(len(grid)):
            obj = sum(curves[i][keep[g_idx, i]] for i in range(len(gains)))
            _, dp_obj = exact_keep_counts(curves, int(keep[g_idx].sum()), mins)
            assert obj == pytest.approx(dp_obj, abs=1e-9)


def test_ragged_greedy_of_equal_lengths_is_the_plain_greedy():
    rng = np.random.default_rng(14)
    gains = rng.lognormal(0, 2, size=(6, 50))
    np.testing.assert_array_equal(
        ragged_keep_counts(list(gains), DEFAULT_GRID, 0.02), greedy_keep_counts(gains, DEFAULT_GRID, 0.02)
    )


def test_held_layers_rank_only_their_window_and_share_the_budget():
    rng = np.random.default_rng(15)
    t, held, sink, window = 120, 30, 2, 3
    oracle, scores = rng.exponential(size=(3, 2, t)), rng.normal(size=(3, 2, t))
    oracle[0, :, : t - held] = (
        1e6  # a sliding layer holds its last 30 tokens: what came before is not its own
    )
    evict = solve_evict_ratios(
        oracle, scores, grid=[0.5, 0.8], sink=sink, window=window, held={0: held, 2: held}
    )
    n = np.array([held - sink - window, t - sink - window, held - sink - window], dtype=float)
    kept = ((1 - evict) * n[None, :, None]).round()
    np.testing.assert_allclose(kept.sum(axis=(1, 2)), np.rint([0.5 * 2 * n.sum(), 0.2 * 2 * n.sum()]))
    # what layer 0 saw before its window does not count (had it, every token would go to it)
    calm = oracle.copy()
    calm[0, :, : t - held] = 0.0
    kw = dict(grid=[0.5, 0.8], sink=sink, window=window, held={0: held, 2: held})
    np.testing.assert_array_equal(evict, solve_evict_ratios(calm, scores, **kw))
    oracle[0, :, t - held + sink : t - window] *= 1e3  # its own window matters most: it keeps it all
    evict = solve_evict_ratios(oracle, scores, grid=[0.5], sink=sink, window=window, held={0: held, 2: held})
    np.testing.assert_allclose(evict[0, 0], 0.0, atol=1e-6)
    with pytest.raises(ConfigurationError, match="nothing to evict"):
        solve_evict_ratios(oracle, scores, grid=[0.5], sink=sink, window=window, held={0: 5})


def test_greedy_is_never_better_than_exact_dp_on_the_original_losses():
    rng = np.random.default_rng(4)
    for _ in range(20):
        gains = scorer_order_gains(rng.exponential(size=(3, 6)), rng.normal(size=(3, 6)))
        keep = greedy_keep_counts(gains, [0.5], 0.0)[0]
        curves = [loss_curve(g) for g in gains]
        _, dp_obj = exact_keep_counts(curves, int(keep.sum()), 1)
        assert sum(c[k] for c, k in zip(curves, keep)) >= dp_obj - 1e-9


def test_kept_total_matches_every_ratio_and_min_keep_holds():
    rng = np.random.default_rng(5)
    gains = rng.lognormal(0, 2, size=(24, 400))
    keep = greedy_keep_counts(gains, DEFAULT_GRID, 0.01)
    expected = np.rint((1 - DEFAULT_GRID.astype(np.float64)) * gains.size).astype(int)
    np.testing.assert_array_equal(keep.sum(axis=1), np.maximum(expected, 24 * 4))
    assert keep.min() >= min_keep_count(400, 0.01) == 4 and keep.max() <= 400
    assert np.all(np.diff(keep, axis=0) <= 0)  # more compression never gives a head more tokens


def test_evict_ratios_lie_in_range_and_match_rho():
    rng = np.random.default_rng(6)
    oracle, scores = rng.exponential(size=(3, 2, 205)), rng.normal(size=(3, 2, 205))
    evict = solve_evict_ratios(oracle, scores, sink=4, window=1, min_keep=0.01)
    assert evict.shape == (99, 3, 2) and evict.dtype == np.float32
    assert evict.min() >= 0 and evict.max() <= 1 - 0.01 + 1e-6
    np.testing.assert_allclose(evict.mean(axis=(1, 2)), DEFAULT_GRID, atol=1 / (6 * 200))


def test_per_layer_scope_keeps_each_layer_total():
    rng = np.random.default_rng(7)
    oracle, scores = rng.exponential(size=(3, 4, 105)), rng.normal(size=(3, 4, 105))
    oracle[0] *= 100  # layer 0 matters far more: the global scope moves budget there, per-layer cannot
    per_layer = solve_evict_ratios(oracle, scores, grid=[0.5], sink=4, window=1, scope="layer")
    np.testing.assert_allclose(per_layer[0].mean(axis=1), 0.5, atol=0.01)
    global_ = solve_evict_ratios(oracle, scores, grid=[0.5], sink=4, window=1, scope="all")
    assert global_[0, 0].mean() < global_[0, 1:].mean()


def test_layers_outside_the_optimisation_get_the_global_ratio():
    rng = np.random.default_rng(8)
    oracle, scores = rng.exponential(size=(3, 2, 50)), rng.normal(size=(3, 2, 50))
    evict = solve_evict_ratios(oracle, scores, grid=[0.2, 0.6], sink=0, window=0, layers=[0, 2])
    np.testing.assert_allclose(evict[:, 1], [[0.2, 0.2], [0.6, 0.6]])


def test_a_faithful_scorer_gets_fewer_tokens_than_an_unfaithful_one_needs():
    # head 0's scorer ranks by the oracle itself, head 1's in reverse: same mass, but head 1's relaxed
    # gains are flat, so the greedy gives head 0 what it needs first
    oracle = np.tile(np.linspace(1, 0, 100) ** 4, (1, 2, 1))
    scores = np.stack([oracle[0, 0], -oracle[0, 1]])[None]
    evict = solve_evict_ratios(oracle, scores, grid=[0.5], sink=0, window=0, min_keep=0.0)
    assert evict[0, 0, 0] > 0.5 > evict[0, 0, 1]


def test_bad_grid_and_scope_raise_configuration_error():
    gains = np.ones((2, 10))
    with pytest.raises(ConfigurationError):
        greedy_keep_counts(gains, [0.5, 0.4])
    with pytest.raises(ConfigurationError):
        greedy_keep_counts(gains, [0.0, 0.5])
    with pytest.raises(ConfigurationError):
        solve_evict_ratios(np.ones((1, 1, 10)), np.ones((1, 1, 10)), scope="model")
    with pytest.raises(ConfigurationError):
        solve_evict_ratios(np.ones((1, 1, 5)), np.ones((1, 1, 5)), sink=4, window=1)
