"""``output_attentions=True`` over a compressed LUKVCache: the eager attention returns its weights over the
logical key positions (``[B, Hq, Q, K]``, K the mask's last dimension), the kept tokens' weights in their
original columns and zeros for the evicted ones, on every decode step as on the prefill."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model
from sink_models import tiny_gpt_oss
from transformers import DynamicCache

from lukv_cache import LUKVCache
from lukv_cache.attention import routing
from lukv_cache.testing import left_padded, prompt


def _generate(model, ids, mask, cache, new_tokens=8, **kwargs):
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=new_tokens,
            do_sample=False,
            output_attentions=True,
            output_logits=True,
            return_dict_in_generate=True,
            **kwargs,
        )


def _spy_stores(monkeypatch):
    """Each call of the routed compressed attention: the store it read and the suffix length."""
    seen = []
    real = routing.compressed_attention

    def spy(store, query, key, *args, **kwargs):
        seen.append((store, key.shape[-2]))
        return real(store, query, key, *args, **kwargs)

    monkeypatch.setattr(routing, "compressed_attention", spy)
    return seen


@pytest.mark.parametrize("arch", ["llama", "gpt_oss", "gemma2"])
def test_ratio_zero_attentions_equal_dynamic_cache_on_every_step(arch):
    """Left-padded batch of 2, eager: every step's attentions (prefill and decode) are DynamicCache's:
    same shapes, same weights (GPT-OSS: the sinks' share left out, so rows sum to less than 1; Gemma 2:
    soft-capped logits). A compressed sliding layer's decode weights cover every logical position, as a
    full layer's do: transformers' sliding layer's are its last columns, and the ones before are zero."""
    model = tiny_gpt_oss("eager") if arch == "gpt_oss" else tiny_model(arch, attn="eager")
    ids, mask = left_padded((20, 13))
    ref = _generate(model, ids, mask, DynamicCache(config=model.config))
    cache = LUKVCache(0.0)
    got = _generate(model, ids, mask, cache)
    assert cache.is_compressed
    assert torch.equal(got.sequences, ref.sequences)
    assert len(got.attentions) == len(ref.attentions) == 8
    for step, (ours, theirs) in enumerate(zip(got.attentions, ref.attentions)):
        assert len(ours) == len(theirs) == model.config.num_hidden_layers, step
        for layer, (a, b) in enumerate(zip(ours, theirs)):
            if a.shape != b.shape and cache.layers[layer].sliding_window is not None and step:
                assert a.shape[:-1] == b.shape[:-1] and a.shape[-1] > b.shape[-1], (step, layer)
                assert not a[..., : -b.shape[-1]].any(), (step, layer)  # older than the window
                a = a[..., -b.shape[-1] :]
            assert a.shape == b.shape, (step, layer)
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=f"step {step} layer {layer}")
    # The first decode step's first layer sees exactly DynamicCache's inputs: a full-attention one's weights
    # are the same bits (the layers after it differ by an ulp because the compressed attention's output
    # does; a compressed sliding layer's softmax runs over every logical column, so it is close, not equal)
    if arch == "llama":
        assert torch.equal(got.attentions[1][0], ref.attentions[1][0])
    if arch == "gpt_oss":
        assert bool((got.attentions[-1][1].sum(-1) < 0.99).any())  # the sinks took their share


def test_ratio_half_attentions_cover_the_logical_positions(monkeypatch):
    """At ratio 0.5 every decode step returns ``[B, Hq, 1, K]`` per layer, K the logical length; rows sum
    to 1 (no sink), the evicted columns (and the padding) are zero, the kept ones are not."""
    model = tiny_model("llama", attn="eager")
    ids, mask = left_padded((30, 21))
    seen = _spy_stores(monkeypatch)
    cache = LUKVCache(0.5)
    got = _generate(model, ids, mask, cache)
    layers, hq = model.config.num_hidden_layers, model.config.num_attention_heads
    h = model.config.num_key_value_heads
    g = hq // h
    assert len(seen) == 7 * layers  # every decode step of every layer read the store
    for step, attentions in enumerate(got.attentions[1:], start=1):
        k_len = ids.shape[1] + step
        assert len(attentions) == layers
        for layer, weights in enumerate(attentions):
            assert weights.shape == (2, hq, 1, k_len), (step, layer)
            torch.testing.assert_close(weights.sum(-1), torch.ones(2, hq, 1), atol=1e-5, rtol=0)
            store, suffix = seen[(step - 1) * layers + layer]
            bounds = store.offsets_list
            for row in range(2):
                for kv in range(h):
                    kept = torch.zeros(k_len, dtype=torch.bool)
                    kept[store.positions[bounds[row * h + kv] : bounds[row * h + kv + 1]].long()] = True
                    kept[k_len - suffix :] = True
                    assert int(kept.sum()) < k_len  # something was evicted
                    block = weights[row, kv * g : (kv + 1) * g, 0]  # [G, K]
                    assert bool((block[:, ~kept] == 0).all()), (step, layer, row, kv)
                    assert bool((block[:, kept] > 0).all()), (step, layer, row, kv)
    # the padding is never attended
    pad = 30 - 21
    assert all(bool((a[1, :, :, :pad] == 0).all()) for step in got.attentions[1:] for a in step)


def test_sdpa_still_returns_no_weights(monkeypatch):
    """transformers' sdpa returns no weights; over a compressed cache neither does lukv's (no error)."""
    model = tiny_model("llama", attn="sdpa")
    ids = prompt(batch=2, length=20)
    ref = _generate(model, ids, None, DynamicCache(config=model.config), new_tokens=4)
    got = _generate(model, ids, None, LUKVCache(0.5), new_tokens=4)
    assert [len(step) for step in got.attentions] == [len(step) for step in ref.attentions]


def test_weights_are_computed_only_when_asked(monkeypatch):
    """The plain decode path does not build the weights."""
    from lukv_cache.attention import compressed

    calls = []
    real = compressed.attention_weights
    monkeypatch.setattr(compressed, "attention_weights", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny_model("llama", attn="eager")
    ids = prompt(batch=2, length=20)
    with torch.no_grad():
        model.generate(ids, past_key_values=LUKVCache(0.5), max_new_tokens=4, do_sample=False)
    assert calls == []
    _generate(model, ids, None, LUKVCache(0.5), new_tokens=4)
    assert len(calls) == 3 * model.config.num_hidden_layers
    # a config that asks for them (no kwarg) is heard too
    calls.clear()
    model.config.output_attentions = True
    try:
        with torch.no_grad():
            out = model(ids[:, :1], past_key_values=_prefilled(model, ids))
    finally:
        model.config.output_attentions = False
    assert len(calls) == model.config.num_hidden_layers
    assert out.attentions[0].shape == (2, model.config.num_attention_heads, 1, 21)


def _prefilled(model, ids):
    cache = LUKVCache(0.5)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    assert cache.is_compressed
    return cache


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_prompt_lookup_decoding_with_output_attentions(ratio):
    """Prompt-lookup (assisted) decoding slices the attentions of its multi-token verification forwards:
    with the weights there it runs; at ratio 0 it gives DynamicCache's tokens and attentions' shapes."""
    model = tiny_model("llama", attn="eager")
    ids = prompt(batch=1, length=30, seed=2)
    ids[0, 20:30] = ids[0, 5:15]  # a repeat for the lookup to find
    got = _generate(model, ids, None, LUKVCache(ratio), new_tokens=10, prompt_lookup_num_tokens=3)
    assert got.sequences.shape == (1, 40)
    assert all(len(step) == model.config.num_hidden_layers for step in got.attentions)
    for attentions in got.attentions:
        for weights in attentions:
            assert weights.shape[:2] == (1, model.config.num_attention_heads)
            torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]), atol=1e-5, rtol=0)
    if ratio == 0.0:
        ref = _generate(
            model, ids, None, DynamicCache(config=model.config), new_tokens=10, prompt_lookup_num_tokens=3
        )
        assert torch.equal(got.sequences, ref.sequences)
        assert [a[0].shape for a in got.attentions] == [a[0].shape for a in ref.attentions]
        for ours, theirs in zip(got.attentions, ref.attentions):
            for a, b in zip(ours, theirs):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("q_len", [1, 3])
def test_weights_times_values_is_the_compressed_attention(softcap, sinks, q_len):
    """Unit check: the weights, applied to the values laid out at their logical columns, give what
    compressed_attention gives (sinks, softcap, a mask hiding stored tokens, causal query tokens)."""
    from sink_models import sink_case
    from test_attention_sinks import _causal_mask

    from lukv_cache.attention.compressed import attention_weights, compressed_attention

    store, query, sk, sv, s_aux, length = sink_case([30, 7, 0, 12], heads=2, q_len=q_len, seed=5)
    s_aux = s_aux if sinks else None
    mask = _causal_mask(2, q_len, length, [(0, int(store.positions[2])), (1, int(store.positions[40]))])
    weights = attention_weights(store, query, sk, mask, 0.25, softcap, s_aux=s_aux)
    assert weights.shape == (2, 4, q_len, length)
    values = torch.zeros(2 * 2, length, 16)
    seg = store.segment_ids()
    values[seg, store.positions.long()] = store.values
    values[:, length - sk.shape[-2] :] = sv.flatten(0, 1)
    values = values.view(2, 2, 1, length, 16).expand(-1, -1, 2, -1, -1).reshape(2, 4, length, 16)
    out = compressed_attention(store, query, sk, sv, mask, 0.25, softcap, s_aux=s_aux)
    torch.testing.assert_close((weights @ values).transpose(1, 2), out, atol=1e-5, rtol=1e-5)
    present = torch.zeros(2 * 2, length, dtype=torch.bool)
    present[seg, store.positions.long()] = True
    present[:, length - sk.shape[-2] :] = True
    present = present.view(2, 2, 1, 1, length).expand(-1, -1, 2, q_len, -1).reshape(weights.shape)
    assert bool((weights[~present] == 0).all())
    sums = weights.sum(-1)
    if sinks:  # the sinks' share is left out: every row sums to less than 1, some to much less
        assert bool((sums < 1).all()) and bool((sums < 0.5).any())
    else:
        torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-5, rtol=0)
