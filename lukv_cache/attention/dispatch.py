"""Which implementation serves an attention call over a compressed layer, decided once per call.

:func:`plan_attention` reads one call of :func:`~lukv_cache.attention.compressed.compressed_attention`
(grouped queries, the store, the dense suffix, the mask as a key bias and a suffix bias, the softcap, the
:class:`~lukv_cache.attention.limits.AttentionLimits`) and returns an :class:`AttentionPlan`: which
:class:`Impl` serves the store part, which the suffix, whether they are fused into one call, and which
bias each part reads. :mod:`.compressed` then computes what the plan says with the leaf modules, which
decide nothing: :mod:`.masked`, :mod:`.tiles`, :mod:`.partial` (the torch math), :mod:`.kernels` (the
CUDA kernels, and the choice among them). The plans, in the order they are tried:

0. a quantized store on CUDA (or Triton's interpreter when forced): store and suffix in one Triton call
   that reads the codes and dequantizes each block in registers (:func:`~.kernels.get_quantized_suffix_kernel`,
   :attr:`AttentionPlan.codes`); on CPU, with a mask that hides nothing (decode), the C kernel of
   :mod:`.cpu_codes` does the same (:attr:`Impl.CODES`, fused), when it could be built;
1. a quantized store of several blocks (``AttentionLimits.block_rows``): the store by blocks
   (:attr:`Impl.BLOCKS`, each block's path chosen by :func:`store_path` when it is dequantized, with its
   rows of the key bias), the suffix by the torch math, their log-sum-exps merged;
2. CUDA (or Triton's interpreter when forced), where :func:`~.kernels.get_ragged_suffix_kernel` gives
   one: store and suffix in one Triton call, both biases as given (:attr:`Impl.TRITON`, fused);
3. a mask that hides nothing (:func:`~.partial.hides_nothing`: the biases are dropped) and a small fp32
   layer on CPU (:func:`.masked.serves`): one masked product over both (:attr:`Impl.MASKED`, fused);
4. a mask that hides nothing and a call the tiles take (:func:`.tiles.serves`: CPU, no softcap):
   store and suffix in a few fused calls over tiles of the flat store (:attr:`Impl.TILES`, fused);
5. otherwise the two parts: the suffix by the torch math (:attr:`Impl.TORCH`), the store by
   :func:`store_path` (a CUDA kernel, the tiles or the per-segment reference), merged.

:func:`ragged_attention` is the store part alone (store path, then the computation): what step 5 and
each block of step 1 run.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from . import cpu_codes, kernels, masked, tiles
from .calls import StoreView
from .kernels import RaggedKernel, RaggedSuffixKernel
from .limits import AttentionLimits
from .partial import hides_nothing, ragged_attention_reference


class Impl(enum.StrEnum):
    """An implementation that serves a part of the attention."""

    TRITON = "triton"  # the Triton kernel (:mod:`._triton_ragged`), store only or store + suffix
    FLASH_ATTN = "flash_attn"  # flash-attn's varlen kernel, store only (fp16/bf16, no key bias)
    MASKED = "masked"  # one masked product over store and suffix (:mod:`.masked`)
    TILES = "tiles"  # fixed-size tiles of the flat store, fused CPU calls (:mod:`.tiles`)
    TORCH = "torch"  # the torch math: the per-segment reference, partial_attention for the suffix
    BLOCKS = "blocks"  # a quantized store a block of rows at a time, each block by its own store path
    CODES = "codes"  # the CPU kernel over a quantized store's codes and the suffix (:mod:`.cpu_codes`)


@dataclass(frozen=True)
class AttentionPlan:
    """How one :func:`~lukv_cache.attention.compressed.compressed_attention` call is served.

    ``fused``: store and suffix in one call (then ``suffix`` is ``store``); else the two parts are
    computed apart and merged by their log-sum-exps. ``key_bias`` / ``suffix_bias``: whether that part
    reads its bias (``False``: no mask, or one that hides nothing there, dropped). ``kernel``: the
    store part's CUDA kernel (:attr:`Impl.TRITON`, :attr:`Impl.FLASH_ATTN`, not fused), ``fused_kernel``:
    the kernel of a fused :attr:`Impl.TRITON` call; else ``None`` (neither is compared or shown).
    ``codes``: that fused kernel reads a quantized store's codes itself (no block is dequantized).

    >>> AttentionPlan(Impl.MASKED, Impl.MASKED, fused=True)
    AttentionPlan(store=<Impl.MASKED: 'masked'>, suffix=<Impl.MASKED: 'masked'>, fused=True, key_bias=False, suffix_bias=False, codes=False)
    """

    store: Impl
    suffix: Impl
    fused: bool
    key_bias: bool = False
    suffix_bias: bool = False
    kernel: RaggedKernel | None = field(default=None, compare=False, repr=False)
    fused_kernel: RaggedSuffixKernel | None = field(default=None, compare=False, repr=False)
    codes: bool = False  # the fused kernel reads a quantized store's codes (dequantized in registers)


def plan_attention(
    query: torch.Tensor,
    store: StoreView,
    suffix_keys: torch.Tensor,
    *,
    key_bias: torch.Tensor | None,
    suffix_bias: torch.Tensor | None,
    softcap: float | None,
    blocks: int = 1,
    limits: AttentionLimits | None = None,
) -> AttentionPlan:
    """The plan for grouped ``query [B, H_kv, M, D]`` over ``store`` (at the model's precision when
    ``blocks`` is 1) and the dense ``suffix_keys [B, H_kv, S, D]``; ``key_bias [N, Q]`` and
    ``suffix_bias [B, 1, M, S]`` as :func:`~lukv_cache.attention.compressed.compressed_attention` builds
    them from the mask; ``blocks``: how many blocks a quantized store is read in (see the module
    docstring for the order).

    >>> class Store:  # what the cache hands attention (a RaggedStore)
    ...     keys = values = torch.randn(50, 8); offsets = torch.tensor([0, 30, 50])
    ...     offsets_list = (0, 30, 50); num_heads = 2
    >>> q, sk = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 4, 8)
    >>> plan_attention(q, Store(), sk, key_bias=None, suffix_bias=None, softcap=None).store
    <Impl.MASKED: 'masked'>
    >>> hidden = torch.zeros(50, 3).index_fill_(0, torch.tensor([7]), -1e30)  # row 7 masked: two parts
    >>> plan = plan_attention(q, Store(), sk, key_bias=hidden, suffix_bias=None, softcap=None)
    >>> plan.store, plan.suffix, plan.fused, plan.key_bias, plan.suffix_bias
    (<Impl.TORCH: 'torch'>, <Impl.TORCH: 'torch'>, False, True, False)
    >>> plan_attention(q, Store(), sk, key_bias=None, suffix_bias=None, softcap=None, blocks=3).store
    <Impl.BLOCKS: 'blocks'>
    """
    if getattr(store, "kv_bits", None) is not None:
        on_codes = kernels.get_quantized_suffix_kernel(query)
        if on_codes is not None:  # CUDA: one fused kernel over the codes and the suffix, any size
            return AttentionPlan(
                Impl.TRITON,
                Impl.TRITON,
                fused=True,
                key_bias=key_bias is not None,
                suffix_bias=suffix_bias is not None,
                fused_kernel=on_codes,
                codes=True,
            )
        if cpu_codes.serves(query, store) and hides_nothing(key_bias) and hides_nothing(suffix_bias):
            return AttentionPlan(Impl.CODES, Impl.CODES, fused=True, codes=True)  # CPU decode on the codes
    if blocks > 1:
        return AttentionPlan(
            Impl.BLOCKS,
            Impl.TORCH,
            fused=False,
            key_bias=key_bias is not None,  # each block drops its rows of it if they hide nothing
            suffix_bias=not hides_nothing(suffix_bias),
        )
    fused = kernels.get_ragged_suffix_kernel(query)
    if fused is not None:  # store + suffix in one kernel pass, no host sync
        return AttentionPlan(
            Impl.TRITON,
            Impl.TRITON,
            fused=True,
            key_bias=key_bias is not None,
            suffix_bias=suffix_bias is not None,
            fused_kernel=fused,
        )
    reads_suffix_bias = not hides_nothing(suffix_bias)  # decode without padding in the suffix: none
    reads_key_bias = not hides_nothing(key_bias)  # the usual case: stored tokens precede every query
    if not (reads_suffix_bias or reads_key_bias):
        if masked.serves(query, store, suffix_keys, limits):  # a small layer: one masked product
            return AttentionPlan(Impl.MASKED, Impl.MASKED, fused=True)
        if tiles.serves(query, store.keys, store.values, softcap):  # three fused calls, one merge
            return AttentionPlan(Impl.TILES, Impl.TILES, fused=True)
    # a mask that hides something, or a softcap on a large layer: the two parts and their merge
    impl, kernel = store_path(
        query, store.keys, store.values, key_bias=key_bias if reads_key_bias else None, softcap=softcap
    )
    return AttentionPlan(
        impl,
        Impl.TORCH,
        fused=False,
        key_bias=reads_key_bias,
        suffix_bias=reads_suffix_bias,
        kernel=kernel,
    )


def store_path(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    key_bias: torch.Tensor | None,
    softcap: float | None,
) -> tuple[Impl, RaggedKernel | None]:
    """Which implementation serves the store part alone, and its kernel when it is one: a CUDA kernel
    of :mod:`.kernels` when one serves (it reads ``key_bias`` as given), else, once a key bias that
    hides nothing is dropped, the tiles (no key bias, :func:`.tiles.serves`), else the per-segment
    torch reference.

    >>> q, k = torch.randn(1, 2, 3, 8), torch.randn(10, 8)
    >>> store_path(q, k, k, key_bias=None, softcap=None), store_path(q, k, k, key_bias=None, softcap=5.0)
    ((<Impl.TILES: 'tiles'>, None), (<Impl.TORCH: 'torch'>, None))
    """
    kernel = kernels.get_ragged_kernel(query, key_bias=key_bias, softcap=softcap)
    if kernel is not None:
        return (Impl.FLASH_ATTN if kernel is kernels.flash_attn_ragged_attention else Impl.TRITON), kernel
    if hides_nothing(key_bias) and tiles.serves(query, keys, values, softcap):
        return Impl.TILES, None
    return Impl.TORCH, None


def run_store(
    impl: Impl,
    kernel: RaggedKernel | None,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    key_bias: torch.Tensor | None = None,
    offsets_list: list[int] | None = None,
    limits: AttentionLimits | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The store part by the implementation :func:`store_path` chose: fp32 ``out`` and ``lse``."""
    if kernel is not None:
        return kernel(
            query, keys, values, offsets, scaling=scaling, softcap=softcap, key_bias=key_bias, limits=limits
        )
    if impl is Impl.TILES:
        out, lse = tiles.tiled_ragged_attention(query, keys, values, offsets, scaling=scaling, limits=limits)
        assert lse is not None  # with_lse, the default
        return out, lse
    return ragged_attention_reference(
        query,
        keys,
        values,
        offsets_list if offsets_list is not None else offsets,
        scaling=scaling,
        softcap=softcap,
        key_bias=key_bias,  # the reference drops one that hides nothing
    )


def ragged_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    key_bias: torch.Tensor | None = None,
    offsets_list: list[int] | None = None,
    limits: AttentionLimits | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped ``query [B, H_kv, M, D]`` over each segment of the flat store: a fused kernel for CUDA
    tensors when one is available; on CPU the fused calls over tiles of :mod:`lukv_cache.attention.tiles`;
    else (softcap, a masking key bias) the torch reference (:func:`store_path`). fp32 ``out`` and ``lse``.

    >>> q, k = torch.randn(1, 2, 3, 8), torch.randn(10, 8)
    >>> out, lse = ragged_attention(q, k, k, torch.tensor([0, 4, 10]), scaling=0.35)
    >>> ref, _ = ragged_attention_reference(q, k, k, [0, 4, 10], scaling=0.35)
    >>> bool(torch.allclose(out, ref, atol=1e-5))
    True
    """
    impl, kernel = store_path(query, keys, values, key_bias=key_bias, softcap=softcap)
    return run_store(
        impl,
        kernel,
        query,
        keys,
        values,
        offsets,
        scaling=scaling,
        softcap=softcap,
        key_bias=key_bias,
        offsets_list=offsets_list,
        limits=limits,
    )
