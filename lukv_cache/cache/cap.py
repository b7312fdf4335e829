"""The ``max_tokens`` cap (``LUKVCache(max_tokens=N)``, and the tokens a memory budget's bytes hold): how many evictable tokens one eviction step may keep
so that every row holds at most ``N`` tokens per (full-attention layer, KV head) on average after the
forward, and the ratio each row's budgets are read at (one per forward, so every layer reads its profile
at the same ratio).
"""

from __future__ import annotations

from typing import Any

import torch

from ..allocation.budget import MAX_RATIO, fill_ratio
from .compression import CompressionPolicy, Region
from .folding import keeps_scores
from .layer import LUKVLayer
from .memory import layer_budget
from .parallel import HeadShard


def row_ratios(
    policy: CompressionPolicy,
    region: Region,
    cap: torch.Tensor | None,
    slots: int,
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
) -> tuple[torch.Tensor | None, int]:
    """With ``max_tokens``: int64 ``[B]``, the evictable tokens that the layers ``evicted`` now (over all
    ``num_heads`` KV heads of the model) may keep in all, so that after this forward every row holds at
    most ``max_tokens`` tokens per (full-attention layer, KV head) on average (every layer's store, its
    protected window, and the sinks of the layers still to evict in this forward all count); and the
    number of (layer, head) pairs still to evict. ``(None, 0)`` without a cap. ``layers``: the cache's;
    ``full``: its full-attention layers, if known."""
    if policy.max_tokens is None and not policy.in_bytes:
        return None, 0
    full = full or [i for i, layer in enumerate(layers) if isinstance(layer, LUKVLayer)]
    later = 0 if policy.defers else sum(1 for i in full if i > max(evicted))
    layer = layers[evicted[0]]
    window = layer.suffix_length - region.length
    sinks = region.sinks.sum(-1).cpu()
    if policy.in_bytes:
        # the bytes hold this many tokens at the layers' bits; the layers evicted before this step have
        # folded their windows into their stores (counted there)
        budget = layer_budget(policy, layer, len(full), num_heads, keeps_scores(policy), query_heads)
        windows = len(evicted) + later
    else:
        assert policy.max_tokens is not None  # a cap: max_tokens or a budget
        budget = policy.max_tokens * len(full) * num_heads
        windows = len(full)
    protected = num_heads * (windows * window + (len(evicted) + later) * sinks)
    cap = budget - stored_in_stores(layers, shard, sinks.shape[0]) - protected
    return cap, (len(evicted) + later) * num_heads


def stored_in_stores(layers: list[Any], shard: HeadShard | None, batch: int) -> torch.Tensor:
    """int64 ``[B]``: tokens in the ragged stores of every layer, over every KV head of the model."""
    per_head = torch.zeros(batch, 1, dtype=torch.long)
    for layer in layers:
        if isinstance(layer, LUKVLayer) and layer.store is not None:
            per_head = per_head + layer.store.counts().view(layer.batch_size, layer.num_heads).cpu()
    if shard is not None:  # every rank holds the same layers: one gather each
        per_head = shard.gather(per_head, dim=1)
    return per_head.sum(-1)
