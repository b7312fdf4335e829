"""``decode_max_tokens=N`` is a hard bound right after every fold: each row holds at most N tokens per
(full-attention layer, KV head) on average, sinks and window included, even when the layers hold very
different amounts (an uneven table, a lopsided profile) and rows of one padded batch differ in length."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import tiny_model
from transformers import LogitsProcessor, LogitsProcessorList

from lukv_cache import LUKVCache
from lukv_cache.cache.storage.layer import LUKVLayer
from lukv_cache.profiles import Profile
from lukv_cache.testing import array_profile, left_padded

BOUND = 120


class AfterFolds(LogitsProcessor):
    """Mean tokens per head of each row, read right after every forward whose layers all folded."""

    def __init__(self, cache: LUKVCache):
        self.cache, self.after_fold = cache, []

    def __call__(self, input_ids, scores):
        layers = [layer for layer in self.cache.layers if isinstance(layer, LUKVLayer)]
        if layers[0].compressed and all(layer.suffix_length == 0 for layer in layers):
            counts = torch.stack([layer.stored_counts() for layer in layers]).double()  # [L, B, H]
            self.after_fold.append(counts.mean((0, 2)))
        return scores


def _lopsided(model) -> Profile:
    """Layer 0 keeps almost nothing at every ratio, layer 1 almost everything."""
    grid = np.array([0.1, 0.5, 0.9], dtype=np.float32)
    table = np.zeros((3, 2, 2), dtype=np.float32)
    table[:, 0], table[:, 1] = 0.98, 0.02
    return array_profile(grid, table, head_dim=16)


CASES = {
    "uniform": dict(allocator="uniform"),
    "uneven_table": dict(allocator="profile", evict_ratio=torch.tensor([[0.98, 0.98], [0.02, 0.02]])),
    "lopsided_profile": dict(allocator="profile", profile=True),
    "adakv": dict(allocator="adakv"),
}


@pytest.mark.parametrize("fold_interval", [16, 40])
@pytest.mark.parametrize("decode_window", [None, 8, 100])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_bound_holds_right_after_every_fold(case, decode_window, fold_interval):
    model = tiny_model("llama", "sdpa", max_position_embeddings=4096)
    spec = dict(CASES[case])
    kwargs = {"allocator_kwargs": {"profile": _lopsided(model)}} if spec.pop("profile", False) else {}
    cache = LUKVCache(
        scorer="keydiff",
        decode_max_tokens=BOUND,
        decode_window=decode_window,
        fold_interval=fold_interval,
        **spec,
        **kwargs,
    )
    ids, mask = left_padded((1, 150, 60), seed=5)  # a 1-token row beside long ones
    watch = AfterFolds(cache)
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=3 * fold_interval + 150,
            do_sample=False,
            logits_processor=LogitsProcessorList([watch]),
        )
    assert len(watch.after_fold) >= 3
    worst = torch.stack(watch.after_fold).max()
    assert float(worst) <= BOUND + 1e-9, float(worst)


@pytest.mark.parametrize("scorer", ["keydiff", "snapkv"])
def test_a_one_token_row_of_a_padded_batch_decodes_as_it_does_alone(scorer):
    """Alone, a 1-token prompt is the prompt too: its folds come at the same steps as in the batch."""
    model = tiny_model("llama", "sdpa", max_position_embeddings=4096)
    lengths = (30, 1)
    ids, mask = left_padded(lengths, seed=7)
    settings = dict(scorer=scorer, decode_max_tokens=24, fold_interval=16, sink=2, window=3)
    steps = 50
    with torch.no_grad():
        batch = model.generate(
            ids,
            attention_mask=mask,
            past_key_values=LUKVCache(**settings),
            max_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        for row, n in enumerate(lengths):
            alone = model.generate(
                ids[row : row + 1, -n:],
                past_key_values=LUKVCache(**settings),
                max_new_tokens=steps,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            got = torch.stack(batch.logits)[:, row]
            want = torch.stack(alone.logits)[:, 0]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
