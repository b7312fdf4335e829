"""What one eviction step decides, as pure functions of a layer and the policy (no cache, no writes): which
suffix tokens are in play (the region), how the scorer ranks them, and which the budgets keep.

Sinks (the first ``sink`` real tokens of each row), the recent ``window`` and padding are never evicted
and never count towards a budget; scores of non-evictable tokens are ``-inf``, so padding ranks below
every real token whatever a scorer returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ...scorers import Scorer, check_scores
from ..options.policy import CompressionPolicy
from ..storage.layer import LUKVLayer
from ..storage.ragged import keep_mask_from_counts


@dataclass(frozen=True, eq=False)
class Region:
    """The first ``length`` tokens of a layer's dense suffix (all but the protected window), per row:
    ``sinks`` (kept) and ``evictable`` tokens, bool ``[B, length]``; ``seen``: int64 ``[B]``, the real
    tokens (padding excluded) each row of the layer has seen in all (a memory budget sizes each row's
    bytes by them, as the row alone would be); ``sinks_left``: int64 ``[B]``, the sinks each row still has
    to protect after this step (the layer's eviction record's ``sinks_left`` once the step is taken: the caller
    stores it)."""

    length: int
    sinks: torch.Tensor
    evictable: torch.Tensor
    seen: torch.Tensor
    sinks_left: torch.Tensor

    @property
    def n_evictable(self) -> torch.Tensor:
        return self.evictable.sum(-1)


class Step(NamedTuple):
    """One layer's eviction step: its ``region``, the region's masked scores ``[B, H, length]`` (``None``:
    nothing to rank) and, for a store that keeps each token's score (:func:`~.fold.keeps_scores`), the raw
    scores ``[B, H, S - length]`` of the protected window after the region: stored with the window when it
    joins the store right after the step (under a memory budget or ``kv_bits``), where an unscored token would
    rank below every other at the next evicting fold."""

    region: Region
    scores: torch.Tensor | None
    window: torch.Tensor | None = None


def valid_from_mask(attention_mask: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
    """``[B, length]`` bool: which of the last ``length`` key positions the last query may read (not padding)."""
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    row = attention_mask[:, 0, -1, -length:]
    if row.dtype != torch.bool:
        row = row > torch.finfo(row.dtype).min / 2
    return row.expand(batch, length).to(device)


def plan_region(layer: LUKVLayer, policy: CompressionPolicy, attention_mask: torch.Tensor | None) -> Region:
    """The region of ``layer``'s suffix this step decides about, and the sinks each row has left after it
    (``Region.sinks_left``: the caller stores it as the layer's; nothing here writes the layer)."""
    assert layer.suffix_keys is not None  # the layer holds a forward
    b, s, device = layer.batch_size, layer.suffix_length, layer.suffix_keys.device
    length = max(s - policy.window, 0)
    valid = valid_from_mask(attention_mask, b, s, device)[:, :length]
    if layer.window_start is not None:
        # a sliding layer: what no later query can read (older than its window) is neither kept nor budgeted
        oldest = layer.window_start - (layer.cumulative_length - s)  # in suffix columns
        if oldest > 0:
            valid = valid & (torch.arange(length, device=device) >= oldest)
    left = layer.eviction.sinks_left
    if left is None:
        left = torch.full((b,), policy.sink, dtype=torch.long, device=device)
    # sinks: the first `sink` real tokens of each row, wherever they fall in a chunked prefill
    sinks = valid & (valid.long().cumsum(-1) <= left.unsqueeze(-1))
    seen = valid_from_mask(attention_mask, b, layer.cumulative_length, device).sum(-1).cpu()
    return Region(length, sinks, valid & ~sinks, seen, left - sinks.sum(-1))


def score_suffix(
    scorer: Scorer,
    layer: LUKVLayer,
    queries: torch.Tensor | None,
    valid: torch.Tensor | None = None,
    context: dict | None = None,
) -> torch.Tensor:
    """fp32 ``[B, H, S]``: the scorer's scores of every token of the layer's suffix (from the last
    ``scorer.n_queries`` post-RoPE queries of this forward).

    ``valid`` (bool ``[B, S]``, from the attention mask) marks the real tokens. A scorer never sees
    padding: when rows differ, each group of rows with the same real tokens is scored on those tokens
    and the queries among them only, exactly as the row alone would be; padding scores ``-inf``.
    ``context``: for a scorer that asks for it (``scorer.context``), ``layer_idx``, ``module``, ``heads``
    and ``positions [B, S]`` (each token's position id), sliced like the tokens.
    """
    keys, values = layer.suffix_keys, layer.suffix_values
    assert keys is not None and values is not None  # the layer holds a forward
    b, h, s, _ = keys.shape
    context = context if scorer.context else None
    if valid is None or bool(valid.all()):
        return _score(scorer, keys, values, queries, context)
    scores = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=keys.device)
    q_len = 0 if queries is None else queries.shape[2]
    for rows, tokens in _row_groups(valid):
        if tokens.numel() == 0:
            continue
        q = None
        if queries is not None:
            q_tokens = tokens[tokens >= s - q_len] - (s - q_len)  # this forward's real queries
            q = queries[rows][:, :, q_tokens]
        k, v = keys[rows][:, :, tokens], values[rows][:, :, tokens]
        part = None if context is None else {**context, "positions": context["positions"][rows][:, tokens]}
        scores[rows.unsqueeze(-1), :, tokens] = _score(scorer, k, v, q, part).transpose(1, 2)
    return scores


def suffix_positions(attention_mask: torch.Tensor | None, layer: LUKVLayer) -> torch.Tensor:
    """int64 ``[B, S]``: the position id of each suffix token, as ``generate()`` numbers them (from the
    mask: each row of a left-padded batch counts its real tokens from 0)."""
    assert layer.suffix_keys is not None  # the layer holds a forward
    b, s, device = layer.batch_size, layer.suffix_length, layer.suffix_keys.device
    if attention_mask is None:
        start = layer.cumulative_length - s
        return torch.arange(start, start + s, device=device).expand(b, s)
    width = attention_mask.shape[-1]
    real = valid_from_mask(attention_mask, b, width, device)
    return (real.long().cumsum(-1) - 1).clamp_min(0)[:, width - s :]


def _row_groups(valid: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(rows, tokens)`` pairs: the batch rows that share one set of real tokens, and those tokens."""
    groups: dict[tuple[int, ...], list[int]] = {}
    patterns = valid.cpu()
    for row in range(patterns.shape[0]):
        groups.setdefault(tuple(patterns[row].nonzero().flatten().tolist()), []).append(row)
    device = valid.device
    return [
        (torch.tensor(rows, device=device), torch.tensor(tokens, dtype=torch.long, device=device))
        for tokens, rows in groups.items()
    ]


def _score(scorer: Scorer, keys, values, queries: torch.Tensor | None, context: dict | None):
    q = queries[:, :, -scorer.n_queries :] if scorer.n_queries and queries is not None else None
    return check_scores(scorer, scorer(keys, values, q, **(context or {})), tuple(keys.shape[:3]))


def masked_scores(scores: torch.Tensor, region: Region) -> torch.Tensor:
    """Region scores ``[B, H, R]`` with ``-inf`` wherever a token is not evictable (sinks, padding).

    A scorer's own non-finite scores become the largest finite ones (NaN and ``-inf``: the lowest), so
    that every evictable token still ranks above every non-evictable one.
    """
    finfo = torch.finfo(torch.float32)
    scores = scores[..., : region.length].nan_to_num(nan=finfo.min, posinf=finfo.max, neginf=finfo.min)
    return scores.masked_fill(~region.evictable.unsqueeze(1), float("-inf"))


def keep_mask(region: Region, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """bool ``[B, H, R]``: the sinks plus each head's ``counts [B, H]`` best evictable tokens."""
    b, h, r = scores.shape
    keep = region.sinks.unsqueeze(1).expand(b, h, r).clone()
    if r:
        keep |= keep_mask_from_counts(scores, counts.to(scores.device)) & region.evictable.unsqueeze(1)
    return keep
