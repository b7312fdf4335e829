"""Triton kernel: grouped queries over a flat ragged KV store, split over segments and blocks of keys.

Same contract as :func:`lukv_cache.attention.ragged.ragged_attention_reference` (see that module for the
layout): ``out [B, H_kv, M, D]`` fp32 normalised within the store and ``lse [B, H_kv, M]`` fp32, an
empty segment giving ``out = 0``, ``lse = -inf``.

Flash-decoding scheme. Program ``(segment, split, block of query rows)`` walks its share of the segment's
keys in blocks of ``BLOCK_N`` with an online softmax in fp32 and writes a partial output and log-sum-exp;
a second kernel merges the splits. The split count is chosen on the host from shapes only, and each
program reads its segment's bounds from ``offsets`` on the device, so a call never waits for the GPU.

Importing this module needs ``triton``; ``lukv_cache.attention.cuda`` imports it lazily. With
``TRITON_INTERPRET=1`` the kernels run on CPU tensors in Triton's interpreter (slow; tests only).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per inner step
MIN_CHUNK = 4 * BLOCK_N  # fewest keys a split is given: below that, launch overhead dominates
MAX_SPLITS = 128


def _ragged_attention_partial(
    q_ptr,
    k_ptr,
    v_ptr,
    offsets_ptr,
    bias_ptr,
    out_ptr,
    lse_ptr,
    stride_qs,
    stride_qm,
    stride_kn,
    stride_vn,
    stride_bn,
    stride_os,
    stride_op,
    stride_om,
    stride_ls,
    stride_lp,
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

    lo = tl.load(offsets_ptr + seg)
    hi = tl.load(offsets_ptr + seg + 1)
    # Every segment is cut into num_splits chunks of whole key blocks, at least MIN_CHUNK long, so
    # chunk * num_splits >= length always holds and short segments leave their last splits empty.
    chunk = tl.maximum(tl.cdiv(hi - lo, num_splits), MIN_CHUNK)
    chunk = tl.cdiv(chunk, BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, hi)
    n_blocks = tl.cdiv(tl.maximum(end - start, 0), BLOCK_N)

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
    dot_dtype = tl.float32 if DOT_FP32 else k_ptr.dtype.element_ty
    q = q.to(dot_dtype)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for i in range(0, n_blocks):
        offs_n = start + i * BLOCK_N + tl.arange(0, BLOCK_N)
        n_valid = offs_n < end
        k_t = tl.load(
            k_ptr + offs_n[None, :] * stride_kn + offs_d[:, None],
            mask=n_valid[None, :] & d_valid[:, None],
            other=0.0,
        )
        logits = tl.dot(q, k_t.to(dot_dtype), input_precision=PRECISION) * scaling
        if HAS_SOFTCAP:
            # tanh from exp: portable across backends and the interpreter, stable for any |x|
            x = logits / softcap
            t = tl.exp(-2.0 * tl.abs(x))
            th = (1.0 - t) / (1.0 + t)
            logits = softcap * tl.where(x < 0, -th, th)
        if HAS_BIAS:
            bias = tl.load(
                bias_ptr + offs_n[None, :] * stride_bn + (offs_m % q_len)[:, None],
                mask=n_valid[None, :] & m_valid[:, None],
                other=0.0,
            )
            logits = logits + bias
        logits = tl.where(n_valid[None, :], logits, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(logits, 1))
        # A row whose keys are all -inf so far (only possible through -inf bias) must not make NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(logits - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + offs_n[:, None] * stride_vn + offs_d[None, :],
            mask=n_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        dot_v_dtype = tl.float32 if DOT_FP32 else v.dtype
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_v_dtype), v.to(dot_v_dtype), input_precision=PRECISION)
        m_i = m_new

    has_mass = l_i > 0
    out = acc / tl.where(has_mass, l_i, 1.0)[:, None]
    lse = tl.where(has_mass, m_i + tl.log(tl.where(has_mass, l_i, 1.0)), float("-inf"))
    tl.store(
        out_ptr + seg * stride_os + split * stride_op + offs_m[:, None] * stride_om + offs_d[None, :],
        out,
        mask=m_valid[:, None] & d_valid[None, :],
    )
    tl.store(lse_ptr + seg * stride_ls + split * stride_lp + offs_m, lse, mask=m_valid)


def _merge_splits(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    head_dim,
    num_splits,
    stride_pos,
    stride_pop,
    stride_pom,
    stride_pls,
    stride_plp,
    stride_os,
    stride_om,
    stride_ls,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seg = tl.program_id(0)
    row = tl.program_id(1)
    offs_p = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < head_dim
    lse_row = part_lse_ptr + seg * stride_pls + row
    top = tl.max(tl.load(lse_row + offs_p * stride_plp, mask=offs_p < num_splits, other=float("-inf")), 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    # One split at a time: a [splits, D] tile would not fit in registers at 128 splits x head_dim 128.
    total = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for split in range(0, num_splits):
        weight = tl.exp(tl.load(lse_row + split * stride_plp) - top)  # an empty split (-inf) weighs 0
        part = tl.load(
            part_out_ptr + seg * stride_pos + split * stride_pop + row * stride_pom + offs_d,
            mask=d_valid,
            other=0.0,
        )
        acc += weight * part
        total += weight
    has_mass = total > 0
    out = acc / tl.where(has_mass, total, 1.0)
    lse = tl.where(has_mass, top + tl.log(tl.where(has_mass, total, 1.0)), float("-inf"))
    tl.store(out_ptr + seg * stride_os + row * stride_om + offs_d, out, mask=d_valid)
    tl.store(lse_ptr + seg * stride_ls + row, lse)


@functools.cache
def _kernels(interpret: bool) -> tuple:
    # Decorated on first use rather than at import: triton.jit picks compiled or interpreted mode from
    # TRITON_INTERPRET when it runs, and tests switch the interpreter on after this module is imported.
    del interpret  # only the cache key
    return triton.jit(_ragged_attention_partial), triton.jit(_merge_splits)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def plan_splits(n_segments: int, n_keys: int, m_blocks: int, multiprocessors: int) -> int:
    """Number of key splits per segment, from shapes only (no device sync).

    Enough programs to fill the GPU a few times over, but no split shorter than ``MIN_CHUNK`` keys on
    average over the whole store (``n_keys`` bounds the longest segment, which may hold them all).

    >>> plan_splits(n_segments=8, n_keys=8 * 26_000, m_blocks=1, multiprocessors=132)
    66
    """
    by_occupancy = triton.cdiv(4 * multiprocessors, max(n_segments * m_blocks, 1))
    by_length = triton.cdiv(n_keys, MIN_CHUNK)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def triton_ragged_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    key_bias: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of ``ragged_attention_reference`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).

    ``num_splits`` overrides the split plan (tests use it to cover the merge kernel).

    >>> out, lse = triton_ragged_attention(q, k, v, offsets, scaling=128**-0.5)  # doctest: +SKIP
    """
    b, h, m, d = query.shape
    n_segments = b * h
    out = query.new_empty((b, h, m, values.shape[-1]), dtype=torch.float32)
    lse = query.new_empty((b, h, m), dtype=torch.float32)
    if keys.shape[0] == 0 or m == 0 or n_segments == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    if values.shape[-1] != d:
        raise ValueError(f"keys and values must share head_dim, got {d} and {values.shape[-1]}")

    q_seg = query.reshape(n_segments, m, d)
    if q_seg.stride(-1) != 1:
        q_seg = q_seg.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    values = values if values.stride(-1) == 1 else values.contiguous()
    offsets = offsets.to(device=query.device, dtype=torch.int64)
    if key_bias is not None:
        key_bias = key_bias.to(torch.float32)
        key_bias = key_bias if key_bias.stride(-1) == 1 else key_bias.contiguous()

    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)  # tl.dot needs >= 16 rows
    m_blocks = triton.cdiv(m, block_m)
    if num_splits is None:
        sms = 4 if not query.is_cuda else _multiprocessor_count(query.device.index or 0)
        num_splits = plan_splits(n_segments, keys.shape[0], m_blocks, sms)
    block_d = max(16, triton.next_power_of_2(d))
    interpret = _interpreting()
    attend, merge = _kernels(interpret)
    dot_fp32 = interpret or keys.dtype == torch.float32
    precision = "ieee" if dot_fp32 else None  # fp32 operands: exact products, not tf32
    out_seg, lse_seg = out.view(n_segments, m, d), lse.view(n_segments, m)
    if num_splits == 1:
        part_out, part_lse = out_seg.unsqueeze(1), lse_seg.unsqueeze(1)
    else:
        part_out = query.new_empty((n_segments, num_splits, m, d), dtype=torch.float32)
        part_lse = query.new_empty((n_segments, num_splits, m), dtype=torch.float32)

    bias_arg = key_bias if key_bias is not None else lse  # any tensor; never read without HAS_BIAS
    attend[(n_segments, num_splits, m_blocks)](
        q_seg,
        keys,
        values,
        offsets,
        bias_arg,
        part_out,
        part_lse,
        q_seg.stride(0),
        q_seg.stride(1),
        keys.stride(0),
        values.stride(0),
        key_bias.stride(0) if key_bias is not None else 0,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        m,
        d,
        key_bias.shape[-1] if key_bias is not None else 1,
        float(scaling),
        float(softcap) if softcap is not None else 1.0,
        num_splits,
        HAS_SOFTCAP=softcap is not None,
        HAS_BIAS=key_bias is not None,
        PRECISION=precision,
        DOT_FP32=dot_fp32,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_D=block_d,
        MIN_CHUNK=MIN_CHUNK,
        num_warps=4,
    )
    if num_splits > 1:
        merge[(n_segments, m)](
            part_out,
            part_lse,
            out_seg,
            lse_seg,
            d,
            num_splits,
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            out_seg.stride(0),
            out_seg.stride(1),
            lse_seg.stride(0),
            BLOCK_SPLITS=max(2, triton.next_power_of_2(num_splits)),
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out, lse
