"""Learned attention sinks (``s_aux``: GPT-OSS and the models that copy it) in the compressed attention.

A sink is one logit per query head added to the softmax's denominator with no value. After the prefill
the prompt lives in the ragged store, so every decode step of a full-attention layer goes through
``compressed_attention``, which must honour it on every path (masked product, tiles, parts and merge).
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import greedy_with_logits
from sink_models import dense_reference, sink_case, tiny_gpt_oss
from transformers import DynamicCache

from lukv_cache import LUKVCache
from lukv_cache.attention import compressed, masked, partial, routing, tiles
from lukv_cache.testing import left_padded, prompt


def _spy_compressed(monkeypatch):
    """Record every call of the routed compressed attention (its arguments and its output)."""
    calls = []
    real = routing.compressed_attention

    def spy(store, query, key, value, mask, scale, softcap=None, **kwargs):
        out = real(store, query, key, value, mask, scale, softcap, **kwargs)
        calls.append((store, query, key, value, mask, scale, softcap, kwargs.get("s_aux"), out))
        return out

    monkeypatch.setattr(routing, "compressed_attention", spy)
    return calls


def test_the_tiny_model_sinks_matter():
    """The test model is one where dropping the sinks shows: its logits move by far more than 1e-5."""
    model = tiny_gpt_oss()
    ids, mask = left_padded((20, 13))
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        saved = [layer.self_attn.sinks.clone() for layer in model.model.layers]
        try:
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(float("-inf"))  # exp(-inf) = 0: no sink
            without = model(ids, attention_mask=mask).logits
        finally:
            for layer, sinks in zip(model.model.layers, saved):
                layer.self_attn.sinks.copy_(sinks)
    assert (logits - without)[mask.bool()].abs().max() > 0.05


def test_ratio_zero_decodes_like_dynamic_cache(monkeypatch):
    """GPT-OSS (sliding and full layers, GQA, sinks), batch 2 with left padding, eager: LUKVCache(0.0)
    gives DynamicCache's logits on every one of 12 greedy steps (both layers' decode steps read the
    compressed store, each with its own sinks: the sliding layer is compressed too, sliding="compress")."""
    model = tiny_gpt_oss("eager")
    ids, mask = left_padded((20, 13))
    ref_seq, ref_logits = greedy_with_logits(
        model, ids, DynamicCache(config=model.config), 12, attention_mask=mask
    )
    calls = _spy_compressed(monkeypatch)
    cache = LUKVCache(0.0)
    seq, logits = greedy_with_logits(model, ids, cache, 12, attention_mask=mask)
    assert cache.is_compressed
    assert len(calls) == 22  # both layers, every decode step after the prefill
    sinks = [layer.self_attn.sinks for layer in model.model.layers]
    assert [call[7] for call in calls[:2]] == sinks and all(
        call[7] is sinks[i % 2] for i, call in enumerate(calls)
    )
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)


def test_sdpa_routed_compressed_attention_honours_the_sinks():
    """``attn_implementation='lukv'`` (the sdpa-routed wrapper; GPT-OSS refuses plain 'sdpa', whose stock
    function has no sinks) honours ``s_aux`` over the compressed store too: an all-full-attention GPT-OSS
    prefilled with eager and decoded through the sdpa route matches eager decoding over a DynamicCache."""
    layer_types = ("full_attention", "full_attention")
    ids, mask = left_padded((20, 13))

    def run(cache, decode_attn):
        model = copy.deepcopy(tiny_gpt_oss("eager", layer_types))
        am, pos = mask.clone(), (mask.cumsum(-1) - 1).clamp_min(0)
        steps = []
        with torch.no_grad():
            out = model(ids, attention_mask=am, position_ids=pos, past_key_values=cache)
            model.set_attn_implementation(decode_attn)
            for _ in range(8):
                steps.append(out.logits[:, -1])
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                am = torch.cat([am, torch.ones_like(token)], dim=-1)
                pos = pos[:, -1:] + 1
                out = model(token, attention_mask=am, position_ids=pos, past_key_values=cache)
        return torch.stack(steps)

    ref = run(DynamicCache(), "eager")
    cache = LUKVCache(0.0)
    got = run(cache, "lukv")
    assert cache.is_compressed
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


PATHS = {
    # path: (left padding, which CPU paths are switched off)
    "masked": (False, ()),
    "tiles": (False, ("masked",)),
    "merge": (False, ("masked", "tiles")),
    "masked_padded": (True, ()),  # left padding: the padding is evicted, the kept tokens are all real
}


@pytest.mark.parametrize("path", list(PATHS))
def test_ratio_half_equals_a_float64_reference_with_the_sink(monkeypatch, path):
    """At ratio 0.5 every decode call of the compressed attention equals a float64 reference over the
    kept tokens, the sink in the denominator, on each CPU path."""
    padded, off = PATHS[path]
    model = tiny_gpt_oss("eager")
    if padded:
        ids, mask = left_padded((24, 15))
    else:
        ids, mask = prompt(batch=2, length=24, seed=5), None
    for name in off:
        monkeypatch.setattr({"masked": masked, "tiles": tiles}[name], "serves", lambda *a: False)
    used = {"masked": 0, "tiles": 0, "merge": 0}
    for module, fn, key in (
        (masked, "masked_ragged_attention", "masked"),
        (tiles, "tiled_ragged_attention", "tiles"),
        (compressed, "merge_partials", "merge"),
    ):
        real = getattr(module, fn)
        monkeypatch.setattr(
            module, fn, lambda *a, _r=real, _k=key, **k: used.__setitem__(_k, used[_k] + 1) or _r(*a, **k)
        )
    calls = _spy_compressed(monkeypatch)
    cache = LUKVCache(0.5, sliding="keep")  # the full layer's paths (a compressed sliding layer merges)
    greedy_with_logits(model, ids, cache, 8, attention_mask=mask)
    assert len(calls) == 7
    assert used[path.removesuffix("_padded")] == 7, used
    kept = cache.layers[1].store.num_tokens
    assert kept < 0.75 * 2 * 2 * 24  # really compressed: about half of each head's prompt is gone
    for store, query, key, value, am, scale, softcap, s_aux, out in calls:
        assert s_aux is not None
        ref = dense_reference(store, query, key, value, am, scale, s_aux, softcap)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        # and the sink really changes the result: without it the same call differs
        assert (out.double() - dense_reference(store, query, key, value, am, scale, None)).abs().max() > 1e-3


# ------------------------------------------------------------------------------------ unit tests


def _causal_mask(b, q_len, length, hidden=()):
    """An additive fp32 mask ``[B, 1, Q, L]`` (causal over the last Q columns), ``hidden`` columns masked."""
    mask = torch.zeros(b, 1, q_len, length)
    neg = torch.finfo(torch.float32).min
    for i in range(q_len):
        mask[:, :, i, length - q_len + i + 1 :] = neg
    for row, col in hidden:
        mask[row, :, :, col] = neg
    return mask


@pytest.mark.parametrize(
    ("counts", "heads"),
    [
        ([30, 7, 0, 12], 2),  # an empty segment: the suffix and the sink alone
        ([20, 20, 20, 20], 2),  # equal segments
        ([300, 260, 5, 1], 2),  # longer than one tile
    ],
)
# the tiles take no softcap (compressed_attention sends soft-capped calls to the other paths)
@pytest.mark.parametrize(
    ("path", "softcap"),
    [("masked", None), ("masked", 5.0), ("tiles", None), ("merge", None), ("merge", 5.0)],
)
def test_compressed_attention_with_sinks_equals_the_reference(monkeypatch, counts, heads, path, softcap):
    store, query, sk, sv, s_aux, _ = sink_case(counts, heads=heads)
    taken = []
    for module, fn, key in (
        (masked, "masked_ragged_attention", "masked"),
        (tiles, "tiled_ragged_attention", "tiles"),
        (compressed, "merge_partials", "merge"),
    ):
        real = getattr(module, fn)
        monkeypatch.setattr(module, fn, lambda *a, _r=real, _k=key, **k: taken.append(_k) or _r(*a, **k))
    if path != "masked":
        monkeypatch.setattr(masked, "serves", lambda *a: False)
    if path == "merge":
        monkeypatch.setattr(tiles, "serves", lambda *a: False)
    out = compressed.compressed_attention(store, query, sk, sv, None, 0.25, softcap, s_aux=s_aux)
    assert taken == [path]
    ref = dense_reference(store, query, sk, sv, None, 0.25, s_aux, softcap)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    assert out.shape == (query.shape[0], query.shape[2], query.shape[1], 16)
    # without the sink the same call gives the reference without it
    plain = compressed.compressed_attention(store, query, sk, sv, None, 0.25, softcap)
    torch.testing.assert_close(
        plain.double(), dense_reference(store, query, sk, sv, None, 0.25, None, softcap), atol=2e-5, rtol=1e-4
    )


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_sinks_with_a_mask_that_hides_stored_and_suffix_tokens(softcap):
    """Several query tokens (causal in the suffix) and masked stored tokens: the parts and their merge."""
    store, query, sk, sv, s_aux, length = sink_case([30, 7, 0, 12], heads=2, q_len=3, seed=3)
    hidden = [(0, int(store.positions[2])), (1, int(store.positions[40]))]
    mask = _causal_mask(2, 3, length, hidden)
    out = compressed.compressed_attention(store, query, sk, sv, mask, 0.25, softcap, s_aux=s_aux)
    ref = dense_reference(store, query, sk, sv, mask, 0.25, s_aux, softcap)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    # a bool mask (True = attend) is read alike
    out_bool = compressed.compressed_attention(store, query, sk, sv, mask == 0, 0.25, softcap, s_aux=s_aux)
    torch.testing.assert_close(out_bool, out, atol=1e-6, rtol=1e-6)


def test_bf16_sinks_through_the_tiles():
    """A bf16 layer (and bf16 sinks, the model's dtype) on CPU takes the tiles; the sink is applied in fp32."""
    store, query, sk, sv, s_aux, _ = sink_case([300, 40, 90, 0], heads=2, dtype=torch.bfloat16, seed=4)
    assert not masked.serves(query, store, sk) and tiles.serves(query, store.keys, store.values, None)
    out = compressed.compressed_attention(store, query, sk, sv, None, 0.25, s_aux=s_aux)
    assert out.dtype == torch.bfloat16
    ref = dense_reference(store, query, sk, sv, None, 0.25, s_aux)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_a_minus_infinite_sink_is_no_sink():
    store, query, sk, sv, s_aux, _ = sink_case([30, 7, 0, 12], heads=2)
    none = compressed.compressed_attention(store, query, sk, sv, None, 0.25)
    off = compressed.compressed_attention(
        store, query, sk, sv, None, 0.25, s_aux=torch.full_like(s_aux, float("-inf"))
    )
    torch.testing.assert_close(off, none, atol=1e-6, rtol=1e-6)


def test_partial_merge_lse_is_what_the_sink_needs():
    """The sink is applied from the merged log-sum-exp: out * sigmoid(lse - s) is the joint softmax with
    the sink (checked on the reference parts, the identity every kernel path relies on)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, 1, 3, 8, generator=gen),
        torch.randn(9, 8, generator=gen),
        torch.randn(9, 8, generator=gen),
    )
    out, lse = partial.partial_attention(q, k, v, scaling=0.5)
    sink = torch.tensor(1.3)
    logits = torch.cat([q[0, 0] @ k.T * 0.5, sink.expand(3, 1)], dim=-1)
    ref = torch.softmax(logits, dim=-1)[:, :-1] @ v
    torch.testing.assert_close(
        out[0, 0] * torch.sigmoid(lse[0, 0] - sink)[:, None], ref, atol=1e-6, rtol=1e-6
    )


def test_the_lukv_route_honours_sinks_on_its_stock_path_too():
    """Through ``attn_implementation='lukv'`` (sdpa-routed), a model with learned sinks reads its own eager
    function wherever the store is not involved (prefill, a DynamicCache): torch's sdpa has no sinks."""
    ids, mask = left_padded((20, 13))
    layer_types = ("full_attention", "full_attention")
    results = {}
    for attn in ("eager", "lukv"):
        model = copy.deepcopy(tiny_gpt_oss("eager", layer_types))
        model.set_attn_implementation(attn)
        with torch.no_grad():
            results[attn] = model(ids, attention_mask=mask, past_key_values=DynamicCache()).logits
    torch.testing.assert_close(results["lukv"], results["eager"], atol=1e-5, rtol=1e-5)
