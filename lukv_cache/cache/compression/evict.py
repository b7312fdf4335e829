"""Running one eviction step over the cache's layers, as functions that :class:`~lukv_cache.cache.compression.compressor.Compressor` drives, taking the
cache's parts (:class:`~lukv_cache.cache.compression.contract.CompressedCache`): whether a layer's forward is
compressed, its region and scores, then one allocator call over the layers evicted together (budgets at
each row's ratio, under ``max_tokens`` trimmed to the cap) and each layer's keep mask. The pure pieces are
:mod:`.region`'s; the ``max_tokens`` room is :mod:`.cap`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch

from ...allocation import AllocationRequest
from ...allocation.budget import trim_weighted
from ...errors import ConfigurationError
from ..storage.layer import LUKVLayer
from .cap import refill_bytes, row_ratios, token_cap
from .contract import CompressedCache
from .fold import keeps_scores, scorer_context, suffix_valid
from .forward_state import ForwardState
from .kinds import cache_kinds
from .region import (
    CompressionPolicy,
    Region,
    Step,
    keep_mask,
    masked_scores,
    score_suffix,
)


def wants_compression(
    policy: CompressionPolicy, layer: LUKVLayer, query_length: int, state: ForwardState | None = None
) -> bool:
    """Compress after a multi-token forward that belongs to the prompt: the first forward into an empty
    layer, and every later multi-token forward while ``state.prompt`` holds, i.e. before the cache's first
    one-token (decode) forward: the chunks of ``generate(prefill_chunk_size=C)``, which calls the model
    once per ``C`` tokens and tells the cache nothing, and chunks forwarded by hand, each compressed as it
    arrives (each keeps about the ratio of what it makes evictable, so the kept tokens come close to the
    unchunked prompt's, and only the compressed prompt and one chunk's KV are alive at a time). The prompt
    ends at the first decode forward, after ``cache.prefill`` and in a ``fork``/``deepcopy`` of the cache
    (:meth:`~lukv_cache.cache.compression.forward_state.ForwardState.end_prompt`); under assisted decoding it is the first
    forward alone (the prompt and the first drafts). A later multi-token forward (a question after a
    context, a second generate's new tokens, a verification forward) is kept whole. A context forwarded by
    hand, not through ``cache.prefill``, leaves the prompt open: a question sent next is compressed like a
    chunk (a cache cannot tell them apart; ``fork()`` the context for its questions).

    With the cache's ``prefill_chunk_size`` ``C``, also after the prompt: a later forward is compressed
    once ``C`` uncompressed tokens have piled up, or when the forward before it (``state.previous_length``)
    had exactly ``C`` tokens (every multi-token forward under a ``max_tokens`` or memory cap)."""
    if not layer.compressed and layer.cumulative_length == query_length:
        return True  # the prompt, even of one token: what comes after it is decoding, as in a batch
    if query_length <= 1:
        return False
    if not layer.compressed:
        return True
    if state is not None and state.prompt:
        return True  # a chunk of the prompt
    chunk = policy.prefill_chunk_size
    if chunk is None:
        return False
    if policy.max_tokens is not None or policy.in_bytes:
        return True  # a cap holds after every chunk, the last shorter one too
    previous = None if state is None else state.previous_length
    return previous == chunk or layer.suffix_length - policy.window >= chunk


def score_step(
    cache: CompressedCache,
    idx: int,
    layer: LUKVLayer,
    region: Region,
    module: Any,
    query: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> Step:
    """Full-attention layer ``idx`` attended (``query``: this forward's) and wants compression: score
    ``region``, the region in play (:func:`~.region.plan_region`, after a sliding layer dropped what it
    holds beyond its window), kept in the cache's ``prefill_scores`` if asked; the region and its masked
    scores (``None``: nothing to rank)."""
    policy = cache.policy
    # the queries before what is left attend none of it (causal): a scorer reads the window's own
    query = query[:, :, -layer.suffix_length :] if layer.suffix_length else query[:, :, :0]
    scores = window = None
    evictable = region.length and bool(region.n_evictable.any())
    # ratio 0 keeps every token: no scoring needed (a reconstruction scorer could not score here anyway)
    wanted = (evictable and cache.evicts) or cache.prefill_scores is not None
    if wanted and policy.scorer.reconstruction is None:
        context = scorer_context(policy, cache.layout.head_shard, idx, module, layer, attention_mask)
        raw = score_suffix(policy.scorer, layer, query, suffix_valid(attention_mask, layer), context)
        if cache.prefill_scores is not None:
            cache.prefill_scores[idx] = raw
        scores = masked_scores(raw, region) if evictable and cache.evicts else None
        window = raw[..., region.length :] if keeps_scores(policy) else None
    return Step(region, scores, window)


def evict(
    cache: CompressedCache,
    steps: dict[int, Step],
    cap_ratio: torch.Tensor | None = None,
    whole: bool = False,
) -> torch.Tensor | None:
    """Evict the regions of ``steps`` (layer -> its :class:`~.region.Step`); one allocator call for
    the layers whose rows have the same evictable tokens and KV heads, each at the ratio (a sliding layer
    compressed under ``sliding="compress"`` has fewer tokens than a full-attention one, and MiMo-V2-Flash's
    more heads: their own call). ``cap_ratio``: with ``max_tokens``, each row's ratio in this forward so
    far (``ForwardState.cap_ratio``); returns it as the steps leave it (the compressor stores it).
    ``whole``: ``steps`` are every layer this forward compresses (a deferred or held eviction), so a cap
    counts those of the groups still to come, and no others; under a budget with ``split="global_first"``
    the sliding groups are evicted first, each group at the ratio its room leaves it, the full-attention
    layers' tokens all held back for them (:func:`~.cap.token_cap`)."""
    groups: dict[tuple[int, ...], dict[int, Step]] = {}
    for idx, step in steps.items():
        heads = cast(LUKVLayer, cache.layers[idx]).num_heads
        groups.setdefault((heads, *step.region.n_evictable.tolist()), {})[idx] = step
    order = list(groups.values())
    first = whole and cache.policy.in_bytes and cache.policy.split == "global_first"
    if first:  # the sliding layers give their tokens first: evicted first, the full-attention ones' kept
        order.sort(key=lambda group: cache.layers[next(iter(group))].sliding_window is None)
    # each row's real tokens, from a full-attention layer's region where the step has one (a sliding
    # layer's mask hides what left its window, as it hides padding)
    full = [step.region.seen for idx, step in steps.items() if cache.layers[idx].sliding_window is None]
    for n, group in enumerate(order):
        # a cap counts the layers of the groups still to come (their protected tokens, their share)
        later = {idx: step.region for rest in order[n + 1 :] for idx, step in rest.items()} if whole else None
        # and those of the groups evicted before (their windows join their stores after the step)
        earlier = [idx for done in order[:n] for idx in done]
        if first:  # each group its own ratio: what the room leaves it
            cap_ratio = None
        cap_ratio = _evict_group(cache, group, cap_ratio, later, full[0] if full else None, earlier)
    return cap_ratio


def _evict_group(
    cache: CompressedCache,
    steps: dict[int, Step],
    cap_ratio: torch.Tensor | None,
    later: dict[int, Region] | None = None,
    seen: torch.Tensor | None = None,
    earlier: list[int] | None = None,
) -> torch.Tensor | None:
    scores: torch.Tensor | None
    scored = [idx for idx, step in steps.items() if step.scores is not None]
    counts = {}
    policy = cache.policy
    if scored:
        region = steps[scored[0]].region
        scores = torch.stack([cast(torch.Tensor, steps[idx].scores) for idx in scored])
        shard = cache.layout.head_shard
        if shard is not None:  # allocate over every head of the model, keep this rank's block
            scores = shard.gather(scores, dim=2)
        cap, slots, weights = token_cap(
            policy,
            cache.layers,
            cache.layout.full_layers,
            shard,
            region,
            scored,
            scores.shape[2],
            cache.layout.query_heads,
            cache.memory_choice,
            cache.prefill_scores is not None,
            later,
            seen,
            earlier,
            cache_kinds(cache, cast(LUKVLayer, cache.layers[scored[0]]), scores.shape[2])
            if policy.in_bytes
            else None,
        )
        ratio, cap_ratio = row_ratios(policy, region, cap, slots, cap_ratio)
        request = AllocationRequest(
            scores=scores,
            n_evictable=region.n_evictable.cpu(),
            ratio=ratio,
            layers=tuple(scored),
            num_layers=cache.num_layers or max(scored) + 1,
            min_keep=policy.min_keep,
        )
        allocated = policy.allocator(request)
        # a row at ratio 0 (a prompt that fits its bound) keeps every token, whatever the allocator
        # (a threshold read at a ratio below its table's smallest would still cut)
        fits = request.ratio <= 0
        if bool(fits.any()):
            allocated = allocated.clone()
            allocated[:, fits.to(allocated.device)] = request.n_evictable[fits].to(allocated).view(1, -1, 1)
        if cap is not None:  # a hard bound: whatever the allocator or profile asked for
            allocated = trim_weighted(allocated, cap, weights)
            if weights is not None and policy.defers:  # one call for the whole model: fill its bytes
                allocated = refill_bytes(policy.allocator, request, allocated, cap, weights)
        if shard is not None:
            allocated = allocated[:, :, shard.heads(request.num_heads)]
        counts = dict(zip(scored, allocated))
    for idx, (region, scores, _) in steps.items():
        layer = cast(LUKVLayer, cache.layers[idx])  # steps come from full-attention layers
        if scores is None:  # nothing to rank: keep every real token (none evictable, or ratio 0)
            b, h = layer.batch_size, layer.num_heads
            keep = (region.sinks | region.evictable).unsqueeze(1).expand(b, h, region.length)
        else:
            keep = keep_mask(region, scores, counts[idx])
        layer.evict(keep, scores if keeps_scores(policy) else None)
        layer.eviction.settle(layer.cumulative_length)
    return cap_ratio


def held_steps(
    cache: CompressedCache, held: Mapping[int, Region], scores: Mapping[int, torch.Tensor]
) -> dict[int, Step]:
    """The eviction steps of what ``cache.holding()`` kept (``held``: layer -> its region, taken from the
    forward's state by the compressor), each layer ranked by ``scores[layer]`` (checked), for :func:`evict`."""
    steps = {}
    for idx, region in held.items():
        layer = cast(LUKVLayer, cache.layers[idx])  # only a LUKVLayer holds
        raw = scores[idx]
        expected = (layer.batch_size, layer.num_heads, layer.suffix_length)
        if not isinstance(raw, torch.Tensor) or tuple(raw.shape) != expected:
            got = tuple(raw.shape) if isinstance(raw, torch.Tensor) else type(raw).__name__
            raise ConfigurationError(f"Scores for layer {idx} must have shape {list(expected)}, got {got}.")
        assert layer.suffix_keys is not None  # it held a forward
        raw = raw.float().to(layer.suffix_keys.device)
        if cache.prefill_scores is not None:
            cache.prefill_scores[idx] = raw
        evictable = region.length and bool(region.n_evictable.any())
        window = raw[..., region.length :] if keeps_scores(cache.policy) else None
        steps[idx] = Step(region, masked_scores(raw, region) if evictable else None, window)
    return steps
