"""The compressor a cache owns (``cache.compressor``): observers see every eviction and fold with its
layers and seconds, a fork reports to the same observers, and every compressed layer is built with its
policy's settings, which no forward rewrites afterwards."""

from __future__ import annotations

import torch
from helpers import tiny_model

from lukv_cache import LUKVCache
from lukv_cache.cache.compression.compressor import CompressionStep
from lukv_cache.cache.layers.factory import LayerFactory
from lukv_cache.cache.storage.layer import LUKVLayer
from lukv_cache.testing import prompt


def _decode(model, cache: LUKVCache, ids: torch.Tensor, new_tokens: int) -> None:
    with torch.no_grad():
        model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False)


def test_observers_see_each_prompt_eviction_and_each_fold_with_its_layers_and_seconds():
    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(decode_max_tokens=24, fold_interval=8, config=model.config)
    steps: list[CompressionStep] = []
    assert cache.compressor.observe(steps.append) == steps.append
    _decode(model, cache, prompt(1, 40, seed=3), new_tokens=17)  # 16 decoded tokens reach the cache: 2 folds
    layers = tuple(range(model.config.num_hidden_layers))
    assert [(step.kind, step.layers) for step in steps if step.kind == "fold"] == [("fold", layers)] * 2
    assert sorted(i for step in steps if step.kind == "evict" for i in step.layers) == list(layers)
    assert all(step.seconds > 0 for step in steps)


def test_a_fork_reports_to_the_same_observers_from_a_list_of_its_own():
    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(decode_max_tokens=24, fold_interval=8, config=model.config)
    _decode(model, cache, prompt(1, 40, seed=4), new_tokens=1)
    steps: list[CompressionStep] = []
    cache.compressor.observe(steps.append)
    fork = cache.fork()
    assert fork.compressor.cache is fork and fork.compressor.observers == [steps.append]
    assert fork.compressor.observers is not cache.compressor.observers
    ids = prompt(1, 8, seed=5)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=fork, use_cache=True)  # 8 tokens after the prompt: a fold
    assert [step.kind for step in steps] == ["fold"]  # the fork's fold, seen by the observer
    assert cache.get_seq_length() == 40  # the cache itself did not move


def test_every_compressed_layer_is_built_with_the_policys_settings():
    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(decode_max_tokens=32, fold_interval=8, kv_bits=8, config=model.config)
    expected = LayerFactory.for_policy(cache.policy)
    assert (expected.kv_bits, expected.fold_at, expected.bounded) == (8, 8 + cache.window, True)
    layers = [layer for layer in cache.layers if isinstance(layer, LUKVLayer)]
    assert layers  # before any forward
    for layer in layers:
        assert (layer.kv_bits, layer.fold_at, layer.bounded) == (8, expected.fold_at, True)
    # without config=: the layers DynamicCache grows come from the same factory
    grown = LUKVCache(fold_interval=12).layer_class_to_replicate()
    assert isinstance(grown, LUKVLayer) and (grown.kv_bits, grown.fold_at, grown.bounded) == (None, 12, False)


def test_a_forward_does_not_rewrite_a_layers_settings():
    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(ratio=0.5, fold_interval=8, config=model.config)
    layer = cache.layers[0]
    layer.fold_at = 5  # anything else than the policy's: a forward must leave it
    with torch.no_grad():
        model(input_ids=prompt(1, 20, seed=6), past_key_values=cache, use_cache=True)
    assert cache.layers[0] is layer and layer.fold_at == 5
    assert cache.layers[1].fold_at == 8
