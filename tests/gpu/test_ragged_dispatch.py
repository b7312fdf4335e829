"""Which ragged-attention implementation CUDA queries get, and the flash-attn adapter's contract.

No GPU here: queries are stand-ins that say ``is_cuda``; flash-attn is a torch stand-in with its varlen
contract (one lse per head and query row, ``+inf`` for an empty sequence).
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from lukv_cache.attention import kernels as cuda
from lukv_cache.attention.partial import ragged_attention_reference
from lukv_cache.errors import ConfigurationError


def cuda_query(dtype=torch.bfloat16, head_dim=128):
    return types.SimpleNamespace(is_cuda=True, dtype=dtype, shape=(1, 8, 4, head_dim))


def fake_flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """flash-attn 2.6's varlen forward in torch: q [total_q, Hq, D], k/v [total_k, Hk, D]."""
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and not causal
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"))
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert max(b - a for a, b in zip(cq, cq[1:])) <= max_seqlen_q
    assert max(b - a for a, b in zip(ck, ck[1:])) <= max_seqlen_k
    for i in range(len(cq) - 1):
        qs, ks, vs = q[cq[i] : cq[i + 1]].float(), k[ck[i] : ck[i + 1]].float(), v[ck[i] : ck[i + 1]].float()
        if ks.shape[0] == 0:
            continue  # flash-attn leaves out = 0, lse = +inf
        logits = torch.einsum("qhd,khd->hqk", qs, ks) * softmax_scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        lse[:, cq[i] : cq[i + 1]] = torch.logsumexp(logits, -1)
        out[cq[i] : cq[i + 1]] = torch.einsum("hqk,khd->qhd", logits.softmax(-1), vs).to(q.dtype)
    return (out, lse, None) if return_attn_probs else out


@pytest.fixture
def no_backends(monkeypatch):
    monkeypatch.delenv(cuda.KERNEL_ENV, raising=False)
    monkeypatch.setattr(cuda, "_flash_attn_varlen", lambda: None)
    monkeypatch.setattr(cuda, "_triton_failure", None)
    monkeypatch.setattr(cuda, "_import_or_none", lambda name: None)
    return monkeypatch


def test_cpu_queries_always_use_the_reference():
    assert cuda.ragged_kernel_name(torch.zeros(1, 8, 4, 128)) == "torch"
    assert cuda.get_ragged_kernel(torch.zeros(1, 8, 4, 128)) is None


def test_cuda_without_triton_or_flash_attn_falls_back_to_reference(no_backends):
    assert cuda.get_ragged_kernel(cuda_query()) is None


def test_cuda_with_triton_gets_the_triton_kernel_with_and_without_bias(no_backends):
    no_backends.setattr(cuda, "_import_or_none", lambda name: object() if name == "triton" else None)
    assert cuda.ragged_kernel_name(cuda_query()) == "triton"
    assert cuda.ragged_kernel_name(cuda_query(), key_bias=torch.zeros(3, 1), softcap=30.0) == "triton"
    assert cuda.get_ragged_kernel(cuda_query()) is cuda._triton_or_reference


def test_flash_attn_is_preferred_for_half_precision_without_bias(no_backends):
    no_backends.setattr(cuda, "_import_or_none", lambda name: object() if name == "triton" else None)
    no_backends.setattr(cuda, "_flash_attn_varlen", lambda: fake_flash_attn_varlen_func)
    assert cuda.get_ragged_kernel(cuda_query()) is cuda.flash_attn_ragged_attention
    # bias, fp32 and head_dim > 256 are not flash-attn's: Triton takes them
    assert cuda.ragged_kernel_name(cuda_query(), key_bias=torch.zeros(3, 1)) == "triton"
    assert cuda.ragged_kernel_name(cuda_query(dtype=torch.float32)) == "triton"
    assert cuda.ragged_kernel_name(cuda_query(head_dim=512)) == "torch"


def test_environment_variable_forces_a_kernel(no_backends):
    no_backends.setattr(cuda, "_import_or_none", lambda name: object() if name == "triton" else None)
    no_backends.setattr(cuda, "_flash_attn_varlen", lambda: fake_flash_attn_varlen_func)
    no_backends.setenv(cuda.KERNEL_ENV, "triton")
    assert cuda.ragged_kernel_name(cuda_query()) == "triton"
    no_backends.setenv(cuda.KERNEL_ENV, "torch")
    assert cuda.get_ragged_kernel(cuda_query()) is None
    no_backends.setenv(cuda.KERNEL_ENV, "flash_attn")  # cannot serve a bias: reference, not Triton
    assert cuda.ragged_kernel_name(cuda_query(), key_bias=torch.zeros(3, 1)) == "torch"


def test_unknown_kernel_name_in_environment_raises_configuration_error(no_backends):
    no_backends.setenv(cuda.KERNEL_ENV, "cutlass")
    with pytest.raises(ConfigurationError, match="LUKV_RAGGED_KERNEL"):
        cuda.ragged_kernel_name(cuda_query())


def test_triton_failure_warns_once_and_falls_back_to_reference(no_backends):
    def broken(*args, **kwargs):
        raise RuntimeError("PTX assembly failed")

    no_backends.setitem(
        sys.modules,
        "lukv_cache.attention._triton_ragged",
        types.SimpleNamespace(triton_ragged_attention=broken),
    )
    no_backends.setattr(cuda, "_import_or_none", lambda name: object() if name == "triton" else None)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(5, 8), torch.randn(5, 8)
    offsets = torch.tensor([0, 2, 5])
    with pytest.warns(RuntimeWarning, match="PTX assembly failed"):
        out, lse = cuda._triton_or_reference(q, k, v, offsets, scaling=0.3)
    ref_out, ref_lse = ragged_attention_reference(q, k, v, offsets, scaling=0.3)
    torch.testing.assert_close(out, ref_out)
    assert "PTX assembly failed" in cuda.triton_failure()
    assert cuda.ragged_kernel_name(cuda_query()) == "torch"


@pytest.mark.parametrize("softcap", [None, 20.0])
def test_flash_attn_adapter_matches_reference_with_empty_segments(monkeypatch, softcap):
    monkeypatch.setattr(cuda, "_flash_attn_varlen", lambda: fake_flash_attn_varlen_func)
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 0, 9, 1, 0, 6]  # B = 2, H_kv = 3
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q = torch.randn(2, 3, 6, 16, generator=gen)  # M = G * Q = 2 * 3
    k, v = torch.randn(19, 16, generator=gen), torch.randn(19, 16, generator=gen)
    out, lse = cuda.flash_attn_ragged_attention(q, k, v, offsets, scaling=0.25, softcap=softcap)
    ref_out, ref_lse = ragged_attention_reference(q, k, v, offsets, scaling=0.25, softcap=softcap)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse)
    assert out.dtype == lse.dtype == torch.float32
    assert torch.isneginf(lse[0, 1]).all() and (out[0, 1] == 0).all()


def test_fused_suffix_kernel_is_triton_only_and_honours_forcing(no_backends):
    assert cuda.get_ragged_suffix_kernel(cuda_query()) is None  # no triton
    no_backends.setattr(cuda, "_import_or_none", lambda name: object() if name == "triton" else None)
    no_backends.setattr(cuda, "_flash_attn_varlen", lambda: fake_flash_attn_varlen_func)
    assert cuda.get_ragged_suffix_kernel(cuda_query()) is cuda._triton_suffix_or_reference
    assert cuda.get_ragged_suffix_kernel(torch.zeros(1, 8, 4, 128)) is None  # CPU
    for forced in ("torch", "flash_attn"):
        no_backends.setenv(cuda.KERNEL_ENV, forced)
        assert cuda.get_ragged_suffix_kernel(cuda_query()) is None


def test_fused_suffix_reference_equals_attention_over_the_concatenation():
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 4, 8, generator=gen)
    store_k, store_v = torch.randn(5, 8, generator=gen), torch.randn(5, 8, generator=gen)
    suffix_k, suffix_v = torch.randn(1, 2, 3, 8, generator=gen), torch.randn(1, 2, 3, 8, generator=gen)
    offsets = [0, 2, 5]
    out, lse = cuda.ragged_with_suffix_reference(
        q, store_k, store_v, offsets, suffix_k, suffix_v, scaling=0.3
    )
    for h in range(2):
        k = torch.cat([store_k[offsets[h] : offsets[h + 1]], suffix_k[0, h]])
        v = torch.cat([store_v[offsets[h] : offsets[h + 1]], suffix_v[0, h]])
        logits = q[0, h] @ k.T * 0.3
        torch.testing.assert_close(out[0, h], logits.softmax(-1) @ v)
        torch.testing.assert_close(lse[0, h], logits.logsumexp(-1))


def test_fused_triton_failure_falls_back_to_the_reference(no_backends):
    def broken(*args, **kwargs):
        raise RuntimeError("out of resource: shared memory")

    no_backends.setitem(
        sys.modules,
        "lukv_cache.attention._triton_ragged",
        types.SimpleNamespace(triton_ragged_attention=broken),
    )
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(5, 8), torch.randn(5, 8)
    sk, sv = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    with pytest.warns(RuntimeWarning, match="shared memory"):
        out, lse = cuda._triton_suffix_or_reference(q, k, v, torch.tensor([0, 2, 5]), sk, sv, scaling=0.3)
    ref = cuda.ragged_with_suffix_reference(q, k, v, [0, 2, 5], sk, sv, scaling=0.3)
    torch.testing.assert_close(out, ref[0])
    torch.testing.assert_close(lse, ref[1])


def test_cpu_tensors_reach_triton_only_when_forced_under_the_interpreter(no_backends):
    no_backends.setattr(cuda, "_import_or_none", lambda name: object() if name == "triton" else None)
    cpu_query = torch.zeros(1, 8, 4, 128)
    no_backends.setenv("TRITON_INTERPRET", "1")
    assert cuda.ragged_kernel_name(cpu_query) == "torch"  # not forced
    no_backends.setenv(cuda.KERNEL_ENV, "triton")
    assert cuda.get_ragged_kernel(cpu_query) is cuda._triton_or_reference
    assert cuda.get_ragged_suffix_kernel(cpu_query) is cuda._triton_suffix_or_reference
    no_backends.delenv("TRITON_INTERPRET")
    assert cuda.get_ragged_kernel(cpu_query) is None
    assert cuda.get_ragged_suffix_kernel(cpu_query) is None


def test_flash_attn_adapter_without_flash_attn_says_what_to_install(no_backends):
    q, k = torch.randn(1, 2, 4, 8), torch.randn(5, 8)
    with pytest.raises(ImportError, match=r"flash-attn package .*\[gpu\]"):
        cuda.flash_attn_ragged_attention(q, k, k, torch.tensor([0, 2, 5]), scaling=0.3)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("given", ["suffix_keys", "suffix_values"])
def test_triton_wrappers_refuse_one_half_of_a_suffix(given):
    from lukv_cache.attention._triton_quantized import triton_quantized_ragged_attention
    from lukv_cache.attention._triton_ragged import triton_ragged_attention

    q, k, offsets = torch.randn(1, 2, 4, 8), torch.randn(5, 8), torch.tensor([0, 2, 5])
    half = {given: torch.randn(1, 2, 3, 8)}
    with pytest.raises(ValueError, match="suffix_keys and suffix_values go together"):
        triton_ragged_attention(q, k, k, offsets, scaling=0.3, **half)
    codes, scale = torch.zeros(5, 8, dtype=torch.uint8), torch.ones(5, 1, dtype=torch.float16)
    with pytest.raises(ValueError, match="suffix_keys and suffix_values go together"):
        triton_quantized_ragged_attention(
            q, codes, scale, scale, codes, scale, scale, offsets, bits=8, dim=8, scaling=0.3, **half
        )


def test_a_triton_kernel_that_runs_gives_its_result_without_a_warning(no_backends):
    import warnings

    result = (torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4))
    no_backends.setitem(
        sys.modules,
        "lukv_cache.attention._triton_ragged",
        types.SimpleNamespace(triton_ragged_attention=lambda *args, **kwargs: result),
    )
    no_backends.setattr(cuda, "_import_or_none", lambda name: object() if name == "triton" else None)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(5, 8), torch.randn(5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cuda._triton_or_reference(q, k, v, torch.tensor([0, 2, 5]), scaling=0.3) is result
    assert cuda.triton_failure() is None
    assert cuda.ragged_kernel_name(cuda_query()) == "triton"
