"""bf16 and fp16 models: the cache stores in the model's dtype and stays as close to an fp32 run as
DynamicCache does (attention is accumulated in fp32)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model
from test_exactness import AttentionRecorder
from transformers import DynamicCache

from lukv_cache import LUKVCache
from lukv_cache.cache.storage.layer import LUKVLayer
from lukv_cache.testing import left_padded, prompt

# logits of these tiny models are below 1 in magnitude: a few units in the last place of each dtype
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
STEPS = 4


def teacher_forced_logits(model, cache, ids, mask, continuation) -> torch.Tensor:
    """Logits of the prompt's last token, then of each continuation token fed one at a time (fp32)."""
    outputs = []
    with torch.no_grad():
        outputs.append(model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits[:, -1:])
        for step in range(continuation.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            step_ids = continuation[:, step : step + 1]
            outputs.append(model(input_ids=step_ids, attention_mask=mask, past_key_values=cache).logits)
    return torch.cat(outputs, dim=1).float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("arch", "attn"), [("llama", "sdpa"), ("qwen3", "eager"), ("gemma2", "eager")])
def test_keep_all_in_low_precision_is_as_close_to_fp32_as_dynamic_cache(arch, attn, dtype):
    ids, mask = left_padded((30, 22, 15))
    continuation = prompt(3, STEPS, seed=9)
    reference = teacher_forced_logits(tiny_model(arch, attn), DynamicCache(), ids, mask, continuation)
    model = tiny_model(arch, attn, dtype)
    dense = teacher_forced_logits(model, DynamicCache(), ids, mask, continuation)
    cache = LUKVCache(0.0)
    ours = teacher_forced_logits(model, cache, ids, mask, continuation)
    torch.testing.assert_close(ours, dense, atol=TOLERANCE[dtype], rtol=0)
    assert (ours - reference).abs().max() <= 1.5 * (dense - reference).abs().max() + 1e-3
    for layer in cache.layers:
        if isinstance(layer, LUKVLayer):
            assert layer.store.keys.dtype == layer.store.values.dtype == dtype
            assert layer.keys.dtype == layer.values.dtype == dtype
            assert layer.store.positions.dtype == torch.int16  # a short prompt: int16 positions


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_ragged_attention_in_low_precision_matches_the_dense_reference(monkeypatch, dtype):
    model = tiny_model("llama", "sdpa", dtype)
    ids, mask = left_padded((60, 47, 40), seed=11)
    full_mask = torch.cat([mask, torch.ones(3, 3, dtype=mask.dtype)], dim=1)
    cache = LUKVCache(0.8, "keydiff")
    recorder = AttentionRecorder(monkeypatch, lambda: full_mask, cache)
    out = model.generate(
        input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=3, do_sample=False
    )
    assert out.shape == (3, 63)
    assert recorder.diffs
    # the output is rounded to the model dtype once, after fp32 accumulation
    tolerance = {torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert all(d[2] < tolerance for d in recorder.diffs), recorder.diffs
    assert all(layer.store.keys.dtype == dtype for layer in cache.layers)
