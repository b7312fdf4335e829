"""A model that passes an attention mask of its own per head: an ALiBi Falcon (``FalconConfig(alibi=True)``,
as falcon-rw), whose bias is in the mask from transformers 5.25 (before, Falcon's attention is its own code).

The compressed store's attention cannot read such a mask, so a cache that evicts raises a typed error; at
ratio 0 nothing is compressed and the model's attention reads the dense layers: DynamicCache's tokens and
logits, on every release (5.24 ran it exactly; 5.25 refused it with the per-head-mask error).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import greedy_with_logits
from packaging.version import Version
from transformers import DynamicCache, FalconConfig, FalconForCausalLM

from lukv_cache import LUKVCache
from lukv_cache.attention.calls import any_pending
from lukv_cache.errors import IncompatibleAttentionError
from lukv_cache.testing import VOCAB, left_padded, prompt

SINCE_5_25 = Version(transformers.__version__) >= Version("5.25")
ATOL = 1e-5


def _alibi_falcon(attn: str) -> FalconForCausalLM:
    torch.manual_seed(0)
    config = FalconConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        alibi=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return FalconForCausalLM._from_config(config, attn_implementation=attn, dtype=torch.float32).eval()


def _assert_same(got, want) -> None:
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    diff = (got[1] - want[1]).abs().max().item()
    assert diff <= ATOL, f"max |logit diff| {diff:.2e}"


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("with_config", [False, True])
def test_ratio_0_with_an_alibi_falcon_is_dynamic_cache(attn, with_config):
    model = _alibi_falcon(attn)
    ids = prompt(1, 20)
    want = greedy_with_logits(model, ids, DynamicCache(), new_tokens=8)
    cache = LUKVCache(0.0, config=model.config) if with_config else LUKVCache(0.0)
    _assert_same(greedy_with_logits(model, ids, cache, new_tokens=8), want)
    assert not cache.is_compressed  # nothing compressed: the model's attention read the dense layers
    assert not any_pending()
    # the cache goes on from where it is, as DynamicCache does
    more = torch.cat([want[0], prompt(1, 5, seed=1)], dim=1)
    _assert_same(
        greedy_with_logits(model, more, cache, new_tokens=4), greedy_with_logits(model, more, None, 4)
    )


def test_ratio_0_with_an_alibi_falcon_on_a_left_padded_batch_is_dynamic_cache():
    model = _alibi_falcon("sdpa")
    ids, mask = left_padded((20, 13, 7))
    want = greedy_with_logits(model, ids, DynamicCache(), new_tokens=6, attention_mask=mask)
    _assert_same(greedy_with_logits(model, ids, LUKVCache(0.0), new_tokens=6, attention_mask=mask), want)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_eviction_with_an_alibi_falcon_is_a_typed_error_before_anything_is_compressed(attn):
    model = _alibi_falcon(attn)
    cache = LUKVCache(0.5)
    with pytest.raises(IncompatibleAttentionError) as raised:
        greedy_with_logits(model, prompt(1, 20), cache)
    message = str(raised.value)
    if SINCE_5_25:  # the bias is in the mask it passes through the attention interface
        assert "mask of its own per head" in message and "ALiBi" in message, message
    else:  # its attention is its own code
        assert "computes attention in its own code" in message, message
    assert "only ratio=0 works" in message.lower() and "DynamicCache" in message, message
    assert not cache.is_compressed
    assert not any_pending()
    # the same model then generates with DynamicCache as ever
    ids = prompt(1, 20)
    assert greedy_with_logits(model, ids, DynamicCache())[0].shape == (1, 26)


def test_a_ratio_0_cache_refused_by_an_alibi_falcon_stays_refused_by_an_evicting_cache():
    """The ratio-0 run leaves no state behind: a cache that evicts, next, is still refused."""
    model = _alibi_falcon("sdpa")
    greedy_with_logits(model, prompt(1, 20), LUKVCache(0.0))
    with pytest.raises(IncompatibleAttentionError):
        greedy_with_logits(model, prompt(1, 20), LUKVCache(0.5))
