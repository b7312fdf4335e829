"""Triton kernels: grouped queries over a flat ragged KV store (and optionally the dense suffix too).

Same contract as :func:`lukv_cache.attention.partial.ragged_attention_reference` (see that module for the
layout): ``out [B, H_kv, M, D]`` fp32 normalised over the keys attended and ``lse [B, H_kv, M]`` fp32,
nothing to attend giving ``out = 0``, ``lse = -inf``.

Flash-decoding scheme. Program ``(segment, split, block of query rows)`` walks its share of the segment's
keys in blocks of ``BLOCK_N`` (``AttentionLimits.triton_block_n``, :mod:`.limits`) with an online
softmax in fp32 and writes a partial output and log-sum-exp; a second kernel merges the splits. With a dense suffix ``[B, H_kv, S, D]`` (the cache's recent tokens)
one more split per segment attends to it, so store + suffix cost two launches in all, the log-sum-exp
merge included. The split count is chosen on the host from shapes only, and each program reads its
segment's bounds from ``offsets`` on the device, so a call never waits for the GPU.

Importing this module needs ``triton``; :mod:`lukv_cache.attention.kernels` imports it lazily. With
``TRITON_INTERPRET=1`` set *before triton is first imported* the kernels run on CPU tensors in Triton's
interpreter (slow; tests only).
"""

from __future__ import annotations

import functools
import os
from typing import cast

import torch
import triton
import triton.language as tl

from .limits import AttentionLimits, resolve_limits


@triton.jit
def _attend_rows(
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    stride_k,
    stride_v,
    bias_base,
    stride_bias_key,
    stride_bias_row,
    bias_rows,
    start,
    end,
    offs_m,
    offs_d,
    m_valid,
    d_valid,
    scaling,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Online-softmax update of (acc, m_i, l_i) with keys ``start:end`` of one segment (rows of k_base)."""
    n_blocks = tl.cdiv(tl.maximum(end - start, 0), BLOCK_N)
    for i in range(0, n_blocks):
        offs_n = start + i * BLOCK_N + tl.arange(0, BLOCK_N)
        n_valid = offs_n < end
        k_t = tl.load(
            k_base + offs_n[None, :] * stride_k + offs_d[:, None],
            mask=n_valid[None, :] & d_valid[:, None],
            other=0.0,
        )
        if DOT_FP32:
            k_t = k_t.to(tl.float32)
        logits = tl.dot(q, k_t, input_precision=PRECISION) * scaling
        if HAS_SOFTCAP:
            # tanh from exp: portable across backends and the interpreter, stable for any |x|
            x = logits / softcap
            t = tl.exp(-2.0 * tl.abs(x))
            th = (1.0 - t) / (1.0 + t)
            logits = softcap * tl.where(x < 0, -th, th)
        if HAS_BIAS:
            bias = tl.load(
                bias_base
                + offs_n[None, :] * stride_bias_key
                + (offs_m % bias_rows)[:, None] * stride_bias_row,
                mask=n_valid[None, :] & m_valid[:, None],
                other=0.0,
            )
            logits = logits + bias
        logits = tl.where(n_valid[None, :], logits, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(logits, 1))
        # A row whose keys are all -inf so far (only possible through a -inf bias) must not make NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(logits - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + offs_n[:, None] * stride_v + offs_d[None, :],
            mask=n_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# suffix_len grows by one every decode step and num_splits follows the store size: specialising on them
# (Triton does for values 1 and multiples of 16) would recompile in the middle of generation.
@triton.jit(do_not_specialize=["suffix_len", "num_splits"])
def _ragged_attention_partial(
    q_ptr,
    k_ptr,
    v_ptr,
    offsets_ptr,
    bias_ptr,
    sk_ptr,
    sv_ptr,
    sbias_ptr,
    out_ptr,
    lse_ptr,
    stride_qs,
    stride_qm,
    stride_kn,
    stride_vn,
    stride_bn,
    stride_skb,
    stride_skh,
    stride_sks,
    stride_svb,
    stride_svh,
    stride_svs,
    stride_sbb,
    stride_sbh,
    stride_sbm,
    stride_sbs,
    stride_os,
    stride_op,
    stride_om,
    stride_ls,
    stride_lp,
    n_heads,
    suffix_len,
    m_rows,
    head_dim,
    q_len,
    scaling,
    softcap,
    num_splits,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
):
    seg = tl.program_id(0)
    split = tl.program_id(1)
    m_block = tl.program_id(2)

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < m_rows
    d_valid = offs_d < head_dim
    q = tl.load(
        q_ptr + seg * stride_qs + offs_m[:, None] * stride_qm + offs_d[None, :],
        mask=m_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    # Half-precision dots accumulate in fp32 on the GPU; the interpreter (numpy) has no bf16 arithmetic,
    # so there DOT_FP32 upcasts the operands instead. Same maths, fp32 accumulation in both.
    q = q.to(tl.float32) if DOT_FP32 else q.to(k_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if split == num_splits:  # the extra split: this segment's rows of the dense suffix [B, H, S, D]
        row = seg // n_heads
        head = seg % n_heads
        acc, m_i, l_i = _attend_rows(
            acc, m_i, l_i, q,
            sk_ptr + row * stride_skb + head * stride_skh, sv_ptr + row * stride_svb + head * stride_svh,
            stride_sks, stride_svs,
            sbias_ptr + row * stride_sbb + head * stride_sbh, stride_sbs, stride_sbm, m_rows,
            0, suffix_len, offs_m, offs_d, m_valid, d_valid, scaling, softcap,
            HAS_SOFTCAP, HAS_BIAS, PRECISION, DOT_FP32, BLOCK_N,
        )  # fmt: skip
    else:
        lo = tl.load(offsets_ptr + seg)
        hi = tl.load(offsets_ptr + seg + 1)
        # Every segment is cut into num_splits chunks of whole key blocks, at least MIN_CHUNK long, so
        # chunk * num_splits >= length always holds and short segments leave their last splits empty.
        chunk = tl.maximum(tl.cdiv(hi - lo, num_splits), MIN_CHUNK)
        chunk = tl.cdiv(chunk, BLOCK_N) * BLOCK_N
        start = lo + split * chunk
        end = tl.minimum(start + chunk, hi)
        # key_bias [N, Q]: row m = g * Q + i reads column i
        acc, m_i, l_i = _attend_rows(
            acc, m_i, l_i, q, k_ptr, v_ptr, stride_kn, stride_vn,
            bias_ptr, stride_bn, 1, q_len,
            start, end, offs_m, offs_d, m_valid, d_valid, scaling, softcap,
            HAS_SOFTCAP, HAS_BIAS, PRECISION, DOT_FP32, BLOCK_N,
        )  # fmt: skip

    has_mass = l_i > 0
    out = acc / tl.where(has_mass, l_i, 1.0)[:, None]
    lse = tl.where(has_mass, m_i + tl.log(tl.where(has_mass, l_i, 1.0)), float("-inf"))
    tl.store(
        out_ptr + seg * stride_os + split * stride_op + offs_m[:, None] * stride_om + offs_d[None, :],
        out,
        mask=m_valid[:, None] & d_valid[None, :],
    )
    tl.store(lse_ptr + seg * stride_ls + split * stride_lp + offs_m, lse, mask=m_valid)


@triton.jit(do_not_specialize=["num_parts"])
def merge_splits(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    head_dim,
    num_parts,
    stride_pos,
    stride_pop,
    stride_pom,
    stride_pls,
    stride_plp,
    stride_os,
    stride_om,
    stride_ls,
    BLOCK_PARTS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merge the ``num_parts`` partial results of one query row of one segment (one program per segment and
    row) into its output and log-sum-exp: each part weighted by ``exp(part_lse - lse)``. Shared by the
    full-precision and the quantized (``_triton_quantized``) split kernels."""
    seg = tl.program_id(0)
    row = tl.program_id(1)
    offs_p = tl.arange(0, BLOCK_PARTS)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < head_dim
    lse_row = part_lse_ptr + seg * stride_pls + row
    top = tl.max(tl.load(lse_row + offs_p * stride_plp, mask=offs_p < num_parts, other=float("-inf")), 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    # One part at a time: a [parts, D] tensor would not fit in registers at 128 parts x head_dim 128.
    total = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for part in range(0, num_parts):
        weight = tl.exp(tl.load(lse_row + part * stride_plp) - top)  # an empty part (-inf) weighs 0
        values = tl.load(
            part_out_ptr + seg * stride_pos + part * stride_pop + row * stride_pom + offs_d,
            mask=d_valid,
            other=0.0,
        )
        acc += weight * values
        total += weight
    has_mass = total > 0
    out = acc / tl.where(has_mass, total, 1.0)
    lse = tl.where(has_mass, top + tl.log(tl.where(has_mass, total, 1.0)), float("-inf"))
    tl.store(out_ptr + seg * stride_os + row * stride_om + offs_d, out, mask=d_valid)
    tl.store(lse_ptr + seg * stride_ls + row, lse)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def plan_splits(
    n_segments: int,
    n_keys: int,
    m_blocks: int,
    multiprocessors: int,
    limits: AttentionLimits | None = None,
) -> int:
    """Number of key splits per segment, from shapes only (no device sync).

    Enough programs to fill the GPU a few times over, but no split shorter than
    ``limits.triton_min_chunk`` keys on average over the whole store (``n_keys`` bounds the longest
    segment, which may hold them all), and at most ``limits.triton_max_splits``.

    >>> plan_splits(n_segments=8, n_keys=8 * 26_000, m_blocks=1, multiprocessors=132)
    66
    """
    limits = resolve_limits(limits)
    by_occupancy = triton.cdiv(4 * multiprocessors, max(n_segments * m_blocks, 1))
    by_length = triton.cdiv(n_keys, limits.triton_min_chunk)
    return max(1, min(by_occupancy, by_length, limits.triton_max_splits))


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def triton_ragged_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    key_bias: torch.Tensor | None = None,
    suffix_keys: torch.Tensor | None = None,
    suffix_values: torch.Tensor | None = None,
    suffix_bias: torch.Tensor | None = None,
    num_splits: int | None = None,
    limits: AttentionLimits | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of ``ragged_attention_reference`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).

    With ``suffix_keys/suffix_values [B, H_kv, S, D]`` (any strides but a contiguous last dim, e.g. a
    view into a larger buffer) the result is attention over the store *and* the suffix, i.e. what
    ``merge_partials`` of the two parts gives. ``suffix_bias``: additive fp32 broadcastable to
    ``[B, H_kv, M, S]``. If one of the two biases is given the other part is unmasked.
    ``num_splits`` overrides the split plan (tests use it to cover the merge kernel); ``limits``: the
    block sizes and split bounds (:data:`.limits.LIMITS` by default).

    >>> out, lse = triton_ragged_attention(q, k, v, offsets, scaling=128**-0.5)  # doctest: +SKIP
    """
    b, h, m, d = query.shape
    n_segments = b * h
    if (suffix_keys is None) != (suffix_values is None):
        raise ValueError("suffix_keys and suffix_values go together: pass both or neither")
    limits = resolve_limits(limits)
    has_suffix = suffix_keys is not None
    out = query.new_empty((b, h, m, d), dtype=torch.float32)
    lse = query.new_empty((b, h, m), dtype=torch.float32)
    if m == 0 or n_segments == 0 or (keys.shape[0] == 0 and not has_suffix):
        return out.zero_(), lse.fill_(float("-inf"))
    if values.shape[-1] != d or keys.shape[-1] != d:
        raise ValueError(f"query, keys and values must share head_dim {d}: {keys.shape}, {values.shape}")

    q_seg = _last_dim_contiguous(query.reshape(n_segments, m, d))
    keys, values = _last_dim_contiguous(keys), _last_dim_contiguous(values)
    offsets = offsets.to(device=query.device, dtype=torch.int64)
    has_bias = key_bias is not None or (has_suffix and suffix_bias is not None)
    if has_suffix:
        assert suffix_keys is not None  # has_suffix says so
        suffix_values = cast(torch.Tensor, suffix_values)  # given with suffix_keys
        suffix_keys, suffix_values = _last_dim_contiguous(suffix_keys), _last_dim_contiguous(suffix_values)
        s = suffix_keys.shape[-2]
        if has_bias:
            if suffix_bias is None:
                suffix_bias = torch.zeros(1, 1, 1, 1, dtype=torch.float32, device=query.device)
            suffix_bias = suffix_bias.to(torch.float32).expand(b, h, m, s)
        if suffix_keys.shape[-2] == 0:  # nothing to attend there; a null part would only cost a launch
            has_suffix, suffix_keys, suffix_values, suffix_bias = False, None, None, None
    if has_bias and key_bias is None:
        key_bias = torch.zeros(1, 1, dtype=torch.float32, device=query.device).expand(keys.shape[0], 1)
    if key_bias is not None:
        key_bias = key_bias.to(torch.float32)
    # Unused pointers still need a tensor of the right element type; they are never read.
    sk = suffix_keys if has_suffix else keys
    sv = suffix_values if has_suffix else values
    sb = suffix_bias if (has_suffix and has_bias) else lse
    kb = key_bias if key_bias is not None else lse
    sk_strides = cast(torch.Tensor, suffix_keys).stride()[:3] if has_suffix else (0, 0, 0)
    sv_strides = cast(torch.Tensor, suffix_values).stride()[:3] if has_suffix else (0, 0, 0)
    sb_strides = cast(torch.Tensor, sb).stride() if (has_suffix and has_bias) else (0, 0, 0, 0)

    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)  # tl.dot needs >= 16 rows
    m_blocks = triton.cdiv(m, block_m)
    if num_splits is None:
        sms = _multiprocessor_count(query.device.index or 0) if query.is_cuda else 4
        num_splits = plan_splits(n_segments, keys.shape[0], m_blocks, sms, limits)
    num_parts = num_splits + int(has_suffix)
    block_d = max(16, triton.next_power_of_2(d))
    dot_fp32 = _interpreting() or keys.dtype == torch.float32
    out_seg, lse_seg = out.view(n_segments, m, d), lse.view(n_segments, m)
    if num_parts == 1:
        part_out, part_lse = out_seg.unsqueeze(1), lse_seg.unsqueeze(1)
    else:
        part_out = query.new_empty((n_segments, num_parts, m, d), dtype=torch.float32)
        part_lse = query.new_empty((n_segments, num_parts, m), dtype=torch.float32)

    _ragged_attention_partial[(n_segments, num_parts, m_blocks)](
        q_seg, keys, values, offsets, kb, sk, sv, sb, part_out, part_lse,
        q_seg.stride(0), q_seg.stride(1), keys.stride(0), values.stride(0),
        key_bias.stride(0) if key_bias is not None else 0,
        *sk_strides, *sv_strides, *sb_strides,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        h, cast(torch.Tensor, suffix_keys).shape[-2] if has_suffix else 0, m, d,
        key_bias.shape[-1] if key_bias is not None else 1,
        float(scaling), float(softcap) if softcap is not None else 1.0, num_splits,
        HAS_SOFTCAP=softcap is not None,
        HAS_BIAS=has_bias,
        PRECISION="ieee" if dot_fp32 else None,  # fp32 operands: exact products, not tf32
        DOT_FP32=dot_fp32,
        BLOCK_M=block_m,
        BLOCK_N=limits.triton_block_n,
        BLOCK_D=block_d,
        MIN_CHUNK=limits.triton_min_chunk,
        num_warps=4,
        num_stages=2 if dot_fp32 else 3,  # fp32 operands: keep shared memory well under 100 KB
    )  # fmt: skip
    if num_parts > 1:
        merge_splits[(n_segments, m)](
            part_out, part_lse, out_seg, lse_seg, d, num_parts,
            part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
            out_seg.stride(0), out_seg.stride(1), lse_seg.stride(0),
            BLOCK_PARTS=max(2, triton.next_power_of_2(num_parts)),
            BLOCK_D=block_d,
            num_warps=4,
        )  # fmt: skip
    return out, lse
