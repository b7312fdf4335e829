"""Measuring a profile's memory table on a tiny random model: the numbers, the build's setting, adding one to
an existing profile file (API and ``lukv memory-table``), the precision of its passes (a cast copy of the model,
never the model itself; what ``"auto"`` picks)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from lukv_cache import LUKVCache, build_profile, testing
from lukv_cache.cli import main
from lukv_cache.errors import ConfigurationError
from lukv_cache.profiles import Profile
from lukv_cache.profiling import cli as profiling_cli
from lukv_cache.profiling import table_dtype as dtypes
from lukv_cache.profiling.build import BuildSettings
from lukv_cache.profiling.continuation import continuation_nll, prefill
from lukv_cache.profiling.memory_table import DEFAULT_RATIOS, add_memory_table, measure_memory_table

TEXT = testing.prose(1200, seed=3)  # one token a character with byte_tokenizer()


def _profile(model, scorer="keydiff", **fields):
    config = model.config
    return testing.curve_profile(
        config.num_hidden_layers,
        config.num_key_value_heads,
        grid=np.linspace(0.1, 0.95, 6),
        spread=0.1,
        model_id="org/tiny",
        scorer=scorer,
        head_dim=config.head_dim,
        **fields,
    )


def _users_cache(profile, ratio, kv_bits, **options):
    """The cache ``from_pretrained`` gives ``profile`` at ``ratio`` and ``kv_bits``, built by hand."""
    return LUKVCache(
        ratio,
        "keydiff",
        "profile",
        allocator_kwargs={"profile": profile},
        sink=profile.sink,
        window=profile.window,
        min_keep=profile.min_keep,
        kv_bits=kv_bits,
        **options,
    )


def test_the_table_has_the_grids_shape_finite_values_and_repeats(tiny_model, byte_tokenizer):
    profile = _profile(tiny_model)
    kwargs = dict(contexts=2, continuation_tokens=32, ratios=(0.3, 0.6, 0.9))
    table = measure_memory_table(tiny_model, byte_tokenizer, profile, TEXT, **kwargs)
    assert table.bits == (None, 8, 4) and table.loss.shape == (3, 3) and table.loss.dtype == np.float32
    np.testing.assert_allclose(table.ratios, [0.3, 0.6, 0.9])
    assert np.isfinite(table.loss).all() and np.abs(table.loss).max() > 0
    assert not np.array_equal(table.loss[0], table.loss[2])  # 4-bit codes change the logits
    # 2 windows of 600 tokens fit, but the model has 512 positions: 480 + 32
    assert "2 contexts of 480 tokens x 32 continuation tokens, allocator profile, seed 0" in table.measure
    assert measure_memory_table(tiny_model, byte_tokenizer, profile, [TEXT], **kwargs) == table
    other_seed = measure_memory_table(tiny_model, byte_tokenizer, profile, TEXT, seed=1, **kwargs)
    assert not np.array_equal(other_seed.loss, table.loss)  # other windows


def test_a_cell_is_the_caches_nll_minus_the_full_caches(tiny_model, byte_tokenizer):
    profile = _profile(tiny_model)
    text = TEXT[:300]  # exactly one window of 268 + 32 tokens
    table = measure_memory_table(
        tiny_model,
        byte_tokenizer,
        profile,
        text,
        bits=(8,),
        ratios=(0.7,),
        contexts=1,
        continuation_tokens=32,
    )
    ids = torch.tensor([byte_tokenizer(text, add_special_tokens=False)["input_ids"]])
    context, target = ids[:, :268], ids[:, 268:]

    def nll(cache):
        return continuation_nll(tiny_model, cache, prefill(tiny_model, context, cache), target)

    cache = _users_cache(profile, 0.7, 8)
    expected = nll(cache) - nll(DynamicCache(config=tiny_model.config))
    assert expected != 0.0
    assert table.loss[0, 0] == pytest.approx(expected, abs=1e-6)


def test_a_layers_loss_is_its_4_bit_store_against_every_layer_at_8(tiny_model, byte_tokenizer):
    profile = _profile(tiny_model)
    text = TEXT[:300]  # exactly one window of 268 + 32 tokens
    kwargs = dict(ratios=(0.7,), contexts=1, continuation_tokens=32)
    table = measure_memory_table(tiny_model, byte_tokenizer, profile, text, layer_method="passes", **kwargs)
    layers = tiny_model.config.num_hidden_layers
    assert table.layer_loss is not None and table.layer_loss.shape == (layers,)
    ids = torch.tensor([byte_tokenizer(text, add_special_tokens=False)["input_ids"]])
    context, target = ids[:, :268], ids[:, 268:]

    def nll(at_4_bits=None):
        cache = _users_cache(profile, 0.0, 8, config=tiny_model.config)
        if at_4_bits is not None:
            cache.layers[at_4_bits].kv_bits = 4
        return continuation_nll(tiny_model, cache, prefill(tiny_model, context, cache), target)

    at_8 = nll()
    expected = [nll(layer) - at_8 for layer in range(layers)]
    assert any(value != 0.0 for value in expected)
    np.testing.assert_allclose(table.layer_loss, expected, atol=1e-6)
    # without it (or without both widths to mix) the table has none
    assert (
        measure_memory_table(tiny_model, byte_tokenizer, profile, text, layers=False, **kwargs).layer_loss
        is None
    )
    assert (
        measure_memory_table(tiny_model, byte_tokenizer, profile, text, bits=(None, 8), **kwargs).layer_loss
        is None
    )


def test_a_kvzap_profile_scores_with_its_surrogate_and_its_allocator(tiny_model, byte_tokenizer):
    config = tiny_model.config
    surrogate = testing.random_surrogate(
        config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    )
    profile = _profile(tiny_model, scorer="kvzap", surrogate=surrogate)
    table = measure_memory_table(
        tiny_model, byte_tokenizer, profile, TEXT, bits=(None,), ratios=(0.5, 0.9), continuation_tokens=16
    )
    assert table.loss.shape == (1, 2) and np.isfinite(table.loss).all()
    assert "allocator global" in table.measure


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(contexts=40, continuation_tokens=32), "does not hold 40 windows"),
        (dict(context_tokens=600, continuation_tokens=32), "does not hold 4 windows"),
        (dict(bits=(None, 3)), "kv_bits must be"),
        (dict(bits=(8, 8)), "distinct"),
        (dict(ratios=(0.5, 0.5)), "strictly increasing"),
        (dict(ratios=(0.5, 1.0)), "strictly increasing"),
        (dict(contexts=0), "contexts must be >= 1"),
    ],
)
def test_what_cannot_be_measured_is_a_configuration_error(tiny_model, byte_tokenizer, kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        measure_memory_table(tiny_model, byte_tokenizer, _profile(tiny_model), TEXT, **kwargs)


def test_a_profile_for_another_shape_is_refused(tiny_model, byte_tokenizer):
    from lukv_cache.errors import ProfileMismatchError

    profile = testing.curve_profile(3, 2, model_id="org/other", head_dim=16)
    with pytest.raises(ProfileMismatchError):
        measure_memory_table(tiny_model, byte_tokenizer, profile, TEXT, continuation_tokens=16)


# ------------------------------------------------------------------------------------------ the build


def _build(model, tokenizer, calibration, tmp_path, **options):
    return build_profile(
        model,
        tokenizer,
        "keydiff",
        calibration,
        k_max=2,
        model_id="org/tiny",
        cache_dir=tmp_path / "cache",
        show_progress=False,
        **options,
    )


def test_a_build_measures_the_table_on_its_calibration_context(
    tiny_model, byte_tokenizer, calibration_writer, tmp_path
):
    text = TEXT[:440]  # with the questions, within the tiny model's 512 positions
    calibration = calibration_writer(tmp_path / "c.jsonl", context=text)
    profile = _build(tiny_model, byte_tokenizer, calibration, tmp_path)
    table = profile.memory_table
    assert (
        table is not None and table.loss.shape == (3, len(DEFAULT_RATIOS)) and np.isfinite(table.loss).all()
    )
    assert table.ratios.tolist() == list(np.float32(DEFAULT_RATIOS))
    # 4 windows of 110 tokens: too short for 128 continuation tokens, so half of each window
    assert "4 contexts of 55 tokens x 55 continuation tokens" in table.measure
    expected = measure_memory_table(
        tiny_model, byte_tokenizer, profile, text, continuation_tokens=55, dtype="auto"
    )
    assert table == expected  # the calibration's context, the build's seed and table_dtype ("auto")
    assert Profile.load(profile.save(tmp_path / "p.safetensors")).memory_table == table


def test_a_short_calibration_gets_shorter_continuations(
    tiny_model, byte_tokenizer, tiny_calibration, tmp_path
):
    table = _build(tiny_model, byte_tokenizer, tiny_calibration, tmp_path).memory_table
    assert table is not None and "x 16 continuation tokens" in table.measure


def test_a_build_without_the_table_has_none(tiny_model, byte_tokenizer, tiny_calibration, tmp_path):
    assert (
        _build(tiny_model, byte_tokenizer, tiny_calibration, tmp_path, memory_table=False).memory_table
        is None
    )


def test_lukv_build_no_memory_table(tiny_model, byte_tokenizer, tiny_calibration, tmp_path, monkeypatch):
    monkeypatch.setattr(profiling_cli, "_load_model", lambda name: (tiny_model, byte_tokenizer, {}))
    args = ["build", "tiny", "--k-max", "2", "--calibration", str(tiny_calibration), "--model-id", "org/t"]
    args += ["--cache-dir", str(tmp_path / "c"), "--quiet"]
    assert main([*args, "--out", str(tmp_path / "a.safetensors")]) == 0
    assert main([*args, "--no-memory-table", "--out", str(tmp_path / "b.safetensors")]) == 0
    assert Profile.load(tmp_path / "a.safetensors").memory_table is not None
    assert Profile.load(tmp_path / "b.safetensors").memory_table is None


# ------------------------------------------------------------------------------------------ an existing file


def test_add_memory_table_writes_the_same_profile_with_a_table(
    tiny_model, byte_tokenizer, calibration_writer, tmp_path
):
    calibration = calibration_writer(tmp_path / "c.jsonl", context=TEXT)
    original = _profile(tiny_model, calibration="c.jsonl: Tiny")
    path = original.save(tmp_path / "p.safetensors")
    with pytest.raises(ConfigurationError, match="not a shipped set"):
        add_memory_table(path, tiny_model, byte_tokenizer)
    assert add_memory_table(path, tiny_model, byte_tokenizer, calibration, continuation_tokens=32) == path
    loaded = Profile.load(path)
    assert loaded.memory_table == measure_memory_table(
        tiny_model, byte_tokenizer, original, TEXT, continuation_tokens=32
    )
    assert loaded._metadata() == original._metadata()  # nothing else changed
    np.testing.assert_array_equal(loaded.evict_ratio, original.evict_ratio)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "p.safetensors"]  # no temp file left
    with pytest.raises(ConfigurationError, match="already holds a memory table"):
        add_memory_table(path, tiny_model, byte_tokenizer, calibration)


def test_add_memory_table_reads_a_shipped_set_from_the_profile(tiny_model, byte_tokenizer, tmp_path):
    path = _profile(tiny_model, calibration="expository.jsonl: whatever").save(tmp_path / "p.safetensors")
    out = tmp_path / "q.safetensors"
    add_memory_table(path, tiny_model, byte_tokenizer, out=out, bits=(None,), ratios=(0.8,))
    assert Profile.load(path).memory_table is None and Profile.load(out).memory_table is not None


def test_lukv_memory_table(tiny_model, byte_tokenizer, calibration_writer, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(dtypes, "available_bytes", lambda: 1 << 40)
    monkeypatch.setattr(dtypes, "native_bf16", lambda: True)  # --table-dtype auto: bfloat16 passes
    monkeypatch.setattr(profiling_cli, "_load_model", lambda name: (tiny_model, byte_tokenizer, {}))
    calibration = calibration_writer(tmp_path / "c.jsonl", context=TEXT)
    path = _profile(tiny_model).save(tmp_path / "p.safetensors")
    args = ["memory-table", "tiny", str(path), "--calibration", str(calibration), "--quiet"]
    assert main([*args, "--contexts", "2", "--continuation-tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "memory    loss of model, int8, int4 at ratios 0.25 0.50 0.70 0.80 0.90 0.95" in out
    assert f"wrote {path}" in out
    assert Profile.load(path).memory_table.measure.startswith("continuation excess NLL")
    assert main(args) == 2  # already there
    assert "--replace" in capsys.readouterr().err
    assert main([*args, "--replace", "--contexts", "0"]) == 2
    assert main([*args, "--replace", "--contexts", "2", "--layer-contexts", "3"]) == 2
    assert "--layer-contexts must be between 1 and --contexts (2)" in capsys.readouterr().err
    assert (
        main([*args, "--replace", "--contexts", "2", "--continuation-tokens", "32", "--layer-contexts", "1"])
        == 0
    )
    assert Profile.load(path).memory_table.measure.endswith(
        "over a float32 prefill (layers' losses: bfloat16, 1 context, midpoint gradient)"
    )
    assert main(["memory-table", "tiny", str(tmp_path / "none.safetensors")]) == 2


def test_the_shared_prefill_gives_the_table_of_a_prefill_per_cell(tiny_model, byte_tokenizer):
    """One prefill per window, replayed into every cell's cache (and the layer losses'): the same table."""
    profile = _profile(tiny_model)
    kwargs = dict(contexts=2, continuation_tokens=32, ratios=(0.3, 0.9))
    shared = measure_memory_table(tiny_model, byte_tokenizer, profile, TEXT, layer_method="passes", **kwargs)
    each = measure_memory_table(tiny_model, byte_tokenizer, profile, TEXT, share_prefill=False, **kwargs)
    np.testing.assert_allclose(shared.loss, each.loss, atol=2e-6)
    np.testing.assert_allclose(shared.layer_loss, each.layer_loss, atol=2e-6)
    assert np.abs(each.layer_loss).max() > 0 and np.abs(each.loss).max() > 1e-3


def test_the_layers_losses_from_one_backward_pass_are_the_passes_to_second_order():
    """By default a shared prefill's layers' losses come from one forward and backward pass per window (the
    continuation's NLL at the midpoint of every layer's 8- and 4-bit keys and values, dotted with their
    difference), not one pass per layer; on a model whose rounding moves the loss a little, the passes'
    values within a few percent."""
    model = testing.tiny_model(num_hidden_layers=5, vocab_size=testing.BYTE_VOCAB, pad_token_id=None)
    tokenizer = testing.byte_tokenizer()
    profile = _profile(model)
    kwargs = dict(ratios=(0.7,), contexts=2, continuation_tokens=32)
    calls = []
    hook = model.model.layers[3].self_attn.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        estimated = measure_memory_table(model, tokenizer, profile, TEXT, **kwargs)
    finally:
        hook.remove()
    passes = measure_memory_table(model, tokenizer, profile, TEXT, layer_method="passes", **kwargs)
    np.testing.assert_allclose(estimated.loss, passes.loss, atol=2e-6)  # the cells are measured either way
    assert np.abs(passes.layer_loss).max() > 1e-5
    np.testing.assert_allclose(estimated.layer_loss, passes.layer_loss, rtol=0.05, atol=2e-6)
    assert estimated.measure.endswith("(layers' losses: float32, 2 contexts, midpoint gradient)")
    # per window: the recorded prefill, the full cache, 3 cells (3 precisions) and the layers' one pass run layer 3
    assert len(calls) == 2 * (1 + 1 + 3 + 1)
    with pytest.raises(ConfigurationError, match="layer_method must be 'gradient' or 'passes'"):
        measure_memory_table(model, tokenizer, profile, TEXT, layer_method="grad", **kwargs)
    with torch.inference_mode():  # nothing to differentiate there: the passes
        inside = measure_memory_table(model, tokenizer, profile, TEXT, **kwargs)
    np.testing.assert_allclose(inside.layer_loss, passes.layer_loss, atol=2e-6)
    assert inside.measure == passes.measure


# ------------------------------------------------------------------------------------------ the passes' dtype

DTYPE_TEXT = testing.prose(700, seed=5)
GRID = dict(contexts=2, continuation_tokens=32, ratios=(0.5, 0.8))


def test_a_bfloat16_table_is_the_table_of_a_bfloat16_copy_and_leaves_the_model_alone(
    tiny_model, byte_tokenizer
):
    profile = _profile(tiny_model)
    tiny_model.train()
    before = {name: p.clone() for name, p in tiny_model.state_dict().items()}
    table = measure_memory_table(tiny_model, byte_tokenizer, profile, DTYPE_TEXT, dtype="bfloat16", **GRID)
    # the model is untouched: float32, the same weights, its training flag back
    assert tiny_model.training
    assert all(torch.equal(before[name], p) for name, p in tiny_model.state_dict().items())
    assert {p.dtype for p in tiny_model.parameters()} == {torch.float32}
    # a copy cast by hand (parameters only) gives the same table
    by_hand = copy.deepcopy(tiny_model).eval()
    for p in by_hand.parameters():
        p.data = p.data.to(torch.bfloat16)
    assert measure_memory_table(by_hand, byte_tokenizer, profile, DTYPE_TEXT, **GRID) == table
    assert table.measure.endswith("bfloat16 passes (layers' losses: bfloat16, 2 contexts, midpoint gradient)")
    own = measure_memory_table(tiny_model, byte_tokenizer, profile, DTYPE_TEXT, **GRID)
    assert own.measure.endswith(
        "float32 passes (layers' losses: float32, 2 contexts, midpoint gradient)"
    ) and not np.array_equal(own.loss, table.loss)
    assert (
        measure_memory_table(tiny_model, byte_tokenizer, profile, DTYPE_TEXT, dtype=torch.float32, **GRID)
        == own
    )


def test_a_bfloat16_table_runs_on_one_copy_of_the_model(tiny_model, byte_tokenizer):
    """Every pass in one dtype that is not the model's: the cells, the prefill and the layers' losses all run
    on one cast copy, not on one copy each."""
    profile = _profile(tiny_model)
    seen: set[int] = set()
    # the copy is a deep copy: it carries the hook, and its layer is another module
    hook = tiny_model.model.layers[0].register_forward_pre_hook(lambda module, args: seen.add(id(module)))
    try:
        measure_memory_table(tiny_model, byte_tokenizer, profile, DTYPE_TEXT, dtype="bfloat16", **GRID)
    finally:
        hook.remove()
    assert len(seen) == 1 and id(tiny_model.model.layers[0]) not in seen


def test_auto_measures_the_cells_in_bfloat16_and_the_layers_losses_at_the_models_precision(
    tiny_model, byte_tokenizer, monkeypatch
):
    """A layer's loss is a small difference of two passes: bfloat16's rounding would make it noisy. The
    cells run on a bfloat16 copy and replay the layers' float32 prefill, cast: one prefill per window."""
    monkeypatch.setattr(dtypes, "available_bytes", lambda: 1 << 40)
    monkeypatch.setattr(dtypes, "native_bf16", lambda: True)
    profile = _profile(tiny_model)
    seen: list[tuple[torch.dtype, int]] = []

    def note(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        seen.append((hidden.dtype, hidden.shape[1]))

    # the bfloat16 copy is a deep copy: it carries the hook
    hook = tiny_model.model.layers[0].register_forward_pre_hook(note, with_kwargs=True)
    try:
        auto = measure_memory_table(tiny_model, byte_tokenizer, profile, DTYPE_TEXT, dtype="auto", **GRID)
    finally:
        hook.remove()
    prefills = [dtype for dtype, length in seen if length > GRID["continuation_tokens"]]
    assert prefills == [torch.float32] * GRID["contexts"]  # the cells' copy prefills nothing
    # the cells' and the layers' backward pass: bfloat16
    assert {dtype for dtype, length in seen if length < GRID["continuation_tokens"]} == {torch.bfloat16}
    bf16 = measure_memory_table(tiny_model, byte_tokenizer, profile, DTYPE_TEXT, dtype="bfloat16", **GRID)
    own = measure_memory_table(tiny_model, byte_tokenizer, profile, DTYPE_TEXT, **GRID)
    # the cells as a bfloat16 prefill's, to its rounding
    np.testing.assert_allclose(auto.loss, bf16.loss, atol=2e-3)
    assert not np.array_equal(auto.loss, bf16.loss) and not np.array_equal(auto.loss, own.loss)
    assert auto.layer_loss is not None and own.layer_loss is not None and bf16.layer_loss is not None
    # the layers' losses: a bfloat16 backward pass over the float32 prefill is the float32 pass's, to its
    # rounding; over a bfloat16 prefill they move (here one changes sign)
    np.testing.assert_allclose(auto.layer_loss, own.layer_loss, rtol=0.2)
    assert not np.allclose(bf16.layer_loss, own.layer_loss, rtol=0.2)
    assert auto.measure.endswith(
        "bfloat16 passes over a float32 prefill (layers' losses: bfloat16, 2 contexts, midpoint gradient)"
    )


def test_the_layers_losses_on_fewer_windows(tiny_model, byte_tokenizer):
    profile = _profile(tiny_model)
    own = measure_memory_table(tiny_model, byte_tokenizer, profile, DTYPE_TEXT, **GRID)
    assert (
        measure_memory_table(tiny_model, byte_tokenizer, profile, DTYPE_TEXT, layer_contexts=2, **GRID) == own
    )
    one = measure_memory_table(tiny_model, byte_tokenizer, profile, DTYPE_TEXT, layer_contexts=1, **GRID)
    assert np.array_equal(one.loss, own.loss)  # the cells on every window
    assert one.layer_loss is not None and not np.array_equal(one.layer_loss, own.layer_loss)
    assert one.measure.endswith("(layers' losses: float32, 1 context, midpoint gradient)")
    for wrong in (0, 3):
        with pytest.raises(ConfigurationError, match="layer_contexts must be between 1 and contexts"):
            measure_memory_table(
                tiny_model, byte_tokenizer, profile, DTYPE_TEXT, layer_contexts=wrong, **GRID
            )


def test_auto_is_bfloat16_for_a_float32_model_on_a_cpu_that_multiplies_it(tiny_model, monkeypatch):
    monkeypatch.setattr(dtypes, "available_bytes", lambda: 1 << 40)
    monkeypatch.setattr(dtypes, "native_bf16", lambda: True)
    assert dtypes.table_dtype(tiny_model, "auto") == torch.bfloat16
    assert dtypes.table_dtype(copy.deepcopy(tiny_model).half(), "auto") == torch.float16  # not float32
    monkeypatch.setattr(dtypes, "available_bytes", lambda: 100)  # no room for the copy
    assert dtypes.table_dtype(tiny_model, "auto") == torch.float32
    monkeypatch.setattr(dtypes, "available_bytes", lambda: None)  # unknown: no copy
    assert dtypes.table_dtype(tiny_model, "auto") == torch.float32
    monkeypatch.setattr(dtypes, "available_bytes", lambda: 1 << 40)
    monkeypatch.setattr(dtypes, "native_bf16", lambda: False)
    assert dtypes.table_dtype(tiny_model, "auto") == torch.float32
    assert dtypes.table_dtype(tiny_model, None) == dtypes.table_dtype(tiny_model, "model") == torch.float32


@pytest.mark.parametrize("dtype", ["int8", "fp8", torch.int8, 3])
def test_a_dtype_that_is_not_a_float_is_refused(tiny_model, dtype):
    with pytest.raises(ConfigurationError, match="dtype"):
        dtypes.table_dtype(tiny_model, dtype)


def test_a_build_refuses_a_bad_table_dtype_before_it_starts_and_passes_a_good_one_on(
    tiny_model, byte_tokenizer, tiny_calibration, tmp_path
):
    with pytest.raises(ConfigurationError, match="table_dtype"):
        BuildSettings(table_dtype="int8")
    profile = build_profile(
        tiny_model,
        byte_tokenizer,
        "keydiff",
        tiny_calibration,
        k_max=2,
        model_id="org/tiny",
        cache_dir=tmp_path / "cache",
        show_progress=False,
        table_dtype="bfloat16",
    )
    assert profile.memory_table is not None and "bfloat16 passes (" in profile.memory_table.measure


def test_lukv_build_table_dtype(tiny_model, byte_tokenizer, tiny_calibration, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(profiling_cli, "_load_model", lambda name: (tiny_model, byte_tokenizer, {}))
    args = ["build", "tiny", "--k-max", "2", "--calibration", str(tiny_calibration), "--model-id", "org/t"]
    args += ["--cache-dir", str(tmp_path / "c"), "--quiet", "--out", str(tmp_path / "a.safetensors")]
    assert main([*args, "--table-dtype", "float16"]) == 0
    assert Profile.load(tmp_path / "a.safetensors").memory_table.measure.count("float16 passes (") == 1
    with pytest.raises(SystemExit):
        main([*args, "--table-dtype", "int8"])
    assert "--table-dtype: invalid choice" in capsys.readouterr().err
    assert main([*args, "--oracle-dtype", "model", "--no-memory-table"]) == 0
    assert Profile.load(tmp_path / "a.safetensors").extra["oracle_dtype"] == "float32"
    assert main([*args, "--oracle-dtype", "bfloat16", "--no-memory-table"]) == 0
    assert Profile.load(tmp_path / "a.safetensors").extra["oracle_dtype"] == "bfloat16"


@pytest.mark.parametrize("scorer", ["kvzap", "kvzip", "snapkv"])
def test_every_kind_of_scorer_measures_in_bfloat16(tiny_model, byte_tokenizer, scorer):
    """A surrogate's float32 weights, KVzip's repeat passes, a scorer reading queries: each on bfloat16 keys."""
    config = tiny_model.config
    fields = {}
    if scorer == "kvzap":
        fields["surrogate"] = testing.random_surrogate(
            config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        )
    profile = _profile(tiny_model, scorer=scorer, **fields)
    table = measure_memory_table(
        tiny_model,
        byte_tokenizer,
        profile,
        TEXT,
        dtype="bfloat16",
        bits=(None, 4),
        ratios=(0.5, 0.9),
        contexts=1,
        continuation_tokens=16,
    )
    assert np.isfinite(table.loss).all() and table.measure.endswith("bfloat16 passes")


def test_the_copys_output_head_reads_a_fresh_copy_of_a_strided_input(tiny_model):
    """transformers slices the last position for ``logits_to_keep=1``; torch's CPU bfloat16 matmul copies the
    whole transposed weight for such a view, so the cast copy's head gets a fresh, plainly laid out input."""
    seen = []
    with dtypes.model_in(tiny_model, torch.bfloat16) as copy_:
        head = copy_.get_output_embeddings()
        head.register_forward_hook(lambda module, args, output: seen.append(args[0].stride()))
        hidden = torch.randn(1, 5, head.in_features, dtype=torch.bfloat16)
        head(hidden[:, -1:, :])  # strides (5 d, d, 1)
    assert seen == [(head.in_features, head.in_features, 1)]
    assert tiny_model.get_output_embeddings()._forward_pre_hooks == {}  # the user's model has no hook


def test_the_oracle_runs_in_its_dtype_on_a_copy_and_leaves_the_model_alone(
    tiny_model, byte_tokenizer, calibration_writer, tmp_path
):
    calibration = calibration_writer(tmp_path / "c.jsonl", context=TEXT[:440])
    before = {name: p.clone() for name, p in tiny_model.state_dict().items()}

    def build(model, dtype, folder):  # each its own result cache: nothing decoded is shared
        return _build(
            model, byte_tokenizer, calibration, tmp_path / folder, oracle_dtype=dtype, memory_table=False
        )

    bf16 = build(tiny_model, "bfloat16", "a")
    assert all(torch.equal(before[name], p) for name, p in tiny_model.state_dict().items())
    assert {p.dtype for p in tiny_model.parameters()} == {torch.float32}
    by_hand = copy.deepcopy(tiny_model).eval()  # a copy cast by hand (parameters only) builds the same
    for p in by_hand.parameters():
        p.data = p.data.to(torch.bfloat16)
    np.testing.assert_array_equal(build(by_hand, "model", "b").evict_ratio, bf16.evict_ratio)
    own = build(tiny_model, "model", "c")
    assert not np.array_equal(own.evict_ratio, bf16.evict_ratio)
    assert bf16.extra["oracle_dtype"] == "bfloat16" and own.extra["oracle_dtype"] == "float32"
    with pytest.raises(ConfigurationError, match=r"The oracle's dtype \(oracle_dtype\) must be one of auto"):
        build(tiny_model, "int8", "d")


def test_the_table_runs_on_the_users_model_whatever_the_oracles_dtype(
    tiny_model, byte_tokenizer, calibration_writer, tmp_path, monkeypatch
):
    """table_dtype="model" is the user's model's precision, not the oracle's copy's; and the oracle's copy is
    gone before the table starts (its bytes are not held through the table's passes)."""
    import contextlib
    import gc
    import weakref

    from lukv_cache.profiling import build as build_module
    from lukv_cache.profiling import memory_table

    copies = []  # weak references to the oracle's copies: other tests' models alive in the process don't count
    model_in = build_module.model_in

    @contextlib.contextmanager
    def recording(model, dtype):
        with model_in(model, dtype) as copy_:
            if copy_ is not model:
                copies.append(weakref.ref(copy_))
            yield copy_

    copies_alive = []
    measure = memory_table.measure_memory_table

    def counting(model, *args, **kwargs):
        gc.collect()
        copies_alive.append(sum(ref() is not None for ref in copies))
        return measure(model, *args, **kwargs)

    monkeypatch.setattr(build_module, "model_in", recording)
    monkeypatch.setattr(memory_table, "measure_memory_table", counting)
    calibration = calibration_writer(tmp_path / "c.jsonl", context=TEXT[:440])
    profile = _build(
        tiny_model, byte_tokenizer, calibration, tmp_path, oracle_dtype="bfloat16", table_dtype="model"
    )
    assert profile.memory_table is not None and "float32 passes (" in profile.memory_table.measure
    assert len(copies) == 1 and copies_alive == [0]


def test_the_continuation_nll_is_the_float32_cross_entropy_a_few_rows_at_a_time(monkeypatch):
    """The table's and the continuation task's NLL casts a few rows of logits to float32 at a time (here 3 of
    10): the cross entropy of the whole float32 logits, every row counted once."""
    from lukv_cache.profiling import continuation

    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(10, 50, generator=generator) * 4).bfloat16()
    target = torch.randint(0, 50, (10,), generator=generator)
    monkeypatch.setattr(continuation, "_CHUNK_BYTES", 3 * 4 * 50)
    expected = torch.nn.functional.cross_entropy(logits.float(), target, reduction="sum")
    assert float(continuation._nll_sum(logits, target)) == pytest.approx(float(expected), rel=1e-6)
    assert float(continuation._nll_sum(logits[:1], target[:1])) == pytest.approx(
        float(torch.nn.functional.cross_entropy(logits[:1].float(), target[:1], reduction="sum")), rel=1e-6
    )
