"""The CPU decode step over a small compressed layer: one masked matrix product instead of tiles.

When a layer holds few rows (a batch of one at a few thousand tokens), the tiled attention of
:mod:`.tiles` spends its time on the fixed cost of its calls (three fused calls, the gathers, a dozen
merge ops), not on arithmetic. Here the queries of every segment meet the whole flat store in one matrix
product, ``[S * M, D] @ [D, N]``, which reads the store once, as the exact computation does; the other
segments' rows are masked out (a bool ``[S, 1, N]`` mask per store, built once and reused like a tile
plan), and the dense suffix joins the same softmax. About ten small ops in all, in fp32. When every
segment holds as many rows (uniform budgets), each segment's rows are read alone instead, a batched
product with no mask and no extra arithmetic.

With ragged segments the product does ``S`` times the arithmetic of the exact attention, so this serves a
layer only while ``segments x stored rows`` stays at most ``AttentionLimits.masked_limit`` (equal
segments: while the rows stay at most ``masked_equal_limit``; both measured with
``benchmarks/cache_bench.py --layer``; :mod:`.limits`), and only in fp32 (in bf16/fp16 the product would round the logits; those take the tiles, which accumulate in fp32).
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .calls import StoreView
from .limits import AttentionLimits, resolve_limits

# Per live store, keyed by its offsets tensor (a new store has new offsets), as the tiles' plans: whether
# its segments are equal, and the mask of the others' rows (built on first use).
_EQUAL: WeakIdKeyDictionary = WeakIdKeyDictionary()
_MASKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _equal(store: StoreView) -> bool:
    equal = _EQUAL.get(store.offsets)
    if equal is None:
        bounds = store.offsets_list
        equal = _EQUAL[store.offsets] = len({hi - lo for lo, hi in zip(bounds, bounds[1:])}) <= 1
    return equal


def serves(
    query: torch.Tensor,
    store: StoreView,
    suffix_keys: torch.Tensor,
    limits: AttentionLimits | None = None,
) -> bool:
    """Whether :func:`masked_ragged_attention` takes this decode call: CPU, fp32, a non-empty suffix
    (so no segment is left with nothing to attend), and a small layer (``limits``: :data:`.limits.LIMITS`
    by default)."""
    if not (
        query.device.type == "cpu"
        and query.dtype == store.keys.dtype == suffix_keys.dtype == torch.float32
        and suffix_keys.shape[-2] > 0
    ):
        return False
    limits = resolve_limits(limits)
    rows = store.keys.shape[0]
    if _equal(store):
        return rows <= limits.masked_equal_limit
    return (len(store.offsets_list) - 1) * rows <= limits.masked_limit


def _hidden(store: StoreView) -> torch.Tensor:
    """bool ``[S, 1, N]``: True where a stored row belongs to another segment than the query's."""
    hidden = _MASKS.get(store.offsets)
    if hidden is None:
        ids = store.segment_ids()
        own = torch.arange(len(store.offsets_list) - 1, device=ids.device)
        hidden = _MASKS[store.offsets] = (ids.unsqueeze(0) != own.unsqueeze(1)).unsqueeze(1)
    return hidden


def masked_ragged_attention(
    query: torch.Tensor,
    store: StoreView,
    suffix_keys: torch.Tensor,
    suffix_values: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 ``out [B, H_kv, M, D]``: grouped ``query [B, H_kv, M, D]`` over each segment of ``store`` and
    its rows of the dense suffix ``[B, H_kv, S, D]`` (all attended), the logits soft-capped if asked.

    ``sink``: fp32 sink logits broadcastable to ``[B, H_kv, M]`` (learned attention sinks), one more
    column of the softmax with no value (not soft-capped).

    >>> from lukv_cache.attention.kernels import ragged_with_suffix_reference
    >>> class Store:  # what the cache hands attention (a RaggedStore)
    ...     keys = values = torch.randn(50, 8); offsets = torch.tensor([0, 30, 50])
    ...     offsets_list = (0, 30, 50); num_heads = 2
    ...     def segment_ids(self): return torch.tensor([0] * 30 + [1] * 20)
    >>> q, sk = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 4, 8)
    >>> out = masked_ragged_attention(q, Store(), sk, sk, scaling=0.35)
    >>> ref, _ = ragged_with_suffix_reference(q, Store.keys, Store.keys, [0, 30, 50], sk, sk, scaling=0.35)
    >>> bool(torch.allclose(out, ref, atol=1e-5))
    True
    """
    b, h, m, d = query.shape
    segments = b * h
    q = query.reshape(segments, m, d) * scaling
    keys, values, hidden = store.keys, store.values, None
    if _equal(store):  # each segment's rows alone, [S, N / S, D]
        per = keys.shape[0] // segments
        keys, values = keys.reshape(segments, per, d), values.reshape(segments, per, values.shape[-1])
    else:
        hidden = _hidden(store)
    n = keys.shape[-2]
    suffix_k = suffix_keys.flatten(0, 1)  # [S, L, D], a view for the cache's suffix
    logits = torch.cat([q @ keys.mT, q @ suffix_k.mT], dim=-1)  # [S, M, n + L]
    if softcap is not None:
        logits = torch.tanh(logits.div_(softcap)).mul_(softcap)
    if hidden is not None:
        logits[..., :n].masked_fill_(hidden, float("-inf"))
    if sink is not None:  # the sink's column joins the softmax, then is dropped
        sinks = sink.expand(b, h, m).reshape(segments, m, 1)
        logits = torch.cat([logits, sinks], dim=-1)
    weights = torch.softmax(logits, dim=-1)
    out = weights[..., :n] @ values
    out.baddbmm_(weights[..., n : n + suffix_k.shape[-2]], suffix_values.flatten(0, 1))
    return out.view(b, h, m, -1)
