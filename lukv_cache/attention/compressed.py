"""Exact attention over a compressed layer: its ragged store plus its dense suffix, merged in fp32.

The mask transformers builds covers logical positions (every token seen), so it is read at each stored
token's original position for the store and at the last ``S`` positions for the suffix.

Which implementation serves a call: CUDA, the fused kernels of :mod:`.kernels`; CPU with a mask that hides
nothing (decode), the masked product of :mod:`.masked` for a small fp32 layer, else the windows of
:mod:`.windows`; otherwise the two parts (:mod:`.partial`) and their log-sum-exp merge.

A quantized store (``LUKVCache(kv_bits=...)``) is read in blocks of at most :data:`BLOCK_ROWS` rows: each
block is dequantized to the model's dtype and attended like a full-precision store (every path above),
the blocks' log-sum-exps merged; a layer never holds more than one block at full precision.

Learned attention sinks (``s_aux [Hq]``, GPT-OSS and its kin: one logit per query head in the softmax's
denominator, with no value) are honoured on every path. The masked product puts the sink in its softmax;
every other path (the fused Triton kernel, the windows, the parts and merge, the flash-attn kernel inside
the merge) returns its log-sum-exp ``lse``, and the sink is applied after the fact in fp32:
``out * sigmoid(lse - s)``, which is ``out * e^lse / (e^lse + e^s)``.

:func:`attention_weights` gives the weights of the same softmax over the logical key positions, what the
routed eager attention returns when ``output_attentions`` asks for them (never on the plain decode path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import kernels, masked, windows
from .calls import StoreView
from .dispatch import ragged_attention
from .partial import _softcap, merge_partials, partial_attention

BLOCK_ROWS = 4096  # rows of a quantized store dequantized at a time (1 MiB per tensor at fp32, head_dim 64)


@dataclass(frozen=True, eq=False)
class _Block:
    """Rows ``start:stop`` of a store (its offsets clipped to them), at the model's precision."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    offsets: torch.Tensor
    offsets_list: tuple[int, ...]
    num_heads: int
    start: int
    stop: int

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start

    def segment_ids(self) -> torch.Tensor:
        counts = self.offsets.diff()
        ids = torch.arange(counts.numel(), device=self.offsets.device)
        return torch.repeat_interleave(ids, counts, output_size=self.num_tokens)


# Per live quantized store (keyed by its offsets, as the window plans): its blocks' bounds and offsets.
_BLOCKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _block_bounds(store: StoreView) -> list[tuple[int, int, torch.Tensor, tuple[int, ...]]]:
    bounds = _BLOCKS.get(store.offsets)
    if bounds is None:
        total = store.offsets_list[-1]
        if total <= BLOCK_ROWS:  # one block: the store's own offsets (plans cached on them are reused)
            bounds = [(0, total, store.offsets, store.offsets_list)]
        else:
            bounds = []
            for start in range(0, total, BLOCK_ROWS):
                stop = min(start + BLOCK_ROWS, total)
                clipped = tuple(min(max(o, start), stop) - start for o in store.offsets_list)
                offsets = torch.tensor(clipped, dtype=torch.long, device=store.offsets.device)
                bounds.append((start, stop, offsets, clipped))
        _BLOCKS[store.offsets] = bounds
    return bounds


def store_blocks(store: StoreView):
    """The store at the model's precision, a block of rows at a time (a full-precision store: itself)."""
    if getattr(store, "kv_bits", None) is None:
        yield store
        return
    for start, stop, offsets, offsets_list in _block_bounds(store):
        keys, values = store.dense(start, stop)
        yield _Block(
            keys, values, store.positions[start:stop], offsets, offsets_list, store.num_heads, start, stop
        )


def _as_bias(mask: torch.Tensor) -> torch.Tensor:
    """Additive fp32 bias from a bool (True = attend) or float additive mask."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(
            ~mask, torch.finfo(torch.float32).min
        )
    return mask.float().clamp_min(torch.finfo(torch.float32).min)


def _sink_rows(s_aux: torch.Tensor, h: int, q_len: int) -> torch.Tensor:
    """fp32 ``[H_kv, M]``: the sink of each grouped query row (row ``m = g * Q + i`` of KV head ``k`` is
    query head ``k * G + g``)."""
    return s_aux.float().view(h, -1, 1).expand(-1, -1, q_len).reshape(h, -1)


def _with_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """fp32 ``out [B, H_kv, M, D]`` normalised over the keys, renormalised with the sink in the denominator."""
    return out * torch.sigmoid(lse - sink).unsqueeze(-1)


def compressed_attention(
    store: StoreView,
    query: torch.Tensor,
    suffix_keys: torch.Tensor,
    suffix_values: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    *,
    s_aux: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query [B, Hq, Q, D]`` over ``store`` and the dense suffix ``[B, H_kv, S, D]``.

    ``s_aux``: the learned sink logits ``[Hq]`` (the kwarg GPT-OSS-style models pass to the attention
    function), one per query head, added to the softmax's denominator with no value (not soft-capped).
    Returns ``[B, Q, Hq, D]`` in the query's dtype, like transformers' stock attention functions.

    >>> out = compressed_attention(call.store, query, key, value, mask, scaling=0.125)  # doctest: +SKIP
    """
    b, hq, q_len, d = query.shape
    h = suffix_keys.shape[1]
    g = hq // h
    grouped = query.reshape(b, h, g * q_len, d)  # row m = g * Q + i
    s = suffix_keys.shape[-2]
    sink = None if s_aux is None else _sink_rows(s_aux, h, q_len)

    key_bias = None
    suffix_bias = None
    if attention_mask is not None:
        bias = _as_bias(attention_mask[:, 0])  # [B or 1, Q, L]
        bias = bias.expand(b, q_len, bias.shape[-1])
        suffix_bias = bias[:, None, :, bias.shape[-1] - s :].repeat(1, 1, g, 1)  # [B, 1, M, S]
        key_bias = bias[store.segment_ids() // h, :, store.positions.long()]  # [N, Q]
    if getattr(store, "kv_bits", None) is not None:
        if len(_block_bounds(store)) > 1:
            return _blockwise(
                store,
                grouped,
                query,
                suffix_keys,
                suffix_values,
                suffix_bias,
                key_bias,
                scaling,
                softcap,
                sink,
            )
        store = next(store_blocks(store))  # a small store: one block, every path below
    fused = kernels.get_ragged_suffix_kernel(grouped)
    if fused is not None:  # store + suffix in one kernel pass, no host sync
        out, lse = fused(
            grouped,
            store.keys,
            store.values,
            store.offsets,
            suffix_keys,
            suffix_values,
            scaling=scaling,
            softcap=softcap,
            key_bias=key_bias,
            suffix_bias=suffix_bias,
        )
        if sink is not None:
            out = _with_sink(out, lse, sink)
        return out.view(b, hq, q_len, -1).transpose(1, 2).contiguous().to(query.dtype)
    if suffix_bias is not None and not bool((suffix_bias < 0).any()):
        suffix_bias = None  # decode without padding in the suffix: take the fused CPU path
    if key_bias is not None and not bool((key_bias < 0).any()):
        key_bias = None  # the usual case: stored tokens are real and precede every query
    nothing_hidden = suffix_bias is None and key_bias is None
    if nothing_hidden and masked.serves(grouped, store, suffix_keys):  # a small layer: one masked product
        out = masked.masked_ragged_attention(
            grouped, store, suffix_keys, suffix_values, scaling=scaling, softcap=softcap, sink=sink
        )
    elif nothing_hidden and windows.serves(grouped, store.keys, store.values, softcap):
        out, lse = windows.windowed_ragged_attention(  # store and suffix: three fused calls, one merge
            grouped,
            store.keys,
            store.values,
            store.offsets,
            scaling=scaling,
            suffix_keys=suffix_keys,
            suffix_values=suffix_values,
            with_lse=sink is not None,
        )
        if sink is not None:
            out = _with_sink(out, lse, sink)
    else:  # a mask that hides something, or a softcap on a large layer: the two parts and their merge
        out_s, lse_s = partial_attention(
            grouped, suffix_keys, suffix_values, scaling=scaling, softcap=softcap, bias=suffix_bias
        )
        out_r, lse_r = ragged_attention(
            grouped,
            store.keys,
            store.values,
            store.offsets,
            scaling=scaling,
            softcap=softcap,
            key_bias=key_bias,
            offsets_list=list(store.offsets_list),
        )
        out, lse = merge_partials(out_r, lse_r, out_s, lse_s)
        if sink is not None:
            out = _with_sink(out, lse, sink)
    return out.view(b, hq, q_len, -1).transpose(1, 2).contiguous().to(query.dtype)


def _blockwise(
    store, grouped, query, suffix_keys, suffix_values, suffix_bias, key_bias, scaling, softcap, sink
):
    """A quantized store of several blocks: the suffix, then each block, merged by log-sum-exp."""
    b, hq, q_len, _ = query.shape
    if suffix_bias is not None and not bool((suffix_bias < 0).any()):
        suffix_bias = None
    out, lse = partial_attention(
        grouped, suffix_keys, suffix_values, scaling=scaling, softcap=softcap, bias=suffix_bias
    )
    for block in store_blocks(store):
        bias = None if key_bias is None else key_bias[block.start : block.stop]
        out_b, lse_b = ragged_attention(
            grouped,
            block.keys,
            block.values,
            block.offsets,
            scaling=scaling,
            softcap=softcap,
            key_bias=bias,
            offsets_list=list(block.offsets_list),
        )
        out, lse = merge_partials(out_b, lse_b, out, lse)
    if sink is not None:
        out = _with_sink(out, lse, sink)
    return out.view(b, hq, q_len, -1).transpose(1, 2).contiguous().to(query.dtype)


def attention_weights(
    store: StoreView,
    query: torch.Tensor,
    suffix_keys: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    *,
    s_aux: torch.Tensor | None = None,
) -> torch.Tensor:
    """The softmax weights of :func:`compressed_attention` over the logical key positions, what an eager
    attention function returns for ``output_attentions``: ``[B, Hq, Q, K]`` in the query's dtype.

    ``K`` is the mask's last dimension (without a mask: the last stored position + 1 + ``S``). A stored
    token's weight is in its original column (``store.positions``), the suffix fills the last ``S``
    columns, and the evicted columns are 0. With ``s_aux`` the sinks' share is left out (rows sum to less
    than 1), as in GPT-OSS's eager attention. fp32 logits of the result's size, one matmul per (row, KV
    head) segment; the attention itself never calls this (the routed eager does, only when asked).

    >>> w = attention_weights(call.store, query, key, mask, scaling=0.125)  # doctest: +SKIP
    """
    b, hq, q_len, d = query.shape
    h, s = suffix_keys.shape[1], suffix_keys.shape[-2]
    g = hq // h
    if attention_mask is not None:
        k_len = attention_mask.shape[-1]
    else:
        k_len = (int(store.positions.max()) + 1 if store.num_tokens else 0) + s
    # Keys broadcast over the G query heads, as eager's repeat_kv: the same products, bit for bit.
    grouped = query.float().reshape(b * h, g, q_len, d)
    logits = grouped.new_full((b * h, g, q_len, k_len), float("-inf"))
    suffix_t = suffix_keys.float().flatten(0, 1).mT.unsqueeze(1)  # [B * H_kv, 1, D, S]
    suffix = torch.matmul(grouped, suffix_t.expand(-1, g, -1, -1)) * scaling
    logits[..., k_len - s :] = _softcap(suffix, softcap)
    columns = store.positions.long()
    bounds = store.offsets_list
    for seg in range(b * h):
        lo, hi = bounds[seg], bounds[seg + 1]
        if hi > lo:
            keys = store.keys[lo:hi] if getattr(store, "kv_bits", None) is None else store.dense(lo, hi)[0]
            part = torch.matmul(grouped[seg], keys.float().mT.expand(g, -1, -1)) * scaling
            logits[seg, :, :, columns[lo:hi]] = _softcap(part, softcap)
    logits = logits.view(b, h, g, q_len, k_len)
    if attention_mask is not None:
        bias = _as_bias(attention_mask[:, 0])  # [B or 1, Q, K]
        logits += bias.expand(b, q_len, k_len)[:, None, None]
    logits = logits.view(b, hq, q_len, k_len)
    if s_aux is not None:  # the sink's column joins the softmax, then is dropped
        sinks = s_aux.float().view(1, hq, 1, 1).expand(b, hq, q_len, 1)
        logits = torch.cat([logits, sinks], dim=-1)
    return torch.softmax(logits, dim=-1)[..., :k_len].to(query.dtype)
