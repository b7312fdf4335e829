"""Continuation loss through a prefilled cache: the context in, then the next tokens teacher-forced.

Shared by the benchmark's ``continuation`` task (:mod:`lukv_cache.evaluation.tasks`) and the profile's
memory table (:mod:`lukv_cache.profiling.memory_table`), so both measure the same thing.
"""

from __future__ import annotations

from typing import Any

import torch

from .._compat import cache_kwarg


@torch.no_grad()
def prefill(model: Any, input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
    """Run the context through ``model`` into ``cache``; return the last position's logits ``[B, V]``.

    >>> last_logits = prefill(model, ids, cache)  # doctest: +SKIP
    """
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
    # a LUKVCache's context is complete, as after cache.prefill: the continuation is appended whole
    end_prompt = getattr(getattr(cache, "state", None), "end_prompt", None)
    if callable(end_prompt):
        end_prompt()
    return out.logits[:, -1, :]


@torch.no_grad()
def continuation_nll(model: Any, cache: Any, last_logits: torch.Tensor, target: torch.Tensor) -> float:
    """Mean negative log-likelihood (nats per token) of ``target`` ``[1, n]``, teacher-forced through a cache
    that holds the context; ``last_logits`` ``[1, V]``: the prefill's last position, which predicts
    ``target``'s first token. The cache is consumed.

    >>> nll = continuation_nll(model, cache, prefill(model, context, cache), continuation)  # doctest: +SKIP
    """
    # Position 0 of the continuation is predicted by the prefill's last logits; the rest by the forward.
    logits = model(input_ids=target[:, :-1], use_cache=True, **{cache_kwarg(model): cache}).logits
    logits = torch.cat([last_logits[:, None, :].to(logits.dtype), logits], dim=1).float()
    return float(torch.nn.functional.cross_entropy(logits[0], target[0], reduction="mean"))
