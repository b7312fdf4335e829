"""Nothing a LUKVCache sets up outlives the forward that set it up: a failed or odd run never changes a
later forward in the same process, of any model, with any cache; and importing lukv_cache is invisible to
code that uses no LUKVCache (torch.compile's fullgraph tracing included)."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy_with_logits, tiny_model
from transformers import BloomConfig, BloomForCausalLM, DynamicCache, GPTNeoConfig, GPTNeoForCausalLM

from lukv_cache import LUKVCache
from lukv_cache.attention.calls import any_pending
from lukv_cache.errors import IncompatibleAttentionError
from lukv_cache.testing import VOCAB, left_padded, prompt


def _reference(model, ids, mask=None):
    """Greedy tokens and logits with a plain DynamicCache in a clean state (computed first)."""
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            past_key_values=DynamicCache(),
            max_new_tokens=6,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences, torch.stack(out.logits)


def _assert_dynamic_cache_exact(model, ids, expected) -> None:
    seqs, logits = greedy_with_logits(model, ids, DynamicCache())
    assert torch.equal(seqs, expected[0])
    torch.testing.assert_close(logits, expected[1], rtol=0, atol=0)


def _own_attention_model(kind: str):
    """A tiny family whose attention is its own code (never transformers' attention interface) in 5.23 and
    5.24 alike (GPT-J and CodeGen were such families until 5.24 moved them to the interface)."""
    torch.manual_seed(0)
    if kind == "bloom":
        config = BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, pad_token_id=0)
        model = BloomForCausalLM(config)
    else:
        config = GPTNeoConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            max_position_embeddings=128,
        )
        model = GPTNeoForCausalLM(config)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.mark.parametrize("kind", ["bloom", "gpt_neo"])
def test_a_ratio_zero_run_on_a_family_with_its_own_attention_leaves_nothing_pending(kind):
    llama, ids = tiny_model("llama"), prompt(1, 20)
    expected = _reference(llama, ids)
    own = _own_attention_model(kind)
    greedy_with_logits(own, prompt(1, 12), LUKVCache(0.0))  # exact there: nothing is compressed
    assert not any_pending()
    _assert_dynamic_cache_exact(llama, ids, expected)
    seqs, _ = greedy_with_logits(llama, ids, LUKVCache(0.0))
    assert torch.equal(seqs, expected[0])


@pytest.mark.parametrize("kind", ["bloom", "gpt_neo"])
def test_a_family_with_its_own_attention_is_refused_with_advice_that_can_help(kind):
    own = _own_attention_model(kind)
    with pytest.raises(IncompatibleAttentionError, match="own code.*only ratio=0 works"):
        greedy_with_logits(own, prompt(1, 12), LUKVCache(0.5))
    llama, ids = tiny_model("llama"), prompt(1, 20)
    _assert_dynamic_cache_exact(llama, ids, _reference(llama, ids))


def test_a_typed_error_inside_a_forward_does_not_break_later_forwards_of_any_cache():
    llama, ids = tiny_model("llama"), prompt(1, 20)
    expected = _reference(llama, ids)
    # an attention implementation that cannot read a LUKVCache raises inside layer 0's attention
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def plain(module, query, key, value, attention_mask, **kwargs):  # registered after import: guarded
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("test_plain_sdpa", plain)
    qwen = tiny_model("qwen2", seed=3)
    qwen.set_attn_implementation("test_plain_sdpa")
    try:
        with pytest.raises(IncompatibleAttentionError):
            greedy_with_logits(qwen, prompt(1, 12), LUKVCache(0.5))
    finally:
        qwen.set_attn_implementation("sdpa")
    assert not any_pending()
    _assert_dynamic_cache_exact(llama, ids, expected)
    seqs, _ = greedy_with_logits(llama, ids, LUKVCache(0.0))
    assert torch.equal(seqs, expected[0])


def test_keyboard_interrupt_inside_a_layer_leaves_the_cache_and_the_process_usable():
    llama, ids = tiny_model("llama"), prompt(1, 20)
    expected = _reference(llama, ids)
    cache = LUKVCache(0.5)

    def interrupt(*_):
        raise KeyboardInterrupt

    hook = llama.model.layers[1].self_attn.register_forward_pre_hook(interrupt)  # layer 0 updated already
    try:
        with pytest.raises(KeyboardInterrupt):
            greedy_with_logits(llama, ids, cache)
    finally:
        hook.remove()
    _assert_dynamic_cache_exact(llama, ids, expected)
    cache.reset()
    fresh, _ = greedy_with_logits(llama, ids, LUKVCache(0.5))
    again, _ = greedy_with_logits(llama, ids, cache)
    assert torch.equal(again, fresh)


def test_update_called_by_hand_leaves_nothing_for_a_later_forward():
    cache = LUKVCache(0.0)
    for layer in range(2):
        cache.update(torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16), layer)
    llama, ids = tiny_model("llama"), prompt(1, 20)
    _assert_dynamic_cache_exact(llama, ids, _reference(llama, ids))
    cache.reset()
    assert not any_pending()


def test_a_left_padded_dynamic_cache_run_after_a_failed_lukv_run_is_exact():
    llama = tiny_model("llama")
    ids, mask = left_padded((20, 13))
    expected = _reference(llama, ids, mask)
    with pytest.raises(IncompatibleAttentionError):
        greedy_with_logits(_own_attention_model("bloom"), prompt(2, 12), LUKVCache(0.5))
    seqs, logits = _reference(llama, ids, mask)
    assert torch.equal(seqs, expected[0])
    torch.testing.assert_close(logits, expected[1], rtol=0, atol=0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_importing_lukv_cache_keeps_fullgraph_compile_of_a_forward_working(attn):
    """torch.compile(fullgraph=True) of a model forward that uses no LUKVCache traces through the routed
    attention functions (dynamo's eager backend: the tracing is what the import could break)."""
    import torch._dynamo

    model = tiny_model("llama", attn=attn)
    ids = prompt(1, 10)
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True, backend="eager")
    with torch.no_grad():
        expected = model(ids).logits
        got = compiled(ids).logits
    torch.testing.assert_close(got, expected)
    torch._dynamo.reset()


def test_importing_lukv_cache_keeps_static_cache_compiled_generation_working():
    """transformers' compiled generation with a StaticCache and fullgraph=True (the usual GPU serving path)
    generates what the uncompiled model does."""
    import torch._dynamo
    from transformers import CompileConfig

    model, ids = tiny_model("llama"), prompt(1, 10)
    expected = _reference(model, ids)[0]
    torch._dynamo.reset()
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=6,
            do_sample=False,
            cache_implementation="static",
            compile_config=CompileConfig(fullgraph=True, backend="eager"),
        )
    torch._dynamo.reset()
    assert torch.equal(out, expected)


def test_a_lukv_cache_under_fullgraph_compile_fails_loudly_not_silently():
    import torch._dynamo

    model = tiny_model("llama")
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True, backend="eager")
    with pytest.raises(Exception) as raised, torch.no_grad():
        compiled(prompt(1, 10), past_key_values=LUKVCache(0.5), use_cache=True)
    assert not isinstance(raised.value, AssertionError)
    torch._dynamo.reset()
    from lukv_cache.attention.calls import discard_attention

    discard_attention()
