"""The built-in scorers. Each is a few lines; the docstring says what it keeps and where it comes from."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import group_queries, register_scorer


@register_scorer("streaming", reads_values=False)
def streaming(keys, values, queries):
    """StreamingLLM (arXiv 2309.17453): keep the most recent tokens (sinks are kept by the cache)."""
    b, h, t, _ = keys.shape
    return torch.arange(t, device=keys.device, dtype=torch.float32).expand(b, h, t)


@register_scorer("knorm", reads_values=False)
def knorm(keys, values, queries):
    """KNorm (arXiv 2406.11430): keys with a *small* L2 norm draw the most attention, keep those."""
    return -keys.float().norm(dim=-1)


@register_scorer("keydiff", reads_values=False)
def keydiff(keys, values, queries):
    """KeyDiff (arXiv 2504.15364): keep keys least similar to the head's mean key direction."""
    unit = F.normalize(keys.float(), dim=-1)
    anchor = unit.mean(dim=2, keepdim=True)
    # the cosine with the anchor as one matmul over the unit keys (F.cosine_similarity: 5-10x slower on CPU)
    return -(unit @ anchor.transpose(-1, -2)).squeeze(-1) / anchor.norm(dim=-1).clamp_min(1e-8)


@register_scorer("snapkv", n_queries=32, window=32, kernel_size=5, reads_values=False)
def snapkv(keys, values, queries, kernel_size=5):
    """SnapKV (arXiv 2404.14469): attention from the last prompt queries (the observation window),
    averaged over that window and the GQA group, smoothed by pooling so kept tokens come in clusters."""
    b, h, t, d = keys.shape
    q = group_queries(queries.float(), h)  # [B, H, G, W, D]
    logits = torch.einsum("bhgwd,bhtd->bhgwt", q, keys.float()) / d**0.5
    w = q.shape[3]
    # the window's own keys: query i sees only keys up to its position
    causal = torch.ones(w, w, dtype=torch.bool, device=keys.device).tril()
    logits[..., t - w :] = logits[..., t - w :].masked_fill(~causal, float("-inf"))
    scores = logits.softmax(dim=-1).mean(dim=(2, 3))  # [B, H, T]
    return F.avg_pool1d(scores, kernel_size, stride=1, padding=kernel_size // 2, count_include_pad=False)


@register_scorer("tova", n_queries=1, reads_values=False)
def tova(keys, values, queries):
    """TOVA (arXiv 2401.06104): keep what the last token attends to, averaged over the GQA group."""
    b, h, t, d = keys.shape
    q = group_queries(queries[:, :, -1:].float(), h)[:, :, :, 0]  # [B, H, G, D]
    return torch.einsum("bhgd,bhtd->bhgt", q, keys.float()).div(d**0.5).softmax(dim=-1).mean(dim=2)


@register_scorer("expected_attention", n_queries=64, epsilon=0.0)
def expected_attention(keys, values, queries, epsilon=0.0):
    """Expected Attention (arXiv 2510.00636, NVIDIA kvpress): model future queries as a Gaussian fitted
    to the last prompt queries; a key's expected attention logit is mu.k/sqrt(d) + k^T Sigma k / (2d).
    Weighted by ||v|| as in the paper (what a token adds to the output, not just how much it is read).
    Unlike kvpress we do not rotate the statistics to future RoPE positions."""
    b, h, t, d = keys.shape
    q = group_queries(queries.float(), h).flatten(2, 3)  # [B, H, G*W, D]
    mu = q.mean(dim=2)  # [B, H, D]
    centred = q - mu.unsqueeze(2)
    cov = centred.transpose(-1, -2) @ centred / max(q.shape[2] - 1, 1)  # [B, H, D, D]
    k = keys.float()
    logits = (k @ mu.unsqueeze(-1)).squeeze(-1) / d**0.5 + ((k @ cov) * k).sum(-1) / (2 * d)
    return (logits.softmax(dim=-1) + epsilon) * values.float().norm(dim=-1)


@register_scorer("random", seed=0, reads_values=False)
def random(keys, values, queries, seed=0):
    """Random eviction: the floor every scorer must beat. Deterministic for a given seed, and the same
    for every batch row (a row draws what it would draw alone)."""
    b, h, t, _ = keys.shape
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.rand(h, t, generator=gen).to(keys.device).expand(b, h, t)
