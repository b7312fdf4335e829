"""Regression tests for the profile build's memory (issue 13): what the oracle pass and the prefill
scores hold, measured deterministically as the bytes of live tensors (torch's own allocation events,
not RSS), on tiny random models."""

import gc
import warnings

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import lukv_cache.profiling.oracle as oracle_module
import lukv_cache.profiling.scores as scores_module
from lukv_cache.cache import LUKVCache
from lukv_cache.profiling.oracle import oracle_importance, prefill_context
from lukv_cache.profiling.scores import prefill_scores
from lukv_cache.testing import tiny_model


def _largest_op_allocation(fn):
    """``fn()`` and the most bytes one torch op allocated in it (torch's allocation events, not RSS)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    return result, max(e.cpu_memory_usage for e in prof.events())


def _is_tensor(obj) -> bool:
    try:
        return isinstance(obj, torch.Tensor)
    except ReferenceError:  # a weakref.proxy whose referent is gone (another module's, in gc's list)
        return False


def _held_bytes() -> int:
    """Bytes of the distinct storages of every tensor Python objects hold right now."""
    storages = {}
    with warnings.catch_warnings():  # isinstance on some deprecated module attributes warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if _is_tensor(obj)]
    for tensor in tensors:
        if isinstance(tensor, torch.nn.Parameter):
            continue
        try:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        except RuntimeError:  # fake or functional tensors left by earlier compile/export tests: no memory
            continue
    return sum(storages.values())


def _model(layers=4, vocab=128):
    return tiny_model(
        num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=1024, pad_token_id=None
    )


def _kv_bytes(model, tokens):
    cfg = model.config
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * tokens * 4


def test_oracle_decoding_holds_no_copy_of_the_context_and_nothing_per_step(monkeypatch):
    model = _model()
    t = 600
    context, question = torch.randint(0, 128, (1, t)), torch.randint(0, 128, (1, 8))
    state = prefill_context(model, context)
    kv = _kv_bytes(model, t)
    held = []
    real = oracle_module._rows_attention

    def observe(rec, *args):  # at every attention call of the decoding: what is held
        out = real(rec, *args)
        held.append(_held_bytes())
        return out

    monkeypatch.setattr(oracle_module, "_rows_attention", observe)
    baseline = _held_bytes()  # weights' buffers, the context state
    imp_short, answer_short = oracle_importance(model, state, question, k_max=4)
    short = max(held) - baseline
    held.clear()
    imp_long, answer_long = oracle_importance(model, state, question, k_max=48)
    long = max(held) - baseline
    assert len(answer_long) == 48 and answer_long[:4] == answer_short
    # a copy of the context cache per question (deepcopy, or concatenating onto it) is a whole `kv`;
    # one layer's attention row and the question's own tokens are a few percent of it
    assert long < kv / 4, (long, kv)
    # decoding 12x more tokens holds nothing more per step (attention of every step, stacked logits...)
    # than the 44 answer tokens' own keys and values
    assert long - short < kv / 20 + _kv_bytes(model, 44), (short, long, kv)
    # the context is left as it was for the next question
    again, answer_again = oracle_importance(model, state, question, k_max=4)
    assert answer_again == answer_short
    np.testing.assert_array_equal(again, imp_short)


def test_context_prefill_keeps_no_logits_of_the_context():
    model = _model(layers=2, vocab=4096)
    t = 500
    context = torch.randint(0, 4096, (1, t))
    _, largest = _largest_op_allocation(lambda: prefill_context(model, context))
    # [T, vocab] fp32 logits would be 8 MB; the largest activation is [T, intermediate] (256 kB)
    assert largest < t * 4096 * 4 / 8, largest


def test_prefill_scores_never_hold_the_whole_context(monkeypatch):
    model = _model(layers=4)
    ids = torch.randint(0, 128, (1, 300))
    caches = []

    class Spy(LUKVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            caches.append(self)

    monkeypatch.setattr(scores_module, "LUKVCache", Spy)
    for name in ("keydiff", "snapkv", "knorm"):
        got = prefill_scores(model, ids, name)
        kept = LUKVCache(ratio=0.0, scorer=name, config=model.config, sink=0, window=0, keep_scores=True)
        kept.prefill(model, ids)
        for layer, scores in enumerate(got):  # the same scores as a keep-everything cache
            torch.testing.assert_close(scores, kept.prefill_scores[layer], rtol=0, atol=0)
        assert caches[-1].memory_bytes() < _kv_bytes(model, ids.shape[1]) / 10
