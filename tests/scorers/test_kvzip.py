"""KVzip: scores by context reconstruction equal an independent reference built from the model's own
attention weights; chunking, padding, sliding layers and errors behave as documented."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_model
from transformers import DynamicCache

from lukv_cache import ConfigurationError, LUKVCache
from lukv_cache.scorers import kvzip_scorer
from lukv_cache.scorers.kvzip import RepeatPrompt
from lukv_cache.testing import PAD, left_padded, prompt

REPEAT = RepeatPrompt(first=(5, 6, 7), next=(8, 9), suffix=(10,))


def reference_scores(model, ids, chunk_size, sink=4, overlap=8):
    """Per layer ``[H_kv, T]``: prefill a DynamicCache, then for each chunk run the repeat prompt through a
    copy with eager attention and ``output_attentions``; renormalise each query's weights over the sinks,
    the chunk and the repeat tokens; max over the queries and the heads of each KV group."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    t = ids.shape[1]
    cache = DynamicCache()
    with torch.no_grad():
        eager(ids, past_key_values=cache)
    h = eager.config.num_key_value_heads
    g = eager.config.num_attention_heads // h
    out = torch.zeros(eager.config.num_hidden_layers, h, t)
    for (start, end), recon in REPEAT.chunks(ids[0].tolist(), chunk_size, overlap):
        r = len(recon)
        with torch.no_grad():
            attentions = eager(
                torch.tensor([recon]), past_key_values=copy.deepcopy(cache), output_attentions=True
            ).attentions
        sub = list(range(min(sink, start))) + list(range(start, end)) + list(range(t, t + r))
        for layer, weights in enumerate(attentions):  # [1, Hq, R, T + R]
            w = weights[0][:, :, sub].double()
            w = w / w.sum(-1, keepdim=True)
            n_sink = min(sink, start)
            part = w[:, :, n_sink : n_sink + end - start]  # [Hq, R, C]
            out[layer, :, start:end] = part.view(h, g, r, -1).amax(dim=(1, 2)).float()
    return out


def kvzip_scores(model, ids, mask=None, chunk_size=2048, sink=4):
    scorer = kvzip_scorer(chunk_size=chunk_size)
    cache = LUKVCache(0.0, scorer, sink=sink, window=0, keep_scores=True)
    cache.prefill(model, ids, mask, repeat_prompt=REPEAT)
    return torch.stack([cache.prefill_scores[i] for i in sorted(cache.prefill_scores)])  # [L, B, H, T]


@pytest.mark.parametrize("chunk_size", [2048, 16])
def test_kvzip_scores_equal_the_reference_from_eager_attention_weights(chunk_size):
    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 50, seed=31)
    got = kvzip_scores(model, ids, chunk_size=chunk_size)[:, 0]
    want = reference_scores(model, ids, chunk_size)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-4)


def test_one_chunk_and_a_chunk_size_beyond_the_context_score_alike():
    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 40, seed=32)
    torch.testing.assert_close(
        kvzip_scores(model, ids, chunk_size=40), kvzip_scores(model, ids, chunk_size=4096)
    )


def test_chunked_reconstruction_differs_from_one_chunk_but_covers_every_token():
    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 60, seed=33)
    whole, chunked = kvzip_scores(model, ids), kvzip_scores(model, ids, chunk_size=16)
    assert not torch.allclose(whole, chunked)
    assert (chunked > 0).all()  # every context token was read by some repeat query


def test_left_padded_batch_scores_each_row_as_if_it_were_alone():
    model = tiny_model("llama", "sdpa")
    ids, mask = left_padded((40, 29, 17), seed=34)
    batch = kvzip_scores(model, ids, mask, chunk_size=12)
    for row, n in enumerate(mask.sum(-1).tolist()):
        alone = kvzip_scores(model, ids[row : row + 1, -n:], chunk_size=12)[:, 0]
        torch.testing.assert_close(batch[:, row, :, -n:], alone, atol=1e-5, rtol=1e-4)


def test_kvzip_cache_evicts_after_the_repeat_passes_and_answers_like_a_dense_cache_of_what_it_kept():
    model = tiny_model("llama", "sdpa")
    ids, mask = left_padded((60, 45), seed=35)
    cache = LUKVCache(0.8, "kvzip", "global", window=1)
    cache.prefill(model, ids, mask, repeat_prompt=REPEAT)
    assert cache.get_seq_length() == 60  # the repeat tokens are gone
    stored = cache.stored_tokens()  # [L, B, H]
    for row, n in enumerate(mask.sum(-1).tolist()):
        evictable = n - 4 - 1
        assert abs(int((stored[:, row] - 5).sum()) - round(0.2 * evictable * 2 * 2)) <= 2
    question = prompt(2, 3, seed=36)
    full_mask = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], dim=1)
    out = model.generate(
        torch.cat([ids, question], 1),
        attention_mask=full_mask,
        past_key_values=cache,
        max_new_tokens=3,
        do_sample=False,
    )
    assert out.shape == (2, 66)


def test_global_allocator_keeps_the_models_top_scores_across_layers():
    model = tiny_model("llama", "sdpa", num_hidden_layers=3)
    ids = prompt(1, 80, seed=37)
    scores = kvzip_scores(model, ids, sink=4)[:, 0, :, 4:79]  # evictable: after the sinks, before the window
    cache = LUKVCache(0.75, "kvzip", "global", window=1)
    cache.prefill(model, ids, repeat_prompt=REPEAT)
    kept = (cache.stored_tokens()[:, 0] - 5).flatten()  # per (layer, head)
    budget = round(0.25 * 75 * 2 * 3)
    assert int(kept.sum()) == budget
    # the kept tokens are exactly the model-wide top `budget` scores (each head keeps at least one)
    threshold = scores.flatten().topk(budget).values[-1]
    want = (scores >= threshold).sum(-1).flatten()
    assert (kept - want).abs().max() <= 1


def test_sliding_window_layers_are_restored_after_the_repeat_passes():
    model = tiny_model("gemma3", "sdpa")
    ids = prompt(1, 30, seed=38)
    cache = LUKVCache(0.5, "kvzip", config=model.config)
    cache.prefill(model, ids, repeat_prompt=REPEAT)
    dense = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=dense)
    for idx in (0, 2):  # gemma3's sliding layers hold exactly the last window of the context
        torch.testing.assert_close(cache.layers[idx].keys, dense.layers[idx].keys)
    assert cache.layers[1].compressed


def test_kvzip_through_a_plain_forward_names_cache_prefill():
    model = tiny_model("llama", "sdpa")
    with pytest.raises(ConfigurationError, match=r"cache\.prefill\(model, input_ids, tokenizer=tokenizer\)"):
        with torch.no_grad():
            model(prompt(1, 20), past_key_values=LUKVCache(0.5, "kvzip"))


def test_prefill_without_tokenizer_or_prompt_is_a_configuration_error():
    model = tiny_model("llama", "sdpa")
    with pytest.raises(ConfigurationError, match="tokenizer="):
        LUKVCache(0.5, "kvzip").prefill(model, prompt(1, 20))


def test_repeat_prompt_follows_the_chat_template_or_plain_text():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(c): i for i, c in enumerate(range(32, 127))} | {"\n": 95}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=" "))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=" ")

    def encode(text):
        return tuple(tok.encode(text, add_special_tokens=False))

    plain = RepeatPrompt.from_tokenizer(tok)
    assert plain.suffix == encode("\n") and plain.first == encode("\n\nRepeat the previous context exactly.")
    tok.chat_template = "{% for m in messages %}<u>{{ m['content'] }}</u>{% endfor %}<a>"
    chat = RepeatPrompt.from_tokenizer(tok)
    assert chat.suffix == encode("</u><a>") and chat.first == plain.first
    assert RepeatPrompt.from_tokenizer(tok, template="plain").suffix == plain.suffix
    with pytest.raises(ConfigurationError, match="template"):
        RepeatPrompt.from_tokenizer(tok, template="jinja")


def test_prefill_leaves_no_hooks_on_the_model():
    model = tiny_model("llama", "sdpa")
    before = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    LUKVCache(0.5, "kvzip").prefill(model, prompt(1, 30), repeat_prompt=REPEAT)
    assert [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()] == before
    assert model.config._attn_implementation == "sdpa"


def test_kvzip_plus_weights_the_attention_by_the_value_output_norm():
    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 40, seed=39)
    plain = LUKVCache(0.0, "kvzip", sink=0, window=0, keep_scores=True)
    plain.prefill(model, ids, repeat_prompt=REPEAT)
    plus = LUKVCache(0.0, "kvzip_plus", sink=0, window=0, keep_scores=True)
    plus.prefill(model, ids, repeat_prompt=REPEAT)
    assert not torch.allclose(plain.prefill_scores[0], plus.prefill_scores[0])
    assert PAD == 0  # the repeat rounds pad with token 0: the tiny models' pad id


def test_the_registered_kvzip_protects_32_recent_tokens():
    assert LUKVCache(0.5, "kvzip").window == 32 and LUKVCache(0.5, "kvzip_plus").window == 32
    assert kvzip_scorer(window=4).window == 4
