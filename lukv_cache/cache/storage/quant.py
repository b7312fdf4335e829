"""Quantized rows for the ragged store (``LUKVCache(kv_bits=8)`` or ``kv_bits=4``).

Every row (one kept token of one KV head) is quantized on its own: its ``D`` channels in groups of
:data:`GROUP` (32; a ``D`` that 32 does not divide: groups of 16 or 8), each group with a ``scale`` and
a ``zero`` (the group's minimum, rounded down) of two bytes each, in a dtype that holds the model's range
(:func:`scale_dtype`: bf16, fp16 for an fp16 model), codes ``round((x - zero) / scale)`` in ``bits``
bits, two 4-bit codes per byte (the even channel in the low nibble). Because a row needs nothing but itself, everything the store does to rows (keep some, reorder
batch rows, append a fold, rebuild at fold time) is the same indexing on codes, scales and zeros, with no
re-quantization and no drift.

Keys and values are quantized alike. KIVI quantizes keys per channel (over blocks of tokens) because a
few key channels are much larger than the rest; that matters at 2 bits, not at 8 or 4 here: on SmolLM2
(``benchmarks/quant_granularity.py``) 4-bit keys in per-token groups of 32 cost no measurable continuation
loss, per-channel blocks of 32 tokens neither, and both lose at 2 bits (which this store does not offer).
Per-token groups keep every row independent, which is what lets eviction at fold time move codes.

:class:`PackedRows` is the quantized counterpart of a store's ``[N, D]`` keys or values; its
:meth:`PackedRows.dequantize` gives rows back in the model's dtype, a block at a time (the attention over a
quantized store, in :mod:`lukv_cache.attention.compressed`, never holds more than a bounded block; the Triton
kernel of :mod:`lukv_cache.attention._triton_quantized` reads the codes themselves).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import ConfigurationError

GROUP = 32  # channels per scale / zero pair (a head_dim that 32 does not divide: 16 or 8, else the whole row)
KV_BITS = (8, 4)


def check_kv_bits(kv_bits) -> int | None:
    """``kv_bits`` as the cache stores it: ``None`` (the model's precision), 8 or 4.

    >>> check_kv_bits(4), check_kv_bits(None)
    (4, None)
    """
    if kv_bits is None:
        return None
    if isinstance(kv_bits, bool) or not isinstance(kv_bits, int) or kv_bits not in KV_BITS:
        raise ConfigurationError(
            f"kv_bits must be None (keep the model's precision), 8 or 4 (bits per stored key and value "
            f"entry), got {kv_bits!r}."
        )
    return kv_bits


def group_size(dim: int) -> int:
    """Channels per scale / zero pair for rows of ``dim`` channels.

    >>> group_size(64), group_size(16), group_size(12)
    (32, 16, 12)
    """
    return next((g for g in (GROUP, 16, 8) if dim % g == 0), dim)


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the scales and zeros of rows in ``dtype``: two bytes that hold the rows' range, bf16
    (fp32's range; fp16 would turn an entry near 1e5 into inf), fp16 for fp16 rows (finer).

    >>> scale_dtype(torch.float32), scale_dtype(torch.float16)
    (torch.bfloat16, torch.float16)
    """
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


def _rounded(x: torch.Tensor, dtype: torch.dtype, toward: float) -> torch.Tensor:
    """fp32 ``x`` in ``dtype``, rounded toward ``toward`` (``inf``: up, ``-inf``: down) where inexact."""
    y = x.to(dtype)
    inexact = y.float() > x if toward < 0 else y.float() < x
    return torch.where(inexact, torch.nextafter(y, y.new_tensor(toward)), y)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 ``[N, D * bits / 8]`` from integer codes ``[N, D]``."""
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Integer codes ``[N, D]`` (uint8) from packed bytes."""
    if bits == 8:
        return packed
    out = torch.empty((packed.shape[0], dim), dtype=torch.uint8, device=packed.device)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out


@dataclass(frozen=True, eq=False)
class PackedRows:
    """``[N, D]`` rows in ``bits`` bits (see the module docstring).

    ``codes`` uint8 ``[N, D * bits / 8]``; ``scale``, ``zero`` ``[N, D / 32]`` in
    ``scale_dtype(dtype)`` (bf16, or fp16 for fp16 rows); ``dtype``: the rows', what :meth:`dequantize`
    returns.

    >>> rows = torch.randn(5, 64)
    >>> packed = PackedRows.quantize(rows, 8)
    >>> packed.shape, packed.codes.dtype, bool((packed.dequantize() - rows).abs().max() < 0.05)
    ((5, 64), torch.uint8, True)
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    dim: int
    dtype: torch.dtype

    @classmethod
    def quantize(cls, rows: torch.Tensor, bits: int) -> PackedRows:
        """Rows ``[N, D]`` (any float dtype) in ``bits`` bits."""
        n, d = rows.shape
        if bits == 4 and d % 2:
            raise ConfigurationError(
                f"kv_bits=4 packs two channels per byte: head_dim {d} is odd; use kv_bits=8."
            )
        g = group_size(d)
        groups = rows.float().reshape(n, d // g, g)
        lo, hi = groups.amin(-1), groups.amax(-1)
        top = (1 << bits) - 1
        kind = scale_dtype(rows.dtype)
        # the zero rounded down and the scale up, so that every entry codes into 0..top; the scale never 0
        # (a constant group codes to 0 and comes back as its minimum); hi / top - zero / top cannot overflow
        zero = _rounded(lo, kind, -math.inf)
        scale = _rounded((hi / top - zero.float() / top).clamp_min(1e-7), kind, math.inf)
        codes = ((groups - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).round_().clamp_(0, top)
        return cls(_pack(codes.flatten(1), bits), scale, zero, bits, d, rows.dtype)

    @staticmethod
    def fits(value, bits: int, dim: int, n: int, dtype: torch.dtype) -> bool:
        """Whether ``value`` is :class:`PackedRows` holding ``n`` rows of ``dim`` channels of ``dtype`` in
        ``bits``: its codes ``[n, dim * bits / 8]`` uint8, a scale and a zero per channel group (a restored
        store's rows, checked before use)."""
        if (
            not isinstance(value, PackedRows)
            or value.bits != bits
            or value.dim != dim
            or value.dtype != dtype
        ):
            return False
        groups = dim // group_size(dim)
        codes, scale, zero = value.codes, value.scale, value.zero
        return (
            isinstance(codes, torch.Tensor)
            and codes.dtype == torch.uint8
            and dim * bits % 8 == 0
            and tuple(codes.shape) == (n, dim * bits // 8)
            and isinstance(scale, torch.Tensor)
            and isinstance(zero, torch.Tensor)
            and scale.is_floating_point()
            and tuple(scale.shape) == tuple(zero.shape) == (n, groups)
        )

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), self.dim)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dequantize(
        self, start: int = 0, stop: int | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Rows ``start:stop`` ``[n, D]`` in ``dtype`` (default :attr:`dtype`), computed in fp32."""
        codes = _unpack(self.codes[start:stop], self.bits, self.dim)
        n = codes.shape[0]
        g = group_size(self.dim)
        # one fresh fp32 block, scaled and shifted in place (the same two roundings as ``codes * s + z``):
        # fewer large allocations, which on CPU cost more than the arithmetic
        out = codes.view(n, self.dim // g, g).float()
        out.mul_(self.scale[start:stop].float().unsqueeze(-1)).add_(
            self.zero[start:stop].float().unsqueeze(-1)
        )
        return out.view(n, self.dim).to(dtype or self.dtype)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` (int64 ``[K]``) dequantized, ``[K, D]``."""
        return self.take(index).dequantize()

    def take(self, index: torch.Tensor) -> PackedRows:
        """Rows ``index`` (an int64 index or a bool mask over the rows), still quantized."""
        if index.dtype != torch.bool:  # index_select: a plain gather of rows
            return self.with_tensors(*(t.index_select(0, index) for t in self.tensors()))
        return PackedRows(
            self.codes[index], self.scale[index], self.zero[index], self.bits, self.dim, self.dtype
        )

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.codes, self.scale, self.zero)

    def with_tensors(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> PackedRows:
        return PackedRows(codes, scale, zero, self.bits, self.dim, self.dtype)

    def to(self, device, non_blocking: bool = False) -> PackedRows:
        return self.with_tensors(*(t.to(device, non_blocking=non_blocking) for t in self.tensors()))

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
