"""Observer = forward: every path that records a context's prefill (the benchmark's shared prefill, the
profiling context prefill, KVzip's hold-then-score prefill) holds the keys and gives the logits of a plain
forward into a DynamicCache, whatever attention the model runs (sdpa, eager, eager with logit softcapping).

An observer swapped in with ``attention_swapped`` gets the mask its own attention needs: the sdpa mask
function returns None for a plainly causal prompt, which an eager attention would read as "attend to
everything".
"""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model
from transformers import DynamicCache

from lukv_cache import ConfigurationError, LUKVCache
from lukv_cache.attention.swap import attention_swapped
from lukv_cache.evaluation.prefill import SharedPrefill
from lukv_cache.profiling.oracle import prefill_context
from lukv_cache.scorers.kvzip import RepeatPrompt
from lukv_cache.testing import prompt

MODELS = [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "eager"), ("gemma2", "eager")]
IDS = [f"{arch}-{attn}" for arch, attn in MODELS]
REPEAT = RepeatPrompt(first=(5, 6, 7), next=(8, 9), suffix=(10,))
TOL = dict(atol=1e-5, rtol=1e-5)


def plain_forward(model, ids, cache):
    """The reference: the model's own forward of ``ids`` into ``cache``; last-position logits."""
    with torch.no_grad():
        return model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]


@pytest.mark.parametrize(("arch", "attn"), MODELS, ids=IDS)
def test_shared_prefill_records_the_logits_and_keys_of_a_plain_forward(arch, attn):
    model = tiny_model(arch, attn)
    ids = prompt(1, 24, seed=71)
    reference = DynamicCache()
    logits = plain_forward(model, ids, reference)
    recorded = SharedPrefill.record(model, ids, n_queries=4)
    torch.testing.assert_close(recorded.last_logits, logits, **TOL)
    for got, want in zip(recorded.keys, reference.layers, strict=True):
        torch.testing.assert_close(got, want.keys, **TOL)
    assert model.config._attn_implementation == attn


@pytest.mark.parametrize(("arch", "attn"), MODELS, ids=IDS)
def test_profiling_context_prefill_holds_the_keys_of_a_plain_forward(arch, attn):
    model = tiny_model(arch, attn)
    ids = prompt(1, 24, seed=72)
    reference = DynamicCache(config=model.config)
    plain_forward(model, ids, reference)
    state = prefill_context(model, ids)
    for got, want in zip(state.cache.layers, reference.layers, strict=True):
        torch.testing.assert_close(got.keys, want.keys, **TOL)
        torch.testing.assert_close(got.values, want.values, **TOL)
    assert model.config._attn_implementation == attn


@pytest.mark.parametrize("ratio", [0.0, 0.5])
@pytest.mark.parametrize(("arch", "attn"), MODELS, ids=IDS)
def test_kvzip_prefill_gives_the_logits_of_a_plain_forward(arch, attn, ratio):
    model = tiny_model(arch, attn)
    ids = prompt(1, 24, seed=73)
    logits = plain_forward(model, ids, DynamicCache())
    cache = LUKVCache(ratio, "kvzip", window=1)
    with torch.no_grad():
        out = cache.prefill(model, ids, repeat_prompt=REPEAT)
    torch.testing.assert_close(out.logits[:, -1], logits, **TOL)
    assert cache.get_seq_length() == 24


def test_kvzip_scores_do_not_depend_on_the_attention_implementation():
    ids = prompt(1, 30, seed=74)
    scores = {}
    for attn in ("sdpa", "eager"):
        cache = LUKVCache(0.0, "kvzip", sink=4, window=0, keep_scores=True)
        with torch.no_grad():
            cache.prefill(tiny_model("llama", attn), ids, repeat_prompt=REPEAT)
        scores[attn] = torch.stack([cache.prefill_scores[i] for i in sorted(cache.prefill_scores)])
    torch.testing.assert_close(scores["eager"], scores["sdpa"], **TOL)


def test_an_observer_gets_the_mask_kind_it_asks_for_and_an_unknown_kind_is_refused():
    model = tiny_model("llama", "sdpa")
    seen = []

    def observer(module, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask)
        return query.transpose(1, 2).contiguous(), None

    with torch.no_grad(), attention_swapped(model, "lukv_test_observer", observer, mask="eager"):
        model(input_ids=prompt(1, 6, seed=75))
    assert all(m is not None and m.dtype == torch.float32 and m.shape[-2:] == (6, 6) for m in seen)
    with pytest.raises(ConfigurationError, match="mask"):
        with attention_swapped(model, "lukv_test_observer", observer, mask="no_such_attention"):
            pass
    assert model.config._attn_implementation == "sdpa"
