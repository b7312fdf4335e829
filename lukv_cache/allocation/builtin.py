"""The built-in allocators: uniform, pyramid (PyramidKV), adakv (AdaKV), global (KVzip), profile (LU-KV),
its hybrids, calibrated (the profile's score-to-gain table, competed model-wide) and threshold (KVzap / DMS)."""

from __future__ import annotations

import math
from typing import cast

import numpy as np
import torch

from ..errors import ConfigurationError
from .base import AllocationRequest, largest_remainder, register_allocator


def _option_number(
    allocator: str, name: str, value: object, low: float = 0.0, high: float = 1.0, valid: str = ""
) -> float:
    """An allocator's numeric option as a float in ``[low, high]``: Python, numpy and 0-d torch numbers;
    bools, NaN, strings, ``None`` and values out of range are a ConfigurationError naming the option."""
    if isinstance(value, torch.Tensor) and value.ndim == 0 and value.dtype != torch.bool:
        value = value.item()
    elif isinstance(value, np.generic) and not isinstance(value, np.bool_):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ConfigurationError(
            f"{allocator}: {name} must be in [{low:g}, {high:g}] (a number, not NaN), got {value!r}"
            + (f"; use {valid}." if valid else ".")
        )
    return float(value)


@register_allocator("uniform")
def uniform():
    """Every head of every layer keeps the same share: round((1 - ratio) * n) tokens (within the per-head
    minimum and n). Exactly the same count for every head of a row, so a layer's total can differ from
    ``round((1 - ratio) * n * H)`` by up to half a token per head; equal heads decode through an exact
    batched product (``lukv_cache.attention.masked``)."""

    def allocate(req: AllocationRequest) -> torch.Tensor:
        share = torch.round((1.0 - req.ratio) * req.n_evictable.double()).long()
        share = torch.minimum(torch.maximum(share, req.min_counts()), req.n_evictable)  # [B]
        return share.view(1, -1, 1).expand(len(req.layers), -1, req.num_heads)

    return allocate


@register_allocator("pyramid")
def pyramid(beta: float = 20.0):
    """PyramidKV (arXiv 2406.02069): layer budgets shrink linearly from the bottom layer to the top one.

    With an average budget k per head, the top layer keeps k / beta and the bottom one 2k - k / beta; heads
    of a layer share its budget uniformly. Layer totals are rounded model-wide by largest remainder, so
    the model keeps round((1 - ratio) * n * H * L) tokens (less only where a layer's share exceeds n).
    ``beta`` must be at least 1: ``beta=1`` is uniform, and below 1 the top layer would keep more than the
    bottom one (an inverted pyramid).
    """
    beta = _option_number("pyramid", "beta", beta, 1.0, math.inf, "1 (uniform) or more; PyramidKV uses 20")

    def allocate(req: AllocationRequest) -> torch.Tensor:
        num_layers = req.num_layers
        lo, hi = 1.0 / beta, 2.0 - 1.0 / beta
        share = torch.linspace(hi, lo, num_layers) if num_layers > 1 else torch.ones(1)
        # layer totals over all layers: the "heads" of this allocation are the layers, each holding n * H
        layer_req = AllocationRequest(
            req.scores[:1, :, :1].expand(1, -1, num_layers, -1),
            req.n_evictable * req.num_heads,
            req.ratio,
            req.layers[:1],
            num_layers,
            0.0,
        )
        model_total = torch.round((1.0 - req.ratio) * req.n_evictable.double() * req.num_heads * num_layers)
        layer_totals = largest_remainder(share.unsqueeze(0), model_total.long(), layer_req)
        heads = torch.ones(1, req.num_heads)
        return req.per_layer(lambda layer, _: largest_remainder(heads, layer_totals[:, layer], req))

    return allocate


def _competing_counts(
    scores: torch.Tensor, total: torch.Tensor, guaranteed: torch.Tensor, n: torch.Tensor
) -> torch.Tensor:
    """Keep counts ``[B, K]`` over ``K`` heads whose tokens compete: each head first keeps its
    ``guaranteed`` best (``[B]``, or ``[B, K]`` per head), the rest of each row's ``total [B]`` goes to the
    highest remaining scores (``scores`` hold no NaN: requests map them to the lowest), ties to the earlier
    head, as a stable sort of every remaining score would give them. Found without sorting: each head's
    guaranteed best by ``topk``, then per row the threshold (the ``extra``-th highest remaining score, by
    ``kthvalue``): every score above it, and the tied ones in head order until the count is reached (a
    global allocation of the whole model's tokens at every evicting fold of a budget: two sorts of ~200k
    scores took most of its time)."""
    b, k, r = scores.shape
    guaranteed = torch.minimum(guaranteed.view(b, -1).expand(b, k), n.view(b, 1))
    open_ = scores
    most = min(int(guaranteed.max()) if guaranteed.numel() else 0, r)
    # each head's guaranteed best leave the competition (which of tied ones: any, the count is the same)
    if most > 0:
        top = scores.topk(most, dim=-1, sorted=True).indices  # [B, K, most], best first
        ranks = torch.arange(most, device=scores.device)
        mine = ranks < guaranteed.to(scores.device).unsqueeze(-1)
        open_ = scores.scatter(-1, top, scores.gather(-1, top).masked_fill(mine, float("-inf")))
    counts = guaranteed.clone()
    for row in range(b):  # one threshold per batch row, not per head
        extra = int((total[row] - guaranteed[row].sum()).clamp_min(0))
        flat = open_[row].flatten()
        extra = min(extra, int(torch.isfinite(flat).sum()))
        if extra:
            cut = flat.kthvalue(flat.numel() - extra + 1).values  # the extra-th highest
            above = open_[row] > cut  # [K, R]
            tied = (open_[row] == cut).flatten()
            tied &= tied.cumsum(0) <= extra - int(above.sum())  # the earlier heads' first
            won = above.sum(-1) + tied.view(k, r).sum(-1)
            counts[row] += won.to(counts.device)
    return torch.minimum(counts, n.view(b, 1))


@register_allocator("adakv")
def adakv(alpha_safeguard: float = 0.2):
    """AdaKV (arXiv 2407.11550): within a layer, keep the globally top-scored tokens across heads, with a
    safeguard: each head first keeps ``alpha_safeguard`` of its uniform share. Scores of different heads
    are compared directly, so this suits scorers whose scale means the same for every head."""
    alpha_safeguard = _option_number("adakv", "alpha_safeguard", alpha_safeguard)

    def layer_counts(req: AllocationRequest, scores: torch.Tensor) -> torch.Tensor:
        total = req.layer_total()  # [B]
        guaranteed = torch.maximum(
            torch.floor(alpha_safeguard * total.double() / req.num_heads).long(), req.min_counts()
        ).clamp_max(req.n_evictable)
        return _competing_counts(scores, total, guaranteed, req.n_evictable)

    def allocate(req: AllocationRequest) -> torch.Tensor:
        return req.per_layer(lambda _, scores: layer_counts(req, scores))

    return allocate


@register_allocator("global", whole_model=True)
def global_():
    """KVzip's allocation (arXiv 2505.23416; kvpress ``layerwise=False``): one top-k over the tokens of every
    layer and head of the model, each head keeping at least its minimum. Scores of different layers are
    compared directly: right for attention-probability scores (kvzip), questionable for others. The cache
    holds the whole prefill's KV until every layer is scored (one layer at a time is not enough)."""

    def allocate(req: AllocationRequest) -> torch.Tensor:
        num, b, h, r = req.scores.shape
        total = torch.round((1.0 - req.ratio) * req.n_evictable.double() * h * num).long()
        flat = req.scores.permute(1, 0, 2, 3).reshape(b, num * h, r)
        counts = _competing_counts(flat, total, req.min_counts(), req.n_evictable)
        return counts.view(b, num, h).transpose(0, 1)

    return allocate


def _profile_budgets(name: str, evict_ratio, profile=None):
    """``budgets(request) -> [L, B, H]``: a profile table's per-head budgets, rounded model-wide by largest
    remainder (so the kept total is the table's own), read at the request's layers. With ``profile`` (an
    object with ``at(ratio)``), each row's table is read at that row's ratio (token budgets)."""
    if evict_ratio is None and profile is not None:
        evict_ratio = profile.at(0.5)  # the shape; rows are read at their own ratios
    if evict_ratio is None:
        raise ConfigurationError(
            f"allocator={name!r} needs an evict-ratio table: pass evict_ratio=<[layers, kv_heads] array> "
            "or use LUKVCache.from_pretrained(model_id, ratio=...) to read it from a profile."
        )
    try:
        if isinstance(evict_ratio, torch.Tensor):
            if not (evict_ratio.is_floating_point() or evict_ratio.dtype in (torch.int32, torch.int64)):
                raise TypeError(evict_ratio.dtype)
            table = evict_ratio.detach().to("cpu", torch.float64)
        else:
            array = np.asarray(evict_ratio)
            if array.dtype.kind not in "fiu":
                raise TypeError(array.dtype)
            table = torch.from_numpy(array.astype(np.float64))
    except (TypeError, ValueError) as err:
        raise ConfigurationError(
            f"allocator={name!r}: evict_ratio must be a numeric [layers, kv_heads] table, got {err}."
        ) from None
    if table.ndim != 2 or 0 in table.shape:
        raise ConfigurationError(
            f"allocator={name!r}: evict_ratio must be a [layers, kv_heads] table, got shape {tuple(table.shape)}."
        )
    if not torch.isfinite(table).all() or (table < 0).any() or (table > 1).any():
        raise ConfigurationError(f"allocator={name!r}: evict_ratio values must be finite and in [0, 1].")
    keep = (1.0 - table).flatten().unsqueeze(0)  # [1, L*H]
    memo: dict[tuple, torch.Tensor] = {}

    def budgets(req: AllocationRequest) -> torch.Tensor:
        num_layers, num_heads = table.shape
        if num_heads != req.num_heads or num_layers != req.num_layers or max(req.layers) >= num_layers:
            raise ConfigurationError(
                f"allocator={name!r}: the evict-ratio table has shape {tuple(table.shape)} but the model has "
                f"{req.num_layers} layers with {req.num_heads} KV heads. Use a profile built for this model."
            )
        key = (tuple(req.n_evictable.tolist()), tuple(req.ratio.tolist()))
        if key not in memo:
            model_req = AllocationRequest(
                req.scores[:1, :, :1].expand(1, -1, num_layers * num_heads, -1),
                req.n_evictable,
                req.ratio,
                (0,),
                num_layers,
                req.min_keep,
            )
            rows = keep
            if profile is not None:
                at = {
                    r: 1.0 - torch.as_tensor(profile.at(r), dtype=torch.float64).flatten()
                    for r in set(key[1])
                }
                rows = torch.stack([at[r] for r in key[1]])
            weights = rows.expand(len(key[0]), -1)
            totals = torch.round((weights * req.n_evictable.double().unsqueeze(-1)).sum(-1)).long()
            memo.clear()
            memo[key] = largest_remainder(weights, totals, model_req).view(-1, num_layers, num_heads)
        return memo[key][:, list(req.layers)].transpose(0, 1)

    return budgets


@register_allocator("profile", reads_profile=True)
def profile(evict_ratio=None, profile=None):
    """LU-KV (arXiv 2602.08585): per-head evict ratios read from an offline profile, ``[L, H_kv]``.

    Integer budgets are computed once for the whole model by largest remainder, so the kept total is the
    profile's own total, and each layer reads its row. ``profile=`` (a :class:`~lukv_cache.Profile`)
    instead of a table reads each prompt's row at its own ratio (what ``max_tokens`` needs)."""
    return _profile_budgets("profile", evict_ratio, profile)


@register_allocator("hybrid", reads_profile=True)
def hybrid(evict_ratio=None, floor: float = 0.5, profile=None):
    """LU-KV's profile as the prior, AdaKV's adaptivity within it (this library's, beyond the paper).

    Each layer keeps the total its profile row gives it; within the layer every head first keeps ``floor``
    of its profile budget, and the rest of the layer's total goes to the highest scores across its heads
    (AdaKV's competition). ``floor=1`` is the profile exactly; ``floor=0`` is AdaKV with the profile's
    layer totals."""
    floor = _option_number("hybrid", "floor", floor)
    budgets = _profile_budgets("hybrid", evict_ratio, profile)

    def allocate(req: AllocationRequest) -> torch.Tensor:
        prior = budgets(req)  # [L, B, H]

        def layer_counts(i: int, scores: torch.Tensor) -> torch.Tensor:
            layer_prior = prior[i]  # [B, H]
            guaranteed = torch.maximum(
                torch.floor(floor * layer_prior.double()).long(), req.min_counts().view(-1, 1)
            )
            return _competing_counts(scores, layer_prior.sum(-1), guaranteed, req.n_evictable)

        return torch.stack([layer_counts(i, req.scores[i]) for i in range(len(req.layers))])

    return allocate


@register_allocator("hybrid_global", whole_model=True, reads_profile=True)
def hybrid_global(evict_ratio=None, floor: float = 0.5, profile=None):
    """LU-KV's profile as a floor, KVzip's model-wide competition for the rest (this library's).

    Every head first keeps ``floor`` of its profile budget; the rest of the model's total goes to the highest
    scores across every layer and head, as ``global`` does. Needs every layer's scores at once (like
    ``global``), so the cache holds the prefill's KV until the last layer has attended."""
    floor = _option_number("hybrid_global", "floor", floor)
    budgets = _profile_budgets("hybrid_global", evict_ratio, profile)

    def allocate(req: AllocationRequest) -> torch.Tensor:
        return _floored_model_wide(req, req.scores, budgets(req), floor)

    return allocate


def _floored_model_wide(
    req: AllocationRequest, values: torch.Tensor, prior: torch.Tensor, floor: float
) -> torch.Tensor:
    """Keep counts ``[L, B, H]``: every head first keeps ``floor`` of its ``prior`` budget (``[L, B, H]``, at
    least its minimum), the rest of the prior's total goes to the highest ``values`` (``[L, B, H, R]``)
    across every layer and head of the row."""
    num, b, h, r = values.shape
    guaranteed = torch.maximum(
        torch.floor(floor * prior.double()).long(), req.min_counts().view(1, -1, 1)
    )  # [L, B, H]
    flat_values = values.permute(1, 0, 2, 3).reshape(b, num * h, r)
    flat_floor = guaranteed.permute(1, 0, 2).reshape(b, num * h)
    counts = _competing_counts(flat_values, prior.sum((0, 2)), flat_floor, req.n_evictable)
    return counts.view(b, num, h).transpose(0, 1)


# how a score-to-gain table's scores were centred (lukv_cache.profiling.gains builds tables with these)
GAIN_CENTRES = ("model", "head")


def _gain_table(name: str, profile) -> tuple[torch.Tensor, torch.Tensor]:
    """A profile's score-to-gain table as float64 ``(knots, gains)`` ``[L, H, Q]``, or a ConfigurationError."""
    knots, gains = getattr(profile, "gain_scores", None), getattr(profile, "gain_values", None)
    if knots is None or gains is None:
        held = (
            "no profile" if profile is None else f"the profile {getattr(profile, 'source', None) or 'given'}"
        )
        raise ConfigurationError(
            f"allocator={name!r} reads a profile's score-to-gain table, and {held} has none. Use "
            "LUKVCache.from_pretrained(model_id, ratio, scorer) with a profile that has one (format version 2; "
            "lukv_cache.profiling.with_score_gains adds it to a profile), or another allocator."
        )
    return torch.as_tensor(knots, dtype=torch.float64), torch.as_tensor(gains, dtype=torch.float64)


def expected_gains(
    scores: torch.Tensor,
    layers,
    knots: torch.Tensor,
    gains: torch.Tensor,
    centre: str = "model",
    blend: float = 1.0,
) -> torch.Tensor:
    """Each token's expected oracle gain ``[L, B, H, R]`` (float64) from its score, through its head's table.

    ``scores``: ``[L, B, H, R]`` of the model layers ``layers``, ``-inf`` where not evictable (stays
    ``-inf``). Each row's scores are centred as the table's knots are: on the row's mean over its evictable
    tokens of these layers (``centre="model"``) or over each head's own (``"head"``); between knots the
    gain is linear in the score, beyond the end knots it is the end knot's. A slope of 1e-9 per score unit is added so that tokens of equal gain (a flat stretch of the
    table) are ranked by their scores, not by their position. ``blend < 1`` returns
    ``blend * log(gain) + (1 - blend) * centred score`` instead (ordered like a geometric mean of the table's
    gain and the score's own exponential: for log-scale scores such as kvzap's, the prompt's score shrunk
    towards its head's calibration).

    >>> knots, gains = torch.tensor([[[-2.0, 2.0]]]), torch.tensor([[[0.0, 4.0]]])  # one layer, one head
    >>> scores = torch.tensor([[[[1.0, 2.0, 3.0, float("-inf")]]]])  # centred: -1, 0, 1
    >>> expected_gains(scores, (0,), knots, gains).squeeze().round(decimals=4).tolist()
    [1.0, 2.0, 3.0, -inf]
    """
    finite = torch.isfinite(scores)
    s = scores.double().masked_fill(~finite, 0.0)
    dims = (0, 2, 3) if centre == "model" else (3,)
    mean = s.sum(dim=dims, keepdim=True) / finite.sum(dim=dims, keepdim=True).clamp_min(1)
    s = s - mean  # [L, B, H, R]
    num, b, h, r = s.shape
    table_knots = knots[list(layers)]  # [L, H, Q]
    table_gains = gains[list(layers)]
    flat = s.permute(0, 2, 1, 3).reshape(num, h, b * r).contiguous()  # [L, H, B*R]
    q = table_knots.shape[-1]
    upper = torch.searchsorted(table_knots.contiguous(), flat).clamp(1, q - 1)
    lower = upper - 1
    k0, k1 = table_knots.gather(-1, lower), table_knots.gather(-1, upper)
    g0, g1 = table_gains.gather(-1, lower), table_gains.gather(-1, upper)
    step = (k1 - k0).clamp_min(1e-12)
    weight = ((flat - k0) / step).clamp(0.0, 1.0)
    value = g0 + weight * (g1 - g0) + 1e-9 * flat  # [L, H, B*R]
    if blend < 1.0:
        value = blend * torch.log(value.clamp_min(1e-9)) + (1.0 - blend) * flat
    value = value.view(num, h, b, r).permute(0, 2, 1, 3)
    return value.masked_fill(~finite, float("-inf"))


@register_allocator("calibrated", whole_model=True, reads_profile=True)
def calibrated(profile=None, floor: float = 0.0, evict_ratio=None, blend: float = 0.5):
    """LU-KV's profile and the prompt's own scores together (this library's, beyond the paper).

    Every token's score goes through its head's score-to-gain table, read from the profile
    (:mod:`lukv_cache.profiling.gains`: the oracle gain that calibration measured for tokens scoring that
    much in that head), and one model-wide top-k keeps the tokens of highest value, as ``global`` does on
    raw scores. The value is ``blend * log(expected gain) + (1 - blend) * the centred score``
    (:func:`expected_gains`): ``blend=1`` competes on the table's gain alone, ``blend=0`` on the raw
    scores (``global``'s order); the default 0.5 was chosen on the tuning texts (news articles, not the
    reported Wikipedia ones; docs/benchmarks.md). A head whose scores predict little has a flat table and
    wins tokens less by them; a prompt whose scores in a head are unusually high still gets more there.
    The model keeps the profile's total (as ``hybrid_global`` does); ``floor``: every head first keeps that
    share of its profile budget (0, the default: only its minimum). Needs every layer's scores at once
    (like ``global``), and a profile with a score-to-gain table (format version 2)."""
    floor = _option_number("calibrated", "floor", floor)
    blend = _option_number("calibrated", "blend", blend)
    knots, gains = _gain_table("calibrated", profile)
    centre = ((getattr(profile, "extra", None) or {}).get("gains") or {}).get("centre", "model")
    if centre not in GAIN_CENTRES:
        raise ConfigurationError(
            f"calibrated: the profile's score-to-gain table says its scores were centred by {centre!r}; this "
            f"lukv_cache knows {', '.join(map(repr, GAIN_CENTRES))}. Upgrade lukv_cache or rebuild the table."
        )
    budgets = _profile_budgets("calibrated", evict_ratio, profile)

    def allocate(req: AllocationRequest) -> torch.Tensor:
        h = req.num_heads
        if knots.shape[:2] != (req.num_layers, h) or max(req.layers) >= knots.shape[0]:
            raise ConfigurationError(
                f"allocator='calibrated': the score-to-gain table has shape {tuple(knots.shape[:2])} but the "
                f"model has {req.num_layers} layers with {h} KV heads. Use a profile built for this model."
            )
        values = expected_gains(req.scores, req.layers, knots, gains, centre, blend)  # [L, B, H, R]
        return _floored_model_wide(req, values, budgets(req), floor)

    return allocate


def _plain_number(value) -> float:
    """A threshold given as a Python, numpy or 0-d torch number, as a float; bools, NaN and anything else
    are a ConfigurationError (infinities are allowed: -inf keeps every token, +inf each head's minimum)."""
    if isinstance(value, torch.Tensor) and value.ndim == 0 and value.dtype != torch.bool:
        value = value.item()
    elif isinstance(value, np.generic) and not isinstance(value, np.bool_):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ConfigurationError(
            f"threshold: value must be a number (a score threshold on the scorer's scale, not NaN), got {value!r}."
        )
    return float(value)


@register_allocator("threshold", adaptive=True, reads_profile=True)
def threshold(value: float | None = None, profile=None):
    """KVzap / DMS: keep every evictable token whose score clears a threshold, so the budget follows the
    prompt (an easy prompt keeps less) instead of a fixed share.

    ``value``: a fixed threshold on the scorer's scale. Or ``profile``: a ``kvzap`` profile, whose
    surrogate records for each global ratio the threshold that removes that share of its training tokens
    (``meta["thresholds"]``); each row reads it at its ratio, so ``ratio`` is the *average* removed share
    on text like the training corpus. Below the table's first ratio the evicted share is scaled down
    linearly to none at ratio 0 (as :meth:`Profile.at` interpolates). Every head keeps at least its minimum;
    ``max_tokens`` still caps it.
    """
    if (value is None) == (profile is None):
        raise ConfigurationError("threshold: pass value= (a score threshold) or profile= (a kvzap profile).")
    grid = values = None
    if profile is not None:
        table = (getattr(getattr(profile, "surrogate", None), "meta", None) or {}).get("thresholds")
        if not isinstance(table, dict) or not table.get("grid"):
            raise ConfigurationError(
                "threshold: this profile records no score thresholds (a kvzap profile built by lukv build "
                "--scorer kvzap does); pass value= instead."
            )
        # validated when the profile was read (ProfileFormatError); a table edited since is re-checked here
        try:
            grid = torch.tensor(table["grid"], dtype=torch.float64)
            values = torch.tensor(table["values"], dtype=torch.float64)
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise ConfigurationError(
                f"threshold: the profile's score thresholds are not two lists of numbers ({err})."
            ) from None
        ordered = grid.ndim == 1 and grid.shape == values.shape and bool((grid[1:] > grid[:-1]).all())
        if (
            not ordered
            or not bool(torch.isfinite(torch.cat([grid, values])).all())
            or bool((values[1:] < values[:-1]).any())
        ):
            raise ConfigurationError(
                "threshold: the profile's score thresholds must be finite, of one length, the grid increasing and "
                "the values non-decreasing with it; rebuild the profile (lukv build <model> --scorer kvzap)."
            )
    else:
        value = _plain_number(value)

    def allocate(req: AllocationRequest) -> torch.Tensor:
        if values is None:
            tau = torch.full_like(req.ratio, float(cast(float, value)))  # value= when no profile
        else:
            tau = torch.from_numpy(
                np.interp(req.ratio.numpy(), cast(torch.Tensor, grid).numpy(), values.numpy())
            )
        above = req.scores >= tau.to(req.scores).view(1, -1, 1, 1)  # -inf (not evictable) never is
        counts = above.sum(-1).cpu()  # [L, B, H]
        if grid is not None and float(grid[0]) > 0:
            # below the first grid point the evicted share shrinks linearly to none at ratio 0, as
            # Profile.at does, instead of holding the first point's threshold
            scale = (req.ratio.double() / float(grid[0])).clamp_max(1.0).view(1, -1, 1)
            n = req.n_evictable.view(1, -1, 1)
            counts = n - torch.round((n - counts).double() * scale).long()
        low = req.min_counts().view(1, -1, 1)
        return torch.minimum(torch.maximum(counts, low), req.n_evictable.view(1, -1, 1))

    return allocate
