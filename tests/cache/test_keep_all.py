"""Keep-all (ratio=0) is DynamicCache: same greedy tokens, logits within 1e-5.

Ratio 0 still compresses (every prompt token moves into the ragged store), so these tests run the ragged
attention path and the log-sum-exp merge, not a shortcut.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_model
from transformers import DynamicCache

from lukv_cache import LUKVCache
from lukv_cache.cache.storage.layer import LUKVLayer
from lukv_cache.testing import ARCHS, PAD, left_padded, prompt

ATOL = 1e-5
GREEDY = dict(do_sample=False, output_logits=True, output_scores=True, return_dict_in_generate=True)


def assert_same_generation(ref, out, atol: float = ATOL) -> None:
    assert torch.equal(ref.sequences, out.sequences), f"tokens differ:\n{ref.sequences}\n{out.sequences}"
    assert len(ref.logits) == len(out.logits)
    for step, (a, b) in enumerate(zip(ref.logits, out.logits)):
        diff = (b - a).abs().max().item()
        assert diff <= atol, f"logits of step {step} differ by {diff:.3g}"
    for step, (a, b) in enumerate(zip(ref.scores, out.scores)):
        finite = torch.isfinite(a)
        assert torch.equal(finite, torch.isfinite(b)), f"scores of step {step}: -inf pattern differs"
        torch.testing.assert_close(b[finite], a[finite], atol=atol, rtol=0)


def assert_ragged_path_used(cache: LUKVCache) -> None:
    """At least one layer holds a ragged store, and every LUKV layer that saw the prompt compressed it."""
    layers = [layer for layer in cache.layers if isinstance(layer, LUKVLayer)]
    assert layers, "no LUKV layer: the ragged path was not exercised"
    assert all(layer.compressed and layer.store is not None for layer in layers)


def both(model, gen_kwargs: dict, cache_kwargs: dict | None = None):
    ref = model.generate(past_key_values=DynamicCache(config=model.config), **GREEDY, **gen_kwargs)
    cache = LUKVCache(0.0, **(cache_kwargs or {}))
    out = model.generate(past_key_values=cache, **GREEDY, **gen_kwargs)
    return ref, out, cache


ARCH_ATTN = [
    (arch, attn) for arch in ARCHS for attn in ("sdpa", "eager") if (arch, attn) != ("gemma2", "sdpa")
]


@pytest.mark.parametrize(("arch", "attn"), ARCH_ATTN)
def test_keep_all_matches_dynamic_cache_with_left_padding(arch, attn):
    model = tiny_model(arch, attn)
    ids, mask = left_padded()
    ref, out, cache = both(model, dict(input_ids=ids, attention_mask=mask, max_new_tokens=6))
    assert_same_generation(ref, out)
    assert_ragged_path_used(cache)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_sliding_layers_stay_stock_and_full_layers_are_compressed(arch):
    model = tiny_model(arch, "eager")
    cache = LUKVCache(0.0, sliding="keep")  # under "compress" (the default) every layer is a LUKVLayer
    model.generate(prompt(1, 20), past_key_values=cache, max_new_tokens=3, do_sample=False)
    kinds = [isinstance(layer, LUKVLayer) for layer in cache.layers]
    assert kinds == [t == "full_attention" for t in model.config.layer_types]


@pytest.mark.parametrize(("arch", "attn"), [("llama", "sdpa"), ("qwen3", "eager"), ("gemma3", "sdpa")])
def test_keep_all_matches_dynamic_cache_in_beam_search(arch, attn):
    model = tiny_model(arch, attn)
    ids, mask = left_padded((20, 13))
    ref, out, cache = both(model, dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, num_beams=3))
    assert_same_generation(ref, out)
    assert_ragged_path_used(cache)


@pytest.mark.parametrize(("arch", "attn"), [("llama", "sdpa"), ("gemma2", "eager"), ("phi3", "eager")])
def test_keep_all_matches_dynamic_cache_with_chunked_prefill(arch, attn):
    model = tiny_model(arch, attn)
    ids, mask = left_padded((27, 19, 12))
    ref, out, cache = both(
        model,
        dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, prefill_chunk_size=8),
        dict(prefill_chunk_size=8),
    )
    assert_same_generation(ref, out)
    assert_ragged_path_used(cache)


def count_crops(monkeypatch) -> list[int]:
    calls: list[int] = []
    crop = LUKVLayer.crop

    def counting(self, tokens_to_remove):
        calls.append(tokens_to_remove)
        return crop(self, tokens_to_remove)

    monkeypatch.setattr(LUKVLayer, "crop", counting)
    return calls


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_keep_all_matches_dynamic_cache_with_assisted_decoding(monkeypatch, attn):
    model = tiny_model("llama", attn)
    assistant = tiny_model("llama", attn, seed=1, num_hidden_layers=1)
    ids = prompt(1, 22, seed=3)
    crops = count_crops(monkeypatch)
    kwargs = dict(input_ids=ids, max_new_tokens=8, assistant_model=assistant)
    ref, out, cache = both(model, kwargs)
    assert_same_generation(ref, out)
    assert_ragged_path_used(cache)
    # the assistant drafts tokens the main model rejects, so crop() ran; the cache ends consistent
    assert any(n < 0 for n in crops)
    assert cache.get_seq_length() == out.sequences.shape[1] - 1


def test_assisted_decoding_with_eviction_never_keeps_rejected_draft_tokens(monkeypatch):
    # The first verification forward holds the prompt and the drafts, so drafts join the eviction
    # (documented); whatever is rejected must be cropped out of both the store and the suffix.
    model = tiny_model("llama", "sdpa")
    assistant = tiny_model("llama", "sdpa", seed=1, num_hidden_layers=1)
    ids = prompt(1, 40, seed=3)
    crops = count_crops(monkeypatch)
    cache = LUKVCache(0.5)
    with pytest.warns(UserWarning, match="draft tokens"):
        out = model.generate(
            ids, past_key_values=cache, max_new_tokens=8, assistant_model=assistant, **GREEDY
        )
    assert any(n < 0 for n in crops)
    length = out.sequences.shape[1] - 1  # the last token was sampled but never fed
    for layer in cache.layers:
        assert layer.cumulative_length == length
        assert int(layer.store.positions.max()) < length - layer.suffix_keys.shape[-2]


@pytest.mark.parametrize(("arch", "attn"), [("llama", "sdpa"), ("gemma3", "eager")])
def test_keep_all_matches_dynamic_cache_in_question_agnostic_two_step_use(arch, attn):
    model = tiny_model(arch, attn)
    context, question = prompt(1, 24, seed=4), prompt(1, 6, seed=5)
    full = torch.cat([context, question], dim=1)
    results = []
    for cache in (DynamicCache(config=model.config), LUKVCache(0.0)):
        with torch.no_grad():
            model(context, past_key_values=cache)
            q_logits = model(question, past_key_values=cache).logits
        gen = model.generate(full, past_key_values=cache, max_new_tokens=5, **GREEDY)
        results.append((q_logits, gen, cache))
    (ref_q, ref_gen, _), (q, gen, cache) = results
    torch.testing.assert_close(q, ref_q, atol=ATOL, rtol=0)
    assert_same_generation(ref_gen, gen)
    assert_ragged_path_used(cache)


@pytest.mark.parametrize(("arch", "attn"), [("llama", "sdpa"), ("qwen2", "eager")])
def test_keep_all_matches_dynamic_cache_on_a_second_generate_with_the_same_cache(arch, attn):
    model = tiny_model(arch, attn)
    ids = prompt(1, 20, seed=6)
    follow_up = prompt(1, 4, seed=7)
    runs = []
    for cache in (DynamicCache(config=model.config), LUKVCache(0.0)):
        first = model.generate(ids, past_key_values=cache, max_new_tokens=4, **GREEDY)
        second_ids = torch.cat([first.sequences, follow_up], dim=1)
        second = model.generate(second_ids, past_key_values=cache, max_new_tokens=4, **GREEDY)
        runs.append((first, second))
    (ref1, ref2), (out1, out2) = runs
    assert_same_generation(ref1, out1)
    assert_same_generation(ref2, out2)


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_deepcopy_of_compressed_cache_answers_two_questions_like_compressing_twice(ratio):
    model = tiny_model("llama", "sdpa")
    context = prompt(1, 40, seed=8)
    questions = [prompt(1, 5, seed=9), prompt(1, 7, seed=10)]
    shared = LUKVCache(ratio, "keydiff")
    with torch.no_grad():
        model(context, past_key_values=shared)
    stored_before = shared.stored_tokens().clone()
    for question in questions:
        full = torch.cat([context, question], dim=1)
        fresh = LUKVCache(ratio, "keydiff")
        fresh.prefill(model, context)  # a complete context: the question is appended whole, as in a copy
        ref = model.generate(full, past_key_values=fresh, max_new_tokens=5, **GREEDY)
        out = model.generate(full, past_key_values=copy.deepcopy(shared), max_new_tokens=5, **GREEDY)
        assert_same_generation(ref, out, atol=0.0)
    # the shared context was never touched by the copies
    assert torch.equal(shared.stored_tokens(), stored_before)
    assert shared.get_seq_length() == context.shape[1]


def test_keep_all_pad_token_is_never_attended():
    """Changing what sits under the padding must not change anything (pads are masked, never read)."""
    model = tiny_model("llama", "sdpa")
    ids, mask = left_padded()
    other = ids.clone()
    other[mask == 0] = 77
    assert not torch.equal(other, ids) and (ids[mask == 0] == PAD).all()
    a = model.generate(
        input_ids=ids, attention_mask=mask, past_key_values=LUKVCache(0.0), max_new_tokens=4, **GREEDY
    )
    b = model.generate(
        input_ids=other, attention_mask=mask, past_key_values=LUKVCache(0.0), max_new_tokens=4, **GREEDY
    )
    assert torch.equal(a.sequences[:, ids.shape[1] :], b.sequences[:, ids.shape[1] :])
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(y, x, atol=ATOL, rtol=0)


def test_keep_all_matches_dynamic_cache_over_a_long_decode():
    """80 new tokens: the suffix buffer outgrows its first capacity and is reallocated on the way."""
    model = tiny_model("llama", "sdpa")
    ids, mask = left_padded((20, 9, 14), seed=17)
    ref, out, cache = both(model, dict(input_ids=ids, attention_mask=mask, max_new_tokens=80))
    assert_same_generation(ref, out)
    assert cache.get_seq_length() == ids.shape[1] + 79


def test_long_decode_folds_the_suffix_into_the_store_and_still_matches_dynamic_cache():
    """300 new tokens: past 256 the decoding suffix is folded into the ragged store (nothing evicted)."""
    model = tiny_model("llama", "sdpa")
    ids, mask = left_padded((20, 9, 14), seed=21)
    ref, out, cache = both(
        model, dict(input_ids=ids, attention_mask=mask, max_new_tokens=300, min_new_tokens=300)
    )
    assert_same_generation(ref, out)
    for layer in cache.layers:
        assert layer.suffix_buffers[0].shape[-2] <= 257, "the suffix buffer kept growing instead of folding"
        assert int(layer.store.positions.max()) >= 256, "decoded tokens never reached the store"
        assert layer.stored_counts().tolist() == cache.layers[0].stored_counts().tolist()


def test_compressed_cache_can_switch_between_sdpa_and_eager():
    context, question = prompt(1, 40, seed=18), prompt(1, 3, seed=19)
    logits = []
    for attn in ("sdpa", "eager"):
        cache = LUKVCache(0.5)
        with torch.no_grad():
            tiny_model("llama", "sdpa")(context, past_key_values=cache)
            logits.append(tiny_model("llama", attn)(question, past_key_values=cache).logits)
    torch.testing.assert_close(logits[1], logits[0], atol=ATOL, rtol=0)


def test_explicit_lukv_attention_implementation_matches_dynamic_cache_with_sdpa():
    model = copy.deepcopy(tiny_model("llama", "sdpa"))
    ids, mask = left_padded()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, **GREEDY)
    ref = model.generate(past_key_values=DynamicCache(config=model.config), **kwargs)
    model.set_attn_implementation("lukv")
    out = model.generate(past_key_values=LUKVCache(0.0), **kwargs)
    assert_same_generation(ref, out)


def test_assisted_decoding_that_evicts_nothing_does_not_warn_that_drafts_join_the_eviction():
    import warnings

    model = tiny_model("llama", "sdpa")
    assistant = tiny_model("llama", "sdpa", seed=1, num_hidden_layers=1)
    cache = LUKVCache(0.0)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model.generate(
            prompt(1, 40, seed=3),
            past_key_values=cache,
            max_new_tokens=8,
            assistant_model=assistant,
            **GREEDY,
        )
    assert not [w for w in caught if "draft tokens" in str(w.message)]
    assert cache.get_seq_length() > 40  # the assisted generation ran through this cache
