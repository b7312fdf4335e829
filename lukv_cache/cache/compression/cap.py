"""The ``max_tokens`` cap (``LUKVCache(max_tokens=N)``, and the tokens a memory budget's bytes hold): how many evictable tokens one eviction step may keep
so that every row holds at most ``N`` tokens per (full-attention layer, KV head) on average after the
forward, and the ratio each row's budgets are read at (one per forward, so every layer reads its profile
at the same ratio).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...allocation.budget import MAX_RATIO, fill_ratio, trim_weighted
from ..layers.parallel import HeadShard
from ..options.memory import Kinds, MemoryChoice, budget_shapes, prefill_scores_bytes
from ..options.policy import CompressionPolicy
from ..storage.layer import LUKVLayer
from .fold import keeps_scores
from .region import Region


def row_ratios(
    policy: CompressionPolicy,
    region: Region,
    cap: torch.Tensor | None,
    slots: float | torch.Tensor,
    fixed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float64 ``[B]``: each row's ratio; with ``max_tokens``, the one that fills the room ``cap`` leaves
    over ``slots`` (layer, KV head) pairs still to evict in this forward (fixed at the forward's first
    eviction, so every layer reads its profile at one ratio). Also the forward's fixed ratios: ``fixed``,
    the ones of the forward's earlier evictions (``None`` at its first), or those computed now."""
    batch = region.evictable.shape[0]
    if cap is None:
        return torch.full((batch,), policy.ratio, dtype=torch.float64), fixed
    if fixed is None or fixed.shape[0] != batch:  # the room is shared by every head of the layers to come
        fixed = fill_ratio(region.n_evictable.cpu(), cap, slots)
    return fixed.clamp(0.0, MAX_RATIO), fixed


def token_cap(
    policy: CompressionPolicy,
    layers: list[Any],
    full: list[int],
    shard: HeadShard | None,
    region: Region,
    evicted: list[int],
    num_heads: int,
    query_heads: int | None = None,
    choice: MemoryChoice | None = None,
    keeps_prefill_scores: bool = False,
    later: dict[int, Region] | None = None,
    seen: torch.Tensor | None = None,
    earlier: list[int] | None = None,
    kinds: Kinds | None = None,
) -> tuple[torch.Tensor | None, float | torch.Tensor, list[int] | None]:
    """With ``max_tokens``: int64 ``[B]``, the evictable tokens that the layers ``evicted`` now (over all
    ``num_heads`` KV heads of the model) may keep in all, so that after this forward every row holds at
    most ``max_tokens`` tokens per (full-attention layer, KV head) on average (every layer's store, its
    protected window, and the sinks of the layers still to evict in this forward all count); and the
    number of (layer, head) pairs still to evict. ``(None, 0, None)`` without a cap. ``layers``: the
    cache's; ``full``: its full-attention layers, if known.

    Under a memory budget (``choice``: what it chose) the room is what its bytes hold, less the prefill
    scores of this forward when the cache keeps them (``keeps_prefill_scores``). With one width
    everywhere it is counted in tokens as above; with per-layer widths, in bytes: every token weighs
    its layer's bytes, the pairs still to evict are weighed alike, and the third value is the weight of
    each layer of ``evicted`` (``None`` when every token weighs the same), which the trim honours
    (:func:`trim_weighted`).

    ``later``: in a step that evicts every layer the forward compresses (deferred or held; ``None``
    otherwise), the layers it evicts after these, with their regions
    (a sliding layer compressed under a budget holds fewer tokens than a full-attention one, so it is
    allocated in a call of its own): their protected tokens are kept out of the room, and the pairs come
    back as a count ``[B]`` weighed by each layer's evictable tokens, so that the ratio that fills the
    room is one for every layer (:func:`row_ratios`); with ``split="global_first"`` a full-attention layer
    among them holds back all its tokens instead (the sliding ones, evicted first, take what is left). ``seen``: each row's real tokens where ``region``'s
    are not (a sliding layer's), from a full-attention layer of the step. ``earlier``: the layers the step
    evicted before these, whose protected windows are still dense (they join the stores after the step).
    ``kinds``: the model's other layer kinds
    (:class:`~lukv_cache.cache.options.memory.Kinds`), which a budget counts."""
    if policy.max_tokens is None and not policy.in_bytes:
        return None, 0, None
    full = full or [i for i, layer in enumerate(layers) if isinstance(layer, LUKVLayer)]
    if later is not None:  # the forward's every compressed layer is in this step: these, then ``later``
        evicting = list(evicted)
    else:
        evicting = list(evicted) if policy.defers else [*evicted, *(i for i in full if i > max(evicted))]
    layer = layers[evicted[0]]
    window = layer.suffix_length - region.length
    sinks = region.sinks.sum(-1).cpu()
    if not policy.in_bytes:
        assert policy.max_tokens is not None  # a cap: max_tokens or a budget
        tokens = policy.max_tokens * len(full) * num_heads
        protected = num_heads * (len(full) * window + len(evicting) * sinks)
        cap = tokens - stored_in_stores(layers, shard, sinks.shape[0], None) - protected
        return cap, len(evicting) * num_heads, None
    # the bytes hold this many tokens at the layers' bits; the layers evicted before this step have
    # folded their windows into their stores (counted there)
    assert choice is not None  # chosen at the budget's first compression
    later = later or {}
    layers_counted = len(full) if kinds is None else len(kinds.compressed)
    scores = (
        prefill_scores_bytes(layers_counted, num_heads, layer.suffix_length) if keeps_prefill_scores else 0
    )
    # [B]: each row its own, as the row alone (padding is not its tokens)
    budget, shapes = budget_shapes(
        policy,
        layer,
        layers_counted,
        num_heads,
        query_heads,
        region.seen if seen is None else seen,
        scores,
        kinds,
    )
    cost = {
        i: shapes.stored_token(choice.bits_of(i), keeps_scores(policy))
        for i in {*full, *evicting, *later, *(earlier or [])}
    }
    uniform = len(set(cost.values())) == 1
    unit = cost[full[0]] if uniform else 1  # one width: count tokens, else bytes
    weight = {i: cost[i] // unit for i in cost}
    pairs = num_heads * sum(weight[i] for i in evicting)
    room = (budget - shapes.fixed()) // unit
    cap = room - stored_in_stores(layers, shard, sinks.shape[0], weight) - pairs * (window + sinks)
    for i in earlier or {}:  # their windows: all their dense suffix holds now, not in their stores yet
        cap = cap - num_heads * weight[i] * layers[i].suffix_length
    slots: float | torch.Tensor = pairs
    if later:
        mine = region.n_evictable.cpu().double().clamp_min(1)
        weighed = torch.full_like(mine, float(pairs))
        first = policy.split == "global_first"
        for i, other in later.items():
            kept = layers[i].suffix_length - other.length + other.sinks.sum(-1).cpu()  # window + sinks
            if first and layers[i].sliding_window is None:  # a full-attention layer keeps every token first
                cap = cap - num_heads * weight[i] * (kept + other.n_evictable.cpu())
                continue
            cap = cap - num_heads * weight[i] * kept
            weighed = weighed + num_heads * weight[i] * other.n_evictable.cpu().double() / mine
        slots = weighed
    return cap, slots, None if uniform else [weight[i] for i in evicted]


def refill_bytes(
    allocator: Any,
    request: Any,
    allocated: torch.Tensor,
    cap: torch.Tensor,
    weights: list[int],
) -> torch.Tensor:
    """Keep counts ``[L, B, H]`` of a whole-model allocator under per-layer widths (``weights``: each
    layer's bytes per token; ``cap [B]``: the bytes the ``L`` layers may keep), asked once more where they
    leave bytes unused. The ratio that fills the bytes assumes every layer keeps the same share of its
    tokens; an allocator that ranks heads across layers gives the wider layers fewer (or more, then
    trimmed), so a row using less than 99% of its bytes is allocated again at the ratio scaled by what it
    used, and trimmed (:func:`trim_weighted`). ``allocator(request)`` is deterministic: asked at the same
    ratio it gives the same counts."""
    w = torch.tensor(weights, dtype=torch.float64, device=allocated.device).view(-1, 1, 1)
    used = (allocated.double() * w).sum((0, 2)).cpu()  # [B]
    room = cap.double().clamp_min(0)
    short = (used > 0) & (used < 0.99 * room) & (request.ratio > 0)
    if not bool(short.any()):
        return allocated
    kept = (1.0 - request.ratio) * room / used.clamp_min(1.0)
    ratio = torch.where(short, 1.0 - kept, request.ratio).clamp(0.0, MAX_RATIO)
    again = trim_weighted(allocator(dataclasses.replace(request, ratio=ratio)), cap, weights)
    return torch.where(short.to(allocated.device).view(1, -1, 1), again, allocated)


def stored_in_stores(
    layers: list[Any], shard: HeadShard | None, batch: int, weight: dict[int, int] | None
) -> torch.Tensor:
    """int64 ``[B]``: tokens in the ragged stores of every layer, over every KV head of the model, each
    layer's counted ``weight[layer]`` times (``None``: once)."""
    per_head = torch.zeros(batch, 1, dtype=torch.long)
    for i, layer in enumerate(layers):
        stored = layer.store_counts() if isinstance(layer, LUKVLayer) else None
        if stored is not None:
            counts = stored.view(layer.batch_size, layer.num_heads).cpu()
            per_head = per_head + counts * (1 if weight is None else weight.get(i, 1))
    if shard is not None:  # every rank holds the same layers: one gather each
        per_head = shard.gather(per_head, dim=1)
    return per_head.sum(-1)
