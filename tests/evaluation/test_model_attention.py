"""The CLI loads a model with an attention it supports: Gemma-2 (soft-capped logits) needs eager."""

from __future__ import annotations

from transformers import Gemma2Config, LlamaConfig

from lukv_cache.models import load_model
from lukv_cache.testing import BYTE_VOCAB, byte_tokenizer, tiny_model


def test_a_gemma2_model_folder_loads_with_eager_attention(tmp_path):
    tiny_model("gemma2", attn="eager", vocab_size=BYTE_VOCAB).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path))
    assert model.config._attn_implementation == "eager"


def test_attention_is_eager_for_soft_capped_logits_else_sdpa():
    from lukv_cache.models import attention_for

    assert attention_for(Gemma2Config()) == "eager"
    assert attention_for(LlamaConfig()) == "sdpa"
    assert attention_for(LlamaConfig(attn_logit_softcapping=30.0)) == "eager"
