"""The quantized ragged store (``LUKVCache(kv_bits=8 / 4)``).

* the format: a round trip is within half a quantization step of each group (plus the rounding of the
  group's scale and minimum), 4-bit codes take half the bytes of 8-bit ones; scales and zeros are two
  bytes that hold the rows' range, so entries beyond fp16's range come back finite, in a model too;
* attention over a quantized store equals attention over its dequantized copy on every path (masked,
  tiles, the parts and merge with a hiding mask or a softcap, several blocks), and keeps nothing of the
  store alive once the store is gone;
* ``kv_bits`` changes no eviction decision at the prompt (same kept positions for every scorer and
  allocator), batch rows equal rows alone, folds and ``decode_max_tokens`` keep working, beam search
  reorders codes, and ``memory_bytes`` counts codes, scales, zeros, positions and offsets.
"""

from __future__ import annotations

import copy
import gc
import weakref
from dataclasses import replace

import pytest
import torch
from helpers import greedy_with_logits, scorer_for, tiny_model

from lukv_cache import LUKVCache
from lukv_cache.attention import compressed, cpu_codes, limits, masked, tiles
from lukv_cache.cache.storage.quant import PackedRows, check_kv_bits, group_size
from lukv_cache.cache.storage.ragged import RaggedStore
from lukv_cache.errors import ConfigurationError
from lukv_cache.testing import flat_profile, left_padded, prompt

BITS = (8, 4)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dim", [64, 16, 12])
def test_round_trip_within_half_a_step(bits, dim):
    gen = torch.Generator().manual_seed(bits * dim)
    rows = torch.randn(200, dim, generator=gen) * torch.linspace(0.1, 8.0, dim)  # uneven channels
    packed = PackedRows.quantize(rows, bits)
    back = packed.dequantize()
    g = group_size(dim)
    groups = rows.view(200, -1, g)
    step = (groups.amax(-1) - groups.amin(-1)) / ((1 << bits) - 1)
    # half a step, plus the rounding of the minimum and of the scale times the largest code
    bound = step / 2 + groups.abs().amax(-1) * 2e-3 + 1e-6
    error = (back - rows).abs().view(200, -1, g).amax(-1)
    assert bool((error <= bound).all()), float((error - bound).max())
    assert packed.codes.shape == (200, dim * bits // 8)
    assert packed.codes.dtype == torch.uint8


def test_constant_rows_and_dtype_come_back():
    rows = torch.full((3, 32), 2.5, dtype=torch.bfloat16)
    back = PackedRows.quantize(rows, 4).dequantize()
    assert back.dtype == torch.bfloat16
    assert torch.equal(back, rows)


@pytest.mark.parametrize(
    "dtype,kind",
    [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)],
)
def test_scales_and_zeros_are_two_bytes_that_hold_the_rows_range(dtype, kind):
    packed = PackedRows.quantize(torch.randn(4, 64).to(dtype), 8)
    assert packed.scale.dtype == packed.zero.dtype == kind


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [1e5, 1e30])
def test_entries_beyond_fp16s_range_come_back_finite(bits, dtype, magnitude):
    gen = torch.Generator().manual_seed(bits)
    rows = (torch.randn(50, 64, generator=gen) * magnitude).to(dtype)
    back = PackedRows.quantize(rows, bits).dequantize()
    assert bool(back.isfinite().all())
    groups = rows.float().view(50, -1, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / ((1 << bits) - 1)
    error = (back.float() - rows.float()).view(50, -1, 32).abs().amax(-1)
    assert bool((error <= 0.51 * step + groups.abs().amax(-1) * 8e-3).all())


@pytest.mark.parametrize("bits", [8, 4])
def test_keys_and_values_quantized_together_get_the_codes_each_gets_alone(bits):
    # a fold quantizes the keys and values it adds in one call: rows are quantized one by one, so the same codes
    gen = torch.Generator().manual_seed(3)
    store = RaggedStore.build(
        torch.randn(6, 64, generator=gen),
        torch.randn(6, 64, generator=gen),
        torch.arange(6),
        torch.tensor([3, 3]),
        num_heads=2,
        kv_bits=bits,
    )
    keys, values = torch.randn(5, 64, generator=gen) * 3, torch.randn(5, 64, generator=gen)
    together = store.quantize_like(keys, values)
    for rows, alone in zip(together, (PackedRows.quantize(keys, bits), PackedRows.quantize(values, bits))):
        assert all(torch.equal(a, b) for a, b in zip(rows.tensors(), alone.tensors()))


@pytest.mark.parametrize("value", [3, 16, 0, "4", True, 4.0])
def test_kv_bits_refused_with_a_typed_error(value):
    with pytest.raises(ConfigurationError, match="kv_bits"):
        check_kv_bits(value)
    with pytest.raises(ConfigurationError, match="kv_bits"):
        LUKVCache(0.5, kv_bits=value)


def test_odd_head_dim_is_refused_at_4_bits():
    with pytest.raises(ConfigurationError, match="odd"):
        PackedRows.quantize(torch.randn(2, 7), 4)


def _stores(bits: int, counts: list[int], dim: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(counts)
    keys, values = torch.randn(n, dim, generator=gen), torch.randn(n, dim, generator=gen)
    positions = torch.cat([torch.arange(c) for c in counts])
    quantized = RaggedStore.build(keys, values, positions, torch.tensor(counts), num_heads=2, kv_bits=bits)
    k, v = quantized.dense()
    dense = RaggedStore.build(k, v, positions, torch.tensor(counts), num_heads=2)
    return quantized, dense


def _attend(store, query, suffix, mask, softcap=None):
    return compressed.compressed_attention(store, query, suffix, suffix, mask, scaling=0.25, softcap=softcap)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(
    "case",
    ["codes", "codes_softcap", "masked", "tiles", "hiding_mask", "softcap", "blocks", "blocks_hiding_mask"],
)
def test_attention_equals_attention_over_the_dequantized_copy(bits, case, monkeypatch):
    counts = [30, 50, 0, 41]
    if case.startswith("codes"):  # the CPU kernel on the codes: it must build wherever a compiler is
        if not cpu_codes.compilers():
            pytest.skip("no C compiler on this machine: the CPU kernel cannot be built")
        assert cpu_codes.kernel() is not None
    else:  # the dequantized blocks' paths, as on a machine without a C compiler
        monkeypatch.setenv(cpu_codes.ENV, "0")
    if case.startswith("blocks"):
        # several blocks, cut inside segments
        monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, block_rows=37))
    if case == "tiles":
        # a layer too large for the masked product
        monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, masked_limit=0))
    calls = {}
    spied = (
        (masked, "masked_ragged_attention"),
        (tiles, "tiled_ragged_attention"),
        (cpu_codes, "codes_attention"),
    )
    for module, name in spied:
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    quantized, dense = _stores(bits, counts)
    gen = torch.Generator().manual_seed(1)
    q_len = 3
    query = torch.randn(2, 4, q_len, 16, generator=gen)
    suffix = torch.randn(2, 2, 5, 16, generator=gen)
    length = max(counts) + 5
    mask = None
    if case.endswith("hiding_mask"):
        mask = torch.ones(2, 1, q_len, length, dtype=torch.bool)
        mask[0, :, :, :7] = False  # row 0's first positions are padding
    calls.clear()
    softcap = 30.0 if case.endswith("softcap") else None
    got = _attend(quantized, query, suffix, mask, softcap=softcap)
    path = dict(calls)
    want = _attend(dense, query, suffix, mask, softcap=softcap)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    expected = {
        "codes": "codes_attention",
        "codes_softcap": "codes_attention",
        "masked": "masked_ragged_attention",
        "tiles": "tiled_ragged_attention",
        "blocks": "tiled_ragged_attention",
    }
    if case in expected:  # the path this case is for served it
        assert path.get(expected[case], 0) >= (2 if case == "blocks" else 1), path
    elif case.endswith("hiding_mask"):  # the parts and their merge
        assert "masked_ragged_attention" not in path and "codes_attention" not in path, path


@pytest.mark.parametrize(
    "limit",
    [{}, {"masked_limit": 0}, {"block_rows": 37}],
    ids=["one block, masked", "one block, tiles", "several blocks"],
)
def test_attention_keeps_nothing_of_a_quantized_store_alive(limit, monkeypatch):
    """What attention derives from a store (block bounds, masks, tile plans) dies with the store: a cache
    builds a new store at every eviction and fold, so anything kept would leak without end."""
    monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, **limit))
    quantized, _ = _stores(8, [30, 50, 0, 41])
    gen = torch.Generator().manual_seed(1)
    query, suffix = torch.randn(2, 4, 3, 16, generator=gen), torch.randn(2, 2, 5, 16, generator=gen)
    _attend(quantized, query, suffix, None)
    offsets = weakref.ref(quantized.offsets)
    del quantized
    gc.collect()
    assert offsets() is None


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(
    "scorer,allocator",
    [
        ("keydiff", "uniform"),
        ("snapkv", "adakv"),
        ("keydiff", "global"),
        ("kvzap", "global"),
        ("knorm", "pyramid"),
    ],
)
def test_kv_bits_changes_no_eviction_decision(bits, scorer, allocator):
    model = tiny_model("llama")
    ids = prompt(1, 120, seed=3)
    kept = []
    for kv_bits in (None, bits):
        cache = LUKVCache(0.6, scorer_for(scorer, model), allocator, kv_bits=kv_bits)
        with torch.no_grad():
            model(ids, past_key_values=cache)
        kept.append([cache.kept_positions(i) for i in range(len(cache.layers))])
        assert cache.layers[0].store.kv_bits == kv_bits
    for a, b in zip(*kept):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bits", BITS)
def test_generation_stays_close_and_memory_shrinks(bits):
    model = tiny_model("llama")
    ids = prompt(1, 200, seed=4)
    full = LUKVCache(0.5, "keydiff", fold_interval=16)
    small = LUKVCache(0.5, "keydiff", fold_interval=16, kv_bits=bits)
    _, ref = greedy_with_logits(model, ids, full, new_tokens=40)  # two folds into the quantized store
    _, got = greedy_with_logits(model, ids, small, new_tokens=40)
    assert (got - ref).abs().max() < (0.01 if bits == 8 else 0.2)
    assert small.layers[0].store.kv_bits == bits
    assert small.memory_bytes() < full.memory_bytes()
    store = small.layers[0].store
    held = sum(t.numel() * t.element_size() for t in (*store.keys.tensors(), *store.values.tensors()))
    held += store.positions.numel() * store.positions.element_size() + store.offsets.numel() * 8
    assert store.memory_bytes() == held


def _scaled_model(dtype, projections, factor=3e5):
    """The tiny model with these attention projections scaled: keys or values near 1.4e5, fine in an fp32
    or bf16 model (beyond fp16's range)."""
    model = copy.deepcopy(tiny_model("llama", dtype=dtype))
    with torch.no_grad():
        for layer in model.model.layers:
            for name in projections:
                getattr(layer.self_attn, name).weight.mul_(factor)
    return model


def _decode_logits(model, cache, steps=6):
    """The logits of ``steps`` fixed tokens decoded one by one after a 40-token prompt (the same tokens for
    every cache, so a quantization error cannot change what is decoded)."""
    tokens = prompt(1, steps, seed=7)
    with torch.no_grad():
        model(prompt(1, 40, seed=6), past_key_values=cache)
        return torch.cat([model(tokens[:, [i]], past_key_values=cache).logits for i in range(steps)], 1)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("ratio", [0.5, 0.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_and_values_beyond_fp16s_range_give_finite_logits(bits, ratio, dtype):
    """They once turned the fp16 scales into inf and every logit into NaN, without a word."""
    model = _scaled_model(dtype, ("k_proj", "v_proj"))
    logits = _decode_logits(model, LUKVCache(ratio, fold_interval=2, kv_bits=bits))
    assert bool(logits.isfinite().all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_beyond_fp16s_range_give_the_unquantized_logits_at_8_bits(dtype):
    model = _scaled_model(dtype, ("v_proj",))
    ref = _decode_logits(model, LUKVCache(0.5, fold_interval=2))
    got = _decode_logits(model, LUKVCache(0.5, fold_interval=2, kv_bits=8))
    assert (got.float() - ref.float()).abs().max() < 5e-3


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_batch_rows_equal_rows_alone(bits, arch):
    model = tiny_model(arch, "eager" if arch == "gemma2" else "sdpa")
    ids, mask = left_padded((60, 41, 23), seed=5)
    batch = LUKVCache(0.5, "keydiff", sink=2, window=3, kv_bits=bits)
    seqs, logits = greedy_with_logits(model, ids, batch, new_tokens=4, attention_mask=mask)
    for row in range(ids.shape[0]):
        real = ids[row : row + 1, mask[row].bool()]
        alone = LUKVCache(0.5, "keydiff", sink=2, window=3, kv_bits=bits)
        seq, row_logits = greedy_with_logits(model, real, alone, new_tokens=4)
        assert torch.equal(seqs[row, -4:], seq[0, -4:])
        torch.testing.assert_close(logits[:, row], row_logits[:, 0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bits", BITS)
def test_decode_bound_reevicts_quantized_tokens(bits):
    model = tiny_model("llama")
    ids = prompt(1, 150, seed=6)
    for scorer in ("keydiff", "kvzap"):
        cache = LUKVCache(
            scorer=scorer_for(scorer, model), decode_max_tokens=40, fold_interval=8, kv_bits=bits
        )
        greedy_with_logits(model, ids, cache, new_tokens=30)
        assert cache.layers[0].store.kv_bits == bits
        assert float(cache.stored_tokens().float().mean()) <= 40 + 8


def test_beam_search_reorders_codes():
    model = tiny_model("llama")
    ids = prompt(1, 90, seed=7)
    outs = []
    for kv_bits in (None, 8):
        cache = LUKVCache(0.5, "keydiff", kv_bits=kv_bits)
        with torch.no_grad():
            outs.append(
                model.generate(ids, past_key_values=cache, max_new_tokens=5, num_beams=3, do_sample=False)
            )
    assert torch.equal(outs[0], outs[1])


def test_kv_bits_through_from_pretrained(tmp_path, monkeypatch):

    profile = flat_profile(2, 2, grid=[0.5])
    path = tmp_path / "p.safetensors"
    profile.save(path)
    cache = LUKVCache.from_pretrained(str(path), ratio=0.5, allocator="profile", kv_bits=4)
    assert cache.kv_bits == 4


@pytest.mark.parametrize("bits", BITS)
def test_max_tokens_and_kvzip_prefill_with_kv_bits(bits):
    from lukv_cache.scorers.kvzip import RepeatPrompt

    model = tiny_model("llama")
    ids, mask = left_padded((70, 41), seed=8)
    capped = LUKVCache(max_tokens=24, scorer="keydiff", kv_bits=bits)
    reference = LUKVCache(max_tokens=24, scorer="keydiff")
    for cache in (capped, reference):
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache)
    assert torch.equal(capped.stored_tokens(), reference.stored_tokens())  # the same bound, the same tokens
    assert float(capped.stored_tokens().float().mean()) <= 24
    assert capped.layers[0].store.kv_bits == bits

    kept = []
    for kv_bits in (None, bits):
        cache = LUKVCache(0.5, "kvzip", "global", kv_bits=kv_bits)
        cache.prefill(model, ids, mask, repeat_prompt=RepeatPrompt((5, 6), (7,), (8,)))
        kept.append([cache.kept_positions(i) for i in range(len(cache.layers))])
    for a, b in zip(*kept):  # KVzip's passes score at full precision: the same tokens kept
        assert torch.equal(a, b)


def test_a_quantized_triton_kernel_that_fails_warns_once_and_falls_back(monkeypatch):
    """A compile or launch error of the kernel on codes must not take generation down: the call is served
    by the reference over the dequantized store, and later calls are planned without the kernel."""
    pytest.importorskip("triton")
    from lukv_cache.attention import _triton_quantized, kernels
    from lukv_cache.attention.kernels import ragged_with_suffix_reference

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(_triton_quantized, "triton_quantized_ragged_attention", broken)
    monkeypatch.setattr(kernels, "_quantized_failure", None)
    quantized, dense = _stores(4, [30, 50, 0, 41])
    gen = torch.Generator().manual_seed(2)
    query, suffix = torch.randn(2, 2, 3, 16, generator=gen), torch.randn(2, 2, 5, 16, generator=gen)
    with pytest.warns(RuntimeWarning, match="quantized Triton kernel failed"):
        out, lse = kernels._triton_quantized_or_reference(
            query, quantized.keys, quantized.values, quantized.offsets, suffix, suffix, scaling=0.25
        )
    want, want_lse = ragged_with_suffix_reference(
        query, dense.keys, dense.values, dense.offsets, suffix, suffix, scaling=0.25
    )
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    assert kernels._quantized_failure == "RuntimeError: no compiler here"
    assert kernels.get_quantized_suffix_kernel(query) is None  # later calls: the block path


def test_a_quantized_triton_kernel_that_runs_gives_its_result_without_a_warning(monkeypatch):
    import warnings

    pytest.importorskip("triton")
    from lukv_cache.attention import _triton_quantized, kernels

    result = (torch.zeros(2, 2, 3, 16), torch.zeros(2, 2, 3))
    monkeypatch.setattr(_triton_quantized, "triton_quantized_ragged_attention", lambda *a, **kw: result)
    monkeypatch.setattr(kernels, "_quantized_failure", None)
    quantized, _ = _stores(4, [30, 50, 0, 41])
    query, suffix = torch.randn(2, 2, 3, 16), torch.randn(2, 2, 5, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = kernels._triton_quantized_or_reference(
            query, quantized.keys, quantized.values, quantized.offsets, suffix, suffix, scaling=0.25
        )
    assert out is result
    assert kernels._quantized_failure is None


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_a_compressed_prompt_holds_no_unused_room_and_with_kv_bits_no_dense_window(bits):
    """After the prompt's eviction the suffix buffer holds just its tokens (no room until the first decoded
    token); with ``kv_bits`` the protected window has joined the store, in its bits: the same tokens kept,
    none at full precision. Decoding then grows the suffix as before."""
    model = tiny_model("llama")
    ids = prompt(1, 120, seed=5)
    cache = LUKVCache(0.6, "keydiff", "uniform", window=8, kv_bits=bits)
    reference = LUKVCache(0.6, "keydiff", "uniform", window=8)
    for each in (cache, reference):
        with torch.no_grad():
            model(ids, past_key_values=each)
    assert torch.equal(cache.stored_tokens(), reference.stored_tokens())
    for layer in cache.layers:
        assert layer.suffix_buffers[0].shape[-2] == layer.suffix_length  # no unused room
        assert layer.suffix_length == (8 if bits is None else 0)
    sequences, _ = greedy_with_logits(model, ids, cache, new_tokens=4)
    dense = 8 if bits is None else 0  # generate feeds back 3 of its 4 new tokens
    assert sequences.shape[-1] == 124 and all(layer.suffix_length == dense + 3 for layer in cache.layers)


def test_under_a_token_bound_the_window_stays_dense_with_kv_bits():
    """``max_tokens``' cap counts every layer's window as dense: the window is not folded there (the same tokens
    as at full precision, ``test_max_tokens_and_kvzip_prefill_with_kv_bits``)."""
    model = tiny_model("llama")
    cache = LUKVCache(max_tokens=40, scorer="keydiff", window=8, kv_bits=4)
    with torch.no_grad():
        model(prompt(1, 120, seed=5), past_key_values=cache)
    assert all(layer.suffix_length == 8 for layer in cache.layers)
