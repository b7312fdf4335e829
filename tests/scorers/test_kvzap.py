"""KVzap: a learned surrogate of KVzip+ scores, read from the profile, scoring in the ordinary forward."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from helpers import scorer_for, tiny_model

from lukv_cache import LUKVCache
from lukv_cache.errors import ConfigurationError, ProfileFormatError
from lukv_cache.profiles import Profile
from lukv_cache.profiling.kvzap import (
    kvzip_targets,
    token_feature_maps,
    train_surrogate,
)
from lukv_cache.profiling.kvzap_options import KVzapTraining
from lukv_cache.profiling.ridge import RidgeStats
from lukv_cache.scorers.kvzap import (
    FEATURES,
    INTERACTION_FEATURES,
    KVZAP_ALLOCATOR,
    WINDOW_FEATURES,
    RopeInverse,
    Surrogate,
    base_features,
    input_size,
    kvzap_scorer,
    token_features,
)
from lukv_cache.scorers.kvzip import RepeatPrompt
from lukv_cache.testing import flat_profile, prompt

PROMPT = RepeatPrompt(first=(5, 6, 7), next=(8, 9), suffix=(10,))


def _hidden_and_keys(model, ids):
    """The hidden state entering each attention layer, and the cached (post-RoPE) keys and values."""
    from transformers import DynamicCache

    hidden, hooks = {}, []
    for layer in model.model.layers:
        attn = layer.self_attn
        hooks.append(
            attn.register_forward_pre_hook(
                lambda m, a, kw, attn=attn: hidden.__setitem__(attn.layer_idx, kw["hidden_states"]),
                with_kwargs=True,
            )
        )
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=cache)
    for hook in hooks:
        hook.remove()
    return hidden, cache


@pytest.mark.parametrize(
    "arch,attn",
    [("llama", "sdpa"), ("qwen2", "sdpa"), ("qwen3", "sdpa"), ("gemma2", "eager"), ("phi3", "sdpa")],
)
def test_rope_is_undone_exactly_with_the_models_own_rotary_embedding(arch, attn):
    model = tiny_model(arch, attn)
    ids = prompt(1, 30, seed=1)
    hidden, cache = _hidden_and_keys(model, ids)
    for idx, layer in enumerate(model.model.layers):
        module = layer.self_attn
        if hasattr(module, "k_proj"):
            k = module.k_proj(hidden[idx])
        else:  # phi3 fuses q, k and v in one projection
            q_dim = model.config.num_attention_heads * module.head_dim
            k = module.qkv_proj(hidden[idx])[
                ..., q_dim : q_dim + model.config.num_key_value_heads * module.head_dim
            ]
        want = k.view(1, 30, -1, module.head_dim).transpose(1, 2)
        if hasattr(module, "k_norm"):
            want = module.k_norm(want)  # qwen3 normalises keys before RoPE
        keys = cache.layers[idx].keys
        got = RopeInverse.for_module(module)(keys, torch.arange(keys.shape[2])[None])
        torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_one_models_layers_share_a_rope_inverse_that_recomputes_at_new_positions(family):
    # the layers of one model rotate alike (per layer type): one RopeInverse, its last cos/sin kept for a
    # fold's few positions and recomputed whenever they change; another model of its own
    from lukv_cache.scorers.kvzap import rope_inverse

    model, other = tiny_model(family, "sdpa"), tiny_model(family, "sdpa", seed=1)  # two models
    modules = [layer.self_attn for layer in model.model.layers]
    inverses = [rope_inverse(m) for m in modules]
    types = getattr(model.config, "layer_types", None) or [None] * len(modules)
    for inverse, module, kind in zip(inverses, modules, types):
        same = [other_inv for other_inv, t in zip(inverses, types) if t == kind]
        assert all(i is inverse for i in same)
        assert rope_inverse(other.model.layers[modules.index(module)].self_attn) is not inverse
    keys = torch.randn(2, 2, 6, modules[0].head_dim)
    for positions in (
        torch.arange(6).repeat(2, 1),
        torch.arange(3, 9).repeat(2, 1),
        torch.arange(6).repeat(2, 1),
    ):
        for module, inverse in zip(modules, inverses):
            fresh = RopeInverse.for_module(module)
            torch.testing.assert_close(inverse(keys, positions), fresh(keys, positions), rtol=0, atol=0)


def test_surrogate_predictions_equal_a_computation_by_hand():
    gen = torch.Generator().manual_seed(0)
    s = Surrogate.zeros(num_layers=2, heads=2, features=6)
    for t in (s.weight, s.bias, s.mean):
        t.copy_(torch.randn(t.shape, generator=gen))
    s.std.copy_(torch.rand(s.std.shape, generator=gen) + 0.5)
    x = torch.randn(3, 5, 6, generator=gen)
    got = s.predict(1, x)
    for b in range(3):
        for h in range(2):
            for t in range(5):
                z = (x[b, t] - s.mean[1]) / s.std[1]
                assert torch.isclose(got[b, h, t], z @ s.weight[1, h] + s.bias[1, h], atol=1e-5)
    # a tensor-parallel rank holding KV head 1 predicts that head only (from every head's features)
    torch.testing.assert_close(s.predict(1, x, heads=slice(1, 2)), got[:, 1:])


def test_mlp_surrogate_predictions_equal_a_computation_by_hand():
    gen = torch.Generator().manual_seed(4)
    s = Surrogate.zeros(num_layers=2, heads=3, features=6, hidden=5)
    for t in (s.weight, s.bias, s.mean, s.hidden_weight, s.hidden_bias):
        t.copy_(torch.randn(t.shape, generator=gen))
    s.std.copy_(torch.rand(s.std.shape, generator=gen) + 0.5)
    x = torch.randn(2, 4, 6, generator=gen)
    got = s.predict(1, x)
    assert got.shape == (2, 3, 4) and s.family == "mlp" and s.num_features == 6
    for b in range(2):
        for t in range(4):
            z = (x[b, t] - s.mean[1]) / s.std[1]
            hidden = torch.nn.functional.gelu(s.hidden_weight[1] @ z + s.hidden_bias[1])
            torch.testing.assert_close(got[b, :, t], s.weight[1] @ hidden + s.bias[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s.predict(1, x, heads=slice(2, 3)), got[:, 2:])


@pytest.mark.parametrize("hidden", [None, 5])
def test_a_surrogate_changed_in_place_after_predicting_predicts_with_its_new_weights(hidden):
    # predict keeps each layer's maps with the standardisation folded in; a tensor changed in place (as a
    # build fills a surrogate layer by layer) must not leave a stale copy behind
    gen = torch.Generator().manual_seed(2)
    s = Surrogate.zeros(num_layers=2, heads=2, features=6, hidden=hidden)
    x = torch.randn(1, 3, 6, generator=gen)
    assert not s.predict(0, x).any()  # all zeros, and kept
    tensors = (s.weight, s.bias, s.mean, s.std, s.hidden_weight, s.hidden_bias)
    for t in (t for t in tensors if t is not None):
        t.add_(torch.rand(t.shape, generator=gen))
    fresh = Surrogate(
        **{f: getattr(s, f) for f in ("weight", "bias", "mean", "std", "hidden_weight", "hidden_bias")}
    )
    torch.testing.assert_close(s.predict(0, x), fresh.predict(0, x))
    assert s.predict(0, x).abs().sum() > 0


def test_ridge_without_penalty_is_least_squares_and_the_penalty_shrinks():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(300, 5, generator=gen, dtype=torch.float64) * torch.tensor([1, 10, 0.1, 3, 1.0])
    y = x @ torch.randn(5, 1, generator=gen, dtype=torch.float64) + torch.randn(300, 1, generator=gen) + 2
    stats = RidgeStats(5, 1)
    for xs, ys in zip(x.split(70), y.split(70)):
        stats.add(xs, ys)
    weight, bias, mean, std = stats.solve(alpha=0.0)
    design = torch.cat([x, torch.ones(300, 1, dtype=torch.float64)], dim=1)
    reference = torch.linalg.lstsq(design, y).solution
    predicted = ((x - mean.double()) / std.double()) @ weight.double() + bias.double()
    torch.testing.assert_close(predicted, design @ reference, atol=1e-3, rtol=1e-4)
    shrunk = stats.solve(alpha=1e4)[0]
    assert shrunk.norm() < weight.norm()


def test_kvzap_scores_are_the_surrogate_on_each_tokens_key_and_value():
    model = tiny_model("llama", "sdpa")
    scorer = scorer_for("kvzap", model)  # reads the context's length and the window attention too
    ids = prompt(1, 40, seed=2)
    cache = LUKVCache(0.0, scorer, sink=0, window=0, keep_scores=True)
    with torch.no_grad():
        cache.prefill(model, ids)
    surrogate = scorer.params["surrogate"]
    assert surrogate.features == WINDOW_FEATURES and scorer.n_queries == 32
    features = token_feature_maps(model, ids, surrogate.features)  # what training reads
    assert features[0].shape[-1] == base_features(WINDOW_FEATURES, 2, 16)
    for layer, scores in cache.prefill_scores.items():
        want = surrogate.predict(layer, features[layer], lengths=torch.tensor([40]))
        torch.testing.assert_close(scores, want, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(
            scores, surrogate.predict(layer, features[layer], lengths=torch.tensor([80]))
        )


def test_a_length_aware_surrogate_reads_log_length_and_its_products_with_the_features():
    gen = torch.Generator().manual_seed(5)
    s = Surrogate.zeros(num_layers=1, heads=2, features=input_size(INTERACTION_FEATURES, 3))
    s.features = INTERACTION_FEATURES
    for t in (s.weight, s.bias, s.mean):
        t.copy_(torch.randn(t.shape, generator=gen))
    x = torch.randn(2, 4, 3, generator=gen)
    got = s.predict(0, x, lengths=torch.tensor([10, 300]))
    for b, length in enumerate((10, 300)):
        log_t = torch.full((4, 1), math.log(length))
        inputs = torch.cat([x[b], log_t, x[b] * log_t], dim=1)
        want = (inputs - s.mean[0]) @ s.weight[0].T + s.bias[0]  # std is 1
        torch.testing.assert_close(got[b], want.T, atol=1e-4, rtol=1e-4)


def test_kvzap_works_with_chunked_prefill_and_keeps_the_budget():
    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 120, seed=3)
    cache = LUKVCache(0.5, scorer_for("kvzap", model), sink=4, window=1, prefill_chunk_size=40)
    with torch.no_grad():
        for start in range(0, 120, 40):
            model(ids[:, start : start + 40], past_key_values=cache)
    assert cache.is_compressed and int(cache.stored_tokens().max()) < 120


def _trained(model, family="linear"):
    docs = [prompt(1, 48, seed=s) for s in range(3)]
    return train_surrogate(
        model, PROMPT, docs, family=family, alpha=1.0, samples=1024, meta={"corpus": "random ids"}
    )


@pytest.mark.parametrize("family", ["linear", "mlp"])
def test_training_end_to_end_on_a_tiny_model_fits_its_own_corpus(family):
    model = tiny_model("llama", "sdpa")
    surrogate = _trained(model, family)
    assert surrogate.layers == [0, 1] and surrogate.meta["corpus"] == "random ids"
    assert surrogate.family == family == surrogate.meta["family"]
    ids = prompt(1, 48, seed=0)
    predicted = surrogate.predict(0, token_feature_maps(model, ids)[0])[0, :, 4:]
    target = kvzip_targets(model, PROMPT, ids)[0][0, 4:].T
    # a random tiny model's KVzip+ is far from linear in its keys and values: 0.45 here, 0 for no fit
    assert torch.corrcoef(torch.stack([predicted.flatten(), target.flatten()]))[0, 1] > 0.3


def test_an_mlp_surrogate_has_the_width_asked_for():
    model = tiny_model("llama", "sdpa")
    docs = [prompt(1, 48, seed=s) for s in range(2)]
    surrogate = train_surrogate(model, PROMPT, docs, family="mlp", samples=1024, hidden=24)
    assert surrogate.hidden_weight.shape[1] == 24 and surrogate.weight.shape[-1] == 24
    assert surrogate.predict(0, token_feature_maps(model, docs[0])[0]).shape == (1, 2, 48)


def test_mlp_rows_spilled_to_disk_train_the_same_surrogate_and_are_removed(tmp_path):
    model = tiny_model("llama", "sdpa")
    docs = [prompt(1, 48, seed=s) for s in range(3)]
    kw = dict(family="mlp", samples=512, hidden=16, seed=3)
    in_memory = train_surrogate(model, PROMPT, docs, **kw)
    spilled = train_surrogate(model, PROMPT, docs, spill=tmp_path, **kw)
    assert in_memory.meta["rows_per_layer"] == spilled.meta["rows_per_layer"] == 3 * 22  # 44 tokens each
    for name, tensor in in_memory.tensors().items():
        assert torch.equal(spilled.tensors()[name], tensor), name
    assert list(tmp_path.iterdir()) == []  # each layer's files go once it is fitted


def test_training_rows_refuse_rows_of_another_width():
    from lukv_cache.profiling.kvzap import TrainingRows

    rows = TrainingRows()
    rows.add(0, torch.ones(2, 5), torch.zeros(2, 3))
    with pytest.raises(ConfigurationError, match="expected"):
        rows.add(0, torch.ones(2, 4), torch.zeros(2, 3))
    with pytest.raises(ConfigurationError, match="targets_of"):
        rows.add(0, torch.ones(2, 5), torch.zeros(3, 3))  # fewer rows than targets


def test_kvzip_targets_are_the_log_of_kvzips_own_scores_not_kvzip_plus():
    from lukv_cache.profiling.scores import prefill_scores

    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 40, seed=2)
    plain = kvzip_targets(model, PROMPT, ids, target="kvzip")
    kvzip = prefill_scores(model, ids, "kvzip", repeat_prompt=PROMPT)
    assert torch.allclose(plain[1], kvzip[1].clamp_min(1e-12).log().transpose(1, 2))
    assert not torch.allclose(plain[1], kvzip_targets(model, PROMPT, ids)[1])
    with pytest.raises(ConfigurationError, match="kvzap target"):
        kvzip_targets(model, PROMPT, ids, target="snapkv")
    with pytest.raises(ConfigurationError, match="kvzap target"):
        KVzapTraining(target="h2o")


def test_an_unknown_surrogate_family_is_refused():
    with pytest.raises(ConfigurationError, match="'linear' or 'mlp'"):
        _trained(tiny_model("llama", "sdpa"), family="forest")


def _profile(surrogate, **kw) -> Profile:
    return flat_profile(
        2, 2, grid=[0.25, 0.5, 0.75], scorer="kvzap", head_dim=16, window=32, surrogate=surrogate, **kw
    )


@pytest.mark.parametrize("family", ["linear", "mlp"])
def test_a_profile_round_trips_with_its_surrogate_and_feeds_from_pretrained(tmp_path, family):
    model = tiny_model("llama", "sdpa")
    surrogate = _trained(model, family)
    path = _profile(surrogate).save(tmp_path / "kvzap.safetensors")
    loaded = Profile.load(path).surrogate
    assert loaded.tensors().keys() == surrogate.tensors().keys()
    for name, tensor in surrogate.tensors().items():
        assert torch.equal(loaded.tensors()[name], tensor)
    assert loaded.family == family and (loaded.hidden_weight is None) == (family == "linear")
    assert loaded.layers == [0, 1] and loaded.meta["corpus"] == "random ids"
    cache = LUKVCache.from_pretrained(path, ratio=0.5)
    assert cache.scorer.name == "kvzap" and cache.scorer.params["surrogate"] is not None
    with torch.no_grad():
        model(prompt(1, 100, seed=5), past_key_values=cache)
    assert cache.is_compressed


def test_kvzap_without_a_surrogate_says_how_to_get_one(tmp_path):
    with pytest.raises(ConfigurationError, match="lukv build <model> --scorer kvzap"):
        LUKVCache(0.5, "kvzap")
    plain = _profile(None).save(tmp_path / "plain.safetensors")
    with pytest.raises(ConfigurationError, match="holds no kvzap surrogate"):
        LUKVCache.from_pretrained(plain, ratio=0.5, scorer="kvzap")


def _corrupt(tmp_path, surrogate, edit) -> bytes:
    from safetensors.numpy import load, save

    data = _profile(surrogate).to_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    tensors, metadata = load(data), header["__metadata__"]
    edit(tensors, metadata)
    return save(tensors, metadata=metadata)


@pytest.mark.parametrize(
    "edit",
    [
        lambda t, m: t.__setitem__("kvzap.weight", t["kvzap.weight"][:, :1]),  # one head short
        lambda t, m: t.__setitem__("kvzap.bias", t["kvzap.bias"].astype(np.float16)),
        lambda t, m: t.__setitem__("kvzap.std", np.zeros_like(t["kvzap.std"])),
        lambda t, m: t.__setitem__("kvzap.mean", np.full_like(t["kvzap.mean"], np.nan)),
        lambda t, m: t.pop("kvzap.mean"),
        lambda t, m: t.__setitem__("kvzap.weight", np.zeros((2, 2, 40), np.float32)),  # not 2 x heads x dim
        lambda t, m: m.__setitem__(
            "kvzap", json.dumps({"features": "hidden", "family": "linear", "layers": [0]})
        ),
        lambda t, m: m.__setitem__(
            "kvzap", json.dumps({"features": "keys_prerope_values", "family": "mlp", "layers": [0]})
        ),
        lambda t, m: m.__setitem__(
            "kvzap", json.dumps({"features": "keys_prerope_values", "family": "linear", "layers": [7]})
        ),
        lambda t, m: m.__setitem__("kvzap", "[" * 100_000),
    ],
)
def test_a_corrupt_surrogate_is_refused_with_a_typed_error(tmp_path, edit):
    data = _corrupt(tmp_path, _trained(tiny_model("llama", "sdpa")), edit)
    with pytest.raises(ProfileFormatError):
        Profile.from_bytes(data)


@pytest.mark.parametrize(
    "edit",
    [
        lambda t, m: t.pop("kvzap.hidden_bias"),
        lambda t, m: t.__setitem__("kvzap.hidden_weight", t["kvzap.hidden_weight"][:, :7]),  # width 7 != 512
        lambda t, m: t.__setitem__("kvzap.hidden_bias", t["kvzap.hidden_bias"].astype(np.float16)),
        lambda t, m: t.__setitem__("kvzap.hidden_weight", np.full_like(t["kvzap.hidden_weight"], np.inf)),
        lambda t, m: m.__setitem__(
            "kvzap", json.dumps({"features": "keys_prerope_values", "family": "linear", "layers": [0]})
        ),
        lambda t, m: (t.pop("kvzap.hidden_weight"), t.pop("kvzap.hidden_bias")),  # an MLP's weight [L, H, M]
    ],
)
def test_a_corrupt_mlp_surrogate_is_refused_with_a_typed_error(tmp_path, edit):
    surrogate = Surrogate.zeros(2, 2, 64, hidden=512)
    surrogate.layers = [0, 1]
    assert Profile.from_bytes(_profile(surrogate).to_bytes()).surrogate.family == "mlp"
    with pytest.raises(ProfileFormatError):
        Profile.from_bytes(_corrupt(tmp_path, surrogate, edit))


@pytest.mark.parametrize("scorer", ["keydiff", "snapkv", "expected_attention", "knorm", "kvzip"])
def test_profiles_without_a_surrogate_still_load_unchanged(scorer):
    """The shipped files were written before kvzap existed (exactly grid and evict_ratio); they load as
    they did, and write back the same values."""
    from lukv_cache.profiles.location import BUNDLED_DIR

    shipped = Profile.load(BUNDLED_DIR / f"HuggingFaceTB/SmolLM2-135M-Instruct/{scorer}.safetensors")
    assert shipped.surrogate is None and shipped.scorer == scorer
    again = Profile.from_bytes(shipped.to_bytes())
    assert again._metadata() == shipped._metadata() and again.surrogate is None
    assert np.array_equal(again.evict_ratio, shipped.evict_ratio) and np.array_equal(again.grid, shipped.grid)


def test_token_features_are_each_heads_key_and_value():
    k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    f = token_features(k, v)  # [B, T, H, 2D]
    assert f.shape == (1, 3, 2, 8)
    assert torch.equal(f[0, :, 1, :4], k[0, 1]) and torch.equal(f[0, :, 1, 4:], v[0, 1])


def test_kvzap_scorer_refuses_anything_but_a_surrogate():
    with pytest.raises(ConfigurationError, match="needs a Surrogate"):
        kvzap_scorer({"weight": 1})


def test_the_threshold_allocator_reads_a_kvzap_profiles_thresholds_and_adapts_to_the_prompt(tmp_path):
    """Every token whose predicted score clears the threshold recorded for the ratio: a prompt whose
    tokens score low keeps less than one whose tokens score high."""
    from lukv_cache.profiling.kvzap import score_thresholds

    model = tiny_model("llama", "sdpa")
    surrogate = _trained(model)
    docs = [prompt(1, 48, seed=s) for s in range(3)]
    surrogate.meta["thresholds"] = score_thresholds(model, surrogate, docs, [0.25, 0.5, 0.75], window=1)
    values = surrogate.meta["thresholds"]["values"]
    assert values == sorted(values)
    path = _profile(surrogate).save(tmp_path / "kvzap.safetensors")
    kept = []
    for seed in range(4):
        cache = LUKVCache.from_pretrained(path, ratio=0.5, allocator="threshold", window=1)
        with torch.no_grad():
            model(prompt(1, 100, seed=10 + seed), past_key_values=cache)
        kept.append(float(cache.stored_tokens().double().mean()))
    assert all(5 < k < 100 for k in kept) and len(set(kept)) > 1  # adaptive: not one fixed share
    with pytest.raises(ConfigurationError, match="records no score thresholds"):
        LUKVCache.from_pretrained(
            _profile(_trained(model)).save(tmp_path / "b.safetensors"), 0.5, allocator="threshold"
        )


def test_the_shipped_smollm2_kvzap_profile_holds_a_valid_surrogate_and_thresholds():
    from lukv_cache.profiles.location import BUNDLED_DIR

    profile = Profile.load(BUNDLED_DIR / "HuggingFaceTB/SmolLM2-135M-Instruct/kvzap.safetensors")
    surrogate = profile.surrogate
    assert profile.scorer == "kvzap" and profile.window == 32
    assert surrogate.features == "keys_prerope_values+window_attention+log_length+interactions"
    inputs = 2 * (3 * (2 * 64 + 1)) + 1  # keys, values, window attention; log T; all of them times log T
    assert surrogate.family == "mlp" and tuple(surrogate.hidden_weight.shape) == (30, 128, inputs)
    assert tuple(surrogate.weight.shape) == (30, 3, 128)
    assert surrogate.layers == list(range(30))
    thresholds = surrogate.meta["thresholds"]
    assert thresholds["grid"] == [float(g) for g in profile.grid] or len(thresholds["grid"]) == 99
    assert thresholds["values"] == sorted(thresholds["values"])
    assert "news" in surrogate.meta["corpus"] and surrogate.meta["target"] == "kvzip"


def test_a_kvzap_profile_of_the_previous_release_still_loads_and_scores():
    """SmolLM2's kvzap profile as shipped before the window attention (keys, values, log T and their
    products): it loads unchanged, and its scorer reads no queries."""
    from pathlib import Path

    old = Path(__file__).parent.parent / "data" / "kvzap_smollm2_keys_values_length.safetensors"
    surrogate = Profile.load(old).surrogate
    assert surrogate.features == INTERACTION_FEATURES and tuple(surrogate.weight.shape) == (30, 3, 769)
    assert kvzap_scorer(surrogate).n_queries == 0
    scores = surrogate.predict(5, torch.randn(2, 7, 384), lengths=torch.tensor([7, 900]))
    assert scores.shape == (2, 3, 7) and bool(torch.isfinite(scores).all())


def test_the_linear_window_attention_kvzap_profile_of_the_previous_release_still_loads_and_scores():
    """SmolLM2's kvzap profile as shipped before the MLP (a ridge on keys, values, the window attention,
    log T and their products): it loads unchanged, and its scorer reads the last 32 queries."""
    from pathlib import Path

    old = Path(__file__).parent.parent / "data" / "kvzap_smollm2_linear_window.safetensors"
    surrogate = Profile.load(old).surrogate
    assert surrogate.family == "linear" and surrogate.features == WINDOW_FEATURES
    assert tuple(surrogate.weight.shape) == (30, 3, 775)
    assert kvzap_scorer(surrogate).n_queries == 32
    scores = surrogate.predict(5, torch.randn(2, 7, 387), lengths=torch.tensor([7, 900]))
    assert scores.shape == (2, 3, 7) and bool(torch.isfinite(scores).all())


def test_from_pretrained_prefers_a_models_kvzap_profile_then_keydiff_and_takes_any_allocator(tmp_path):
    model = tiny_model("llama", "sdpa")
    mirror = tmp_path / "mirror" / "org" / "tiny"
    mirror.mkdir(parents=True)
    flat_profile(2, 2, grid=[0.25, 0.5, 0.75], head_dim=16).save(mirror / "keydiff.safetensors")
    keydiff = LUKVCache.from_pretrained("org/tiny", 0.5, local_dir=tmp_path / "mirror")
    assert keydiff.scorer.name == "keydiff" and keydiff.allocator_name == "profile"  # LU-KV's budgets
    _profile(_trained(model)).save(mirror / "kvzap.safetensors")
    cache = LUKVCache.from_pretrained("org/tiny", 0.5, local_dir=tmp_path / "mirror")
    assert (
        cache.scorer.name == "kvzap" and cache.allocator_name == KVZAP_ALLOCATOR
    )  # kvzap's default allocator
    lukv = LUKVCache.from_pretrained("org/tiny", 0.5, local_dir=tmp_path / "mirror", allocator="profile")
    assert lukv.scorer.name == "kvzap" and lukv.allocator_name == "profile"
    with torch.no_grad():
        model(prompt(1, 90, seed=4), past_key_values=cache)
    assert cache.is_compressed


def test_a_learned_scorer_is_known_by_its_abilities_not_its_name(tmp_path, monkeypatch):
    """from_pretrained and saved contexts read what a learned scorer declares (``from_surrogate``,
    ``default_allocator``), never the name ``kvzap``: one registered under another name is bound to its
    profile's surrogate, gets its own default allocator, and saves and loads with its surrogate."""
    import dataclasses

    from lukv_cache import load_cache
    from lukv_cache.scorers import SCORERS, get_scorer

    monkeypatch.setattr(SCORERS, "_items", dict(SCORERS._items))  # undo the registration afterwards

    def other(surrogate, window=32):
        return dataclasses.replace(kvzap_scorer(surrogate, window), name="other", from_surrogate=other)

    SCORERS.add(
        "other",
        dataclasses.replace(
            get_scorer("kvzap"), name="other", from_surrogate=other, default_allocator="uniform"
        ),
    )
    model = tiny_model("llama", "sdpa")
    source = dataclasses.replace(_profile(_trained(model)), scorer="other").save(
        tmp_path / "other.safetensors"
    )
    cache = LUKVCache.from_pretrained(source, 0.5)
    assert cache.scorer.name == "other" and cache.allocator_name == "uniform"
    assert cache.scorer.params["surrogate"] is cache.profile.surrogate
    with torch.no_grad():
        model(prompt(1, 90, seed=4), past_key_values=cache)
    loaded = load_cache(cache.save(tmp_path / "embedded.safetensors"), model)  # the surrogate in the profile
    assert loaded.scorer.name == "other" and loaded.scorer.params["surrogate"] is loaded.profile.surrogate
    alone = LUKVCache(0.5, other(cache.profile.surrogate), allocator="uniform")
    with torch.no_grad():
        model(prompt(1, 90, seed=4), past_key_values=alone)
    again = load_cache(alone.save(tmp_path / "alone.safetensors"), model)  # the surrogate's own tensors
    assert again.scorer.name == "other" and again.scorer.from_surrogate is other
    assert torch.equal(again.scorer.params["surrogate"].weight, cache.profile.surrogate.weight)
    plain = dataclasses.replace(_profile(None), scorer="other").save(tmp_path / "plain.safetensors")
    with pytest.raises(ConfigurationError, match="holds no other surrogate"):
        LUKVCache.from_pretrained(plain, ratio=0.5)


class _WordTokenizer:
    """One id per word: enough to cut a corpus into documents."""

    def encode(self, text, add_special_tokens=False):
        return [hash(w) % 1000 for w in text.split()]


def test_kvzap_training_options_and_corpora_refuse_what_they_cannot_do():
    from lukv_cache.profiling.kvzap import news_documents
    from lukv_cache.profiling.kvzap_options import KVzapTraining

    with pytest.raises(ConfigurationError, match="kvzap length must be one of"):
        KVzapTraining(length="cubic")
    with pytest.raises(ConfigurationError, match="samples and hidden must be positive integers"):
        KVzapTraining(samples=0)
    with pytest.raises(ConfigurationError, match="samples and hidden must be positive integers"):
        KVzapTraining(hidden=0)
    with pytest.raises(ConfigurationError, match="alpha must be a number >= 0"):
        KVzapTraining(alpha=-1.0)
    with pytest.raises(ConfigurationError, match="Unknown kvzap feature set"):
        train_surrogate(tiny_model("llama", "sdpa"), PROMPT, [prompt(1, 48)], features="hidden_states")
    with pytest.raises(
        ConfigurationError, match="The news corpus holds .* documents of 4096 tokens, not 500"
    ):
        news_documents(_WordTokenizer(), 500, 4096)


def test_an_mlp_surrogate_of_no_width_is_refused():
    surrogate = Surrogate.zeros(2, 2, 64, hidden=0)
    surrogate.layers = [0, 1]
    with pytest.raises(ProfileFormatError, match="an MLP of width 0"):
        _profile(surrogate)


def test_a_window_attention_surrogate_is_checked_against_its_own_input_count():
    """2 KV heads x head dim 16: keys and values give 64 features, the window attention 2 more; with the
    length and the products, 129 inputs without it and 133 with it."""
    window_set = WINDOW_FEATURES
    fits = Surrogate.zeros(2, 2, input_size(window_set, base_features(window_set, 2, 16)))
    fits.features, fits.layers = window_set, [0, 1]
    assert fits.num_features == 133
    _profile(fits)  # accepted
    sized_without = Surrogate.zeros(2, 2, input_size(window_set, 64))  # 129: the count of the set without it
    sized_without.features, sized_without.layers = window_set, [0, 1]
    with pytest.raises(ProfileFormatError, match="133 expected"):
        _profile(sized_without)


def test_a_window_attention_surrogate_without_queries_is_a_typed_error():
    model = tiny_model("llama", "sdpa")
    scorer = scorer_for("kvzap", model)  # reads the window attention
    keys, values = torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    with pytest.raises(ConfigurationError, match="none were kept"):
        scorer(
            keys,
            values,
            None,
            layer_idx=0,
            module=model.model.layers[0].self_attn,
            heads=slice(None),
            positions=torch.arange(6)[None],
        )


def _with_thresholds(table) -> Surrogate:
    surrogate = Surrogate.zeros(2, 2, input_size(FEATURES, 64))
    surrogate.layers = [0, 1]
    surrogate.meta["thresholds"] = table
    return surrogate


_GOOD_TABLE = {"grid": [0.25, 0.5, 0.75], "values": [-3.0, -2.0, -1.0]}


@pytest.mark.parametrize(
    "table",
    [
        {"grid": [0.25, 0.5, 0.75], "values": [-3.0, float("nan"), -1.0]},  # NaN
        {"grid": [0.75, 0.5, 0.25], "values": [-3.0, -2.0, -1.0]},  # decreasing grid
        {"grid": [0.25, 0.5, 0.75], "values": [-3.0, float("inf"), -1.0]},
        {"grid": [0.0, 0.5, 1.0], "values": [-3.0, -2.0, -1.0]},  # the grid outside (0, 1)
        {"grid": [0.25, 0.5, 1.5], "values": [-3.0, -2.0, -1.0]},
        {"grid": [0.25, 0.5, 0.75], "values": [True, False, True]},  # bools
        {"grid": [True, 0.5, 0.75], "values": [-3.0, -2.0, -1.0]},
        {"grid": [0.25, 0.5, 0.75], "values": [-1.0, -2.0, -3.0]},  # decreasing with the ratio
        {"grid": [0.25, 0.5, 0.75], "values": [-3.0, -2.0]},  # lengths differ
        {"grid": [0.25, 0.5, 0.75], "values": [-3.0, None, -1.0]},  # nulls
        {"grid": [0.25, 0.5, 0.75], "values": ["-3", "-2", "-1"]},  # strings
        {"grid": [0.25, 0.5, 0.75], "values": [[-3.0], [-2.0], [-1.0]]},  # nested lists
        {"grid": [0.25, 0.5, 0.75]},  # no values
        {"grid": [], "values": []},
        {"grid": "0.5", "values": "-1"},
        [0.25, 0.5],  # not a table
    ],
)
def test_a_kvzap_profiles_thresholds_table_is_validated_on_load(table):
    data = _profile(_with_thresholds(_GOOD_TABLE)).to_bytes()
    assert Profile.from_bytes(data).surrogate.meta["thresholds"] == _GOOD_TABLE
    with pytest.raises(ProfileFormatError, match="thresholds") as err:
        _profile(_with_thresholds(table))
    assert err.value.field == "kvzap.thresholds"
    from safetensors.numpy import load, save

    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    metadata = header["__metadata__"]
    meta = json.loads(metadata["kvzap"])
    meta["meta"]["thresholds"] = table
    metadata["kvzap"] = json.dumps(meta)  # NaN and Infinity as json writes them
    with pytest.raises(ProfileFormatError, match="thresholds"):
        Profile.from_bytes(save(load(data), metadata=metadata))


def test_the_threshold_allocator_reads_thresholds_that_grow_with_the_ratio():
    """A higher ratio keeps fewer tokens, so its threshold is higher: the allocator interpolates the table
    and a row at a higher ratio keeps no more than one at a lower ratio."""
    from lukv_cache.allocation import AllocationRequest
    from lukv_cache.allocation.builtin import threshold

    profile = _profile(_with_thresholds({"grid": [0.25, 0.5, 0.75], "values": [-1.0, 0.0, 1.0]}))
    allocate = threshold(profile=profile)
    scores = torch.linspace(-2, 2, 200).view(1, 1, 1, 200).expand(1, 2, 2, 200).contiguous()
    req = AllocationRequest(
        scores, torch.tensor([200, 200]), torch.tensor([0.25, 0.75], dtype=torch.float64), (0,), 1, 0.0
    )
    counts = allocate(req)[0]  # [B, H]
    assert (counts[0] > counts[1]).all()
    assert counts[0, 0] == int((torch.linspace(-2, 2, 200) >= -1.0).sum())


@pytest.mark.parametrize("value", [np.float32(0.5), np.float64(0.5), torch.tensor(0.5), np.int64(0)])
def test_the_threshold_allocators_value_takes_numpy_and_0d_torch_numbers(value):
    from lukv_cache.allocation.builtin import threshold

    threshold(value=value)


@pytest.mark.parametrize(
    "value", [True, np.bool_(True), float("nan"), np.float32("nan"), torch.tensor(True), torch.ones(2), "1"]
)
def test_the_threshold_allocators_value_refuses_bools_nan_and_non_numbers(value):
    from lukv_cache.allocation.builtin import threshold

    with pytest.raises(ConfigurationError, match="value must be a number"):
        threshold(value=value)


def test_a_deep_copied_cache_shares_its_read_only_kvzap_surrogate():
    """The copy-per-question recipe deep-copies a filled cache for every question: the surrogate (12 MiB
    for SmolLM2) is read-only and shared by every copy, not duplicated."""
    import copy

    model = tiny_model("llama", "sdpa")
    scorer = scorer_for("kvzap", model)
    cache = LUKVCache(0.5, scorer, sink=4, window=1)
    with torch.no_grad():
        model(prompt(1, 80, seed=6), past_key_values=cache)
    clone = copy.deepcopy(cache)
    original, copied = scorer.params["surrogate"], clone.scorer.params["surrogate"]
    for name, tensor in original.tensors().items():
        assert copied.tensors()[name].data_ptr() == tensor.data_ptr(), name
    assert copy.deepcopy(original) is original
    with torch.no_grad():  # the copy still works on its own
        model(prompt(1, 3, seed=7), past_key_values=clone)


def _scorer_call(scorer, model, keys, values, layer_idx=0, heads=slice(None)):
    t = keys.shape[2]
    return scorer(
        keys,
        values,
        torch.randn(1, 4, min(t, 32), keys.shape[-1]),
        layer_idx=layer_idx,
        module=model.model.layers[min(layer_idx, 1)].self_attn,
        heads=heads,
        positions=torch.arange(t)[None],
    )


def test_a_surrogate_whose_width_does_not_fit_the_model_is_a_typed_error_at_the_first_forward():
    """A surrogate built for another head dim (or a profile with head_dim null, which skips the check on
    load) names the layer, the inputs it expects and the ones the model gives."""
    model = tiny_model("llama", "sdpa")  # 2 KV heads x head dim 16
    features = WINDOW_FEATURES
    wrong = Surrogate.zeros(2, 2, input_size(features, base_features(features, 2, 32)))
    wrong.features, wrong.layers = features, [0, 1]
    scorer = kvzap_scorer(wrong)
    keys, values = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    with pytest.raises(ConfigurationError, match=r"layer 0.*261 inputs.*133"):
        _scorer_call(scorer, model, keys, values)
    cache = LUKVCache(0.5, scorer, sink=4, window=1)
    with pytest.raises(ConfigurationError, match="layer 0"), torch.no_grad():
        model(prompt(1, 60, seed=1), past_key_values=cache)
    profile = flat_profile(
        2, 2, grid=[0.5], scorer="kvzap", head_dim=None, window=1, surrogate=wrong
    )  # head_dim null: no width check on load
    cache = LUKVCache(0.5, kvzap_scorer(profile.surrogate), sink=4, window=1)
    with pytest.raises(ConfigurationError, match="layer 0"), torch.no_grad():
        model(prompt(1, 60, seed=1), past_key_values=cache)


def test_a_surrogate_with_too_few_layers_or_heads_is_a_typed_error():
    model = tiny_model("llama", "sdpa")
    features = WINDOW_FEATURES
    width = input_size(features, base_features(features, 2, 16))
    keys, values = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    one_layer = Surrogate.zeros(1, 2, width)
    one_layer.features, one_layer.layers = features, [0]
    with pytest.raises(ConfigurationError, match="layer 1.*1 layer"):
        _scorer_call(kvzap_scorer(one_layer), model, keys, values, layer_idx=1)
    one_head = Surrogate.zeros(2, 1, width)
    one_head.features, one_head.layers = features, [0, 1]
    with pytest.raises(ConfigurationError, match="layer 0.*KV head"):
        _scorer_call(kvzap_scorer(one_head), model, keys, values)


def test_a_surrogate_that_predicts_non_finite_scores_says_which_layer():
    model = tiny_model("llama", "sdpa")
    scorer = scorer_for("kvzap", model)
    surrogate = scorer.params["surrogate"]
    surrogate.weight[1].fill_(3e38)  # finite, but its products overflow
    keys, values = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    assert bool(torch.isfinite(_scorer_call(scorer, model, keys, values, layer_idx=0)).all())
    with pytest.raises(ConfigurationError, match="layer 1.*non-finite"):
        _scorer_call(scorer, model, keys, values, layer_idx=1)


def test_a_thresholds_table_edited_after_loading_is_refused_by_the_allocator():
    from lukv_cache.allocation.builtin import threshold

    profile = _profile(_with_thresholds({"grid": [0.25, 0.5, 0.75], "values": [-1.0, 0.0, 1.0]}))
    profile.surrogate.meta["thresholds"] = {"grid": [0.25, 0.5, 0.75], "values": [1.0, 0.0, float("nan")]}
    with pytest.raises(ConfigurationError, match="score thresholds must be finite"):
        threshold(profile=profile)


def test_feature_sets_are_read_back_by_the_names_profiles_store():
    from lukv_cache.scorers.kvzap import FEATURE_SETS, FeatureSet

    assert [FeatureSet.named(name).name for name in FEATURE_SETS] == list(FEATURE_SETS)
    assert FeatureSet.named(WINDOW_FEATURES).window_attention and FeatureSet.named(FEATURES).length == "none"
    with pytest.raises(ConfigurationError, match="Unknown kvzap feature set"):
        FeatureSet.named("keys_prerope_values+log")
    with pytest.raises(ConfigurationError, match="length"):
        FeatureSet(length="sqrt")


@pytest.mark.parametrize(
    "window, length", [(False, "none"), (False, "log"), (False, "interactions"), (True, "interactions")]
)
def test_the_build_options_name_a_known_feature_set(window, length):
    from lukv_cache.scorers.kvzap import FEATURE_SETS, reads_window

    features = KVzapTraining(window_attention=window, length=length).features
    assert features in FEATURE_SETS and reads_window(features) == window
