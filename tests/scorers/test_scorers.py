"""Each built-in scorer ranks a hand-built case the way its paper says, and the cache feeds scorers the
prefill keys and the post-RoPE queries of the last prefill tokens."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model
from transformers import AttentionInterface, DynamicCache

from lukv_cache import LUKVCache, Scorer, UnknownNameError, get_scorer, lukv_aware, register_scorer
from lukv_cache.cache.storage.layer import LUKVLayer
from lukv_cache.errors import ConfigurationError
from lukv_cache.profiling import prefill_scores
from lukv_cache.scorers import SCORERS
from lukv_cache.testing import prompt

T, D = 40, 16
BUILTINS = ("streaming", "knorm", "keydiff", "snapkv", "expected_attention", "tova", "random")


def generator(seed=0):
    return torch.Generator().manual_seed(seed)


def unit(vector: torch.Tensor) -> torch.Tensor:
    return vector / vector.norm()


def noise(*shape, scale=0.1, seed=0):
    return torch.randn(*shape, generator=generator(seed)) * scale


def top(scores: torch.Tensor, k: int = 1) -> set[int]:
    return set(scores.flatten().topk(k).indices.tolist())


@pytest.mark.parametrize("name", BUILTINS)
def test_every_builtin_scorer_returns_one_score_per_cached_token(name):
    scorer = get_scorer(name)
    b, hkv, hq = 2, 2, 4
    keys, values = noise(b, hkv, T, D, scale=1.0), noise(b, hkv, T, D, scale=1.0, seed=1)
    queries = noise(b, hq, max(scorer.n_queries, 1), D, scale=1.0, seed=2) if scorer.n_queries else None
    scores = scorer(keys, values, queries)
    assert scores.shape == (b, hkv, T)
    assert torch.isfinite(scores).all()


def test_knorm_keeps_the_key_with_the_smallest_norm():
    keys = unit(torch.ones(D)).repeat(1, 1, T, 1) * 10 + noise(1, 1, T, D)
    keys[0, 0, 17] = keys[0, 0, 17] / 100
    assert top(get_scorer("knorm")(keys, keys, None)) == {17}


def test_keydiff_keeps_the_key_least_aligned_with_the_mean_key():
    direction = unit(torch.arange(1.0, D + 1))
    keys = direction.repeat(1, 1, T, 1) * torch.linspace(1, 5, T).view(1, 1, T, 1) + noise(1, 1, T, D)
    keys[0, 0, 9] = -direction * 2  # points away from the others: most distinct
    keys[0, 0, 30] = unit(torch.randn(D, generator=generator(3)))  # random direction: second
    scores = get_scorer("keydiff")(keys, keys, None)
    assert top(scores) == {9}
    assert top(scores, 2) == {9, 30}
    # a key's norm does not matter, only its direction
    scaled = keys.clone()
    scaled[0, 0, 20] *= 10
    torch.testing.assert_close(get_scorer("keydiff")(scaled, scaled, None)[0, 0, 20], scores[0, 0, 20])


def _attending(position: int, hq: int, w: int, keys: torch.Tensor, strength: float = 30.0) -> torch.Tensor:
    """Queries ``[1, hq, w, D]`` that all point at ``keys[..., position, :]``."""
    target = unit(keys[0, 0, position])
    return (target * strength).repeat(1, hq, w, 1) + noise(1, hq, w, D, seed=5)


def test_snapkv_keeps_a_cluster_around_what_the_observation_window_attends_to():
    keys = noise(1, 1, T, D, scale=1.0, seed=6)
    queries = _attending(12, hq=2, w=8, keys=keys)
    scores = get_scorer("snapkv")(keys, keys, queries, kernel_size=5)
    # pooling over 5 tokens: the attended token and its two neighbours on each side come first
    assert top(scores, 5) == {10, 11, 12, 13, 14}
    no_pool = get_scorer("snapkv")(keys, keys, queries, kernel_size=1)
    assert top(no_pool) == {12}


def test_snapkv_declares_its_observation_window_and_protects_it():
    scorer = get_scorer("snapkv")
    assert scorer.n_queries == 32 and scorer.window == 32
    assert LUKVCache(0.5, "snapkv").window == 32


def test_tova_keeps_what_the_last_query_attends_to_not_earlier_queries():
    keys = noise(1, 1, T, D, scale=1.0, seed=7)
    queries = _attending(25, hq=2, w=4, keys=keys)
    queries[:, :, -1] = _attending(8, hq=2, w=1, keys=keys)[:, :, 0]
    scores = get_scorer("tova")(keys, keys, queries)
    assert top(scores) == {8}
    assert get_scorer("tova").n_queries == 1


def test_expected_attention_keeps_keys_with_a_high_expected_logit():
    keys = noise(1, 1, T, D, scale=1.0, seed=8)
    values = torch.ones(1, 1, T, D)
    queries = _attending(31, hq=2, w=16, keys=keys, strength=10.0)
    scores = get_scorer("expected_attention")(keys, values, queries)
    assert top(scores) == {31}


def test_expected_attention_prefers_the_larger_value_norm_when_logits_tie():
    keys = torch.zeros(1, 1, T, D)  # every key gets the same expected logit
    values = torch.ones(1, 1, T, D)
    values[0, 0, 5] *= 3.0
    queries = noise(1, 2, 16, D, scale=1.0, seed=9)
    scores = get_scorer("expected_attention")(keys, values, queries)
    assert top(scores) == {5}


def test_streaming_keeps_the_most_recent_tokens():
    keys = noise(2, 3, T, D, scale=1.0)
    scores = get_scorer("streaming")(keys, keys, None)
    assert top(scores[1, 2], 5) == set(range(T - 5, T))


def test_random_scorer_is_deterministic_for_a_seed_and_changes_with_it():
    keys = noise(2, 2, T, D, scale=1.0)
    scorer = get_scorer("random")
    assert torch.equal(scorer(keys, keys, None), scorer(keys, keys, None))
    assert not torch.equal(scorer(keys, keys, None), scorer(keys, keys, None, seed=1))


def test_streaming_cache_keeps_sinks_and_the_most_recent_tokens():
    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 50, seed=10)
    cache = LUKVCache(0.8, "streaming", sink=4)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    kept = round(0.2 * (50 - 4 - 1))
    expected = list(range(4)) + list(range(49 - kept, 49))
    for layer in cache.layers:
        bounds = layer.store.offsets.tolist()
        for head in range(2):
            assert layer.store.positions[bounds[head] : bounds[head + 1]].tolist() == expected
        assert layer.suffix_keys.shape[2] == 1  # the protected window: the last prompt token


def _record_queries(monkeypatch) -> dict[int, torch.Tensor]:
    """The post-RoPE queries each layer's attention receives (a DynamicCache run: nothing is tagged)."""
    seen: dict[int, torch.Tensor] = {}
    stock = AttentionInterface._global_mapping["sdpa"]

    def attention(module, query, *args, **kwargs):
        seen[module.layer_idx] = query.detach().clone()
        return stock(module, query, *args, **kwargs)

    # delegates to lukv's routing: the guard must let it be
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", lukv_aware(attention))
    return seen


@pytest.mark.parametrize("name", ["keydiff", "knorm", "snapkv", "tova", "expected_attention"])
def test_cache_scores_prefill_keys_and_last_post_rope_queries(monkeypatch, name):
    model = tiny_model("qwen3", "sdpa")
    ids = prompt(1, 70, seed=11)
    full = DynamicCache(config=model.config)
    queries = _record_queries(monkeypatch)
    with torch.no_grad():
        model(ids, past_key_values=full)
    monkeypatch.undo()
    recorded = prefill_scores(model, ids, name)
    scorer = get_scorer(name)
    for idx, layer in enumerate(full.layers):
        q = queries[idx][:, :, -scorer.n_queries :] if scorer.n_queries else None
        expected = scorer(layer.keys, layer.values, q).float()
        torch.testing.assert_close(recorded[idx], expected, atol=1e-5, rtol=1e-5)


def test_register_scorer_makes_a_name_usable_by_the_cache(monkeypatch):
    def value_norm(keys, values, queries):
        return values.float().norm(dim=-1)

    monkeypatch.setattr(SCORERS, "_items", dict(SCORERS._items))  # undo the registration afterwards
    register_scorer("test_vnorm", value_norm, window=2)
    scorer = get_scorer("test_vnorm")
    assert isinstance(scorer, Scorer) and scorer.window == 2
    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(0.5, "test_vnorm")
    with torch.no_grad():
        model(prompt(1, 30), past_key_values=cache)
    assert all(isinstance(layer, LUKVLayer) and layer.suffix_keys.shape[2] == 2 for layer in cache.layers)
    with pytest.raises(ConfigurationError, match="already registered"):
        register_scorer("test_vnorm", value_norm)
    register_scorer("test_vnorm", value_norm, window=3, overwrite=True)
    assert get_scorer("test_vnorm").window == 3


def test_a_scorer_declared_not_to_read_values_is_checked_at_registration(monkeypatch):
    monkeypatch.setattr(SCORERS, "_items", dict(SCORERS._items))  # undo the registrations afterwards
    register_scorer("test_knorm", lambda k, v, q: -k.float().norm(dim=-1), reads_values=False)
    assert not get_scorer("test_knorm").reads_values
    with pytest.raises(ConfigurationError, match="reads_values=False"):  # it reads them: crashes on None
        register_scorer("test_vnorm_crash", lambda k, v, q: v.float().norm(dim=-1), reads_values=False)
    with pytest.raises(ConfigurationError, match="reads_values=False"):  # reads them when given only
        register_scorer(
            "test_vnorm_quiet",
            lambda k, v, q: k.float().sum(-1) if v is None else v.float().sum(-1),
            reads_values=False,
        )
    assert "test_vnorm_crash" not in SCORERS and "test_vnorm_quiet" not in SCORERS
    for name in ("keydiff", "snapkv", "tova", "knorm", "streaming", "random"):  # and declared right
        assert not get_scorer(name).reads_values, name
    assert get_scorer("expected_attention").reads_values


def test_unknown_scorer_error_lists_the_known_names():
    with pytest.raises(UnknownNameError) as info:
        get_scorer("snapkvv")
    for name in BUILTINS:
        assert name in str(info.value)


def test_from_pretrained_with_another_scorer_than_the_profiles_warns_that_it_reuses_the_budgets(tmp_path):
    from lukv_cache.testing import flat_profile

    path = flat_profile(2, 2).save(tmp_path / "keydiff.safetensors")
    with pytest.warns(
        UserWarning, match="built for scorer 'keydiff'; its budgets are used with scorer 'snapkv'"
    ):
        cache = LUKVCache.from_pretrained(path, ratio=0.5, scorer="snapkv")
    assert cache.scorer.name == "snapkv"


@pytest.mark.parametrize("scorer", [None, "keydiff"])
def test_from_pretrained_with_the_profiles_own_scorer_does_not_warn(tmp_path, scorer):
    import warnings

    from lukv_cache.testing import flat_profile

    path = flat_profile(2, 2).save(tmp_path / "keydiff.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache = LUKVCache.from_pretrained(path, ratio=0.5, scorer=scorer)
    assert cache.scorer.name == "keydiff"
