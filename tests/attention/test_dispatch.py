"""The attention dispatcher (lukv_cache.attention.dispatch): one plan per call, and the limits object."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lukv_cache.attention import compressed, kernels, limits, masked
from lukv_cache.attention.dispatch import AttentionPlan, Impl, plan_attention, store_path
from lukv_cache.attention.limits import LIMITS, AttentionLimits
from lukv_cache.cache.storage.ragged import RaggedStore
from lukv_cache.errors import ConfigurationError

NEG = torch.finfo(torch.float32).min


def _case(counts=(300, 20, 40, 7), heads=2, dtype=torch.float32, q_len=1):
    gen = torch.Generator().manual_seed(0)
    n = sum(counts)
    store = RaggedStore.build(
        torch.randn(n, 16, generator=gen).to(dtype),
        torch.randn(n, 16, generator=gen).to(dtype),
        torch.arange(n),
        torch.tensor(counts),
        num_heads=heads,
    )
    b = len(counts) // heads
    query = torch.randn(b, heads, 2 * q_len, 16, generator=gen).to(dtype)  # grouped, G = 2
    suffix = torch.randn(b, heads, 5, 16, generator=gen).to(dtype)
    return store, query, suffix


def _plan(store, query, suffix, *, key_bias=None, suffix_bias=None, softcap=None, **kwargs):
    return plan_attention(
        query, store, suffix, key_bias=key_bias, suffix_bias=suffix_bias, softcap=softcap, **kwargs
    )


def test_cpu_decode_plans():
    store, query, suffix = _case()
    assert _plan(store, query, suffix) == AttentionPlan(Impl.MASKED, Impl.MASKED, fused=True)
    small = AttentionLimits(masked_limit=0)
    assert _plan(store, query, suffix, limits=small) == AttentionPlan(Impl.TILES, Impl.TILES, fused=True)
    # a bias that hides nothing is no bias
    zeros = torch.zeros(store.num_tokens, 1)
    assert (
        _plan(store, query, suffix, key_bias=zeros, suffix_bias=torch.zeros(2, 1, 2, 5)).store is Impl.MASKED
    )
    # a softcap on a layer too large for the masked product: the two parts, the store by the reference
    assert _plan(store, query, suffix, softcap=5.0, limits=small) == AttentionPlan(
        Impl.TORCH, Impl.TORCH, fused=False
    )
    # bf16 on CPU: the tiles (the masked product is fp32 only)
    store16, query16, suffix16 = _case(dtype=torch.bfloat16)
    assert _plan(store16, query16, suffix16).store is Impl.TILES


def test_a_mask_that_hides_something_takes_the_two_parts():
    store, query, suffix = _case(q_len=3)
    key_bias = torch.zeros(store.num_tokens, 3)
    key_bias[5] = NEG
    plan = _plan(store, query, suffix, key_bias=key_bias)
    assert plan == AttentionPlan(Impl.TORCH, Impl.TORCH, fused=False, key_bias=True)
    # only the suffix hides (several query tokens, causal there): the store part takes the tiles
    suffix_bias = torch.zeros(2, 1, 6, 5)
    suffix_bias[..., -1] = NEG
    plan = _plan(store, query, suffix, key_bias=torch.zeros(store.num_tokens, 3), suffix_bias=suffix_bias)
    assert plan == AttentionPlan(Impl.TILES, Impl.TORCH, fused=False, suffix_bias=True)


def test_several_blocks_and_the_fused_kernel(monkeypatch):
    store, query, suffix = _case()
    key_bias = torch.zeros(store.num_tokens, 1)
    plan = _plan(store, query, suffix, key_bias=key_bias, blocks=2)
    assert plan == AttentionPlan(Impl.BLOCKS, Impl.TORCH, fused=False, key_bias=True)  # each block drops it
    # where the fused Triton kernel serves (here: forced under the interpreter), both biases as given
    monkeypatch.setenv(kernels.KERNEL_ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kernels, "_import_or_none", lambda name: object() if name == "triton" else None)
    plan = _plan(store, query, suffix, key_bias=key_bias)
    assert plan == AttentionPlan(Impl.TRITON, Impl.TRITON, fused=True, key_bias=True)
    assert plan.fused_kernel is kernels._triton_suffix_or_reference and plan.kernel is None
    assert store_path(query, store.keys, store.values, key_bias=None, softcap=None) == (
        Impl.TRITON,
        kernels._triton_or_reference,
    )


def test_limits_are_frozen_and_checked():
    assert LIMITS == AttentionLimits()
    assert (LIMITS.masked_limit, LIMITS.masked_equal_limit, LIMITS.tile_rows, LIMITS.block_rows) == (
        16384,
        262144,
        256,
        32768,  # benchmarks/quantized_cost.py: memory=0.1's 4k batch of 4 (16,860 rows) in one block
    )
    assert (LIMITS.triton_block_n, LIMITS.triton_min_chunk, LIMITS.triton_max_splits) == (64, 256, 128)
    with pytest.raises(dataclasses.FrozenInstanceError):
        LIMITS.tile_rows = 128  # type: ignore[misc]
    for bad in (
        {"tile_rows": 0},
        {"block_rows": -1},
        {"masked_limit": -1},
        {"tile_rows": 2.5},
        {"tile_rows": True},
    ):
        with pytest.raises(ConfigurationError, match=next(iter(bad))):
            AttentionLimits(**bad)
    assert AttentionLimits(masked_limit=0).masked_limit == 0  # the masked product serves nothing


def test_passed_limits_and_a_patched_default_pick_the_same_path(monkeypatch):
    store, query, suffix = _case()
    hq_query = query.reshape(2, 4, 1, 16)
    calls = []
    real = masked.masked_ragged_attention
    monkeypatch.setattr(masked, "masked_ragged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    default = compressed.compressed_attention(store, hq_query, suffix, suffix, None, 0.25)
    assert calls == [1]
    passed = compressed.compressed_attention(
        store, hq_query, suffix, suffix, None, 0.25, limits=AttentionLimits(masked_limit=0)
    )
    assert calls == [1]  # the tiles
    monkeypatch.setattr(limits, "LIMITS", dataclasses.replace(LIMITS, masked_limit=0))
    patched = compressed.compressed_attention(store, hq_query, suffix, suffix, None, 0.25)
    assert calls == [1]
    assert torch.equal(patched, passed)
    torch.testing.assert_close(passed, default, atol=2e-5, rtol=1e-4)


def test_a_cpu_mask_that_hides_nothing_is_dropped_before_any_bias_is_gathered(monkeypatch):
    # the usual decode step: an all-True bool mask (or an all-zero additive one) gives what no mask gives,
    # without gathering a bias row per stored token; a mask that hides one stored token still gathers it
    store, grouped, suffix = _case()
    b, h, m, d = grouped.shape
    query = grouped.reshape(b, h * m, 1, d)  # [B, H_q, Q = 1, D]
    length = int(store.positions.max()) + 1 + suffix.shape[-2]  # the mask's columns: every position
    gathered = []
    original = compressed._as_bias
    monkeypatch.setattr(compressed, "_as_bias", lambda mask: gathered.append(1) or original(mask))

    def attend(mask):
        return compressed.compressed_attention(store, query, suffix, suffix, mask, scaling=0.25)

    plain = attend(None)
    for mask in (torch.ones(b, 1, 1, length, dtype=torch.bool), torch.zeros(b, 1, 1, length)):
        torch.testing.assert_close(attend(mask), plain, rtol=0, atol=0)
    assert not gathered
    hiding = torch.ones(b, 1, 1, length, dtype=torch.bool)
    hiding[..., 3] = False  # position 3: a stored token (of the first segment)
    assert not torch.equal(attend(hiding), plain) and gathered
