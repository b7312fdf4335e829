"""Chunked prefill (issue 54, item 2): the one line compresses every chunk of transformers'
``generate(prefill_chunk_size=C)`` as it arrives, keeping about what the unchunked prompt keeps, with the
compressed cache plus one chunk's KV alive at a time. A cache counts every multi-token forward before its
first one-token (decode) forward as its prompt; the prompt ends at that decode, after ``cache.prefill`` and
in a ``fork``/``deepcopy`` (a copy for a question), and under assisted decoding it is the first forward
alone, so a question, a second generate's new tokens and a verification forward are still appended whole.
A cache built with ``prefill_chunk_size=C`` compresses chunks as documented, also after the prompt."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import scorer_for, tiny_model
from test_registry_contracts import PROMPT, _cache_args, _flat_profile

from lukv_cache import LUKVCache
from lukv_cache._compat import cache_kwarg
from lukv_cache.allocation import ALLOCATORS
from lukv_cache.cache.storage.layer import LUKVLayer
from lukv_cache.cache.storage.suffix import MIN_CAPACITY
from lukv_cache.scorers import SCORERS, get_scorer
from lukv_cache.testing import left_padded, prompt

# a reconstruction scorer (kvzip) ranks a context only through cache.prefill, never through generate()
# (check_scorer refuses it there): its chunks are not generate's, so it is exempt from the generate tests
FORWARD_SCORERS = [n for n in SCORERS.names() if get_scorer(n).reconstruction is None]
CHUNK, LENGTH = 32, 128


def _full_counts(cache) -> torch.Tensor:
    """int64 ``[full layers, B, H]``: tokens held per head of the compressed (full-attention) layers."""
    return cache.stored_tokens()[[isinstance(layer, LUKVLayer) for layer in cache.layers]]


def _generate(model, ids, cache, mask=None, chunk=None, new_tokens=1, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            **{cache_kwarg(model): cache},
            max_new_tokens=new_tokens,  # 1: the prompt only, no decode step runs
            do_sample=False,
            prefill_chunk_size=chunk,
            **kwargs,
        )


def _forward(model, ids, cache) -> None:
    with torch.no_grad():
        model(ids, use_cache=True, **{cache_kwarg(model): cache})


def _own_chunks(model, ids, cache) -> None:
    for start in range(0, ids.shape[1], CHUNK):
        _forward(model, ids[:, start : start + CHUNK], cache)


def _cache(scorer, allocator, model, **kwargs) -> LUKVCache:
    args = _cache_args(allocator)
    if "profile" in args:  # the flat curve, for this model's layer count
        args = {"profile": _flat_profile(model.config.num_hidden_layers)}
    return LUKVCache(scorer=scorer_for(scorer, model), allocator=allocator, allocator_kwargs=args, **kwargs)


def _watch_peak(cache: LUKVCache) -> list[int]:
    """``[bytes]``: the most ``cache.memory_bytes()`` held right after a layer stored a forward's keys (before
    that layer's, or a whole-model allocator's, eviction): the cache's peak during a prefill."""
    peak = [0]
    update = cache.update

    def counting(*args, **kwargs):
        out = update(*args, **kwargs)
        peak[0] = max(peak[0], cache.memory_bytes())
        return out

    cache.update = counting  # type: ignore[method-assign]
    return peak


def _token_bytes(model) -> int:
    """Bytes of one token's keys and values in every layer of ``model`` (fp32)."""
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers * text.num_key_value_heads * head_dim * 2 * 4


@pytest.mark.parametrize("allocator", ALLOCATORS.names())
@pytest.mark.parametrize("scorer", FORWARD_SCORERS)
def test_the_one_line_compresses_generates_chunked_prefill_as_it_compresses_the_whole_prompt(
    scorer, allocator
):
    """The deliverable of issue 54, item 2: no prefill_chunk_size on the cache, only on generate()."""
    model, ids, length = tiny_model("llama"), prompt(1, 2 * LENGTH, seed=2), 2 * LENGTH
    chunked = _cache(scorer, allocator, model, ratio=0.8)
    peak = _watch_peak(chunked)
    _generate(model, ids, chunked, chunk=CHUNK)
    whole = _cache(scorer, allocator, model, ratio=0.8)
    _generate(model, ids, whole)
    kept, expected = chunked.stored_tokens().float(), whole.stored_tokens().float()
    # every head within one chunk's worth of the unchunked run; ratio allocators within a token per chunk
    # per head on average (each chunk's eviction rounds its own share)
    assert float((kept - expected).abs().max()) <= CHUNK
    if not whole.allocator.adaptive:
        assert abs(float(kept.mean() - expected.mean())) <= length // CHUNK
    # the later chunks were compressed: the chunks after the first would be held whole otherwise
    assert (
        float(_full_counts(chunked).float().mean()) < length - CHUNK
        or float(expected.mean()) >= length - CHUNK
    )
    # peak memory: the compressed cache plus one chunk's KV in every layer (the dense window it joins, and
    # the suffix buffer's room), never the whole prompt's
    chunk_bytes = (CHUNK + chunked.window + MIN_CAPACITY) * _token_bytes(model)
    assert peak[0] <= whole.memory_bytes() + chunk_bytes, (peak[0], whole.memory_bytes(), chunk_bytes)


@pytest.mark.parametrize("allocator", ALLOCATORS.names())
@pytest.mark.parametrize("scorer", FORWARD_SCORERS)
def test_generate_chunked_prefill_keeps_what_the_caches_own_chunking_keeps(scorer, allocator):
    model, ids = tiny_model("llama"), prompt(1, LENGTH, seed=2)
    for option in (CHUNK, None):  # the cache's own option changes nothing within the prompt
        through_generate = _cache(scorer, allocator, model, ratio=0.8, prefill_chunk_size=option)
        _generate(model, ids, through_generate, chunk=CHUNK)
        own = _cache(scorer, allocator, model, ratio=0.8, prefill_chunk_size=option)
        _own_chunks(model, ids, own)
        assert torch.equal(through_generate.stored_tokens(), own.stored_tokens())


@pytest.mark.parametrize("option", [20, None])
@pytest.mark.parametrize("bound", ["max_tokens", "decode_max_tokens"])
@pytest.mark.parametrize("allocator", ALLOCATORS.names())
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_token_bound_holds_after_every_chunk_of_generates_chunked_prefill(arch, allocator, bound, option):
    model = tiny_model(arch, "eager" if arch == "gemma2" else "sdpa")
    ids, mask = left_padded((LENGTH - 3, 70, 40), seed=4)
    cache = _cache("keydiff", allocator, model, prefill_chunk_size=option, **{bound: 24})
    _generate(model, ids, cache, mask=mask, chunk=20)  # the last chunk is shorter
    per_row = _full_counts(cache).float().mean(dim=(0, 2))  # [B]
    assert bool((per_row <= 24 + 1e-6).all()), per_row


def test_a_memory_budget_holds_after_every_chunk_of_the_one_lines_chunked_prefill():
    model, ids = tiny_model("llama", "sdpa"), prompt(1, 480, seed=4)
    full = LUKVCache(0.0)
    _forward(model, ids, full)
    cache = LUKVCache(memory=0.15)
    bytes_after = []
    model_hook = model.register_forward_hook(lambda *_: bytes_after.append(cache.memory_bytes()))
    try:
        _generate(model, ids, cache, chunk=120)
    finally:
        model_hook.remove()
    assert len(bytes_after) == 4
    # the budget grows with the prompt: after the last chunk, 15% of the whole prompt's bytes
    assert bytes_after[-1] <= 0.15 * full.memory_bytes() * 1.05
    assert max(bytes_after) <= bytes_after[-1] * 1.05


@pytest.mark.parametrize("option", [CHUNK, None])
def test_the_last_shorter_chunk_leaves_no_more_uncompressed_than_the_window(option):
    model, ids = tiny_model("llama"), prompt(1, 100, seed=1)
    cache = LUKVCache(0.8, prefill_chunk_size=option, window=2)
    _generate(model, ids, cache, chunk=CHUNK)  # 32 + 32 + 32 + 4: the 4 follow a chunk of exactly 32
    full = [layer for layer in cache.layers if isinstance(layer, LUKVLayer)]
    assert full and all(layer.suffix_length <= cache.window for layer in full)


@pytest.mark.parametrize("option", [CHUNK, None])
def test_the_last_shorter_chunk_of_generate_is_compressed_too(option):
    model, ids = tiny_model("llama"), prompt(1, 100, seed=1)
    chunked, whole = LUKVCache(0.8, prefill_chunk_size=option), LUKVCache(0.8)
    _generate(model, ids, chunked, chunk=CHUNK)  # 32 + 32 + 32 + 4
    _generate(model, ids, whole)
    assert (chunked.stored_tokens().float().mean() - whole.stored_tokens().float().mean()).abs() <= 4


def test_a_chunked_prompt_then_decoding_appends_the_decoded_tokens_whole():
    model, ids = tiny_model("llama"), prompt(1, LENGTH, seed=3)
    prompt_only, generated = LUKVCache(0.8), LUKVCache(0.8)
    _generate(model, ids, prompt_only, chunk=CHUNK)
    out = _generate(model, ids, generated, chunk=CHUNK, new_tokens=6)
    decoded = out.shape[1] - LENGTH - 1  # the last token is never forwarded
    assert torch.equal(generated.stored_tokens(), prompt_only.stored_tokens() + decoded)


def test_beam_search_compresses_every_chunk_of_its_prompt():
    model, ids = tiny_model("llama"), prompt(1, LENGTH, seed=5)
    chunked, whole = LUKVCache(0.8), LUKVCache(0.8)
    _generate(model, ids, chunked, chunk=CHUNK, new_tokens=3, num_beams=2)
    _generate(model, ids, whole, new_tokens=3, num_beams=2)
    assert (
        chunked.stored_tokens().float().mean() - whole.stored_tokens().float().mean()
    ).abs() <= LENGTH // CHUNK


# ----------------------------------------------------------------- what comes after the prompt: kept whole


@pytest.mark.parametrize("chunk", [None, 8])
def test_a_question_after_a_prefilled_context_is_appended_whole(chunk):
    """README's "One long context, many questions": cache.prefill ends the prompt, so a question (also one
    generate sends in chunks) is appended whole, in a fork and in the cache itself."""
    model, context, question = tiny_model("llama"), prompt(1, 64, seed=1), prompt(1, 20, seed=2)
    cache = LUKVCache(0.8)
    cache.prefill(model, context)
    after_context = cache.stored_tokens().clone()
    for asked in (cache.fork(), cache):
        _generate(model, torch.cat([context, question], 1), asked, chunk=chunk)
        assert torch.equal(asked.stored_tokens(), after_context + question.shape[1])


def test_a_question_after_a_kvzip_prefill_is_appended_whole():
    model, context, question = tiny_model("llama"), prompt(1, 64, seed=1), prompt(1, 20, seed=2)
    cache = LUKVCache(0.8, scorer="kvzip", allocator="global")
    cache.prefill(model, context, repeat_prompt=PROMPT)
    after_context = cache.stored_tokens().clone()
    assert int(after_context.max()) < 64
    fork = cache.fork()
    _generate(model, torch.cat([context, question], 1), fork, chunk=8)
    assert torch.equal(fork.stored_tokens(), after_context + question.shape[1])


@pytest.mark.parametrize("copy_of", [LUKVCache.fork, copy.deepcopy])
def test_a_question_in_a_copy_of_a_context_forwarded_by_hand_is_appended_whole(copy_of):
    model, context, question = tiny_model("llama"), prompt(1, 64, seed=1), prompt(1, 12, seed=2)
    cache = LUKVCache(0.8)
    _forward(model, context, cache)
    asked = copy_of(cache)
    _generate(model, torch.cat([context, question], 1), asked)
    assert torch.equal(asked.stored_tokens(), cache.stored_tokens() + question.shape[1])


def test_a_question_after_a_saved_context_is_appended_whole_in_it_and_in_the_loaded_one(tmp_path):
    model, context, question = tiny_model("llama"), prompt(1, 64, seed=1), prompt(1, 12, seed=2)
    cache = LUKVCache(0.8)
    _forward(model, context, cache)  # by hand: the prompt is still open
    path = cache.save(tmp_path / "context.safetensors", model=model)
    after_context = cache.stored_tokens().clone()
    for asked in (cache, LUKVCache.load(path, model)):
        _generate(model, torch.cat([context, question], 1), asked)
        assert torch.equal(asked.stored_tokens(), after_context + question.shape[1])


def test_a_question_after_a_context_forwarded_by_hand_is_compressed_like_a_chunk():
    """The one case a cache cannot tell apart: a context forwarded by hand then a question look exactly like
    generate's first chunk and its last one. The question is compressed (documented in docs/usage.md:
    cache.prefill or fork() keep it whole)."""
    model, context, question = tiny_model("llama"), prompt(1, 64, seed=1), prompt(1, 32, seed=2)
    cache = LUKVCache(0.8)
    _forward(model, context, cache)
    after_context = cache.stored_tokens().clone()
    _generate(model, torch.cat([context, question], 1), cache)
    assert bool((cache.stored_tokens() < after_context + question.shape[1]).all())


def test_a_second_generate_after_decoding_appends_its_new_tokens_whole():
    model, ids, question = tiny_model("llama"), prompt(1, LENGTH, seed=1), prompt(1, 40, seed=2)
    cache = LUKVCache(0.8)
    out = _generate(model, ids, cache, chunk=CHUNK, new_tokens=4)
    before = cache.stored_tokens().clone()
    follow = torch.cat([out, question], 1)
    _generate(model, follow, cache, chunk=16)  # chunks of 16, 16 and 9 new tokens (one decoded token pends)
    assert torch.equal(cache.stored_tokens(), before + follow.shape[1] - out.shape[1] + 1)


def test_a_question_sent_in_chunks_through_generate_is_compressed_with_the_caches_option():
    """generate(prefill_chunk_size=C) on a prefilled cache with prefill_chunk_size=C: its chunks are compressed
    like a chunked prefill, after the prompt too (documented in docs/usage.md)."""
    model, context, question = tiny_model("llama"), prompt(1, 64, seed=1), prompt(1, 64, seed=2)
    cache = LUKVCache(0.8, prefill_chunk_size=CHUNK)
    cache.prefill(model, context)
    before = int(cache.stored_tokens().sum())
    _generate(model, torch.cat([context, question], 1), cache, chunk=CHUNK)
    assert (
        int(cache.stored_tokens().sum()) - before < question.shape[1] * cache.stored_tokens()[..., 0].numel()
    )


def test_a_holding_block_holds_every_chunk_then_evicts_them_together():
    model, ids = tiny_model("llama"), prompt(1, LENGTH, seed=2)
    cache = LUKVCache(0.8, window=0)
    with cache.holding():
        _own_chunks(model, ids, cache)
    assert torch.equal(cache.stored_tokens(), torch.full_like(cache.stored_tokens(), LENGTH))  # all held
    cache.evict_held({i: torch.rand(1, 2, LENGTH) for i in range(2)})
    counts = cache.stored_tokens()
    assert int(counts.max()) < LENGTH // 2  # every chunk was ranked, not only the first


# ----------------------------------------------------------------- assisted decoding


def test_assisted_decodings_verification_forwards_are_appended_whole():
    """Prompt lookup switches the past recording on before its first forward, which holds the whole prompt
    and the first drafts (transformers 5.23 to 5.25 alike; prefill_chunk_size does not split it): that
    forward is the prompt, the multi-token verification forwards after it are appended whole, silently."""
    model = tiny_model("llama")
    ids = torch.cat([prompt(1, 48, seed=2)] * 2, 1)  # repeated: prompt lookup finds drafts
    cache = LUKVCache(0.8)
    before: list[tuple[torch.Tensor, int]] = []  # each forward's cache as it starts (the first: empty)
    lengths: list[int] = []  # each forward's tokens

    def starting(module, args, kwargs):
        before.append((cache.stored_tokens().clone(), cache.get_seq_length()))
        lengths.append(kwargs["input_ids"].shape[1])

    hook = model.register_forward_pre_hook(starting, with_kwargs=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _generate(model, ids, cache, chunk=CHUNK, new_tokens=8, prompt_lookup_num_tokens=3)
    finally:
        hook.remove()
    ours = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert all("assisted decoding: the first forward holds the prompt" in message for message in ours), ours
    assert lengths[0] > ids.shape[1] and max(lengths[1:]) > 1  # prompt + drafts, then verification
    kept, length = before[1]  # the first forward's, its rejected drafts cropped
    assert int(kept.max()) < ids.shape[1] // 2  # the prompt (and first drafts) compressed
    appended = cache.get_seq_length() - length  # the accepted tokens since
    got = cache.stored_tokens()
    # a crop can leave one rejected draft in a layer's store
    assert bool((got >= kept + appended).all()) and bool((got <= kept + appended + 1).all()), (got, kept)


def _recording_left_by_an_earlier_prompt(model) -> LUKVCache:
    cache = LUKVCache(0.8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the assisted-decoding warning of 5.23/5.24's call order
        cache.activate_past_recording()  # as assisted decoding does
    _generate(model, prompt(1, 40, seed=7), cache, new_tokens=2)
    cache.reset()
    return cache


def test_a_chunk_that_cannot_be_told_from_a_verification_forward_is_kept_whole_and_warned_once():
    """A cache whose past recording an earlier assisted generate left on cannot tell a chunk of a new prompt
    from assisted decoding's verification forward: it keeps it whole and warns (once per cache)."""
    model, ids = tiny_model("llama"), prompt(1, LENGTH, seed=2)
    cache = _recording_left_by_an_earlier_prompt(model)
    with pytest.warns(UserWarning, match="prefill_chunk_size"):
        _generate(model, ids, cache, chunk=CHUNK)
    assert float(_full_counts(cache).float().mean()) >= LENGTH - CHUNK  # the later chunks kept whole
    cache.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _generate(model, ids, cache, chunk=CHUNK)  # once per cache


def test_the_caches_option_compresses_the_chunks_a_left_recording_makes_unsure():
    model, ids = tiny_model("llama"), prompt(1, LENGTH, seed=2)
    cache = LUKVCache(0.8, prefill_chunk_size=CHUNK)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache.activate_past_recording()
    _generate(model, prompt(1, 40, seed=7), cache, new_tokens=2)
    cache.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _generate(model, ids, cache, chunk=CHUNK)
    assert float(_full_counts(cache).float().mean()) < LENGTH - CHUNK


def test_a_recording_switched_on_before_a_fresh_prompt_keeps_its_later_forwards_whole_silently():
    """5.23/5.24's assisted decoding: the past recording starts before the first forward, which holds the
    whole prompt (and the first drafts); the multi-token forwards after it are verification forwards."""
    model, ids = tiny_model("llama"), prompt(1, 64, seed=2)
    cache = LUKVCache(0.8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache.activate_past_recording()
    _forward(model, ids, cache)
    after_prompt = cache.stored_tokens().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _forward(model, prompt(1, 4, seed=3), cache)
    assert torch.equal(cache.stored_tokens(), after_prompt + 4)
