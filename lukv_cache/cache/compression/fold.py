"""Running a fold (``LUKVCache(decode_max_tokens=N)``) over the cache's layers: which layers fold and
when, the scores of what they hold, one allocator call over all of them, and the refold of each layer.

The pure pieces (what a layer holds, rescoring) are :mod:`lukv_cache.cache.compression.fold_plan`'s, fitting counts is
:mod:`lukv_cache.allocation.budget`'s; these functions take the cache's parts (its policy, layers and :class:`~lukv_cache.cache.layers.parallel.HeadShard`).
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch

from ...allocation import AllocationRequest
from ...allocation.budget import MAX_RATIO, fill_ratio, fit_counts, trim_weighted
from ..layers.parallel import HeadShard
from ..options.memory import budget_shapes
from ..options.policy import CompressionPolicy
from ..storage.layer import LUKVLayer
from ..storage.ragged import keep_mask_evicting_few
from .fold_plan import Held, gather_held, held_counts, held_tokens, masked_held, rescore
from .kinds import layer_kinds
from .region import score_suffix, suffix_positions, valid_from_mask

_UNBOUNDED = 1 << 40  # tokens per (layer, KV head) when only a memory budget's bytes bound a fold
# Under a memory budget an evicting fold evicts this many folds' tokens deeper (at most 1/DEEPER_SHARE of what the
# bytes hold), so that the next folds fit and only append: evicting folds (rescoring every held token, the
# allocator, a rebuilt store) come every (DEEPER_FOLDS + 1)-th fold instead of every fold, for about 1% fewer
# tokens held on average (memory=0.1, SmolLM2-shaped, 4k, batch 4: a mean decode step 1.31x -> 1.09x the one
# line's with the index gathers, docs/benchmarks.md).
DEEPER_FOLDS = 3
DEEPER_SHARE = 32


def scorer_context(
    policy: CompressionPolicy,
    shard: HeadShard | None,
    idx: int,
    module: Any,
    layer: LUKVLayer,
    attention_mask,
) -> dict | None:
    """What a scorer that reads more than keys and values gets (``Scorer.context``)."""
    if not policy.scorer.context:
        return None
    heads = slice(None) if shard is None else shard.heads(layer.num_heads * shard.size)
    return {
        "layer_idx": idx,
        "module": module,
        "heads": heads,
        "positions": suffix_positions(attention_mask, layer),
        "gather_heads": None if shard is None else shard.gather,
    }


def keeps_scores(policy: CompressionPolicy) -> bool:
    """Whether stores keep each token's score (eviction at fold time, under ``decode_max_tokens`` or a memory
    budget, with a scorer that reuses them)."""
    return policy.evicts_at_folds and policy.scorer.keeps_scores


def fold_due(layer: LUKVLayer, policy: CompressionPolicy, query: torch.Tensor) -> bool:
    """With ``decode_max_tokens``, after a forward that did not compress: keep the queries the scorer
    reads at the next fold; whether ``fold_interval`` tokens arrived since the last eviction (the fold is
    then due: every layer's at once, after the last full-attention layer's attention)."""
    fold = policy.fold_interval
    since = layer.cumulative_length - layer.eviction.settled_length
    wanted = policy.scorer.n_queries
    if wanted and since > fold - wanted:
        layer.eviction.record_queries(query, wanted)
    return since >= fold


def suffix_valid(attention_mask: torch.Tensor | None, layer: LUKVLayer) -> torch.Tensor:
    """bool ``[B, S]``: which tokens of ``layer``'s dense suffix are real (not padding)."""
    assert layer.suffix_keys is not None  # the layer holds a forward
    return valid_from_mask(attention_mask, layer.batch_size, layer.suffix_length, layer.suffix_keys.device)


def fold_evict(
    layers: list[Any],
    folding: dict[int, tuple[Any, torch.Tensor | None]],
    policy: CompressionPolicy,
    shard: HeadShard | None,
    num_layers: int | None,
    query_heads: int | None = None,
    scores_bytes: int = 0,
    readers: list[int] | None = None,
) -> None:
    """Eviction at fold time (:mod:`lukv_cache.cache.compression.fold_plan`): the layers whose fold is due (``folding``:
    layer -> the attention module that read it, its mask) keep, per row, at most ``decode_max_tokens``
    tokens per (layer, KV head) on average, sinks and window included; budgets from one allocator call at
    the ratio that total implies over the row's tokens. Under a memory budget also no more than its bytes
    hold (``scores_bytes``: the kept prefill scores' bytes per row, which count in it): in tokens at one
    width; with per-layer widths in bytes, each layer's tokens at its own width (the ratio the higher of
    the two, the counts trimmed to both). A budget without ``decode_max_tokens`` bounds the bytes alone,
    and its folds protect the prompt's ``window``. ``readers``: the layers that read another's KV (a budget
    counts nothing for them, :func:`~.kinds.layer_kinds`)."""
    kept_scores = keeps_scores(policy)
    idxs = sorted(folding)
    all_layers, layers = layers, [layers[i] for i in idxs]
    for layer in layers:  # a sliding layer's tokens older than its window are not held (nor counted)
        layer.slide()
    first = layers[0]
    assert first.suffix_keys is not None  # the layer holds a forward
    b, h, device = first.batch_size, first.num_heads, first.suffix_keys.device
    # each row's real tokens, from a full-attention layer's mask where one folds (a sliding layer's hides
    # what left its window)
    counted = next((i for i, layer in zip(idxs, layers) if layer.sliding_window is None), idxs[0])
    real = (
        valid_from_mask(folding[counted][1], b, all_layers[counted].cumulative_length, device).sum(-1).cpu()
    )
    recent = policy.window if policy.decode_max_tokens is None else policy.decode_window
    valids = [suffix_valid(folding[i][1], layer) for i, layer in zip(idxs, layers)]
    heads = h * (1 if shard is None else shard.size)
    # [L, B, H] protected (sinks, recent window) and evictable tokens: layers that hold different
    # amounts protect different counts, and the bound counts every layer's and head's own
    held = (
        torch.stack([held_counts(layer, valid) for layer, valid in zip(layers, valids)]).view(-1, b, h).cpu()
    )
    # as held_tokens protects them: a segment's first `sink` and last `recent` tokens
    protected = held.clamp_max(policy.sink + recent)
    evictable = held - protected
    if shard is not None:
        protected, evictable = shard.gather(protected, dim=2), shard.gather(evictable, dim=2)
    # [B] evictable tokens the folding layers may keep in all, so that each row holds at most
    # decode_max_tokens per (layer, KV head) on average, protected tokens included
    # folds evict under decode_max_tokens or a memory budget (then the bytes alone bound them)
    bound = policy.decode_max_tokens if policy.decode_max_tokens is not None else _UNBOUNDED
    per_head = torch.tensor(bound)  # [B] under a memory budget
    weights, room = None, None  # per-layer widths: each layer's bytes per token, the bytes [B] left
    if policy.in_bytes:  # and no more than the memory budget's bytes hold at the layers' bits
        others = readers or []
        kinds = layer_kinds(all_layers, others, first, heads)
        full = [i for i, layer in enumerate(all_layers) if isinstance(layer, LUKVLayer) and i not in others]
        # each row its own budget, by the real tokens it has seen (as the row alone)
        budget, shapes = budget_shapes(
            policy, first, len(full), heads, query_heads, real, scores_bytes, kinds
        )
        cost = {i: shapes.stored_token(all_layers[i].kv_bits, kept_scores) for i in full}
        least = shapes.fixed() + protected.sum((0, 2)) * min(cost.values())  # [B]: what no fold can evict
        if kinds.stock and bool((least > budget).any()):
            warnings.warn(
                f"LUKVCache(memory= / max_bytes=): the layers this cache leaves to transformers (layers "
                f"{[i for i, layer in enumerate(all_layers) if not isinstance(layer, LUKVLayer)]}) grew past "
                "what the budget leaves them, so the cache holds more than its budget from now on: nothing it "
                "can evict makes room. Raise the budget (memory= grows with the tokens; a fixed max_bytes= does "
                "not).",
                stacklevel=2,
            )
        if len(set(cost.values())) > 1 and idxs == full:  # in bytes, every layer's tokens at its width
            weights = [cost[i] for i in idxs]
            spent = (protected * torch.tensor(weights).view(-1, 1, 1)).sum((0, 2))
            room = (budget - shapes.fixed() - spent).clamp_min(0)
        else:  # one width (or some layers not folding: each counted at the widest)
            widest = max(cost.values())
            fit = (budget - shapes.fixed()).clamp_min(0) // widest // (len(full) * heads)  # [B]
            per_head = torch.minimum(fit, per_head)
    allowed = (per_head * len(idxs) * heads - protected.sum((0, 2))).clamp_min(0)
    protected = protected.double().mean((0, 2))  # [B], per head
    row_fits = evictable.sum((0, 2)) <= allowed  # such a row keeps everything, whatever the allocator
    if room is not None:
        assert weights is not None  # set with room
        row_fits &= (evictable * torch.tensor(weights).view(-1, 1, 1)).sum((0, 2)) <= room
    fits = bool(row_fits.all())
    if policy.in_bytes and not fits:  # evict a few folds deeper: the next folds fit
        deeper = DEEPER_FOLDS * policy.fold_interval * heads  # tokens per layer, all heads
        allowed = allowed - torch.minimum(torch.tensor(deeper * len(idxs)), allowed // DEEPER_SHARE)
        if room is not None:
            assert weights is not None  # set with room
            room = room - torch.minimum(torch.tensor(deeper * sum(weights)), room // DEEPER_SHARE)
    # every held token stays: each suffix joins its store (a store that keeps scores gets the suffix's)
    if fits:
        # a quantized store appends in place, into room for this fold and the ones that will only append too
        ahead = folds_ahead(policy, evictable, allowed, room, weights, len(idxs) * heads)
        tail = policy.fold_interval * (1 + ahead)
        for i, layer, valid in zip(idxs, layers, valids):
            scores = suffix_scores(policy, shard, i, layer, *folding[i]) if kept_scores else None
            layer.fold(room=policy.fold_interval, valid=valid, scores=scores, tail_room=tail)
            layer.eviction.settle(layer.cumulative_length)
        return
    frames = [held_tokens(layer, valid, policy.sink, recent) for layer, valid in zip(layers, valids)]
    raw = [held_scores(policy, shard, i, layer, f, *folding[i]) for i, layer, f in zip(idxs, layers, frames)]
    width = max(f.width for f in frames)
    if shard is not None:  # every rank's request has the same width
        width = int(shard.gather(torch.tensor([[width]], device=device), dim=1).max())
    scores = torch.stack(
        [
            torch.nn.functional.pad(masked_held(r, f), (0, width - f.width), value=float("-inf"))
            for r, f in zip(raw, frames)
        ]
    ).view(len(idxs), b, h, width)
    if shard is not None:
        scores = shard.gather(scores, dim=2)
    n = (real - protected.round().long()).clamp_min(0)
    ratio = fill_ratio(n, allowed, len(idxs) * heads)
    if room is not None:  # and the ratio that fills the bytes, whichever is higher
        ratio = torch.maximum(ratio, fill_ratio(n, room, heads * sum(cast("list[int]", weights))))
    request = AllocationRequest(
        scores=scores,
        n_evictable=n,
        ratio=ratio.clamp(0.0, MAX_RATIO),
        layers=tuple(idxs),
        num_layers=num_layers or max(idxs) + 1,
        min_keep=policy.min_keep,
    )
    counts = fit_counts(policy.allocator(request), evictable, allowed, not policy.allocator.adaptive)
    if room is not None:
        counts = trim_weighted(counts, room, weights)
    counts[:, row_fits] = evictable[:, row_fits]
    if shard is not None:
        counts, scores = (t[:, :, shard.heads(request.num_heads)] for t in (counts, scores))
    keeps = [
        f.protected | (keep_mask_evicting_few(scores[i], counts[i]).flatten(0, 1)[:, : f.width] & f.evictable)
        for i, f in enumerate(frames)
    ]
    for i, (layer, frame, keep) in enumerate(zip(layers, frames, keeps)):
        kept = raw[i][keep] if kept_scores else None
        layer.refold(frame.source[keep], keep.sum(-1), kept, capacity=policy.fold_interval)
        layer.eviction.settle(layer.cumulative_length)


def folds_ahead(
    policy: CompressionPolicy,
    evictable: torch.Tensor,
    allowed: torch.Tensor,
    room: torch.Tensor | None,
    weights: list[int] | None,
    segments: int,
) -> int:
    """How many more folds will only append after this one (at most ``DEEPER_FOLDS + 1``: what an evicting
    fold's deeper eviction leaves room for, rounding included): the tokens the
    folding layers may still keep per row (``allowed [B]`` past ``evictable [L, B, H]``, and ``room [B]``
    bytes at the layers' ``weights`` when they differ), each fold adding ``fold_interval`` tokens to each of
    their ``segments`` (layer, KV head) pairs. A layer's :class:`~..storage.tail.StoreTail` gets room for
    them (and this fold's): the room is never more than the budget holds."""
    step = policy.fold_interval * segments
    ahead = int(((allowed - evictable.sum((0, 2))).clamp_min(0) // max(step, 1)).min())
    if room is not None and weights is not None:
        spent = (evictable * torch.tensor(weights).view(-1, 1, 1)).sum((0, 2))
        per_fold = policy.fold_interval * (segments // max(len(weights), 1)) * sum(weights)
        ahead = min(ahead, int(((room - spent).clamp_min(0) // max(per_fold, 1)).min()))
    return max(0, min(ahead, DEEPER_FOLDS + 1))


def held_scores(
    policy: CompressionPolicy,
    shard: HeadShard | None,
    idx: int,
    layer: LUKVLayer,
    held: Held,
    module: Any,
    attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    """fp32 ``[G, M]``: the scores of the tokens ``layer`` holds, in ``held``'s slots: kept ones from
    the store plus the suffix scored now, or every segment's tokens scored again."""
    store, tail = layer.store_parts()  # a pending tail is read where it is, never joined first
    if keeps_scores(policy):
        suffix = suffix_scores(policy, shard, idx, layer, module, attention_mask)
        stored = None if store is None or store.scores is None else store.scores.unsqueeze(-1)
        in_tail = None if tail is None or tail.scores is None else tail.scores.reshape(-1, 1)
        return gather_held(held, stored, suffix.unsqueeze(-1), in_tail).squeeze(-1)
    assert layer.suffix_keys is not None and layer.suffix_values is not None  # it holds what it folds
    keys = gather_held(
        held, None if store is None else store.keys, layer.suffix_keys, None if tail is None else tail.keys
    )
    values = None  # a scorer that never reads them: no values dequantized and gathered
    if policy.scorer.reads_values:
        values = gather_held(
            held,
            None if store is None else store.values,
            layer.suffix_values,
            None if tail is None else tail.values,
        )
    return rescore(policy.scorer, held, keys, values, layer.eviction.queries, layer.num_heads)


def suffix_scores(
    policy: CompressionPolicy,
    shard: HeadShard | None,
    idx: int,
    layer: LUKVLayer,
    module: Any,
    attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    """fp32 ``[B, H, S]``: the scores of ``layer``'s dense suffix (padding ``-inf``), from the queries kept for
    the fold: what a store that keeps scores stores with the suffix's tokens."""
    context = scorer_context(policy, shard, idx, module, layer, attention_mask)
    valid = suffix_valid(attention_mask, layer)
    return score_suffix(policy.scorer, layer, layer.eviction.queries, valid, context)
