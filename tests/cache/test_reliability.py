"""No silent wrong results: a batch mismatch, a huge window, scores of -inf, bad arguments of every kind."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

from lukv_cache import BatchMismatchError, ConfigurationError, LUKVCache, register_scorer
from lukv_cache.scorers import SCORERS
from lukv_cache.testing import array_profile, left_padded, prompt


def test_a_forward_with_another_batch_size_raises_and_leaves_the_cache_unchanged():
    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(0.5)
    with torch.no_grad():
        model(prompt(2, 40), past_key_values=cache)
    stored, length = cache.stored_tokens().clone(), cache.get_seq_length()
    with pytest.raises(BatchMismatchError, match="batch of 2") as info:
        with torch.no_grad():
            model(prompt(1, 1, seed=3), past_key_values=cache)
    assert (info.value.expected, info.value.got) == (2, 1)
    assert torch.equal(cache.stored_tokens(), stored) and cache.get_seq_length() == length
    with torch.no_grad():  # and it still works with the right batch
        model(prompt(2, 1, seed=3), past_key_values=cache)
    assert cache.get_seq_length() == length + 1


def test_a_batch_mismatch_on_a_sliding_first_layer_is_the_same_typed_error():
    model = tiny_model("gemma2", "eager")
    cache = LUKVCache(0.5, config=model.config)
    with torch.no_grad():
        model(prompt(2, 30), past_key_values=cache)
        with pytest.raises(BatchMismatchError):
            model(prompt(3, 1), past_key_values=cache)


def test_a_huge_window_never_sizes_a_buffer():
    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(0.5, "keydiff", window=60_000)
    with torch.no_grad():
        model(prompt(1, 30), past_key_values=cache)
    # 30 tokens x 2 heads x 16 dims x 2 (K, V) x 4 bytes per layer, plus 16 tokens of room: a few KB
    assert cache.memory_bytes() < 64 * 1024


def test_minus_inf_scores_never_drop_a_head_below_its_minimum_under_left_padding(monkeypatch):
    monkeypatch.setattr(SCORERS, "_items", dict(SCORERS._items))

    @register_scorer("test_minus_inf")
    def minus_inf(keys, values, queries):
        scores = torch.full(keys.shape[:3], float("-inf"))
        scores[..., ::7] = torch.nan
        return scores

    model = tiny_model("llama", "sdpa")
    ids, mask = left_padded((50, 20), seed=5)
    cache = LUKVCache(0.95, "test_minus_inf", sink=4, window=1)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    for layer in cache.layers:
        for row, real in enumerate(mask.sum(-1).tolist()):
            pad = 50 - real
            for head in range(2):
                seg = row * 2 + head
                lo, hi = layer.store.offsets_list[seg], layer.store.offsets_list[seg + 1]
                positions = layer.store.positions[lo:hi]
                assert (positions >= pad).all(), "padding was kept"
                assert hi - lo >= 4 + 1, "no evictable token kept beyond the sinks"


@pytest.mark.parametrize(
    "fn",
    [
        lambda keys, values, queries: keys.norm(dim=-1)[..., :-1],  # wrong length
        lambda keys, values, queries: keys.norm(dim=-1).tolist(),  # not a tensor
        lambda keys, values, queries: keys.norm(dim=-1).long(),  # not float
        lambda keys, values, queries: 1 / 0,  # crashes
    ],
    ids=["shape", "list", "int", "raises"],
)
def test_a_scorer_that_cannot_work_is_refused_at_registration(monkeypatch, fn):
    monkeypatch.setattr(SCORERS, "_items", dict(SCORERS._items))
    with pytest.raises(ConfigurationError, match="test_bad") as info:
        register_scorer("test_bad", fn)
    assert "B, H_kv, T" in str(info.value)
    assert "test_bad" not in SCORERS


def test_a_scorer_object_with_the_wrong_shape_is_a_configuration_error_at_prefill():
    from lukv_cache import Scorer

    model = tiny_model("llama", "sdpa")
    bad = Scorer("sneaky", lambda keys, values, queries: keys.norm(dim=-1)[:, :1])
    with pytest.raises(ConfigurationError, match=r"sneaky.*\[B, H_kv, T\]"):
        with torch.no_grad():
            model(prompt(1, 30), past_key_values=LUKVCache(0.5, bad))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_keep": None},
        {"min_keep": "0.1"},
        {"allocator": "profile", "evict_ratio": [["a", "b"], ["c", "d"]]},
        {"allocator": "profile", "evict_ratio": torch.full((2, 2), 0.5, dtype=torch.bfloat16)[:, :0]},
        {"allocator": "profile", "evict_ratio": torch.full((2, 2), 0.5).bool()},
    ],
    ids=["min_keep-None", "min_keep-str", "table-str", "table-empty", "table-bool"],
)
def test_bad_cache_arguments_raise_configuration_error(kwargs):
    with pytest.raises(ConfigurationError):
        LUKVCache(0.5, **kwargs)


def test_a_bfloat16_table_is_read_as_numbers():
    cache = LUKVCache(allocator="profile", evict_ratio=torch.full((2, 2), 0.5, dtype=torch.bfloat16))
    model = tiny_model("llama", "sdpa")
    with torch.no_grad():
        model(prompt(1, 45), past_key_values=cache)
    assert (cache.stored_tokens() == 20 + 5).all()


@pytest.mark.parametrize(
    "ratio", [__import__("numpy").float32(0.5), torch.tensor(0.5), __import__("numpy").float64(0.25)]
)
def test_ratio_accepts_numpy_and_zero_dim_torch_numbers(ratio):
    assert LUKVCache(ratio).ratio == pytest.approx(float(ratio))


@pytest.mark.parametrize(
    "ratio", [__import__("numpy").bool_(True), torch.tensor(True), torch.tensor([0.5]), float("nan")]
)
def test_ratio_refuses_bools_vectors_and_nan(ratio):
    with pytest.raises(ConfigurationError, match="ratio"):
        LUKVCache(ratio)


@pytest.mark.parametrize("length", [40, 120, 300])
def test_a_token_budget_bounds_every_head_whatever_the_prompt_length(length):
    model = tiny_model("llama", "sdpa", max_position_embeddings=512)
    cache = LUKVCache(max_tokens=32, scorer="keydiff")
    with torch.no_grad():
        model(prompt(1, length, seed=6), past_key_values=cache)
    stored = cache.stored_tokens()
    if length <= 32:
        assert (stored == length).all()
    else:
        assert abs(float(stored.double().mean()) - 32) <= 1 and int(stored.max()) <= 33


def test_a_token_budget_gives_each_row_of_a_padded_batch_its_own_ratio():
    model = tiny_model("llama", "sdpa")
    ids, mask = left_padded((120, 60, 20), seed=7)
    cache = LUKVCache(max_tokens=30)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    per_row = cache.stored_tokens().double().mean(dim=(0, 2))
    assert abs(per_row[0] - 30) <= 1 and abs(per_row[1] - 30) <= 1
    assert per_row[2] == 20  # fits: kept whole


def test_a_token_budget_with_a_profile_reads_it_at_each_prompts_ratio(tmp_path):
    import numpy as np

    grid = np.array([0.25, 0.5, 0.75, 0.85], dtype=np.float32)
    ratios = np.stack([np.full((2, 2), r, dtype=np.float32) for r in grid])
    ratios[:, 0, 0] -= 0.1  # layer 0, head 0 keeps more at every ratio; the mean stays the grid's
    ratios[:, 1, 1] += 0.1
    path = array_profile(grid, ratios).save(tmp_path / "p.safetensors")
    cache = LUKVCache.from_pretrained(path, max_tokens=40)
    model = tiny_model("llama", "sdpa")
    with torch.no_grad():
        model(prompt(1, 205, seed=8), past_key_values=cache)
    stored = cache.stored_tokens()[:, 0]
    assert abs(float(stored.double().mean()) - 40) <= 1 and stored[0, 0] > stored[0, 1]


def test_ratio_and_max_tokens_together_is_a_configuration_error():
    with pytest.raises(ConfigurationError, match="either ratio"):
        LUKVCache(0.5, max_tokens=64)
    with pytest.raises(ConfigurationError, match="max_tokens"):
        LUKVCache(max_tokens=0)


@pytest.mark.parametrize("allocator", ["uniform", "global"])
def test_reset_after_a_forward_interrupted_inside_a_layer_gives_a_fresh_cache(allocator):
    """Ctrl-C or out of memory between a layer's update and its attention left the cache waiting for that
    attention (IncompatibleAttentionError) or half-deferred (TypeError) on the retry."""
    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 40, seed=3)
    cache = LUKVCache(0.5, allocator=allocator)
    update = cache.update

    def failing_update(keys, values, layer_idx, *args, **kwargs):
        out = update(keys, values, layer_idx, *args, **kwargs)
        if layer_idx == 1:
            raise MemoryError("out of memory inside layer 1")
        return out

    cache.update = failing_update
    with pytest.raises(MemoryError), torch.no_grad():
        model(ids, past_key_values=cache)
    del cache.update
    cache.reset()
    fresh = LUKVCache(0.5, allocator=allocator)
    with torch.no_grad():
        got, want = model(ids, past_key_values=cache), model(ids, past_key_values=fresh)
    assert torch.equal(got.logits, want.logits)
    assert torch.equal(cache.stored_tokens(), fresh.stored_tokens())


def test_assisted_decoding_from_a_filled_cache_is_refused_with_the_reason():
    """transformers' assisted generation feeds the whole prompt again: after cache.prefill it was stored a
    second time, uncompressed (833 logical tokens for 433, and other tokens than greedy)."""
    model, assistant = tiny_model("llama", "sdpa"), tiny_model("llama", "sdpa", seed=1)
    ids = prompt(1, 60, seed=3)
    cache = LUKVCache(0.5)
    cache.prefill(model, ids)
    question = torch.cat([ids, prompt(1, 4, seed=5)], dim=1)
    with pytest.raises(ConfigurationError, match="Assisted decoding cannot start from a filled cache"):
        model.generate(
            question, past_key_values=cache, max_new_tokens=4, do_sample=False, assistant_model=assistant
        )


def test_beam_search_after_prefill_says_how_to_repeat_the_rows():
    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 40, seed=3)
    cache = LUKVCache(0.5)
    cache.prefill(model, ids)
    question = torch.cat([ids, torch.tensor([[11, 12]])], dim=1)
    with pytest.raises(BatchMismatchError, match=r"batch_repeat_interleave\(n\)"):
        model.generate(question, past_key_values=cache, max_new_tokens=2, num_beams=2, do_sample=False)
    cache.batch_repeat_interleave(2)
    out = model.generate(question, past_key_values=cache, max_new_tokens=2, num_beams=2, do_sample=False)
    assert out.shape == (1, question.shape[1] + 2)


def test_a_model_whose_every_layer_slides_warns_that_nothing_is_compressed():
    # under sliding="keep" the prompt decides (issue 30): one longer than the window leaves the sliding
    # layers stock, warned then
    model = tiny_model("mistral", "sdpa", sliding_window=16)
    cache = LUKVCache(0.9, config=model.config, sliding="keep")
    with pytest.warns(UserWarning, match="leaves every layer of this model alone"), torch.no_grad():
        model(prompt(1, 60), past_key_values=cache)
    assert not cache.is_compressed
    gemma2 = tiny_model("gemma2", "eager")
    cache = LUKVCache(0.5, config=gemma2.config, sliding="keep")
    with pytest.warns(UserWarning, match=r"layers \[0, 2\]"), torch.no_grad():  # sliding, full, sliding
        gemma2(prompt(1, 12), past_key_values=cache)
