"""The CPU kernel over a quantized store's codes (lukv_cache.attention.cpu_codes): exact against
dequantize-then-attend, built once, and a machine without a compiler falls back with one warning."""

from __future__ import annotations

import dataclasses
import logging
import subprocess

import pytest
import torch
from helpers import greedy_with_logits, tiny_model

from lukv_cache import LUKVCache
from lukv_cache.attention import compressed, cpu_codes
from lukv_cache.attention.dispatch import Impl, plan_attention
from lukv_cache.attention.kernels import ragged_with_suffix_reference
from lukv_cache.cache.storage.ragged import RaggedStore
from lukv_cache.testing import prompt

needs_compiler = pytest.mark.skipif(
    not cpu_codes.compilers(), reason="no C compiler: the kernel cannot be built"
)


def _store(bits, counts, dim, heads, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(counts)
    keys = torch.randn(n, dim, generator=gen) * scale
    values = torch.randn(n, dim, generator=gen)
    positions = torch.cat([torch.arange(c) for c in counts])
    return RaggedStore.build(keys, values, positions, torch.tensor(counts), num_heads=heads, kv_bits=bits)


# The kernel as other CPUs get it (cpu_codes.TARGETS), built here: the AVX2 vectors (8 lanes) and the scalar
# loop (x86-64's baseline: no vectors), where this CPU runs their code. "default": this machine's own build.
BUILDS = ["default", "avx2", "x86-64"]
LANES = {"avx2": 8, "x86-64": 0}


def _built(name):
    """The kernel library of the build ``name`` (skips where this CPU cannot run it or no compiler builds it)."""
    if name == "default":
        return None
    lib = cpu_codes.load_target(name)
    if lib is None:
        pytest.skip(f"this CPU does not run the {name} target's code, or no compiler here builds it")
    return lib


def _vectorising_compiler() -> bool:
    """Whether the compiler the kernel is built with takes the vector block (clang, or GCC 12 and later)."""
    compiler = cpu_codes.compilers()[0]
    said = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    if "clang" in said:
        return True
    version = subprocess.run([compiler, "-dumpversion"], capture_output=True, text=True, check=False).stdout
    return version.split(".")[0].strip().isdigit() and int(version.split(".")[0]) >= 12


@needs_compiler
@pytest.mark.parametrize("build", list(LANES))
def test_each_build_runs_the_width_it_was_built_for(build):
    lib = _built(build)
    if LANES[build] and not _vectorising_compiler():
        pytest.skip("this compiler (GCC before 12) builds the scalar loop for every target")
    assert cpu_codes.vector_lanes(lib) == LANES[build]


@needs_compiler
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    ("dim", "rows", "counts", "suffix", "softcap", "threads"),
    [
        (64, 3, [823, 0, 300, 17], 5, None, 1),  # SmolLM2's shape (a specialised path), an empty segment
        (64, 7, [600, 1000, 33, 256], 1, None, 2),  # Qwen's 7 query rows per KV head, two threads
        (128, 4, [513, 2], 0, None, 2),  # no suffix: the store alone
        # the vector paths (64, 128, 256): partial blocks and blocks of two vectors (AVX2), tiles of 4 / 2 / 1
        # query rows and their remainders, a softcap
        (64, 13, [100, 31], 2, 20.0, 1),
        (128, 5, [513, 2, 17, 40], 0, 50.0, 1),
        (256, 3, [300, 9], 2, None, 1),  # Gemma-3's head_dim
        (16, 64, [40, 0, 0, 9], 3, 30.0, 1),  # groups of 16 (the generic path), 64 rows, a softcap
        (24, 2, [70, 5], 2, None, 1),  # groups of 8
    ],
)
def test_kernel_equals_attention_over_the_dequantized_copy(
    build, bits, dim, rows, counts, suffix, softcap, threads
):
    lib = _built(build)
    heads = 2
    store = _store(bits, counts, dim, heads)
    keys, values = store.dense()
    gen = torch.Generator().manual_seed(1)
    b = len(counts) // heads
    query = torch.randn(b, heads, rows, dim, generator=gen)
    sk, sv = (
        torch.randn(b, heads, suffix, dim, generator=gen),
        torch.randn(b, heads, suffix, dim, generator=gen),
    )
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = cpu_codes.codes_attention(
            query, store, sk, sv, scaling=dim**-0.5, softcap=softcap, lib=lib
        )
    finally:
        torch.set_num_threads(before)
    want, want_lse = ragged_with_suffix_reference(
        query, keys, values, list(store.offsets_list), sk, sv, scaling=dim**-0.5, softcap=softcap
    )
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=2e-6, rtol=1e-5)


@needs_compiler
def test_a_bfloat16_model_is_served_in_fp32():
    gen = torch.Generator().manual_seed(2)
    counts = [300, 41]
    keys, values = torch.randn(341, 64, generator=gen), torch.randn(341, 64, generator=gen)
    positions = torch.cat([torch.arange(c) for c in counts])
    store = RaggedStore.build(
        keys.bfloat16(), values.bfloat16(), positions, torch.tensor(counts), num_heads=2, kv_bits=8
    )
    query = torch.randn(1, 2, 3, 64, generator=gen).bfloat16()
    suffix = torch.randn(1, 2, 4, 64, generator=gen).bfloat16()
    assert cpu_codes.serves(query, store)
    out, lse = cpu_codes.codes_attention(query, store, suffix, suffix, scaling=0.125)
    dense_k, dense_v = store.dense()  # the rows in bf16, as the blocks path attends them
    want, want_lse = ragged_with_suffix_reference(
        query.float(), dense_k.float(), dense_v.float(), list(store.offsets_list), suffix.float(),
        suffix.float(), scaling=0.125,
    )  # fmt: skip
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)  # the dequantized rows' bf16 rounding
    torch.testing.assert_close(lse, want_lse, atol=2e-2, rtol=2e-2)


@needs_compiler
def test_a_segment_with_nothing_to_attend_gives_zero_and_minus_infinity():
    store = _store(8, [0, 12], 64, 2)
    query = torch.randn(1, 2, 3, 64)
    empty = torch.zeros(1, 2, 0, 64)
    out, lse = cpu_codes.codes_attention(query, store, empty, empty, scaling=0.125)
    assert (
        torch.equal(out[0, 0], torch.zeros(3, 64)) and torch.isinf(lse[0, 0]).all() and (lse[0, 0] < 0).all()
    )
    assert torch.isfinite(out[0, 1]).all() and torch.isfinite(lse[0, 1]).all()


@needs_compiler
def test_the_plan_takes_the_kernel_for_decode_only():
    store = _store(8, [30, 20], 64, 2)
    query, suffix = torch.randn(1, 2, 3, 64), torch.randn(1, 2, 4, 64)
    plan = plan_attention(query, store, suffix, key_bias=None, suffix_bias=None, softcap=None)
    assert (plan.store, plan.fused, plan.codes) == (Impl.CODES, True, True)
    hiding = torch.zeros(50, 3).index_fill_(0, torch.tensor([7]), -1e30)  # a mask that hides row 7
    plan = plan_attention(query, store, suffix, key_bias=hiding, suffix_bias=None, softcap=None)
    assert plan.store is not Impl.CODES
    keys, values = store.dense()
    fp16 = RaggedStore.build(
        keys.half(), values.half(), store.positions, torch.tensor([30, 20]), num_heads=2, kv_bits=8
    )
    assert not cpu_codes.serves(query.half(), fp16)  # an fp16 model's fp16 scales: the blocks serve


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """The kernel state forgotten, the cache folder a temporary one; restored afterwards."""
    monkeypatch.setenv("LUKV_CACHE_DIR", str(tmp_path))
    cpu_codes.reset()
    yield tmp_path
    cpu_codes.reset()


@needs_compiler
def test_the_library_is_built_once_then_reused(fresh_kernel):
    assert cpu_codes.kernel() is not None
    built = sorted((fresh_kernel / "kernels").glob("*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    cpu_codes.reset()
    assert cpu_codes.kernel() is not None
    assert sorted((fresh_kernel / "kernels").glob("*.so")) == built and built[0].stat().st_mtime_ns == stamp
    assert not [p for p in (fresh_kernel / "kernels").iterdir() if p.is_dir()]  # no build folder left behind


@needs_compiler
def test_a_damaged_library_in_the_cache_is_built_again(fresh_kernel, monkeypatch):
    assert cpu_codes.kernel() is not None
    (built,) = (fresh_kernel / "kernels").glob("*.so")
    other = fresh_kernel / "other"  # a cache this process never loaded from, holding a damaged library
    (other / "kernels").mkdir(parents=True)
    damaged = other / "kernels" / built.name
    damaged.write_bytes(b"not a shared library")
    monkeypatch.setenv("LUKV_CACHE_DIR", str(other))
    cpu_codes.reset()
    assert cpu_codes.kernel() is not None  # loaded from a fresh build in its place
    assert damaged.read_bytes() != b"not a shared library"


def test_without_a_compiler_one_warning_and_the_blocks_serve(fresh_kernel, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(fresh_kernel / "no-such-cc"))
    monkeypatch.setenv("PATH", str(fresh_kernel))  # no cc, gcc or clang either
    store = _store(8, [30, 0, 20, 5], 64, 2)
    keys, values = store.dense()
    query, suffix = torch.randn(2, 2, 3, 64), torch.randn(2, 2, 4, 64)
    with caplog.at_level(logging.WARNING, logger="lukv_cache"):
        for _ in range(2):
            got = compressed.compressed_attention(store, query, suffix, suffix, None, scaling=0.125)
    warnings = [r for r in caplog.records if "no C compiler built the CPU kernel" in r.getMessage()]
    assert len(warnings) == 1 and "Install gcc or clang" in warnings[0].getMessage()
    assert cpu_codes.kernel() is None
    dense = RaggedStore.build(keys, values, store.positions, torch.tensor([30, 0, 20, 5]), num_heads=2)
    want = compressed.compressed_attention(dense, query, suffix, suffix, None, scaling=0.125)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert not list(fresh_kernel.glob("kernels/*.so"))  # nothing half-built left


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(cpu_codes.ENV, "0")
    assert cpu_codes.kernel() is None
    assert not cpu_codes.serves(torch.randn(1, 2, 3, 64), _store(8, [3, 4], 64, 2))


@needs_compiler
@pytest.mark.parametrize("bits", [8, 4])
def test_generation_on_the_kernel_equals_generation_on_the_blocks(bits, monkeypatch):
    model = tiny_model("llama")
    ids = prompt(1, 200, seed=4)

    def run():  # two folds into the quantized store
        return greedy_with_logits(model, ids, LUKVCache(0.5, "keydiff", fold_interval=16, kv_bits=bits), 40)

    calls = []
    real = cpu_codes.codes_attention
    monkeypatch.setattr(cpu_codes, "codes_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    tokens, logits = run()
    assert calls  # the decode steps ran on the kernel
    monkeypatch.setenv(cpu_codes.ENV, "0")
    calls.clear()
    tokens_blocks, logits_blocks = run()
    assert not calls
    assert torch.equal(tokens, tokens_blocks)
    torch.testing.assert_close(logits, logits_blocks, atol=1e-4, rtol=1e-4)


@needs_compiler
def test_codes_that_are_a_strided_view_are_read_as_their_values():
    store = _store(8, [40, 25], 64, 2)
    keys = store.keys
    strided = torch.stack([keys.codes, torch.zeros_like(keys.codes)], dim=-1)[
        ..., 0
    ]  # the same bytes, stride 2
    assert not strided.is_contiguous() and torch.equal(strided, keys.codes)
    viewed = dataclasses.replace(store, keys=keys.with_tensors(strided, keys.scale, keys.zero))
    query, suffix = torch.randn(1, 2, 3, 64), torch.randn(1, 2, 4, 64)
    want, _ = cpu_codes.codes_attention(query, store, suffix, suffix, scaling=0.125)
    got, _ = cpu_codes.codes_attention(query, viewed, suffix, suffix, scaling=0.125)
    assert torch.equal(got, want)


@needs_compiler
@pytest.mark.parametrize("batch", [1, 2])
def test_a_suffix_read_in_its_buffer_is_read_as_a_copy_of_it(batch):
    # the dense suffix is a view of buffers with room to decode into ([B, H, capacity, D]): the kernel reads
    # it there, each segment's rows a capacity apart, with no copy; a transposed view (no common stride) is
    # copied first
    store = _store(8, [40, 25] * batch, 64, 2)
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(batch, 2, 3, 64, generator=gen)
    keys, values = (torch.randn(batch, 2, 9, 64, generator=gen) for _ in range(2))
    sk, sv = keys[:, :, :5], values[:, :, :5]
    assert not sk.is_contiguous()
    want, want_lse = cpu_codes.codes_attention(query, store, sk.contiguous(), sv.contiguous(), scaling=0.125)
    got, lse = cpu_codes.codes_attention(query, store, sk, sv, scaling=0.125)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    swapped = keys.transpose(0, 1).contiguous().transpose(0, 1)[:, :, :5]  # rows a batch apart: copied
    got, _ = cpu_codes.codes_attention(query, store, swapped, sv, scaling=0.125)
    want, _ = cpu_codes.codes_attention(query, store, swapped.contiguous(), sv.contiguous(), scaling=0.125)
    assert torch.equal(got, want)


@needs_compiler
def test_the_environment_names_the_flags_the_kernel_is_built_with(fresh_kernel, monkeypatch):
    _built("avx2")  # skips where this CPU does not run AVX2 code
    monkeypatch.setenv(cpu_codes.FLAGS_ENV, " ".join(cpu_codes.TARGETS["avx2"][0]))
    assert cpu_codes.vector_lanes() == 8
    store = _store(8, [40, 9], 64, 2)
    query, suffix = torch.randn(1, 2, 3, 64), torch.randn(1, 2, 2, 64)
    assert cpu_codes.serves(query, store)
    keys, values = store.dense()
    out, _ = cpu_codes.codes_attention(query, store, suffix, suffix, scaling=0.125)
    want, _ = ragged_with_suffix_reference(
        query, keys, values, list(store.offsets_list), suffix, suffix, scaling=0.125
    )
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)


@needs_compiler
def test_flags_no_compiler_accepts_give_one_warning_and_the_blocks(fresh_kernel, monkeypatch, caplog):
    monkeypatch.setenv(cpu_codes.FLAGS_ENV, "-O3 --no-such-flag-lukv")
    with caplog.at_level(logging.WARNING, logger="lukv_cache"):
        assert cpu_codes.kernel() is None
        assert cpu_codes.kernel() is None
    (warning,) = [r.getMessage() for r in caplog.records if "CPU kernel" in r.getMessage()]
    assert "--no-such-flag-lukv" in warning and cpu_codes.FLAGS_ENV in warning
    assert not cpu_codes.serves(torch.randn(1, 2, 3, 64), _store(8, [4, 4], 64, 2))
    assert not list(fresh_kernel.glob("kernels/*.so"))
