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
    total = _nll_sum(last_logits[:1], target[0, :1]) + _nll_sum(logits[0], target[0, 1:])
    return float(total) / target.shape[1]


# the rows of logits cast to float32 at a time: a few MB (the whole [n, V] would be 77 MB for Qwen's 152k-token
# vocabulary at 128 tokens, twice over with the log-softmax: fresh pages every pass, and out of the caches)
_CHUNK_BYTES = 8 << 20


def _nll_sum(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The summed negative log-likelihood of ``target`` ``[n]`` under ``logits`` ``[n, V]`` (any float dtype),
    in float32, as ``cross_entropy(logits.float(), target, reduction="sum")``, a few rows at a time."""
    rows = max(1, _CHUNK_BYTES // (4 * logits.shape[-1]))
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], rows):
        chunk = logits[start : start + rows].float()
        picked = chunk.gather(-1, target[start : start + rows, None])[:, 0]
        total += (chunk.logsumexp(-1) - picked).sum()
    return total
