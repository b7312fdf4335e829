"""Saved contexts that must not go silently wrong (issue 42): a cache half-filled by an interrupted forward
is neither saved nor loaded, kept prefill scores follow the batch operations' rows into the file, a context
refuses a model with the same shapes but other weights, and a bad path or device is a typed error."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

from lukv_cache import LUKVCache, SavedContextError, load_cache, save_cache
from lukv_cache.cache import savefile
from lukv_cache.testing import prompt


class _Stop(Exception):
    pass


def _half_filled(model, stop_at: int) -> LUKVCache:
    """A cache whose forward raised in decoder layer ``stop_at``: the layers before it hold the prompt,
    the others nothing."""
    cache = LUKVCache(0.5, "keydiff", config=model.config)

    def stop(module, args):
        raise _Stop

    hook = model.model.layers[stop_at].register_forward_pre_hook(stop)
    try:
        with torch.no_grad(), pytest.raises(_Stop):
            model(prompt(1, 40), past_key_values=cache, use_cache=True)
    finally:
        hook.remove()
    assert [layer.get_seq_length() for layer in cache.layers] == [40] * stop_at + [0] * (4 - stop_at)
    return cache


def test_a_cache_a_forward_left_half_filled_is_not_saved(tmp_path):
    cache = _half_filled(tiny_model("llama", "sdpa", num_hidden_layers=4), stop_at=2)
    with pytest.raises(
        SavedContextError, match=r"layers 0-1: 40 tokens, layers 2-3: 0 tokens.*Re-run the prompt"
    ):
        save_cache(cache, tmp_path / "context.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_a_file_of_a_half_filled_cache_is_not_loaded(tmp_path, monkeypatch):
    model = tiny_model("llama", "sdpa", num_hidden_layers=4)
    cache = _half_filled(model, stop_at=3)
    # written as lukv_cache did before save refused such a cache: only the empty layer tells
    monkeypatch.setattr(savefile, "_check_savable", lambda cache, path: None)
    path = save_cache(cache, tmp_path / "context.safetensors")
    monkeypatch.undo()
    with pytest.raises(
        SavedContextError, match=r"layers 0-2: 40 tokens, layer 3: 0 tokens.*Re-run the prompt"
    ):
        load_cache(path, model)


# ---------------------------------------------------------------------------------- kept scores, batch rows
BATCH_OPS = {
    "reorder_cache": (lambda cache: cache.reorder_cache(torch.tensor([2, 0, 1])), [2, 0, 1]),
    "batch_repeat_interleave": (lambda cache: cache.batch_repeat_interleave(2), [0, 0, 1, 1, 2, 2]),
    "batch_select_indices": (lambda cache: cache.batch_select_indices([0, 2]), [0, 2]),
}


def _scored():
    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(0.5, "keydiff", keep_scores=True, config=model.config)
    with torch.no_grad():
        model(torch.cat([prompt(1, 40, seed=s) for s in range(3)]), past_key_values=cache, use_cache=True)
    return model, cache


@pytest.mark.parametrize("op", list(BATCH_OPS))
def test_a_batch_operation_moves_the_kept_prefill_scores_with_their_rows(op):
    _, cache = _scored()
    before = {idx: scores.clone() for idx, scores in cache.prefill_scores.items()}
    apply, rows = BATCH_OPS[op]
    apply(cache)
    assert cache.prefill_scores.keys() == before.keys()
    for idx, scores in cache.prefill_scores.items():
        assert torch.equal(scores, before[idx][rows])


@pytest.mark.parametrize("op", list(BATCH_OPS))
def test_a_cache_with_kept_scores_saves_and_loads_after_a_batch_operation(op, tmp_path):
    model, cache = _scored()
    BATCH_OPS[op][0](cache)
    loaded = load_cache(save_cache(cache, tmp_path / "context.safetensors"), model)
    assert torch.equal(loaded.stored_tokens(), cache.stored_tokens())
    for idx, scores in cache.prefill_scores.items():
        assert torch.equal(loaded.prefill_scores[idx], scores)
