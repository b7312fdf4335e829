"""Exact attention over a compressed layer: its ragged store plus its dense suffix, merged in fp32.

The mask transformers builds covers logical positions (every token seen), so it is read at each stored
token's original position for the store and at the last ``S`` positions for the suffix.

Which implementation serves a call is decided once, by :func:`.dispatch.plan_attention` (an
:class:`~.dispatch.AttentionPlan`): CUDA, the fused kernels of :mod:`.kernels`; CPU with a mask that
hides nothing (decode), the masked product of :mod:`.masked` for a small fp32 layer, else the tiles of
:mod:`.tiles`; otherwise the two parts (:mod:`.partial`, :func:`.dispatch.ragged_attention`) and their
log-sum-exp merge. This module computes what the plan says.

A quantized store (``LUKVCache(kv_bits=...)``) on CUDA goes to the Triton kernel on its codes (each block
dequantized in registers, :mod:`._triton_quantized`); on CPU, when the mask hides nothing (decode), to the C
kernel on its codes (:mod:`.cpu_codes`, built on first use; a block of 16 rows dequantized on the stack);
elsewhere (a mask that hides something, no C compiler) it is read in blocks of at most
``AttentionLimits.block_rows`` rows (:mod:`.limits`): each block is dequantized to the model's dtype and
attended like a full-precision store (every path above), the blocks' log-sum-exps merged; a layer never
holds more than one block at full precision.

Learned attention sinks (``s_aux [Hq]``, GPT-OSS and its kin: one logit per query head in the softmax's
denominator, with no value) are honoured on every path. The masked product puts the sink in its softmax;
every other path (the fused Triton kernel, the tiles, the parts and merge, the flash-attn kernel inside
the merge) returns its log-sum-exp ``lse``, and the sink is applied after the fact in fp32:
``out * sigmoid(lse - s)``, which is ``out * e^lse / (e^lse + e^s)``.

:func:`attention_weights` gives the weights of the same softmax over the logical key positions, what the
routed eager attention returns when ``output_attentions`` asks for them (never on the plain decode path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import cpu_codes, masked, tiles
from .calls import StoreView, WholeStoreView
from .dispatch import Impl, plan_attention, ragged_attention, run_store
from .limits import AttentionLimits, resolve_limits
from .partial import apply_softcap, merge_partials, partial_attention


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


# Per live quantized store of several blocks (keyed by its offsets, as the tile plans): the blocks' size,
# bounds and offsets. A value must never hold its key (nor anything that holds it): the entry would keep
# the key alive, and every store read would stay in the process for good.
_BLOCKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _block_bounds(store: StoreView, rows: int) -> list[tuple[int, int, torch.Tensor, tuple[int, ...]]]:
    total = store.offsets_list[-1]
    if total <= rows:  # one block: the store's own offsets (plans cached on them are reused), not cached
        return [(0, total, store.offsets, store.offsets_list)]
    cached = _BLOCKS.get(store.offsets)
    if cached is None or cached[0] != rows:
        bounds = []
        for start in range(0, total, rows):
            stop = min(start + rows, total)
            clipped = tuple(min(max(o, start), stop) - start for o in store.offsets_list)
            offsets = torch.tensor(clipped, dtype=torch.long, device=store.offsets.device)
            bounds.append((start, stop, offsets, clipped))
        cached = _BLOCKS[store.offsets] = (rows, bounds)
    return cached[1]


def store_blocks(store: WholeStoreView, limits: AttentionLimits | None = None):
    """A quantized store at the model's precision, a block of ``limits.block_rows`` rows at a time."""
    for start, stop, offsets, offsets_list in _block_bounds(store, resolve_limits(limits).block_rows):
        keys, values = store.dense(start, stop)
        yield _Block(
            keys, values, store.positions[start:stop], offsets, offsets_list, store.num_heads, start, stop
        )


def _has_tail(store: StoreView) -> bool:
    """Whether ``store`` is a store with rows appended in place beside it (the cache's ``TailedStore``: its
    ``base``, its ``tail``, and ``merged()``, the two joined)."""
    return callable(getattr(type(store), "merged", None))


def _as_bias(mask: torch.Tensor) -> torch.Tensor:
    """Additive fp32 bias from a bool (True = attend) or float additive mask."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(
            ~mask, torch.finfo(torch.float32).min
        )
    return mask.float().clamp_min(torch.finfo(torch.float32).min)


def _attends_everything(mask: torch.Tensor) -> bool:
    """Whether a CPU mask neither hides nor weights anything (bool: all True; additive: all 0), so that no
    bias needs gathering for the stored tokens (read on the host: CPU only, where that costs no sync)."""
    if mask.device.type != "cpu":
        return False
    return bool(mask.all()) if mask.dtype == torch.bool else not bool(mask.any())


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
    limits: AttentionLimits | None = None,
) -> torch.Tensor:
    """Attention of ``query [B, Hq, Q, D]`` over ``store`` and the dense suffix ``[B, H_kv, S, D]``.

    ``s_aux``: the learned sink logits ``[Hq]`` (the kwarg GPT-OSS-style models pass to the attention
    function), one per query head, added to the softmax's denominator with no value (not soft-capped).
    ``limits``: where the paths hand over and the blocks' sizes (:data:`.limits.LIMITS` by default).
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
    if attention_mask is not None and _attends_everything(attention_mask):
        attention_mask = None  # the usual decode step: no bias to gather for every stored token
    # rows appended in place beside the store (a TailedStore): the CPU kernel reads both, any other path joins them
    tailed = _has_tail(store)
    base = store.base if tailed else store  # type: ignore[attr-defined]
    if attention_mask is None and cpu_codes.serves(grouped, base):
        # the usual CPU decode step over a quantized store: straight to the kernel (what the plan's Impl.CODES runs)
        on_codes, codes_lse = cpu_codes.codes_attention(
            grouped,
            base,
            suffix_keys,
            suffix_values,
            scaling=scaling,
            softcap=softcap,
            tail=store.tail if tailed else None,  # type: ignore[attr-defined]
        )
        if sink is not None:
            on_codes = _with_sink(on_codes, codes_lse, sink)
        return on_codes.view(b, hq, q_len, -1).transpose(1, 2).contiguous().to(query.dtype)
    if tailed:
        store = store.merged()  # type: ignore[attr-defined]
    if attention_mask is not None:
        bias = _as_bias(attention_mask[:, 0])  # [B or 1, Q, L]
        bias = bias.expand(b, q_len, bias.shape[-1])
        suffix_bias = bias[:, None, :, bias.shape[-1] - s :].repeat(1, 1, g, 1)  # [B, 1, M, S]
        key_bias = bias[store.segment_ids() // h, :, store.positions.long()]  # [N, Q]
    quantized = getattr(store, "kv_bits", None) is not None
    blocks = len(_block_bounds(store, resolve_limits(limits).block_rows)) if quantized else 1
    plan = plan_attention(
        grouped,
        store,
        suffix_keys,
        key_bias=key_bias,
        suffix_bias=suffix_bias,
        softcap=softcap,
        blocks=blocks,
        limits=limits,
    )
    if quantized and blocks == 1 and not plan.codes:
        # a small store: one block, the plan's path over it
        store = next(store_blocks(cast(WholeStoreView, store), limits))  # quantized: a whole store
    key_bias = key_bias if plan.key_bias else None
    suffix_bias = suffix_bias if plan.suffix_bias else None
    if plan.store is Impl.MASKED:  # store and suffix in one masked product, the sink in its softmax
        out = masked.masked_ragged_attention(
            grouped, store, suffix_keys, suffix_values, scaling=scaling, softcap=softcap, sink=sink
        )
        return out.view(b, hq, q_len, -1).transpose(1, 2).contiguous().to(query.dtype)
    lse: torch.Tensor | None  # None only from the tiles, when no sink reads it
    if (
        plan.store is Impl.CODES
    ):  # CPU: store (its codes) + suffix in one kernel call (a mask hiding no stored row)
        out, lse = cpu_codes.codes_attention(
            grouped, store, suffix_keys, suffix_values, scaling=scaling, softcap=softcap
        )
    elif plan.fused_kernel is not None:  # store + suffix in one kernel pass (Triton), no host sync
        out, lse = plan.fused_kernel(
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
            limits=limits,
        )
    elif plan.fused:  # the tiles: store and suffix in three fused calls, one merge
        out, lse = tiles.tiled_ragged_attention(
            grouped,
            store.keys,
            store.values,
            store.offsets,
            scaling=scaling,
            suffix_keys=suffix_keys,
            suffix_values=suffix_values,
            with_lse=sink is not None,
            limits=limits,
        )
    else:  # the two parts: the suffix, then the store (or each of its blocks), merged by log-sum-exp
        out, lse = partial_attention(
            grouped, suffix_keys, suffix_values, scaling=scaling, softcap=softcap, bias=suffix_bias
        )
        if plan.store is Impl.BLOCKS:
            for block in store_blocks(cast(WholeStoreView, store), limits):  # a quantized whole store
                out_b, lse_b = ragged_attention(  # each block's own store path (its rows of the bias)
                    grouped,
                    block.keys,
                    block.values,
                    block.offsets,
                    scaling=scaling,
                    softcap=softcap,
                    key_bias=None if key_bias is None else key_bias[block.start : block.stop],
                    offsets_list=list(block.offsets_list),
                    limits=limits,
                )
                out, lse = merge_partials(out_b, lse_b, out, lse)
        else:
            out_r, lse_r = run_store(
                plan.store,
                plan.kernel,
                grouped,
                store.keys,
                store.values,
                store.offsets,
                scaling=scaling,
                softcap=softcap,
                key_bias=key_bias,
                offsets_list=list(store.offsets_list),
                limits=limits,
            )
            out, lse = merge_partials(out_r, lse_r, out, lse)
    if sink is not None:
        assert lse is not None  # every path gives it when there is a sink
        out = _with_sink(out, lse, sink)
    return out.view(b, hq, q_len, -1).transpose(1, 2).contiguous().to(query.dtype)


def attention_weights(
    store: WholeStoreView,
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
    if _has_tail(store):  # rows appended in place beside the store: joined to it
        store = store.merged()  # type: ignore[attr-defined]
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
    logits[..., k_len - s :] = apply_softcap(suffix, softcap)
    columns = store.positions.long()
    bounds = store.offsets_list
    for seg in range(b * h):
        lo, hi = bounds[seg], bounds[seg + 1]
        if hi > lo:
            keys = store.keys[lo:hi] if getattr(store, "kv_bits", None) is None else store.dense(lo, hi)[0]
            part = torch.matmul(grouped[seg], keys.float().mT.expand(g, -1, -1)) * scaling
            logits[seg, :, :, columns[lo:hi]] = apply_softcap(part, softcap)
    logits = logits.view(b, h, g, q_len, k_len)
    if attention_mask is not None:
        bias = _as_bias(attention_mask[:, 0])  # [B or 1, Q, K]
        logits += bias.expand(b, q_len, k_len)[:, None, None]
    logits = logits.view(b, hq, q_len, k_len)
    if s_aux is not None:  # the sink's column joins the softmax, then is dropped
        sinks = s_aux.float().view(1, hq, 1, 1).expand(b, hq, q_len, 1)
        logits = torch.cat([logits, sinks], dim=-1)
    return torch.softmax(logits, dim=-1)[..., :k_len].to(query.dtype)
