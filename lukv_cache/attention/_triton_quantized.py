"""Triton kernel: grouped queries over a *quantized* flat ragged store, dequantized in registers.

Same contract as :func:`lukv_cache.attention._triton_ragged.triton_ragged_attention` (and so as
:func:`lukv_cache.attention.partial.ragged_attention_reference` on the dequantized store): ``out [B, H_kv,
M, D]`` fp32 normalised over the keys attended and ``lse [B, H_kv, M]`` fp32, nothing to attend giving
``out = 0``, ``lse = -inf``; an optional dense suffix ``[B, H_kv, S, D]`` is attended in the same launch.

The store is what :class:`lukv_cache.cache.storage.quant.PackedRows` holds for keys and for values: uint8
``codes [N, D * bits / 8]`` (8 bits: one code per byte; 4 bits: two per byte, the even channel in the low
nibble) and ``scale``, ``zero`` ``[N, D / G]`` (bf16, or fp16 for an fp16 model: any float dtype is
read) with ``G = group_size(D)`` channels per pair; a stored entry is ``code * scale + zero``. No full-precision copy of the store is ever made: each program
loads a block of ``BLOCK_N`` rows of codes together with their scales and zeros, dequantizes the block
to fp32 in registers (then to the query's dtype for the tensor-core dot on the GPU) and runs the same
online softmax as the full-precision kernel. The flash-decoding scheme (splits per segment, one extra
split for the suffix, the log-sum-exp merge kernel, the split plan from shapes only) is the one of
:mod:`._triton_ragged`, whose merge kernel and split planner this module reuses.

Per block of keys the codes are read as stored, ``[BLOCK_N, D]`` bytes at 8 bits or ``[BLOCK_N, D / 2]``
packed bytes at 4 bits, whose low and high nibbles are interleaved back into channel order; scales and
zeros are read once per group, ``[BLOCK_N, D / G]``, and broadcast over their channels (a head_dim that
8 does not divide has one group of ``D`` channels, not a power of two: its scales are read per channel).
Keys are dequantized in the same ``[BLOCK_N, D]`` orientation as values and transposed for ``q @ k``.
Compiled for sm_90, the code loads of both widths go through ``cp.async`` like the full-precision
kernel's, and the scales and zeros cost a few scalar loads per thread and block.

Importing this module needs ``triton``. With ``TRITON_INTERPRET=1`` set *before triton is first imported*
the kernels run on CPU tensors in Triton's interpreter (slow; tests only).
"""

from __future__ import annotations

import functools
import os
from typing import cast

import torch
import triton
import triton.language as tl

from ._triton_ragged import merge_splits, plan_splits

BLOCK_N = 64  # keys per inner step (the full-precision kernel's default)
MIN_CHUNK = 4 * BLOCK_N  # fewest keys a split is given (plan_splits assumes the same by default)
BITS = (8, 4)


@triton.jit
def _online_update(
    acc,
    m_i,
    l_i,
    q,
    k_t,
    v,
    bias_base,
    stride_bias_key,
    stride_bias_row,
    bias_rows,
    offs_n,
    n_valid,
    offs_m,
    m_valid,
    scaling,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One online-softmax step of (acc, m_i, l_i) with loaded keys ``k_t [D, BLOCK_N]`` and values
    ``v [BLOCK_N, D]`` (both already in q's dtype, zero where masked)."""
    logits = tl.dot(q, k_t, input_precision=PRECISION) * scaling
    if HAS_SOFTCAP:
        # tanh from exp: portable across backends and the interpreter, stable for any |x|
        x = logits / softcap
        t = tl.exp(-2.0 * tl.abs(x))
        th = (1.0 - t) / (1.0 + t)
        logits = softcap * tl.where(x < 0, -th, th)
    if HAS_BIAS:
        bias = tl.load(
            bias_base + offs_n[None, :] * stride_bias_key + (offs_m % bias_rows)[:, None] * stride_bias_row,
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
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _dequantize_rows(
    codes_ptr,
    scale_ptr,
    zero_ptr,
    stride_codes,
    stride_scale,
    stride_zero,
    offs_n,
    n_valid,
    head_dim,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """fp32 ``code * scale + zero`` of rows ``offs_n``, ``[BLOCK_N, BLOCK_D]`` (0 where masked).

    Codes are read as stored: ``[BLOCK_N, D]`` bytes at 8 bits, ``[BLOCK_N, D / 2]`` packed bytes at 4
    bits whose low and high nibbles (the even and odd channels) are interleaved back into channel order.
    Scales and zeros are read once per group, ``[BLOCK_N, D / G]``, and broadcast over their ``G``
    channels (a ``G`` that is not a power of two, i.e. a head_dim that 8 does not divide: read per
    channel instead)."""
    if BITS == 8:
        offs_d = tl.arange(0, BLOCK_D)
        codes = tl.load(
            codes_ptr + offs_n[:, None] * stride_codes + offs_d[None, :],
            mask=n_valid[:, None] & (offs_d < head_dim)[None, :],
            other=0,
        )
    else:
        offs_b = tl.arange(0, BLOCK_D // 2)
        packed = tl.load(
            codes_ptr + offs_n[:, None] * stride_codes + offs_b[None, :],
            mask=n_valid[:, None] & (offs_b < head_dim // 2)[None, :],
            other=0,
        )
        codes = tl.interleave(packed & 0x0F, packed >> 4)  # channel 2j: low nibble of byte j
    codes = codes.to(tl.float32)
    if (GROUP & (GROUP - 1)) == 0 and GROUP <= BLOCK_D:
        offs_g = tl.arange(0, BLOCK_D // GROUP)
        g_mask = n_valid[:, None] & (offs_g < head_dim // GROUP)[None, :]
        scale = tl.load(scale_ptr + offs_n[:, None] * stride_scale + offs_g[None, :], mask=g_mask, other=0.0)
        zero = tl.load(zero_ptr + offs_n[:, None] * stride_zero + offs_g[None, :], mask=g_mask, other=0.0)
        scale = tl.reshape(
            tl.broadcast_to(scale.to(tl.float32)[:, :, None], (BLOCK_N, BLOCK_D // GROUP, GROUP)),
            (BLOCK_N, BLOCK_D),
        )
        zero = tl.reshape(
            tl.broadcast_to(zero.to(tl.float32)[:, :, None], (BLOCK_N, BLOCK_D // GROUP, GROUP)),
            (BLOCK_N, BLOCK_D),
        )
    else:
        offs_d = tl.arange(0, BLOCK_D)
        mask = n_valid[:, None] & (offs_d < head_dim)[None, :]
        group = offs_d // GROUP
        scale = tl.load(scale_ptr + offs_n[:, None] * stride_scale + group[None, :], mask=mask, other=0.0)
        zero = tl.load(zero_ptr + offs_n[:, None] * stride_zero + group[None, :], mask=mask, other=0.0)
        scale, zero = scale.to(tl.float32), zero.to(tl.float32)
    return codes * scale + zero


@triton.jit
def _attend_dense(
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
    length,
    offs_m,
    offs_d,
    m_valid,
    d_valid,
    scaling,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Online-softmax update with the ``length`` full-precision rows at ``k_base``/``v_base`` (the suffix)."""
    for i in range(0, tl.cdiv(length, BLOCK_N)):
        offs_n = i * BLOCK_N + tl.arange(0, BLOCK_N)
        n_valid = offs_n < length
        k_t = tl.load(
            k_base + offs_n[None, :] * stride_k + offs_d[:, None],
            mask=n_valid[None, :] & d_valid[:, None],
            other=0.0,
        ).to(q.dtype)
        v = tl.load(
            v_base + offs_n[:, None] * stride_v + offs_d[None, :],
            mask=n_valid[:, None] & d_valid[None, :],
            other=0.0,
        ).to(q.dtype)
        acc, m_i, l_i = _online_update(
            acc, m_i, l_i, q, k_t, v, bias_base, stride_bias_key, stride_bias_row, bias_rows,
            offs_n, n_valid, offs_m, m_valid, scaling, softcap, HAS_SOFTCAP, HAS_BIAS, PRECISION,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _attend_quantized(
    acc,
    m_i,
    l_i,
    q,
    kc_ptr,
    ks_ptr,
    kz_ptr,
    vc_ptr,
    vs_ptr,
    vz_ptr,
    stride_kcn,
    stride_ksn,
    stride_kzn,
    stride_vcn,
    stride_vsn,
    stride_vzn,
    bias_ptr,
    stride_bias_key,
    bias_rows,
    start,
    end,
    offs_m,
    m_valid,
    head_dim,
    scaling,
    softcap,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Online-softmax update with the quantized rows ``start:end`` of the store, block by block: each
    block's codes, scales and zeros are loaded and dequantized in registers, never written back."""
    for i in range(0, tl.cdiv(tl.maximum(end - start, 0), BLOCK_N)):
        offs_n = start + i * BLOCK_N + tl.arange(0, BLOCK_N)
        n_valid = offs_n < end
        # [BLOCK_N, D] keys and values, dequantized in registers; keys transposed for q @ k
        k = _dequantize_rows(
            kc_ptr, ks_ptr, kz_ptr, stride_kcn, stride_ksn, stride_kzn, offs_n, n_valid, head_dim,
            BITS, GROUP, BLOCK_N, BLOCK_D,
        )  # fmt: skip
        v = _dequantize_rows(
            vc_ptr, vs_ptr, vz_ptr, stride_vcn, stride_vsn, stride_vzn, offs_n, n_valid, head_dim,
            BITS, GROUP, BLOCK_N, BLOCK_D,
        )  # fmt: skip
        k_t = tl.trans(k.to(q.dtype))
        v = v.to(q.dtype)
        acc, m_i, l_i = _online_update(
            acc, m_i, l_i, q, k_t, v, bias_ptr, stride_bias_key, 1, bias_rows,
            offs_n, n_valid, offs_m, m_valid, scaling, softcap, HAS_SOFTCAP, HAS_BIAS, PRECISION,
        )  # fmt: skip
    return acc, m_i, l_i


# suffix_len grows by one every decode step and num_splits follows the store size: specialising on them
# (Triton does for values 1 and multiples of 16) would recompile in the middle of generation.
@triton.jit(do_not_specialize=["suffix_len", "num_splits"])
def _quantized_ragged_attention_partial(
    q_ptr,
    kc_ptr,
    ks_ptr,
    kz_ptr,
    vc_ptr,
    vs_ptr,
    vz_ptr,
    offsets_ptr,
    bias_ptr,
    sk_ptr,
    sv_ptr,
    sbias_ptr,
    out_ptr,
    lse_ptr,
    stride_qs,
    stride_qm,
    stride_kcn,
    stride_ksn,
    stride_kzn,
    stride_vcn,
    stride_vsn,
    stride_vzn,
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
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
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
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if split == num_splits:  # the extra split: this segment's rows of the dense suffix [B, H, S, D]
        row = seg // n_heads
        head = seg % n_heads
        acc, m_i, l_i = _attend_dense(
            acc, m_i, l_i, q,
            sk_ptr + row * stride_skb + head * stride_skh, sv_ptr + row * stride_svb + head * stride_svh,
            stride_sks, stride_svs,
            sbias_ptr + row * stride_sbb + head * stride_sbh, stride_sbs, stride_sbm, m_rows,
            suffix_len, offs_m, offs_d, m_valid, d_valid, scaling, softcap,
            HAS_SOFTCAP, HAS_BIAS, PRECISION, BLOCK_N,
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
        acc, m_i, l_i = _attend_quantized(
            acc, m_i, l_i, q, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
            stride_kcn, stride_ksn, stride_kzn, stride_vcn, stride_vsn, stride_vzn,
            bias_ptr, stride_bn, q_len, start, end, offs_m, m_valid, head_dim, scaling, softcap,
            BITS, GROUP, HAS_SOFTCAP, HAS_BIAS, PRECISION, BLOCK_N, BLOCK_D,
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


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _group_size(dim: int) -> int:
    # lukv_cache.cache.storage.quant.group_size, repeated here so that attention does not import the cache
    return next((g for g in (32, 16, 8) if dim % g == 0), dim)


def _check_rows(name: str, codes, scale, zero, bits: int, dim: int, group: int) -> None:
    n = codes.shape[0]
    if codes.dtype != torch.uint8 or tuple(codes.shape) != (n, dim * bits // 8):
        raise ValueError(
            f"{name}_codes must be uint8 [N, {dim * bits // 8}] ({bits}-bit codes of {dim} channels), "
            f"got {codes.dtype} {tuple(codes.shape)}"
        )
    for part, t in (("scale", scale), ("zero", zero)):
        if tuple(t.shape) != (n, dim // group) or not t.is_floating_point():
            raise ValueError(
                f"{name}_{part} must be floating [N, {dim // group}] (one per {group} channels of {n} "
                f"rows), got {t.dtype} {tuple(t.shape)}"
            )


def triton_quantized_ragged_attention(
    query: torch.Tensor,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    offsets: torch.Tensor,
    *,
    bits: int,
    dim: int,
    scaling: float,
    softcap: float | None = None,
    key_bias: torch.Tensor | None = None,
    suffix_keys: torch.Tensor | None = None,
    suffix_values: torch.Tensor | None = None,
    suffix_bias: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``triton_ragged_attention`` over a quantized store, dequantized block by block in registers.

    ``key_codes/key_scale/key_zero`` and ``value_*``: the tensors of two
    :class:`~lukv_cache.cache.storage.quant.PackedRows` (``store.keys.tensors()``, ``store.values.tensors()``)
    of ``bits`` (8 or 4) bits and ``dim`` channels (the query's head_dim); ``offsets``: the store's
    ``[B * H_kv + 1]`` segment bounds. The result equals ``ragged_attention_reference`` (or
    ``ragged_with_suffix_reference`` with a suffix) on the dequantized store. ``suffix_keys/suffix_values
    [B, H_kv, S, D]`` at the model's precision (any strides but a contiguous last dim),
    ``suffix_bias`` broadcastable to ``[B, H_kv, M, S]``, ``key_bias [N, Q]`` and ``num_splits`` as in
    :func:`~lukv_cache.attention._triton_ragged.triton_ragged_attention`.

    On the GPU the dequantized keys and values are cast to the query's dtype (as ``PackedRows.dequantize`` does for
    the model's dtype) and multiplied on tensor cores with fp32 accumulation; an fp32 query, or the
    interpreter, keeps them in fp32.

    >>> k, v = store.keys, store.values  # doctest: +SKIP
    >>> out, lse = triton_quantized_ragged_attention(q, *k.tensors(), *v.tensors(), store.offsets,
    ...     bits=k.bits, dim=k.dim, scaling=128**-0.5)  # doctest: +SKIP
    """
    b, h, m, d = query.shape
    n_segments = b * h
    if bits not in BITS:
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    if (suffix_keys is None) != (suffix_values is None):
        raise ValueError("suffix_keys and suffix_values go together: pass both or neither")
    if dim != d:
        raise ValueError(f"the store's rows have {dim} channels, the query's head_dim is {d}")
    if bits == 4 and d % 2:
        raise ValueError(f"4-bit rows pack two channels per byte: head_dim {d} is odd")
    group = _group_size(d)
    _check_rows("key", key_codes, key_scale, key_zero, bits, d, group)
    _check_rows("value", value_codes, value_scale, value_zero, bits, d, group)
    if value_codes.shape[0] != key_codes.shape[0]:
        raise ValueError(
            f"keys and values must have as many rows: {key_codes.shape[0]}, {value_codes.shape[0]}"
        )
    n_keys = key_codes.shape[0]
    has_suffix = suffix_keys is not None
    out = query.new_empty((b, h, m, d), dtype=torch.float32)
    lse = query.new_empty((b, h, m), dtype=torch.float32)
    if m == 0 or n_segments == 0 or (n_keys == 0 and not has_suffix):
        return out.zero_(), lse.fill_(float("-inf"))

    q_seg = _last_dim_contiguous(query.reshape(n_segments, m, d))
    kc, ks, kz = (_last_dim_contiguous(t) for t in (key_codes, key_scale, key_zero))
    vc, vs, vz = (_last_dim_contiguous(t) for t in (value_codes, value_scale, value_zero))
    offsets = offsets.to(device=query.device, dtype=torch.int64)
    has_bias = key_bias is not None or (has_suffix and suffix_bias is not None)
    if has_suffix:
        assert suffix_keys is not None  # has_suffix says so
        suffix_values = cast(torch.Tensor, suffix_values)  # given with suffix_keys
        if suffix_keys.shape[-1] != d or suffix_values.shape[-1] != d:
            raise ValueError(
                f"the suffix must have head_dim {d}: {tuple(suffix_keys.shape)}, {tuple(suffix_values.shape)}"
            )
        suffix_keys, suffix_values = _last_dim_contiguous(suffix_keys), _last_dim_contiguous(suffix_values)
        s = suffix_keys.shape[-2]
        if has_bias:
            if suffix_bias is None:
                suffix_bias = torch.zeros(1, 1, 1, 1, dtype=torch.float32, device=query.device)
            suffix_bias = suffix_bias.to(torch.float32).expand(b, h, m, s)
        if s == 0:  # nothing to attend there; a null part would only cost a launch
            has_suffix, suffix_keys, suffix_values, suffix_bias = False, None, None, None
    if has_bias and key_bias is None:
        key_bias = torch.zeros(1, 1, dtype=torch.float32, device=query.device).expand(n_keys, 1)
    if key_bias is not None:
        key_bias = key_bias.to(torch.float32)
    # Unused pointers still need a tensor; they are never read.
    sk = suffix_keys if has_suffix else query
    sv = suffix_values if has_suffix else query
    sb = suffix_bias if (has_suffix and has_bias) else lse
    kb = key_bias if key_bias is not None else lse
    sk_strides = cast(torch.Tensor, suffix_keys).stride()[:3] if has_suffix else (0, 0, 0)
    sv_strides = cast(torch.Tensor, suffix_values).stride()[:3] if has_suffix else (0, 0, 0)
    sb_strides = cast(torch.Tensor, sb).stride() if (has_suffix and has_bias) else (0, 0, 0, 0)

    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)  # tl.dot needs >= 16 rows
    m_blocks = triton.cdiv(m, block_m)
    if num_splits is None:
        sms = _multiprocessor_count(query.device.index or 0) if query.is_cuda else 4
        num_splits = plan_splits(n_segments, n_keys, m_blocks, sms)
    num_parts = num_splits + int(has_suffix)
    block_d = max(16, triton.next_power_of_2(d))
    dot_fp32 = _interpreting() or query.dtype == torch.float32
    out_seg, lse_seg = out.view(n_segments, m, d), lse.view(n_segments, m)
    if num_parts == 1:
        part_out, part_lse = out_seg.unsqueeze(1), lse_seg.unsqueeze(1)
    else:
        part_out = query.new_empty((n_segments, num_parts, m, d), dtype=torch.float32)
        part_lse = query.new_empty((n_segments, num_parts, m), dtype=torch.float32)

    _quantized_ragged_attention_partial[(n_segments, num_parts, m_blocks)](
        q_seg, kc, ks, kz, vc, vs, vz, offsets, kb, sk, sv, sb, part_out, part_lse,
        q_seg.stride(0), q_seg.stride(1),
        kc.stride(0), ks.stride(0), kz.stride(0), vc.stride(0), vs.stride(0), vz.stride(0),
        key_bias.stride(0) if key_bias is not None else 0,
        *sk_strides, *sv_strides, *sb_strides,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        h, cast(torch.Tensor, suffix_keys).shape[-2] if has_suffix else 0, m, d,
        key_bias.shape[-1] if key_bias is not None else 1,
        float(scaling), float(softcap) if softcap is not None else 1.0, num_splits,
        BITS=bits,
        GROUP=group,
        HAS_SOFTCAP=softcap is not None,
        HAS_BIAS=has_bias,
        PRECISION="ieee" if dot_fp32 else None,  # fp32 operands: exact products, not tf32
        DOT_FP32=dot_fp32,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_D=block_d,
        MIN_CHUNK=MIN_CHUNK,
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
