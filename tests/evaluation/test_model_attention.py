"""The CLI loads a model with an attention it supports: Gemma-2 (soft-capped logits) needs eager."""

from __future__ import annotations

from demo_helpers import byte_tokenizer
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig

from lukv_cache.models import load_model


def test_a_gemma2_model_folder_loads_with_eager_attention(tmp_path):
    config = Gemma2Config(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip
    Gemma2ForCausalLM(config).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path))
    assert model.config._attn_implementation == "eager"


def test_attention_is_eager_for_soft_capped_logits_else_sdpa():
    from lukv_cache.models import attention_for

    assert attention_for(Gemma2Config()) == "eager"
    assert attention_for(LlamaConfig()) == "sdpa"
    assert attention_for(LlamaConfig(attn_logit_softcapping=30.0)) == "eager"
