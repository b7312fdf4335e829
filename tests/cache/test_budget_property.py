"""A memory budget covers everything the cache holds (``memory_bytes()``: stores, positions, offsets, the dense
decode room, kept queries and, with ``keep_scores=True``, the prefill scores), after every forward: the
prompt, each decoding step, a second multi-token forward, a fork's question. ``max_bytes=N`` is ``N`` per
row whatever the length; ``memory=f`` is ``f`` times what a ``DynamicCache`` holds for the tokens seen so far
(so ``memory=1.0`` is the whole cache, exactly ``DynamicCache``'s logits and bytes)."""

from __future__ import annotations

import pytest
import torch
from helpers import scorer_for, tiny_model
from test_memory_budget import _full_bytes
from test_memory_mixed import _cache as _mixed_cache
from test_memory_mixed import _model as _mixed_model
from test_memory_mixed import profile_path  # noqa: F401  (a fixture: a profile whose table mixes widths)
from transformers import DynamicCache

from lukv_cache import LUKVCache
from lukv_cache._compat import cache_kwarg
from lukv_cache.scorers import SCORERS
from lukv_cache.testing import left_padded, prompt

DECODE_STEPS = 20
QUESTION = 50  # a second multi-token forward: a question after the context


def _forward(model, cache, ids, mask=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})


def _bound(options: dict, model, rows: int, length: int) -> int:
    """The bytes the whole cache may hold after a forward that brought it to ``length`` tokens."""
    if "max_bytes" in options:
        return options["max_bytes"] * rows
    return int(options["memory"] * _full_bytes(model, prompt(rows, length)))


def _run_and_check(model, cache, options: dict, ids, mask=None) -> list[float]:
    """The prompt, decoding steps, a question, more decoding steps: after each forward the cache's bytes
    against the bound; returns every step's bytes / bound."""
    rows, seen = ids.shape[0], []

    def check():
        bound = _bound(options, model, rows, cache.get_seq_length())
        seen.append(cache.memory_bytes() / bound)
        assert cache.memory_bytes() <= bound, (len(seen), cache.memory_bytes(), bound)

    out = _forward(model, cache, ids, mask)
    check()
    for phase in ("decode", "question", "decode"):
        if phase == "question":
            question = prompt(rows, QUESTION, seed=11)
            mask = None if mask is None else torch.cat([mask, torch.ones_like(question)], 1)
            out = _forward(model, cache, question, mask)
            check()
            continue
        for _ in range(DECODE_STEPS):
            token = out.logits[:, -1:].argmax(-1)
            mask = None if mask is None else torch.cat([mask, torch.ones_like(token)], 1)
            out = _forward(model, cache, token, mask)
            check()
    return seen


@pytest.mark.parametrize(
    "options",
    [
        dict(memory=0.12),  # 8 bits
        dict(memory=0.05),  # 4 bits
        dict(memory=0.6),  # the model's precision keeps most tokens
        dict(memory=0.12, keep_scores=True),
        dict(max_bytes=20_000),
        dict(max_bytes=20_000, keep_scores=True),
        dict(memory=0.12, decode_max_tokens=150),
        dict(max_bytes=60_000, decode_max_tokens=400, scorer="snapkv", allocator="adakv"),
        dict(memory=0.12, scorer="snapkv", keep_scores=True),
    ],
    ids=repr,
)
def test_the_budget_holds_after_every_forward(options):
    model = tiny_model("llama", "sdpa")
    keep_scores = options.get("keep_scores", False)
    cache_options = {k: v for k, v in options.items() if k != "keep_scores"}
    cache = LUKVCache(**cache_options, keep_scores=keep_scores)
    seen = _run_and_check(model, cache, options, prompt(1, 300, seed=2))
    if cache.memory_choice.ratio > 0:  # the budget is used, not only respected (unless it holds every token)
        assert max(seen) > 0.8


@pytest.mark.parametrize("options", [dict(memory=0.12), dict(max_bytes=20_000, keep_scores=True)], ids=repr)
def test_the_budget_holds_for_padded_batches(options):
    model = tiny_model("llama", "sdpa")
    ids, mask = left_padded((300, 211), seed=3)
    keep_scores = options.get("keep_scores", False)
    cache = LUKVCache(**{k: v for k, v in options.items() if k != "keep_scores"}, keep_scores=keep_scores)
    _run_and_check(model, cache, options, ids, mask)


def test_the_budget_holds_with_per_layer_widths(profile_path):  # noqa: F811
    model = _mixed_model()
    cache = _mixed_cache(profile_path, memory=0.15)
    _run_and_check(model, cache, dict(memory=0.15), prompt(1, 400, seed=1))
    assert isinstance(cache.kv_bits, tuple)  # the mix was chosen


def test_a_fork_holds_the_budget_with_its_question():
    model = tiny_model("llama", "sdpa")
    ids = prompt(1, 300, seed=4)
    cache = LUKVCache(memory=0.12)
    cache.prefill(model, ids)
    fork = cache.fork()
    _forward(model, fork, prompt(1, QUESTION, seed=9))
    assert fork.memory_bytes() <= int(0.12 * _full_bytes(model, prompt(1, 300 + QUESTION)))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_memory_one_is_the_whole_cache(attn):
    """``memory=1.0``: nothing evicted, nothing quantized: DynamicCache's logits and bytes, step by step."""
    model = tiny_model("llama", attn)
    ids = prompt(1, 120, seed=5)
    ours, theirs = LUKVCache(memory=1.0), DynamicCache()
    a, b = _forward(model, ours, ids), _forward(model, theirs, ids)
    for step in range(12):
        assert torch.equal(a.logits, b.logits), step
        assert ours.memory_bytes() == _dynamic_bytes(theirs)
        token = a.logits[:, -1:].argmax(-1)
        ids = prompt(1, 30, seed=step) if step == 5 else token  # a second multi-token forward too
        a, b = _forward(model, ours, ids), _forward(model, theirs, ids)
    assert ours.kv_bits is None and ours.memory_choice is None


def test_a_second_multi_token_forward_grows_the_cache_as_dynamic_cache_does():
    """Ratio 0 keeps every token: a 200-token forward after the prompt adds the bytes DynamicCache adds (its
    buffer was sized twice the tokens before), plus their positions."""
    model = tiny_model("llama", "sdpa")
    ours, theirs = LUKVCache(0.0), DynamicCache()
    for ids in (prompt(1, 300, seed=1), prompt(1, 200, seed=2)):
        before = ours.memory_bytes(), _dynamic_bytes(theirs)
        _forward(model, ours, ids), _forward(model, theirs, ids)
    grew = ours.memory_bytes() - before[0]
    assert grew <= (_dynamic_bytes(theirs) - before[1]) * 1.05


def _dynamic_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@pytest.mark.parametrize("memory", [0.3, 0.15])
def test_a_padded_row_keeps_what_it_keeps_alone(memory):
    """Each row's budget counts its real tokens, not the batch's padding (at 0.3 a 150-token row beside a
    300-token one kept every token, alone 109 per head)."""
    model = tiny_model("llama", "sdpa")
    ids, mask = left_padded((300, 150), seed=3)
    batch, alone = LUKVCache(memory=memory), LUKVCache(memory=memory)
    _forward(model, batch, ids, mask)
    _forward(model, alone, ids[1:, -150:])
    assert batch.kv_bits == alone.kv_bits  # the bits are chosen for the batch (docs/memory.md, Limits)
    assert torch.equal(batch.stored_tokens()[:, 1], alone.stored_tokens()[:, 0])
    for layer in range(2):
        for head in range(2):
            kept_in_batch = batch.layers[layer].head_tokens(1, head)[0] - 150  # the row's own columns
            assert torch.equal(kept_in_batch, alone.layers[layer].head_tokens(0, head)[0])


def test_under_a_budget_a_fold_comes_every_eight_decoded_tokens():
    """``fold_interval=None`` means 8 under a budget (docs/memory.md); each fold evicts to the bytes. After a
    second 200-token forward nothing folded for 24 steps (its suffix buffer had doubled)."""
    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(memory=0.12)
    steps = []
    cache.compressor.observe(steps.append)
    out = _forward(model, cache, prompt(1, 300, seed=2))
    out = _forward(model, cache, prompt(1, 200, seed=3))
    folds_before = sum(step.kind == "fold" for step in steps)
    for _ in range(24):
        out = _forward(model, cache, out.logits[:, -1:].argmax(-1))
    assert sum(step.kind == "fold" for step in steps) - folds_before == 3


@pytest.mark.parametrize("name", [n for n in SCORERS.names() if SCORERS.get(n).reconstruction is None])
def test_every_scorer_holds_the_budget_while_decoding(name):
    """Every fold evicts with the cache's scorer (kvzap, the one line's, reads every KV head of a token: its
    folds reuse each token's first score, kept with the token and counted in the bytes)."""
    model = tiny_model("llama", "sdpa")
    cache = LUKVCache(memory=0.15, scorer=scorer_for(name, model))
    _run_and_check(model, cache, dict(memory=0.15), prompt(1, 300, seed=2))
