"""A tiny random GPT-OSS (learned attention sinks, ``s_aux``) and a float64 reference of the compressed
attention that includes the sink; shared by the sink and output-attentions tests."""

from __future__ import annotations

import functools

import torch
from transformers import GptOssConfig, GptOssForCausalLM

from lukv_cache.cache.storage.ragged import RaggedStore
from lukv_cache.testing import PAD, VOCAB

# GPT-OSS alternates sliding and full layers; its sliding layers slide over 8 tokens (shorter than the
# prompts the tests use, so the window really slides)
SLIDING = 8


@functools.cache
def _cached(attn: str, layer_types: tuple[str, ...], seed: int):
    config = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: 2 query heads per KV head
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=SLIDING,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=None,
    )
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config).float().eval()
    # The initialiser draws sinks with std 0.02: next to ~20 keys of logit ~0 they would weigh nothing.
    # Spread them so that some heads put most of their mass on the sink and others almost none.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            sinks = layer.self_attn.sinks
            sinks.copy_(torch.empty(sinks.shape).uniform_(-2.0, 4.0, generator=gen))
    model.set_attn_implementation(attn)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    return model


def tiny_gpt_oss(
    attn: str = "eager",
    layer_types: tuple[str, ...] = ("sliding_attention", "full_attention"),
    seed: int = 0,
):
    """A seeded tiny random ``GptOssForCausalLM`` (fp32, 4 query heads, 2 KV heads, head_dim 16, MoE of
    4 experts) whose sinks matter. Cached: tests must not change it (``copy.deepcopy`` it first)."""
    return _cached(attn, tuple(layer_types), seed)


def _additive(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    return mask.double()


def dense_reference(store, query, suffix_keys, suffix_values, mask, scaling, s_aux=None, softcap=None):
    """float64 ``[B, Q, Hq, D]``: each query head over its KV head's stored tokens (read at their original
    positions in ``mask``) and the dense suffix (the mask's last ``S`` columns), one softmax whose
    denominator also holds ``exp(s_aux[head])`` (no value). A loop over heads, independent of the
    library's paths."""
    b, hq, q_len, _ = query.shape
    h, s = suffix_keys.shape[1], suffix_keys.shape[-2]
    g = hq // h
    bounds = store.offsets_list
    out = torch.zeros(b, hq, q_len, suffix_values.shape[-1], dtype=torch.float64)
    for row in range(b):
        for kv in range(h):
            lo, hi = bounds[row * h + kv], bounds[row * h + kv + 1]
            keys = torch.cat([store.keys[lo:hi], suffix_keys[row, kv]]).double()
            values = torch.cat([store.values[lo:hi], suffix_values[row, kv]]).double()
            for head in range(kv * g, (kv + 1) * g):
                logits = query[row, head].double() @ keys.T * scaling  # [Q, n + S]
                if softcap is not None:
                    logits = softcap * torch.tanh(logits / softcap)
                if mask is not None:
                    length = mask.shape[-1]
                    cols = torch.cat([store.positions[lo:hi].long(), torch.arange(length - s, length)])
                    logits = logits + _additive(mask[row if mask.shape[0] > 1 else 0, 0][:, cols])
                if s_aux is not None:
                    sink = s_aux[head].double().expand(q_len, 1)
                    logits = torch.cat([logits, sink], dim=-1)
                weights = torch.softmax(logits, dim=-1)[:, : keys.shape[0]]
                out[row, head] = weights @ values
    return out.transpose(1, 2)


def sink_case(counts, *, heads, q_len=1, g=2, d=16, suffix=5, dtype=torch.float32, seed=0):
    """A store of ``counts`` tokens per segment at increasing positions, a suffix after them, queries
    ``[B, Hq, Q, D]`` and sinks ``[Hq]`` spread from weightless to dominant."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(counts)
    positions = torch.cat(
        [torch.sort(torch.randperm(max(counts + [1]) + 8, generator=gen)[:c])[0] for c in counts]
    )
    store = RaggedStore.build(
        (3 * torch.randn(n, d, generator=gen)).to(dtype),
        torch.randn(n, d, generator=gen).to(dtype),
        positions,
        torch.tensor(counts),
        num_heads=heads,
    )
    b = len(counts) // heads
    query = torch.randn(b, heads * g, q_len, d, generator=gen).to(dtype)
    sk = torch.randn(b, heads, suffix + 4, d, generator=gen).to(dtype)[:, :, :suffix]
    sv = torch.randn(b, heads, suffix + 4, d, generator=gen).to(dtype)[:, :, :suffix]
    s_aux = torch.linspace(-3.0, 6.0, heads * g).to(dtype)
    length = max(counts + [1]) + 8 + suffix  # logical length: the store's positions, then the suffix
    return store, query, sk, sv, s_aux, length
