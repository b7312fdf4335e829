"""Allocators turn a ratio into integer budgets that sum exactly and respect the minimums.

Minimum per head: max(1, ceil(min_keep * n)) and never more than n, the head's evictable tokens.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import tiny_model

from lukv_cache import AllocationRequest, LUKVCache, UnknownNameError, get_allocator, register_allocator
from lukv_cache.allocation import ALLOCATORS, allocators_reading_profile, largest_remainder
from lukv_cache.errors import ConfigurationError
from lukv_cache.profiles import Profile
from lukv_cache.testing import flat_profile, prompt

RATIOS = [0.0, 0.1, 0.5, 0.8, 0.95, 0.999]
ROWS = [(1,), (7,), (100,), (1000,), (1000, 300, 37)]  # evictable tokens per batch row


def request(
    n_rows, heads=4, ratio=0.5, layer_idx=0, num_layers=1, min_keep=0.01, seed=0
) -> AllocationRequest:
    """One layer's request: random scores over a region as long as the longest row; -inf past each row's
    evictable tokens."""
    n = torch.tensor(n_rows, dtype=torch.long)
    width = int(n.max())
    scores = torch.rand(len(n_rows), heads, width, generator=torch.Generator().manual_seed(seed))
    # heads differ in scale, so adakv's global competition is uneven
    scores = scores * torch.logspace(0, 2, heads).view(1, heads, 1)
    scores = scores.masked_fill(torch.arange(width) >= n.view(-1, 1, 1), float("-inf"))
    ratios = torch.full((len(n_rows),), ratio, dtype=torch.float64)
    return AllocationRequest(scores.unsqueeze(0), n, ratios, (layer_idx,), num_layers, min_keep)


def whole_model(n_rows, heads, ratio, num_layers) -> AllocationRequest:
    """One request for every layer of a model (what the cache sends a ``whole_model`` allocator)."""
    reqs = [request(n_rows, heads, ratio, idx, num_layers, seed=idx) for idx in range(num_layers)]
    first = reqs[0]
    scores = torch.cat([r.scores for r in reqs])
    return AllocationRequest(scores, first.n_evictable, first.ratio, tuple(range(num_layers)), num_layers)


def minimum(n: int, min_keep: float = 0.01) -> int:
    return min(max(1, math.ceil(min_keep * n)), n)


def assert_budgets_valid(counts: torch.Tensor, n_rows) -> None:
    assert counts.dtype == torch.long
    for row, n in enumerate(n_rows):
        assert (counts[row] >= minimum(n)).all(), (counts[row], n)
        assert (counts[row] <= n).all(), (counts[row], n)


def layer_target(n: int, heads: int, ratio: float) -> int:
    """round((1 - ratio) * n * H), raised to the minimums when they need more."""
    return max(round((1 - ratio) * n * heads), heads * minimum(n))


@pytest.mark.parametrize("n_rows", ROWS)
@pytest.mark.parametrize("ratio", RATIOS)
def test_adakv_budgets_sum_exactly_and_respect_minimums(ratio, n_rows):
    req = request(n_rows, ratio=ratio)
    counts = get_allocator("adakv")(req)[0]
    assert counts.shape == (len(n_rows), 4)
    assert_budgets_valid(counts, n_rows)
    for row, n in enumerate(n_rows):
        assert int(counts[row].sum()) == layer_target(n, 4, ratio)


@pytest.mark.parametrize("n_rows", ROWS)
@pytest.mark.parametrize("ratio", RATIOS)
def test_uniform_gives_every_head_exactly_its_rounded_share(ratio, n_rows):
    req = request(n_rows, heads=3, ratio=ratio)
    counts = get_allocator("uniform")(req)[0]
    assert counts.shape == (len(n_rows), 3)
    assert_budgets_valid(counts, n_rows)
    for row, n in enumerate(n_rows):
        share = min(max(round((1 - ratio) * n), minimum(n)), n)
        assert counts[row].tolist() == [share] * 3
        # the layer's total is the exact one up to half a token per head and the target's own rounding
        assert abs(int(counts[row].sum()) - layer_target(n, 3, ratio)) <= (3 + 1) / 2


def test_adakv_favours_high_scoring_heads_but_keeps_the_safeguard():
    req = request((1000,), heads=4, ratio=0.8)  # head 3's scores are 100x head 0's
    counts = get_allocator("adakv", alpha_safeguard=0.2)(req)[0, 0]
    share = 0.2 * 1000  # uniform share per head
    assert counts[3] > share > counts[0]
    assert counts[0] >= math.floor(0.2 * share)


@pytest.mark.parametrize("n_rows", ROWS)
@pytest.mark.parametrize("ratio", RATIOS)
def test_pyramid_budgets_sum_exactly_over_the_model_and_shrink_with_depth(ratio, n_rows):
    layers, heads = 6, 2
    counts = torch.stack(
        [
            get_allocator("pyramid")(request(n_rows, heads, ratio, idx, layers, seed=idx))[0]
            for idx in range(layers)
        ]
    )  # [L, B, H]
    for row, n in enumerate(n_rows):
        assert_budgets_valid(counts[:, row], [n] * layers)
        per_layer = counts[:, row].sum(-1)
        assert (per_layer[:-1] >= per_layer[1:]).all(), per_layer  # bottom keeps most
        total = round((1 - ratio) * n * heads * layers)
        # exact, except where the minimums force more or a layer's share is capped at n
        if (counts[:, row] > minimum(n)).all() and (counts[:, row] < n).all():
            assert int(per_layer.sum()) == total


def test_pyramid_is_strictly_pyramid_shaped_for_a_mid_ratio():
    counts = [get_allocator("pyramid")(request((1000,), 2, 0.8, idx, 4)).sum().item() for idx in range(4)]
    assert counts == [int(c) for c in get_allocator("pyramid")(whole_model((1000,), 2, 0.8, 4)).sum((1, 2))]
    assert counts[0] > counts[1] > counts[2] > counts[3]
    assert sum(counts) == round(0.2 * 1000 * 2 * 4)


def profile_table(layers=3, heads=2, seed=0) -> torch.Tensor:
    return torch.rand(layers, heads, generator=torch.Generator().manual_seed(seed)) * 0.9


@pytest.mark.parametrize("n_rows", ROWS)
def test_profile_budgets_follow_the_table_and_sum_exactly_over_the_model(n_rows):
    table = profile_table()
    layers, heads = table.shape
    allocate = get_allocator("profile", evict_ratio=table)
    counts = torch.stack(
        [allocate(request(n_rows, heads, 0.5, idx, layers, seed=idx))[0] for idx in range(layers)]
    )  # [L, B, H]
    for row, n in enumerate(n_rows):
        assert_budgets_valid(counts[:, row], [n] * layers)
        wanted = (1 - table.double()) * n
        if (wanted >= minimum(n) + 1).all():
            assert int(counts[:, row].sum()) == round(float(wanted.sum()))
            assert ((counts[:, row] - wanted).abs() < 1).all()


def test_profile_table_of_a_higher_evict_ratio_keeps_fewer_tokens():
    table = torch.tensor([[0.2, 0.9], [0.5, 0.0]])
    allocate = get_allocator("profile", evict_ratio=table)
    counts = torch.cat([allocate(request((100,), 2, 0.5, idx, 2))[0] for idx in range(2)])
    assert allocate(whole_model((100,), 2, 0.5, 2)).flatten(0, 1).tolist() == counts.tolist()
    assert counts.tolist() == [[80, 10], [50, 100]]


def test_largest_remainder_is_proportional_exact_and_bounded():
    req = request((50,), heads=5, ratio=0.5)
    weights = torch.tensor([[1.0, 2.0, 3.0, 4.0, 0.0]])
    counts = largest_remainder(weights, torch.tensor([100]), req)
    assert int(counts.sum()) == 100
    assert counts[0, 4] == minimum(50)  # zero weight: only the minimum
    assert (counts[0, :3].diff() > 0).all() and counts[0, 3] <= 50


def test_row_with_nothing_evictable_keeps_nothing():
    req = request((100, 0), heads=2, ratio=0.5)
    for name in ("uniform", "adakv"):
        counts = get_allocator(name)(req)[0]
        assert counts[1].tolist() == [0, 0]
        assert int(counts[0].sum()) == 100


def test_cache_keeps_exactly_the_uniform_budget_per_head_plus_sinks_and_window():
    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 80, seed=3)
    cache = LUKVCache(0.8, "keydiff", "uniform", sink=4, window=2)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    evictable = 80 - 4 - 2
    stored = cache.stored_tokens()  # [L, B, H]
    assert stored.shape == (2, 1, 2)
    assert (stored - 4 - 2).sum(-1).flatten().tolist() == [round(0.2 * evictable * 2)] * 2


def test_register_allocator_makes_a_name_usable_by_the_cache(monkeypatch):
    monkeypatch.setattr(ALLOCATORS, "_items", dict(ALLOCATORS._items))

    @register_allocator("test_first_head_only")
    def first_head_only(extra: int = 0):
        def allocate(req):
            def layer_counts(layer, scores):
                counts = req.min_counts().view(-1, 1).repeat(1, req.num_heads)
                counts[:, 0] = req.n_evictable
                return counts

            return req.per_layer(layer_counts)

        return allocate

    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(0.5, allocator="test_first_head_only", allocator_kwargs={"extra": 1}, sink=0, window=1)
    with torch.no_grad():
        model(prompt(1, 41), past_key_values=cache)
    assert cache.stored_tokens()[:, 0].tolist() == [[41, 2], [41, 2]]  # 40 evictable: min 1 + window 1


def test_the_built_in_allocators_that_read_a_profile_are_flagged():
    assert allocators_reading_profile() == ("calibrated", "hybrid", "hybrid_global", "profile", "threshold")
    assert not any(ALLOCATORS.get(name).reads_profile for name in ("uniform", "pyramid", "adakv", "global"))


@pytest.mark.parametrize("reads_profile", [True, False])
def test_from_pretrained_gives_the_profile_to_an_allocator_registered_as_reading_it(
    monkeypatch, tmp_path, reads_profile
):
    """CONTRIBUTING.md's recipe: ``reads_profile=True`` is all it takes to receive ``profile=``."""
    monkeypatch.setattr(ALLOCATORS, "_items", dict(ALLOCATORS._items))  # the registration ends with the test
    received = []

    @register_allocator("test_reads_profile", reads_profile=reads_profile)
    def reads(profile=None):
        received.append(profile)

        def allocate(req):
            return req.per_layer(
                lambda layer, s: largest_remainder(torch.ones(1, req.num_heads), req.layer_total(), req)
            )

        return allocate

    assert ("test_reads_profile" in allocators_reading_profile()) is reads_profile
    curves = flat_profile(2, 2, grid=[0.25, 0.5, 0.75], head_dim=16)
    cache = LUKVCache.from_pretrained(
        curves.save(tmp_path / "p.safetensors"), 0.5, allocator="test_reads_profile"
    )
    assert received and all(p is (cache.profile if reads_profile else None) for p in received)
    with torch.no_grad():
        tiny_model("llama", "sdpa")(prompt(1, 40), past_key_values=cache)
    assert cache.stored_tokens().shape == (2, 1, 2)


def test_unknown_allocator_error_lists_the_known_names():
    with pytest.raises(UnknownNameError) as info:
        LUKVCache(0.5, allocator="pyramidkv")
    for name in ("uniform", "pyramid", "adakv", "profile"):
        assert name in str(info.value)


@pytest.mark.parametrize(("name", "kwargs"), [("pyramid", {"beta": 0}), ("adakv", {"alpha_safeguard": 1.5})])
def test_allocator_parameters_out_of_range_raise_configuration_error(name, kwargs):
    with pytest.raises(ConfigurationError):
        LUKVCache(0.5, allocator=name, allocator_kwargs=kwargs)


def test_hybrid_with_full_floor_is_the_profile_and_keeps_its_layer_totals_otherwise():
    table = torch.tensor([[0.2, 0.9], [0.5, 0.0]])
    req = whole_model((100, 40), 2, 0.5, 2)
    profile_counts = get_allocator("profile", evict_ratio=table)(req)
    assert torch.equal(get_allocator("hybrid", evict_ratio=table, floor=1.0)(req), profile_counts)
    for floor in (0.0, 0.5):
        counts = get_allocator("hybrid", evict_ratio=table, floor=floor)(req)
        assert torch.equal(counts.sum(-1), profile_counts.sum(-1))  # each layer keeps its profile total
        assert (counts >= torch.floor(floor * profile_counts)).all()


def test_hybrid_moves_budget_to_the_head_whose_scores_are_higher():
    table = torch.full((1, 4), 0.8)
    req = request((1000,), heads=4, ratio=0.8)  # head 3's scores are 100x head 0's
    counts = get_allocator("hybrid", evict_ratio=table, floor=0.5)(req)[0, 0]
    assert counts[3] > 200 > counts[0] >= 100


def test_hybrid_global_with_full_floor_is_the_profile_and_without_floor_is_global():
    table = torch.tensor([[0.2, 0.9], [0.5, 0.5]])
    req = whole_model((100, 40), 2, 0.5, 2)
    profile_counts = get_allocator("profile", evict_ratio=table)(req)
    assert torch.equal(get_allocator("hybrid_global", evict_ratio=table, floor=1.0)(req), profile_counts)
    free = get_allocator("hybrid_global", evict_ratio=table, floor=0.0)(req)
    assert torch.equal(free.sum((0, 2)), profile_counts.sum((0, 2)))  # the profile's model total
    assert not torch.equal(free, profile_counts)  # spread by score, across layers
    assert get_allocator("hybrid_global", evict_ratio=table).whole_model


# ------------------------------------------------------------------------------------------ calibrated


def _calibrated_profile(gain_values: np.ndarray, ratio: float = 0.5) -> Profile:
    """One layer, two heads, a flat budget curve; knots of both heads span [-1, 1]."""
    heads = gain_values.shape[1]
    knots = np.broadcast_to(np.linspace(-1, 1, gain_values.shape[-1], dtype=np.float32), gain_values.shape)
    return flat_profile(
        1, heads, grid=[0.25, 0.5, 0.75], gain_scores=knots.copy(), gain_values=gain_values.astype(np.float32)
    )


def _two_heads(n: int = 200, ratio: float = 0.5) -> AllocationRequest:
    """Head 0 scores far below head 1 (raw scores), the same spread inside each."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(1, 1, 2, n, generator=gen) * 2 - 1
    scores[:, :, 0] -= 0.5
    scores[:, :, 1] += 0.5
    return AllocationRequest(scores, torch.tensor([n]), torch.tensor([ratio], dtype=torch.float64), (0,), 1)


def test_calibrated_gives_the_tokens_to_the_head_whose_scores_are_worth_more():
    req = _two_heads()
    steep, flat = np.linspace(0, 10, 8), np.full(8, 0.1)
    table = _calibrated_profile(np.stack([steep, flat])[None])
    counts = get_allocator("calibrated", profile=table, blend=1.0)(req)
    raw = get_allocator("global")(req)
    assert int(counts.sum()) == int(raw.sum()) == 200  # the profile's total: half of 2 x 200
    assert raw[0, 0, 1] > raw[0, 0, 0]  # on raw scores head 1 wins ...
    assert counts[0, 0, 0] > 2 * counts[0, 0, 1]  # ... on expected gain head 0 does
    # swapping the tables swaps the outcome: the table decides, not the raw scale
    swapped = get_allocator(
        "calibrated", profile=_calibrated_profile(np.stack([flat, steep])[None]), blend=1.0
    )(req)
    assert swapped[0, 0, 1] > 2 * swapped[0, 0, 0]


def test_calibrated_blend_zero_is_globals_order_and_the_default_lies_between():
    req = _two_heads()
    table = _calibrated_profile(np.stack([np.linspace(0, 10, 8), np.full(8, 0.1)])[None])
    raw = get_allocator("global")(req)
    assert torch.equal(get_allocator("calibrated", profile=table, blend=0.0)(req), raw)
    alone = get_allocator("calibrated", profile=table, blend=1.0)(req)
    default = get_allocator("calibrated", profile=table)(req)  # blend 0.5
    assert alone[0, 0, 0] > default[0, 0, 0] > raw[0, 0, 0]


def test_calibrated_with_a_floor_keeps_that_share_of_each_profile_budget():
    req = _two_heads()
    tables = np.stack([np.linspace(0, 10, 8), np.full(8, 0.1)])[None]
    counts = get_allocator("calibrated", profile=_calibrated_profile(tables), floor=0.8)(req)
    assert int(counts.sum()) == 200 and int(counts[0, 0, 1]) >= 80  # 0.8 of its 100


def test_calibrated_without_a_table_or_with_a_bad_floor_is_refused():
    plain = flat_profile(1, 2, grid=[0.5])
    with pytest.raises(ConfigurationError, match="score-to-gain table"):
        get_allocator("calibrated", profile=plain)
    with pytest.raises(ConfigurationError, match="score-to-gain table"):
        get_allocator("calibrated")
    with pytest.raises(ConfigurationError, match="floor must be in"):
        get_allocator("calibrated", profile=_calibrated_profile(np.ones((1, 2, 4))), floor=2.0)
    with pytest.raises(
        ConfigurationError, match="centred by 'median'; this lukv_cache knows 'model', 'head'"
    ):
        table = _calibrated_profile(np.ones((1, 2, 4)))
        table.extra = {"gains": {"centre": "median"}}
        get_allocator("calibrated", profile=table)
    with pytest.raises(ConfigurationError, match=r"table has shape \(1, 2\) but the model has 2 layers"):
        req = _two_heads()
        get_allocator("calibrated", profile=_calibrated_profile(np.ones((1, 2, 4))))(
            AllocationRequest(req.scores.expand(2, -1, -1, -1), req.n_evictable, req.ratio, (0, 1), 2)
        )
    with pytest.raises(ConfigurationError, match="blend must be in"):
        get_allocator("calibrated", profile=_calibrated_profile(np.ones((1, 2, 4))), blend=-1)


@pytest.mark.parametrize(
    ("name", "option"),
    [("pyramid", "beta"), ("adakv", "alpha_safeguard"), ("hybrid", "floor"), ("calibrated", "floor")]
    + [("calibrated", "blend"), ("hybrid_global", "floor")],
)
@pytest.mark.parametrize("value", [float("nan"), "0.5", None, True, [0.5]])
def test_allocator_options_that_are_not_numbers_raise_configuration_error_naming_the_option(
    name, option, value
):
    table = _calibrated_profile(np.ones((1, 2, 4)))
    kwargs = {} if name in ("pyramid", "adakv") else {"profile": table}
    with pytest.raises(ConfigurationError, match=f"{name}: {option} must be in"):
        get_allocator(name, **kwargs, **{option: value})


@pytest.mark.parametrize("beta", [0.25, 0.999])
def test_pyramid_refuses_a_beta_below_one_which_would_invert_the_pyramid(beta):
    with pytest.raises(ConfigurationError, match=r"beta must be in \[1, inf\]"):
        get_allocator("pyramid", beta=beta)


def test_pyramid_with_beta_one_is_uniform_and_larger_betas_shrink_the_top_layer():
    req = whole_model((100,), heads=2, ratio=0.5, num_layers=4)
    flat = get_allocator("pyramid", beta=1.0)(req)
    assert (flat == 50).all()
    steep = get_allocator("pyramid", beta=np.float64(20.0))(req)
    assert steep[0, 0, 0] > steep[-1, 0, 0]


def test_threshold_below_its_first_grid_point_evicts_a_proportional_share_as_a_profile_does():
    """A table whose first point is ratio 0.5: at ratio 0.25 half of that point's evictions happen, and a
    ratio near 0 keeps (nearly) every token, as Profile.at interpolates towards ratio 0."""
    from types import SimpleNamespace

    table = {"grid": [0.5, 0.9], "values": [0.0, 1.0]}
    profile = SimpleNamespace(surrogate=SimpleNamespace(meta={"thresholds": table}))
    scores = torch.linspace(-1, 1, 100).view(1, 1, 1, 100).expand(1, 3, 2, 100).contiguous()
    ratios = torch.tensor([1e-6, 0.25, 0.5], dtype=torch.float64)
    req = AllocationRequest(scores, torch.tensor([100, 100, 100]), ratios, (0,), 1, 0.0)
    counts = get_allocator("threshold", profile=profile)(req)[0, :, 0]  # [B]
    at_first = int((torch.linspace(-1, 1, 100) >= 0.0).sum())  # 50 kept at ratio 0.5
    assert counts.tolist() == [100, 100 - round((100 - at_first) / 2), at_first]


def _competing_counts_by_sorting(scores, total, guaranteed, n):
    """The reference: each head's guaranteed best out by a sort, then a stable sort of every remaining
    score, its first ``extra`` counted per head (what ``_competing_counts`` computed before its threshold)."""
    b, k, r = scores.shape
    guaranteed = torch.minimum(guaranteed.view(b, -1).expand(b, k), n.view(b, 1))
    ranked = scores.sort(dim=-1, descending=True).values
    open_ = ranked.masked_fill(torch.arange(r) < guaranteed.unsqueeze(-1), float("-inf"))
    counts = guaranteed.clone()
    for row in range(b):
        extra = int((total[row] - guaranteed[row].sum()).clamp_min(0))
        flat = open_[row].flatten()
        extra = min(extra, int(torch.isfinite(flat).sum()))
        if extra:
            winners = flat.argsort(descending=True, stable=True)[:extra] // r
            counts[row] += torch.bincount(winners, minlength=k)
    return torch.minimum(counts, n.view(b, 1))


def test_competing_counts_by_threshold_equal_a_stable_sort_of_every_score():
    # ties (scores on a coarse grid), -inf (tokens never evictable), per-head and per-row guarantees, totals
    # below and above what the guarantees take
    from lukv_cache.allocation.builtin import _competing_counts

    gen = torch.Generator().manual_seed(0)
    for case in range(400):
        b, k, r = (int(torch.randint(1, hi, (1,), generator=gen)) for hi in (4, 9, 40))
        scores = torch.randint(0, 1 + case % 7, (b, k, r), generator=gen).float()
        scores[torch.rand(b, k, r, generator=gen) < 0.2] = float("-inf")
        n = torch.randint(0, r + 1, (b,), generator=gen)
        shape = (b, k) if case % 2 else (b,)
        guaranteed = torch.randint(0, r + 1, shape, generator=gen)
        total = torch.randint(0, k * r + 5, (b,), generator=gen)
        got = _competing_counts(scores, total, guaranteed, n)
        want = _competing_counts_by_sorting(scores, total, guaranteed, n)
        assert torch.equal(got, want), (case, got, want)
