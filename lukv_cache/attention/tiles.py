"""The CPU ragged attention: a few fused calls per layer over fixed-size tiles of the flat store.

The flat store ``keys [N, D]`` is viewed in place as ``N // C`` tiles of ``C`` rows (no copy); a tile
that lies inside one segment is attended by that segment's queries. The rows left over (tiles shared by
several segments, and the last partial tile) are gathered into a few extra tiles, one per (tile,
segment), with a bias hiding the other segments' rows. The dense suffix, when given, is one more part per
segment. Every tile is one work item of torch's fused CPU attention, so a layer costs at most three calls
that spread over all threads whatever the segment lengths, and the parts' log-sum-exps merge exactly into
one result per segment (the flash-decoding merge, in fp32).

The plan (which tile serves which segment, the biases, the gather, where each part lands in the merge)
depends only on the offsets: it is computed once per store (the cache rebuilds its store every few hundred
decode steps) and reused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .._ops import flash_attention_cpu as _flash_cpu
from .limits import AttentionLimits, resolve_limits

_NEG = torch.finfo(torch.float32).min


@dataclass(frozen=True)
class TilePlan:
    """How one store is cut into tiles (see the module docstring).

    Parts are numbered in-place tiles first, then gathered tiles, then (if any) one suffix part per
    segment; ``grid [segments, K]`` lists each segment's parts, padded with part 0 where ``padding``
    (bool ``[segments, K, 1]``) is True.
    """

    size: int
    in_place: int
    owner: torch.Tensor  # int64 [in_place], the segment whose queries attend tile j
    gather_index: torch.Tensor  # int64 [extra * size], rows of the gathered tiles
    gather_bias: torch.Tensor  # fp32 [extra, 1, 1, size]
    gather_owner: torch.Tensor  # int64 [extra]
    grid: torch.Tensor  # int64 [segments, K] (without the suffix part)
    suffix_grid: torch.Tensor  # int64 [segments, K + 1] (the suffix part of segment s last)
    padding: torch.Tensor  # bool [segments, K, 1]: the grid's padding entries
    suffix_padding: torch.Tensor  # bool [segments, K + 1, 1]


def tile_plan(offsets: torch.Tensor, total: int, size: int | None = None) -> TilePlan:
    """The tiles of a store with ``offsets [S + 1]`` and ``total`` rows, ``size`` rows each (default:
    ``AttentionLimits.tile_rows``).

    >>> plan = tile_plan(torch.tensor([0, 5, 12]), 12, size=4)
    >>> plan.in_place, plan.owner.tolist(), plan.gather_owner.tolist(), plan.grid.tolist()
    (3, [0, 0, 1], [0, 1], [[0, 3], [2, 4]])
    """
    size = resolve_limits(None).tile_rows if size is None else size
    segments = offsets.numel() - 1
    seg = torch.repeat_interleave(torch.arange(segments), offsets.diff(), output_size=total)
    in_place = total // size
    padded = torch.full(((in_place + 1) * size,), -1, dtype=torch.long)
    padded[:total] = seg
    tiles = padded.view(in_place + 1, size)
    owner = tiles[:in_place, 0].clone()
    whole = (tiles[:in_place] == owner[:, None]).all(-1)  # tiles inside one segment
    # Every (tile, segment) pair of a shared tile or of the partial last tile is gathered.
    gathered = torch.cat([~whole, torch.tensor([True])])
    rows = tiles[gathered]
    tile_idx = torch.arange(in_place + 1)[gathered][:, None].expand_as(rows)
    present = rows >= 0
    n_seg = max(segments, 1)
    pairs = torch.unique(tile_idx[present] * n_seg + rows[present])  # sorted by (tile, segment)
    gather_tile, gather_owner = pairs // n_seg, pairs % n_seg
    gather_index = (gather_tile[:, None] * size + torch.arange(size)).clamp_(max=max(total - 1, 0))
    hidden = tiles[gather_tile] != gather_owner[:, None]
    gather_bias = torch.zeros(hidden.shape).masked_fill_(hidden, _NEG).view(-1, 1, 1, size)

    # Which parts serve each segment; a shared in-place tile serves nobody (it is gathered instead).
    part_segment = torch.cat([torch.where(whole, owner, -1), gather_owner])
    n_parts = part_segment.numel()
    grid = _grid(part_segment, segments, empty=-1)
    padding = (grid < 0).unsqueeze(-1)
    grid = grid.clamp_(min=0)
    suffix_part = torch.arange(n_parts, n_parts + segments)[:, None]  # the suffix parts follow the rest
    return TilePlan(
        size=size,
        in_place=in_place,
        owner=owner,
        gather_index=gather_index.flatten(),
        gather_bias=gather_bias,
        gather_owner=gather_owner,
        grid=grid,
        suffix_grid=torch.cat([grid, suffix_part], dim=1),
        padding=padding,
        suffix_padding=torch.cat([padding, torch.zeros(segments, 1, 1, dtype=torch.bool)], dim=1),
    )


def _grid(part_segment: torch.Tensor, segments: int, *, empty: int) -> torch.Tensor:
    """int64 ``[segments, K]``: the parts of each segment (in order), padded with ``empty``."""
    valid = part_segment >= 0
    seg = part_segment[valid]
    counts = torch.bincount(seg, minlength=segments)
    k = int(counts.max()) if segments else 0
    order = torch.argsort(seg, stable=True)
    rank = torch.arange(seg.numel()) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    grid = torch.full((segments, k), empty, dtype=torch.long)
    grid[seg[order], rank] = torch.arange(part_segment.numel())[valid][order]
    return grid


# One plan per live store: keyed by the store's offsets tensor (a new store has new offsets); a call with
# another tile size replaces it.
_PLANS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _plan_for(offsets: torch.Tensor, total: int, size: int) -> TilePlan:
    plan = _PLANS.get(offsets)
    if plan is None or plan.size != size:
        plan = _PLANS[offsets] = tile_plan(offsets.cpu(), total, size)
    return plan


def serves(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, softcap: float | None) -> bool:
    """Whether :func:`tiled_ragged_attention` can take this call (CPU, fused kernel, no softcap)."""
    return (
        _flash_cpu is not None
        and softcap is None
        and query.device.type == "cpu"
        and query.dtype == keys.dtype == values.dtype
        and keys.shape[-1] == values.shape[-1]
    )


def tiled_ragged_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    *,
    scaling: float,
    suffix_keys: torch.Tensor | None = None,
    suffix_values: torch.Tensor | None = None,
    with_lse: bool = True,
    limits: AttentionLimits | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``ragged_attention_reference`` (no softcap, no key bias) in at most three fused calls, over tiles
    of ``limits.tile_rows`` rows (:data:`.limits.LIMITS` by default).

    ``query [B, H_kv, M, D]`` over each segment of ``keys/values [N, D]`` and, when given, its rows of
    the dense ``suffix_keys/values [B, H_kv, S, D]`` (all attended, no bias); fp32 ``out [B, H_kv, M, D]``
    and ``lse [B, H_kv, M]`` (``None`` without ``with_lse``, one op less), a segment with nothing to
    attend giving ``out = 0`` and ``lse = -inf``.

    >>> from lukv_cache.attention.partial import ragged_attention_reference
    >>> q, k = torch.randn(1, 2, 3, 8), torch.randn(700, 8)
    >>> out, lse = tiled_ragged_attention(q, k, k, torch.tensor([0, 300, 700]), scaling=0.35)
    >>> ref, ref_lse = ragged_attention_reference(q, k, k, [0, 300, 700], scaling=0.35)
    >>> bool(torch.allclose(out, ref, atol=1e-5)), bool(torch.allclose(lse, ref_lse, atol=1e-5))
    (True, True)
    """
    b, h, m, d = query.shape
    segments, dv = b * h, values.shape[-1]
    plan = _plan_for(offsets, keys.shape[0], resolve_limits(limits).tile_rows)
    with_suffix = suffix_keys is not None and suffix_keys.shape[-2] > 0
    grid = plan.suffix_grid if with_suffix else plan.grid
    if grid.shape[1] == 0:  # nothing stored and no suffix
        out = query.new_zeros((b, h, m, dv), dtype=torch.float32)
        return out, query.new_full((b, h, m), float("-inf"), dtype=torch.float32)
    q = query.reshape(segments, m, d)
    c = plan.size
    outs: list[torch.Tensor] = []
    lses: list[torch.Tensor] = []

    def attend(queries, k, v, bias=None):
        flash = cast("Callable[..., Any]", _flash_cpu)  # serves() checked it is there
        out, lse = flash(queries, k, v, 0.0, False, attn_mask=bias, scale=scaling)[:2]
        outs.append(out.reshape(-1, m, dv))
        lses.append(lse.reshape(-1, m))

    if plan.in_place:
        rows = plan.in_place * c
        tiles_k = keys[:rows].reshape(plan.in_place, 1, c, d)
        tiles_v = values[:rows].reshape(plan.in_place, 1, c, dv)
        attend(q.index_select(0, plan.owner).unsqueeze(1), tiles_k, tiles_v)
    if plan.gather_owner.numel():
        extra = plan.gather_owner.numel()
        attend(
            q.index_select(0, plan.gather_owner).unsqueeze(1),
            keys.index_select(0, plan.gather_index).view(extra, 1, c, d),
            values.index_select(0, plan.gather_index).view(extra, 1, c, dv),
            plan.gather_bias,
        )
    if with_suffix:
        attend(query, suffix_keys, suffix_values)  # [B, H_kv, S, D] as it is, views included
    # Each segment's parts side by side; the grid's padding points at part 0, its log-sum-exp masked.
    flat = grid.flatten()
    part_lse = torch.cat(lses).index_select(0, flat).view(segments, -1, m)
    part_lse.masked_fill_(plan.suffix_padding if with_suffix else plan.padding, float("-inf"))
    part_out = torch.cat(outs).float().index_select(0, flat).view(segments, -1, m, dv)
    # the flash-decoding merge; a segment with nothing to attend (every part -inf, never with a suffix)
    # gets NaN weights from the softmax, hence zeros
    weight = torch.softmax(part_lse, dim=1)
    if not with_suffix:
        weight.nan_to_num_(0.0)
    out = (weight.unsqueeze(-1) * part_out).sum(1).view(b, h, m, dv)
    return out, torch.logsumexp(part_lse, dim=1).view(b, h, m) if with_lse else None
