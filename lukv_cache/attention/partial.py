"""Exact attention over parts of a layer's keys, and the log-sum-exp merge of the parts (torch math).

Layout of one layer's ragged store (see ``lukv_cache.cache.storage.ragged``):

* ``keys``, ``values``: ``[N, D]``, every kept token of every (batch row, KV head) back to back;
* ``offsets``: int64 ``[B * H_kv + 1]``; segment ``s = b * H_kv + h`` is rows ``offsets[s]:offsets[s+1]``.

Queries come grouped by KV head: ``[B, H_kv, M, D]`` with ``M = G * Q`` (G query heads per KV head, Q query
tokens, row ``m = g * Q + i``). Each part returns its output normalised within the part plus the part's
log-sum-exp, so parts merge exactly (the flash-decoding merge), in fp32.
"""

from __future__ import annotations

import torch

from .._ops import flash_attention_cpu as _flash_cpu

_NEG = torch.finfo(torch.float32).min  # finite "masked": a fully masked part gets weight 0, not NaN


def apply_softcap(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(logits / softcap)`` (Gemma 2's attention logit cap); ``logits`` when ``softcap`` is None."""
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def hides_nothing(bias: torch.Tensor | None) -> bool:
    """Whether an additive bias masks nothing: ``None``, or no negative entry (the usual decode case:
    stored tokens are real and precede every query). Reads the bias on the host when there is one.

    >>> hides_nothing(None), hides_nothing(torch.zeros(3, 1)), hides_nothing(torch.tensor([[0.0], [-1e30]]))
    (True, True, False)
    """
    return bias is None or not bool((bias < 0).any())


def partial_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``query [..., M, D]`` over ``keys/values [..., n, D]``; fp32 out and lse.

    ``bias``: additive fp32 ``[..., M, n]`` (0 = attend, very negative = masked). An empty part gives
    ``out = 0`` and ``lse = -inf`` so that it vanishes in :func:`merge_partials`. Without bias or
    softcap on CPU this is one fused kernel call (fp32 accumulation inside); otherwise plain fp32 math.
    """
    if keys.shape[-2] == 0:
        shape = query.shape[:-1]
        out = query.new_zeros((*shape, values.shape[-1]), dtype=torch.float32)
        return out, query.new_full(shape, float("-inf"), dtype=torch.float32)
    if (
        _flash_cpu is not None
        and bias is None
        and softcap is None
        and query.device.type == "cpu"
        and query.dtype == keys.dtype == values.dtype
        and keys.shape[-1] == values.shape[-1]
    ):
        lead = query.shape[:-2]
        q4, k4, v4 = (t.reshape(-1, 1, *t.shape[-2:]) for t in (query, keys, values))
        out, lse = _flash_cpu(q4, k4, v4, 0.0, False, attn_mask=None, scale=scaling)[:2]
        return out.float().view(*lead, *out.shape[-2:]), lse.view(*lead, lse.shape[-1])
    logits = apply_softcap(query.float() @ keys.float().transpose(-1, -2) * scaling, softcap)
    if bias is not None:
        logits = logits + bias
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.softmax(logits, dim=-1) @ values.float()
    return out, lse


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two normalised partial attentions over disjoint key sets into the exact joint softmax."""
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1)
    return out_a * w_a + out_b * w_b, lse


def ragged_attention_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor | list[int],
    *,
    scaling: float,
    softcap: float | None = None,
    key_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped queries ``[B, H_kv, M, D]`` over each (row, head) segment of the flat store.

    ``key_bias``: optional additive fp32 ``[N, Q]`` per stored token and query token (``M = G * Q``).
    Returns ``out [B, H_kv, M, D]`` fp32 and ``lse [B, H_kv, M]`` fp32. The torch reference (CPU and
    fallback): one small matmul per segment, never a padded copy of the store.
    """
    b, h, m, _ = query.shape
    if hides_nothing(key_bias):
        key_bias = None  # the usual case: stored tokens are real and precede every query
    bounds = offsets.tolist() if isinstance(offsets, torch.Tensor) else offsets
    out = query.new_empty((b, h, m, values.shape[-1]), dtype=torch.float32)
    lse = query.new_empty((b, h, m), dtype=torch.float32)
    q_flat = query.reshape(b * h, m, -1)
    for s in range(b * h):
        lo, hi = bounds[s], bounds[s + 1]
        bias = None
        if key_bias is not None:
            q_len = key_bias.shape[-1]
            bias = key_bias[lo:hi].T.repeat(m // q_len, 1)  # [M, n], row m = g * Q + i
        o, l_ = partial_attention(
            q_flat[s], keys[lo:hi], values[lo:hi], scaling=scaling, softcap=softcap, bias=bias
        )
        out[s // h, s % h], lse[s // h, s % h] = o, l_
    return out, lse
