"""Tiny random models built from configs, shared by the core tests.

Every factory is seeded, so two calls give identical weights (an assistant model and a main model can
share a vocabulary without sharing weights by passing another seed).
"""

from __future__ import annotations

import functools

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from lukv_cache.allocation import ALLOCATORS, allocators_reading_profile

VOCAB = 128
PAD = 0
# the allocators that read a profile's curves (registered with reads_profile=True); the adaptive one
# (threshold) reads a kvzap profile's score thresholds instead, and takes value= in the tests
PROFILE_FAMILY = tuple(a for a in allocators_reading_profile() if not ALLOCATORS.get(a).adaptive)
# Gemma's local layers slide over 8 tokens: shorter than the prompts below, so the window really slides.
SLIDING = 8

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=PAD,
    bos_token_id=1,
    eos_token_id=None,  # random models must not stop early: the runs compared have the same length
)


ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")


def _config(arch: str, **overrides):
    kw = dict(_COMMON)
    if arch == "llama":
        return LlamaConfig(**{**kw, "head_dim": 16, **overrides}), LlamaForCausalLM
    if arch == "mistral":
        return MistralConfig(
            **{**kw, "head_dim": 16, "sliding_window": None, **overrides}
        ), MistralForCausalLM
    if arch == "qwen2":
        return Qwen2Config(**{**kw, **overrides}), Qwen2ForCausalLM
    if arch == "qwen3":
        return Qwen3Config(**{**kw, "head_dim": 16, **overrides}), Qwen3ForCausalLM
    if arch == "phi3":
        return Phi3Config(**{**kw, **overrides}), Phi3ForCausalLM
    layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    kw.update(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16, sliding_window=SLIDING)
    kw["layer_types"] = layer_types
    if arch == "gemma2":
        return Gemma2Config(**{**kw, **overrides}), Gemma2ForCausalLM
    if arch == "gemma3":
        return Gemma3TextConfig(**{**kw, **overrides}), Gemma3ForCausalLM
    raise ValueError(arch)


@functools.cache
def _cached(arch: str, attn: str, dtype: torch.dtype, seed: int, frozen: tuple):
    config, cls = _config(arch, **dict(frozen))
    torch.manual_seed(seed)
    model = cls(config).to(dtype).eval()
    model.set_attn_implementation(attn)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    return model


def tiny_model(
    arch: str = "llama", attn: str = "sdpa", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides
):
    """A seeded tiny random causal LM (2-3 layers, 4 query heads, 2 KV heads, head_dim 16).

    Cached per argument set: tests must not change a model they get here (use ``fresh=True``-style copies
    via ``copy.deepcopy`` if they do).
    """
    return _cached(arch, attn, dtype, seed, tuple(sorted(overrides.items())))


def prompt(batch: int = 1, length: int = 24, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    """Random token ids in [3, vocab): no pad/bos/eos ids inside the text."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen)


def greedy_with_logits(
    model, ids: torch.Tensor, cache, new_tokens: int = 6, attention_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ``generate`` over ``cache``: the sequences and the stacked logits of every new token."""
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            max_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences, torch.stack(out.logits)


def left_padded(lengths: tuple[int, ...] = (24, 17, 11), seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch: ``input_ids`` and ``attention_mask`` with rows of the given real lengths."""
    width = max(lengths)
    ids = prompt(len(lengths), width, seed)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, : width - n] = PAD
        mask[row, width - n :] = 1
    return ids, mask


def scorer_for(name: str, model):
    """A registered scorer by name, ready for ``model``: ``kvzap`` gets a seeded random surrogate of the
    model's shape (a trained one needs the real model; the cache's contract does not) that reads every
    input a surrogate can read, the context's length included (so a padded row must see its own length) and
    the last queries' window attention (so a padded row must be scored from its own queries)."""
    if name != "kvzap":
        return name
    from lukv_cache.scorers.kvzap import FEATURE_SETS, Surrogate, base_features, input_size, kvzap_scorer

    text = model.config.get_text_config()
    heads, head_dim = text.num_key_value_heads, getattr(text, "head_dim", None) or 16
    features = FEATURE_SETS[-1]  # keys, values, the window attention, the length and their products
    size = input_size(features, base_features(features, heads, head_dim))
    surrogate = Surrogate.zeros(text.num_hidden_layers, heads, size)
    surrogate.features = features
    gen = torch.Generator().manual_seed(0)
    surrogate.weight.copy_(torch.randn(surrogate.weight.shape, generator=gen))
    surrogate.bias.copy_(torch.randn(surrogate.bias.shape, generator=gen))
    surrogate.layers = list(range(text.num_hidden_layers))
    return kvzap_scorer(surrogate)
