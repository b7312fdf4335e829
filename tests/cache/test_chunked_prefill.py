"""Chunked prefill compresses every chunk of a cache built with ``prefill_chunk_size=C``: transformers'
``generate(prefill_chunk_size=C)`` and forwards chunked by hand keep the same tokens, within the promise of
the unchunked run; a question sent after a context is still appended whole, and without the option the
cache cannot tell generate's later chunks from a question (it keeps them whole)."""

from __future__ import annotations

import pytest
import torch
from helpers import scorer_for, tiny_model
from test_registry_contracts import _cache_args, _flat_profile

from lukv_cache import LUKVCache
from lukv_cache.allocation import ALLOCATORS
from lukv_cache.cache.layer import LUKVLayer
from lukv_cache.scorers import SCORERS, get_scorer
from lukv_cache.testing import left_padded, prompt

FORWARD_SCORERS = [n for n in SCORERS.names() if get_scorer(n).reconstruction is None]
CHUNK, LENGTH = 32, 128


def _full_counts(cache) -> torch.Tensor:
    """int64 ``[full layers, B, H]``: tokens held per head of the compressed (full-attention) layers."""
    return cache.stored_tokens()[[isinstance(layer, LUKVLayer) for layer in cache.layers]]


def _generate(model, ids, cache, mask=None, chunk=None) -> None:
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=1,  # the prompt only: no decode step runs
            do_sample=False,
            prefill_chunk_size=chunk,
        )


def _own_chunks(model, ids, cache) -> None:
    with torch.no_grad():
        for start in range(0, ids.shape[1], CHUNK):
            model(ids[:, start : start + CHUNK], past_key_values=cache, use_cache=True)


def _cache(scorer, allocator, model, **kwargs) -> LUKVCache:
    args = _cache_args(allocator)
    if "profile" in args:  # the flat curve, for this model's layer count
        args = {"profile": _flat_profile(model.config.num_hidden_layers)}
    return LUKVCache(scorer=scorer_for(scorer, model), allocator=allocator, allocator_kwargs=args, **kwargs)


@pytest.mark.parametrize("allocator", ALLOCATORS.names())
@pytest.mark.parametrize("scorer", FORWARD_SCORERS)
def test_generate_chunked_prefill_keeps_what_the_caches_own_chunking_keeps(scorer, allocator):
    model, ids = tiny_model("llama"), prompt(1, LENGTH, seed=2)
    through_generate = _cache(scorer, allocator, model, ratio=0.8, prefill_chunk_size=CHUNK)
    _generate(model, ids, through_generate, chunk=CHUNK)
    own = _cache(scorer, allocator, model, ratio=0.8, prefill_chunk_size=CHUNK)
    _own_chunks(model, ids, own)
    assert torch.equal(through_generate.stored_tokens(), own.stored_tokens())
    whole = _cache(scorer, allocator, model, ratio=0.8)
    _generate(model, ids, whole)
    if not whole.allocator.adaptive:  # the ratio holds within a token per chunk per head
        chunks = LENGTH // CHUNK
        gap = through_generate.stored_tokens().float().mean() - whole.stored_tokens().float().mean()
        assert gap.abs() <= chunks
        # appending the later chunks whole would hold more than the chunks after the first
        assert float(_full_counts(through_generate).float().mean()) < LENGTH - CHUNK


@pytest.mark.parametrize("bound", ["max_tokens", "decode_max_tokens"])
@pytest.mark.parametrize("allocator", ALLOCATORS.names())
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_token_bound_holds_after_every_chunk_of_generates_chunked_prefill(arch, allocator, bound):
    model = tiny_model(arch, "eager" if arch == "gemma2" else "sdpa")
    ids, mask = left_padded((LENGTH - 3, 70, 40), seed=4)
    cache = _cache("keydiff", allocator, model, prefill_chunk_size=20, **{bound: 24})
    _generate(model, ids, cache, mask=mask, chunk=20)  # the last chunk is shorter
    per_row = _full_counts(cache).float().mean(dim=(0, 2))  # [B]
    assert bool((per_row <= 24 + 1e-6).all()), per_row


def test_the_last_shorter_chunk_leaves_no_more_uncompressed_than_the_window():
    model, ids = tiny_model("llama"), prompt(1, 100, seed=1)
    cache = LUKVCache(0.8, prefill_chunk_size=CHUNK, window=2)
    _generate(model, ids, cache, chunk=CHUNK)  # 32 + 32 + 32 + 4: the 4 follow a chunk of exactly 32
    full = [layer for layer in cache.layers if isinstance(layer, LUKVLayer)]
    assert full and all(layer.suffix_length <= cache.window for layer in full)


def test_the_last_shorter_chunk_of_generate_is_compressed_too():
    model, ids = tiny_model("llama"), prompt(1, 100, seed=1)
    chunked, whole = LUKVCache(0.8, prefill_chunk_size=CHUNK), LUKVCache(0.8)
    _generate(model, ids, chunked, chunk=CHUNK)  # 32 + 32 + 32 + 4
    _generate(model, ids, whole)
    assert (chunked.stored_tokens().float().mean() - whole.stored_tokens().float().mean()).abs() <= 4


def test_a_question_after_a_context_is_still_appended_whole():
    model, context, question = tiny_model("llama"), prompt(1, 64, seed=1), prompt(1, 12, seed=2)
    cache = LUKVCache(0.8)
    with torch.no_grad():
        model(context, past_key_values=cache, use_cache=True)
    after_context = cache.stored_tokens().clone()
    _generate(model, torch.cat([context, question], 1), cache)
    assert torch.equal(cache.stored_tokens(), after_context + question.shape[1])


def test_a_question_sent_in_chunks_through_generate_is_compressed_like_a_chunked_prompt():
    """generate(prefill_chunk_size=C) on a filled cache with prefill_chunk_size=C: its chunks are a chunked
    prefill too (the cache cannot see where the context ended), documented in docs/usage.md."""
    model, context, question = tiny_model("llama"), prompt(1, 64, seed=1), prompt(1, 64, seed=2)
    cache = LUKVCache(0.8, prefill_chunk_size=CHUNK)
    with torch.no_grad():
        model(context, past_key_values=cache, use_cache=True)
    before = int(cache.stored_tokens().sum())
    _generate(model, torch.cat([context, question], 1), cache, chunk=CHUNK)
    assert (
        int(cache.stored_tokens().sum()) - before < question.shape[1] * cache.stored_tokens()[..., 0].numel()
    )


def test_without_the_option_generates_later_chunks_are_kept_whole_like_a_question():
    """transformers tells a cache nothing of generate's chunk loop: a cache built without
    prefill_chunk_size compresses the first chunk only (docs/usage.md says to pass the same C)."""
    model, ids = tiny_model("llama"), prompt(1, 100, seed=1)
    cache = LUKVCache(0.8)
    _generate(model, ids, cache, chunk=CHUNK)
    assert float(_full_counts(cache).float().mean()) >= 100 - CHUNK
