"""The DynamicCache behaviours transformers' own suites check, checked against LUKVCache (issues 29 and 30).

Sources read (transformers' ``tests/utils/test_cache_utils.py`` and the cache-related parts of
``tests/generation/test_utils.py``: ``GenerationTesterMixin`` and ``GenerationIntegrationTests``); every test
below is written from what its counterpart asserts, on this project's tiny seeded random models, and its
docstring names that counterpart. Each runs with ``LUKVCache(ratio=0)``, which must equal ``DynamicCache``
(tokens identical, logits within 1e-5), and, where the assertion still means something once tokens are
evicted, with ``LUKVCache(0.5)`` (generation continues, shapes, the logical length, batch operations act on
rows, crop then continue).

A strict ``xfail`` marks what LUKVCache does not do like DynamicCache yet (its reason says what differs); a
fix flips it to a failure that asks for the mark to go.

Transformers cache tests that cannot apply to LUKVCache, and why:

* Static / compile / export: ``test_static_cache_mha_mqa_gqa``, ``test_static_cache_out_of_bounds``,
  ``test_static_cache``, ``test_sliding_window_cache``, ``test_hybrid_cache*``, ``test_hybrid_chunked_cache``,
  ``test_static_cache_greedy_decoding_pad_left``, ``test_static_cache_no_cuda_graph_skips``,
  ``test_static_cache_multi_accelerator``, ``test_generate_with_static_cache``,
  ``test_generate_from_inputs_embeds_with_static_cache``, ``test_generate_compile_model_forward``,
  ``test_generate_compile_fullgraph_tiny``, ``test_init_static_cache_multi_gpu``,
  ``test_generate_with_static_cache_multi_gpu``, ``test_*_exportability``,
  ``test_cache_dependant_input_preparation_exporting``: they test other cache classes (StaticCache,
  SlidingWindowCache, HybridCache) or ``torch.compile`` / ``torch.export``; LUKVCache is a dynamic,
  non-compileable cache (``is_compileable`` is False) whose per-head ragged store has no static shape.
* Offloading: ``test_offloaded_cache_implementation``, ``test_offloaded_cache_uses_less_memory_than_dynamic_cache``
  (need an accelerator; LUKVCache does not offload).
* Quantized caches: ``test_quantized_cache_generation``, ``test_generate_with_quant_cache`` (quanto/HQQ caches,
  another cache class; neither backend is installed).
* ``cache_implementation=`` sweeps (``test_cache_batched`` / ``test_cache_beam_search`` /
  ``test_cache_extra_left_padding`` / ``test_cache_gptj_model`` over ``ALL_CACHE_IMPLEMENTATIONS``): a
  LUKVCache is passed as the cache (``past_key_values``; ``cache`` from transformers 5.24), not named by a
  string; the dynamic case is mirrored below.
* Multi-device: ``test_data_parallel_dynamic_cache``, ``test_model_parallel_beam_search``,
  ``test_assisted_decoding_in_different_gpu``, ``test_assisted_decoding_model_in_gpu_assistant_in_cpu``
  (several GPUs; the ``__iter__`` / ``DynamicCache(ddp_cache_data)`` path DataParallel relies on is tested).
* Generation modes that are Hub-only in transformers 5.23 (``custom_generate`` repositories, no network here):
  contrastive search (``test_contrastive_generate*``, ``test_contrastive_search_batched``,
  ``test_padding_input_contrastive_search_*``), DoLa (``test_dola_decoding_sample``), group beam search and
  constrained beam search (``test_group_beam_search_*``, ``test_constrained_beam_search_*``). The cache calls
  contrastive search makes (``batch_repeat_interleave``, ``batch_select_indices``, ``crop``) are tested
  directly below.
* ``test_beam_search_low_memory`` / ``low_memory=True``: removed from beam search in 5.23.
* ``test_dynamic_cache_hard``, ``test_sink_cache_*``, ``test_assisted_generation_early_exit``,
  ``test_speculative_decoding_equals_regular_decoding`` (pretrained checkpoints, network; the seeded-sampling
  and assisted-decoding behaviours are mirrored on tiny models), and ``DynamicCache.from_legacy_cache`` /
  ``to_legacy_cache`` (``test_dynamic_cache_retrocompatibility``, ``test_reorder_cache_retrocompatibility``):
  removed in 5.23; their conversion is now ``DynamicCache(ddp_cache_data=...)`` and iterating a cache, tested
  below.
* At ratio > 0 only (both run at ratio 0): hand-made ``update`` calls without a model
  (``test_dynamic_cache``, the retrocompatibility tests), since an evicting cache needs each update to come
  from a model's attention; and the dense ``[batch, kv_heads, seq_len, head_dim]`` keys/values of
  ``test_past_key_values_format`` / ``_check_past_key_values_for_generate``, which do not exist once each KV
  head keeps its own tokens (the logical length and ``stored_tokens()`` are checked instead).
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_model
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from lukv_cache import LUKVCache
from lukv_cache._compat import cache_kwarg
from lukv_cache.testing import PAD, SLIDING, VOCAB, left_padded, prompt, tiny_config

ATOL = 1e-5
EVICT = 0.5
RATIOS = [0.0, EVICT]
T = 24  # prompt length: with sink=4 and window=1, ratio 0.5 evicts about 10 tokens per head
# every call spells the cache as the installed release does (``cache`` from transformers 5.24): the old name
# would still work there, with a FutureWarning, which is an error here
DEPRECATED_NAME = ".*past_key_values"
pytestmark = pytest.mark.filterwarnings(f"error:{DEPRECATED_NAME}:FutureWarning")

# A cache that evicts needs every update to come from a model's attention through transformers' attention
# interface (it evicts right after it, and refuses models that attend in their own code with
# IncompatibleAttentionError), so the tests that call ``update`` by hand, without a model, run at ratio 0 only.
# With eviction the KV heads of a row keep different tokens, so a layer has no dense [batch, kv_heads,
# seq_len, head_dim] keys/values to show (transformers' format checks): those run at ratio 0; at ratio 0.5
# the tests check the number of layers, the logical length and stored_tokens() instead.


def make(ratio: float | None):
    """``None``: the DynamicCache reference; otherwise a LUKVCache at that ratio."""
    return DynamicCache() if ratio is None else LUKVCache(ratio)


def generate(model, ids, cache, mask=None, new_tokens=4, **kwargs):
    kwargs = {"do_sample": False, "output_logits": True, "output_scores": True, **kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the documented eviction-with-assisted-decoding warning
        warnings.filterwarnings("error", DEPRECATED_NAME, FutureWarning)
        with torch.no_grad():
            return model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                **{cache_kwarg(model): cache},
                return_dict_in_generate=True,
                **kwargs,
            )


def cache_of(out):
    """The cache an output carries, under the release's field name (``cache`` from transformers 5.24, which
    renamed ``past_key_values``; the old name still reads there, with a deprecation message)."""
    fields = {field.name for field in dataclasses.fields(out)}
    return out.cache if "cache" in fields else out.past_key_values


def forward(model, cache, ids, **kwargs):
    with torch.no_grad():
        return model(ids, use_cache=True, **{cache_kwarg(model): cache}, **kwargs)


def assert_same_generation(ref, out, atol: float = ATOL) -> None:
    """Tokens identical and every step's logits within ``atol``."""
    assert torch.equal(ref.sequences, out.sequences)
    assert len(ref.logits) == len(out.logits)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=atol, rtol=0)


def assert_similar_generation(ref, out, atol: float = ATOL) -> None:
    """``GenerationTesterMixin._check_similar_generate_outputs``: the sequences match, or the scores are
    close up to and including each row's first mismatch (assisted decoding runs other matmul shapes)."""
    matches = ref.sequences == out.sequences
    prompt_len = ref.sequences.shape[1] - len(ref.scores)
    for row in range(ref.sequences.shape[0]):
        if matches[row].all():
            continue
        first = int(matches[row].int().argmin()) - prompt_len
        torch.testing.assert_close(out.scores[first][row], ref.scores[first][row], atol=atol, rtol=atol)


def text_dims(model):
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads, head_dim


def assert_evicted(cache, ratio: float) -> None:
    """With eviction, every (layer, row, KV head) holds fewer tokens than the logical length: the test ran
    over a compressed cache, not a dense one."""
    if ratio:
        assert bool((cache.stored_tokens() < cache.get_seq_length()).all())


def logits_of_rows(model, cache, token):
    """Next-token logits of every row after feeding ``token`` ([B, 1]) to a copy of ``cache``."""
    return forward(model, copy.deepcopy(cache), token).logits[:, -1]


# ---------------------------------------------------------------- tests/utils/test_cache_utils.py


def test_update_appends_per_layer_like_dynamic_cache():
    ratio = 0.0  # hand-made updates: see the notes after the constants
    """Mirrors ``SyntheticCacheTest.test_dynamic_cache``: hand-made updates (no model) append to each layer
    in order, layers independent of each other."""
    one = lambda v: torch.tensor(v)[None, None, None, None]  # noqa: E731
    prefill = torch.tensor([1.0, 2.0])[None, None, :, None]
    cache = make(ratio)
    cache.update(prefill, prefill, 0)
    cache.update(one(3.0), one(3.0), 0)
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0]
    cache.update(one(4.0), one(4.0), 0)
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0, 4.0]

    cache = make(ratio)
    prefill1 = torch.tensor([10.0, 20.0])[None, None, :, None]
    cache.update(prefill, prefill, 0)
    cache.update(prefill1, prefill1, 1)
    for a, b in ((3.0, 30.0), (4.0, 40.0)):
        cache.update(one(a), one(a), 0)
        cache.update(one(b), one(b), 1)
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert cache.layers[1].keys[0, 0, :, 0].tolist() == [10.0, 20.0, 30.0, 40.0]
    assert cache.layers[1].values[0, 0, :, 0].tolist() == [10.0, 20.0, 30.0, 40.0]
    assert cache.get_seq_length() == cache.get_seq_length(1) == 4


def test_iterating_a_cache_rebuilds_an_equal_dynamic_cache():
    ratio = 0.0  # hand-made updates: see the notes after the constants
    """Mirrors ``CacheTest.test_dynamic_cache_retrocompatibility`` (5.23 has no ``from_legacy_cache`` /
    ``to_legacy_cache``: the conversion is iterating the cache and ``DynamicCache(ddp_cache_data)``): 10 layers
    updated by hand have the shapes and contents given, the sequence length agrees every way it is read,
    and a DynamicCache rebuilt from the iteration holds the same tensors."""
    torch.manual_seed(0)
    cache, given = make(ratio), []
    for layer in range(10):
        key, value = torch.rand(2, 4, 8, 16), torch.rand(2, 4, 8, 16)
        cache.update(key, value, layer)
        given.append((key, value))
    assert len(cache) == 10
    assert cache.layers[0].keys.shape[-2] == cache.get_seq_length() == 8
    for (key, value, _), (k, v) in zip(cache, given):
        assert torch.equal(key, k) and torch.equal(value, v)
    rebuilt = DynamicCache(list(cache))
    for layer, (k, v) in zip(rebuilt.layers, given):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    assert rebuilt.get_seq_length() == 8


def test_iterating_a_cache_filled_by_the_model_rebuilds_the_dynamic_cache():
    """Mirrors ``CacheTest.test_dynamic_cache_retrocompatibility`` after a model's forward (as
    ``test_data_parallel_dynamic_cache`` relies on): at ratio 0 iterating gives DynamicCache's tensors."""
    model, ids = tiny_model("llama"), prompt(2, T)
    ref, cache = DynamicCache(), LUKVCache(0)
    forward(model, ref, ids)
    forward(model, cache, ids)
    for (k, v, _), (rk, rv, _) in zip(cache, ref):
        torch.testing.assert_close(k, rk, atol=ATOL, rtol=0)
        torch.testing.assert_close(v, rv, atol=ATOL, rtol=0)


def test_reorder_cache_selects_rows_like_index_select():
    ratio = 0.0  # hand-made updates: see the notes after the constants
    """Mirrors ``CacheTest.test_reorder_cache_retrocompatibility``: after ``reorder_cache(beam_idx)`` every
    layer holds the rows ``beam_idx`` names (hand-made updates, 4 beams of one prompt)."""
    torch.manual_seed(0)
    cache, given = make(ratio), []
    for layer in range(4):
        key, value = torch.rand(4, 4, 8, 16), torch.rand(4, 4, 8, 16)
        cache.update(key, value, layer)
        given.append((key, value))
    beam_idx = torch.tensor([3, 0, 0, 2])
    cache.reorder_cache(beam_idx)
    for layer, (k, v) in zip(cache.layers, given):
        assert torch.equal(layer.keys, k[beam_idx]) and torch.equal(layer.values, v[beam_idx])


@pytest.mark.parametrize("ratio", RATIOS)
def test_reorder_cache_after_prefill_reorders_the_rows(ratio):
    """Mirrors ``CacheTest.test_reorder_cache_retrocompatibility`` on a cache the model filled (and
    compressed): each reordered row then predicts what the row it came from predicts."""
    model, ids = tiny_model("llama"), prompt(3, T, seed=1)
    cache = make(ratio)
    forward(model, cache, ids)
    token = prompt(3, 1, seed=2)
    before = logits_of_rows(model, cache, token)
    beam_idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(beam_idx)
    after = logits_of_rows(model, cache, token[beam_idx])
    torch.testing.assert_close(after, before[beam_idx], atol=ATOL, rtol=0)
    assert cache.get_seq_length() == T


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("ratio", RATIOS)
def test_left_padded_batch_generates_and_returns_the_cache(arch, ratio):
    """Mirrors ``CacheIntegrationTest.test_cache_batched`` (dynamic cache): a left-padded batch generates
    through the cache, the output carries that cache, and at ratio 0 the tokens are DynamicCache's."""
    model, (ids, mask) = tiny_model(arch), left_padded()
    ref = generate(model, ids, DynamicCache(), mask, new_tokens=6)
    cache = LUKVCache(ratio)
    out = generate(model, ids, cache, mask, new_tokens=6)
    assert isinstance(cache_of(out), Cache) and cache_of(out) is cache
    assert out.sequences.shape == ref.sequences.shape
    assert cache.get_seq_length() == cache_of(ref).get_seq_length()
    assert_evicted(cache, ratio)
    if ratio == 0:
        assert_same_generation(ref, out)


@pytest.mark.parametrize("ratio", RATIOS)
def test_beam_search_reorders_the_cache(ratio):
    """Mirrors ``CacheIntegrationTest.test_cache_beam_search``: beam search with 2 beams and 2 returned
    sequences runs through the cache, some sequence is built from several beams (``reorder_cache`` had to
    move rows), and at ratio 0 sequences and beam scores are DynamicCache's."""
    model, ids = tiny_model("llama"), prompt(1, T, seed=4)
    kwargs = dict(num_beams=2, num_return_sequences=2, new_tokens=10, output_logits=False)
    ref = generate(model, ids, DynamicCache(), **kwargs)
    out = generate(model, ids, LUKVCache(ratio), **kwargs)
    assert isinstance(cache_of(out), LUKVCache)
    assert out.sequences.shape == ref.sequences.shape == (2, T + 10)
    assert any(len(set(beams.tolist()) - {-1}) > 1 for beams in out.beam_indices)
    assert cache_of(out).get_seq_length() == cache_of(ref).get_seq_length()
    assert_evicted(cache_of(out), ratio)
    if ratio == 0:
        assert torch.equal(out.sequences, ref.sequences)
        assert torch.equal(out.beam_indices, ref.beam_indices)
        torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, atol=ATOL, rtol=0)


@pytest.mark.parametrize("ratio", RATIOS)
def test_extra_left_padding_does_not_change_generation(ratio):
    """Mirrors ``CacheIntegrationTest.test_cache_extra_left_padding``: padding the prompt further on the left
    (masked) leaves the generated tokens unchanged."""
    model, ids = tiny_model("llama"), prompt(1, T, seed=5)
    plain = generate(model, ids, LUKVCache(ratio), torch.ones_like(ids), new_tokens=8)
    padded_ids = F.pad(ids, (8, 0), value=PAD)
    padded_mask = F.pad(torch.ones_like(ids), (8, 0), value=0)
    padded = generate(model, padded_ids, LUKVCache(ratio), padded_mask, new_tokens=8)
    assert torch.equal(padded.sequences[:, 8:], plain.sequences)
    torch.testing.assert_close(torch.stack(padded.logits), torch.stack(plain.logits), atol=1e-4, rtol=0)
    if ratio == 0:
        assert_same_generation(
            generate(model, ids, DynamicCache(), torch.ones_like(ids), new_tokens=8), plain
        )


def test_seeded_sampling_matches_dynamic_cache():
    """Mirrors ``CacheHardIntegrationTest.test_dynamic_cache_hard`` (seeded sampling, tokens and the scores of
    the sampled tokens) on a tiny model: at ratio 0 the same seed samples the same tokens."""
    model, ids = tiny_model("qwen2"), prompt(2, T, seed=6)
    kwargs = dict(do_sample=True, new_tokens=12, top_k=20)
    torch.manual_seed(0)
    ref = generate(model, ids, DynamicCache(), **kwargs)
    torch.manual_seed(0)
    out = generate(model, ids, LUKVCache(0), **kwargs)
    assert_same_generation(ref, out)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), atol=ATOL, rtol=0)


@pytest.mark.parametrize("ratio", RATIOS)
def test_prompt_cache_copied_and_reused_for_two_continuations(ratio):
    """Mirrors ``CacheHardIntegrationTest.test_cache_copy``: a shared prompt is run once into a cache, which is
    deep-copied for each of two continuations; the prompt cache itself is left as it was, and at ratio 0
    each continuation equals DynamicCache's."""
    model = tiny_model("llama")
    shared = prompt(1, T, seed=7)
    ref_cache, cache = DynamicCache(), LUKVCache(ratio)
    forward(model, ref_cache, shared)
    forward(model, cache, shared)
    stored = cache.stored_tokens().clone()
    for seed in (8, 9):
        ids = torch.cat([shared, prompt(1, 6, seed=seed)], dim=1)
        out = generate(model, ids, copy.deepcopy(cache), new_tokens=5)
        again = generate(model, ids, copy.deepcopy(cache), new_tokens=5)
        assert out.sequences.shape == (1, T + 6 + 5)
        assert_same_generation(again, out, atol=0)  # each copy is independent of the other
        if ratio == 0:
            assert_same_generation(generate(model, ids, copy.deepcopy(ref_cache), new_tokens=5), out)
    assert cache.get_seq_length() == T
    assert torch.equal(cache.stored_tokens(), stored)
    assert_evicted(cache, ratio)


@pytest.mark.parametrize("ratio", RATIOS)
def test_cache_built_from_a_config_has_dynamic_cache_layer_types(ratio):
    """Mirrors ``SyntheticCacheTest.test_hybrid_cache`` for ``DynamicCache(config=...)`` (sliding layers keep
    only their window, full layers everything): a LUKVCache given a Gemma-2 config has DynamicCache's layer
    types, its sliding layers hold what DynamicCache's hold, and at ratio 0 generation is DynamicCache's
    (under sliding="keep": the default compresses the sliding layers too, test_sliding_compression.py)."""
    model = tiny_model("gemma2", "eager")
    config = tiny_config("gemma2")
    ref, cache = DynamicCache(config=config), LUKVCache(ratio, config=config, sliding="keep")
    assert cache.is_sliding == ref.is_sliding == [True, False, True]
    ids = prompt(1, T, seed=10)
    forward(model, ref, ids)
    forward(model, cache, ids)
    for mine, theirs in zip(cache.layers, ref.layers):
        if isinstance(theirs, DynamicSlidingWindowLayer):
            assert type(mine) is DynamicSlidingWindowLayer
            assert mine.keys.shape[-2] == theirs.keys.shape[-2] < SLIDING + 1
            torch.testing.assert_close(mine.keys, theirs.keys, atol=ATOL, rtol=0)
    assert cache.get_seq_length() == ref.get_seq_length() == T
    if ratio == 0:
        out = generate(model, ids, LUKVCache(0, config=config), new_tokens=6)
        assert_same_generation(generate(model, ids, DynamicCache(config=config), new_tokens=6), out)


# ---------------------------------------------------------------- tests/generation/test_utils.py


@pytest.mark.parametrize("ratio", RATIOS)
def test_past_key_values_format(ratio):
    """Mirrors ``GenerationTesterMixin.test_past_key_values_format``: after one forward the cache has one
    entry per layer, keys and values of shape ``[batch, kv_heads, seq_len, head_dim]``. With eviction each KV
    head keeps its own tokens, so no dense tensor of that shape exists (notes after the constants): what is checked
    there is one entry per layer, the logical length and ``stored_tokens()`` as ``[layers, batch, kv_heads]``
    with fewer than ``seq_len`` tokens per head."""
    model, ids = tiny_model("llama"), prompt(2, T)
    cache = LUKVCache(ratio)
    forward(model, cache, ids)
    layers, kv_heads, head_dim = text_dims(model)
    assert len(cache) == layers
    assert cache.get_seq_length() == T
    if ratio == 0:
        for layer in cache.layers:
            assert layer.keys.shape == layer.values.shape == (2, kv_heads, T, head_dim)
    else:
        stored = cache.stored_tokens()
        assert stored.shape == (layers, 2, kv_heads)
        assert bool((stored < T).all())


@pytest.mark.parametrize("ratio", RATIOS)
def test_generate_returns_past_key_values_of_the_generated_length(ratio):
    """Mirrors ``GenerationTesterMixin._check_past_key_values_for_generate`` (part of
    ``test_greedy_generate_dict_outputs_use_cache``): the returned cache's keys/values per layer are
    ``[batch, kv_heads, len(sequences) - 1, head_dim]`` (with eviction: the logical length is that; notes
    after the constants)."""
    model, ids = tiny_model("llama"), prompt(2, T)
    out = generate(model, ids, LUKVCache(ratio), new_tokens=3)
    layers, kv_heads, head_dim = text_dims(model)
    length = out.sequences.shape[-1] - 1
    assert cache_of(out).get_seq_length() == length
    if ratio == 0:
        expected = (2, kv_heads, length, head_dim)
        assert [layer.keys.shape for layer in cache_of(out).layers] == [expected] * layers
        assert [layer.values.shape for layer in cache_of(out).layers] == [expected] * layers
    else:
        assert cache_of(out).stored_tokens().shape == (layers, 2, kv_heads)


def check_dict_outputs(out, model, batch, prompt_len, new_tokens, beams=1):
    """``GenerationTesterMixin._check_outputs`` with ``use_cache=True`` (past key values aside, see
    ``test_generate_returns_past_key_values_of_the_generated_length``)."""
    config = model.config
    internal = batch * beams
    assert out.sequences.shape[-1] == prompt_len + new_tokens
    assert len(out.scores) == len(out.logits) == new_tokens
    assert [s.shape for s in out.scores] == [(internal, VOCAB)] * new_tokens
    assert [s.shape[0] for s in out.logits] == [internal] * new_tokens
    # the first step is the prompt's forward; every later step is one query over a growing past
    for step, (attentions, hidden) in enumerate(zip(out.attentions[1:], out.hidden_states[1:])):
        src = prompt_len + step + 1
        assert [a.shape for a in attentions] == [(internal, config.num_attention_heads, 1, src)] * len(
            attentions
        )
        assert [h.shape for h in hidden] == [(internal, 1, config.hidden_size)] * len(hidden)
    assert len(out.attentions) == len(out.hidden_states) == new_tokens


@pytest.mark.parametrize("ratio", RATIOS)
def test_greedy_generate_dict_outputs_use_cache(ratio):
    """Mirrors ``GenerationTesterMixin.test_greedy_generate_dict_outputs_use_cache``: greedy decoding through
    the cache with scores, logits, hidden states and attentions has the shapes of a cached generation (one
    query per step, keys over every logical position); at ratio 0 every output equals DynamicCache's."""
    model, ids = tiny_model("llama", "eager"), prompt(2, T, seed=11)
    kwargs = dict(new_tokens=3, output_attentions=True, output_hidden_states=True, repetition_penalty=1.2)
    out = generate(model, ids, LUKVCache(ratio), **kwargs)
    check_dict_outputs(out, model, 2, T, 3)
    assert_evicted(cache_of(out), ratio)
    if ratio == 0:
        ref = generate(model, ids, DynamicCache(), **kwargs)
        assert_same_generation(ref, out)
        for mine, theirs in zip(out.attentions, ref.attentions):
            torch.testing.assert_close(torch.stack(mine), torch.stack(theirs), atol=ATOL, rtol=0)
        for mine, theirs in zip(out.hidden_states, ref.hidden_states):
            torch.testing.assert_close(torch.stack(mine), torch.stack(theirs), atol=ATOL, rtol=0)


@pytest.mark.parametrize("ratio", RATIOS)
def test_beam_search_generate_dict_outputs_use_cache(ratio):
    """Mirrors ``GenerationTesterMixin.test_beam_search_generate_dict_outputs_use_cache``: beam search (2
    beams, length penalty) through the cache with every output; shapes over ``batch x beams`` rows, and at
    ratio 0 DynamicCache's sequences, scores and beam indices."""
    model, ids = tiny_model("llama", "eager"), prompt(2, T, seed=12)
    kwargs = dict(
        new_tokens=3,
        num_beams=2,
        length_penalty=2.0,
        early_stopping=False,
        output_attentions=True,
        output_hidden_states=True,
    )
    out = generate(model, ids, LUKVCache(ratio), **kwargs)
    check_dict_outputs(out, model, 2, T, 3, beams=2)
    assert_evicted(cache_of(out), ratio)
    if ratio == 0:
        ref = generate(model, ids, DynamicCache(), **kwargs)
        assert_same_generation(ref, out)
        assert torch.equal(out.beam_indices, ref.beam_indices)
        torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, atol=ATOL, rtol=0)


@pytest.mark.parametrize("ratio", RATIOS)
def test_sample_generate_dict_output_num_return_sequences(ratio):
    """Mirrors ``GenerationTesterMixin.test_sample_generate_dict_output`` (``num_return_sequences=2``) with the
    cache on: 2 sequences per prompt, scores for ``batch x 2`` rows; at ratio 0 the seeded samples equal
    DynamicCache's."""
    model, ids = tiny_model("llama"), prompt(2, T, seed=13)
    kwargs = dict(do_sample=True, num_return_sequences=2, top_k=10, top_p=0.7, temperature=0.7, new_tokens=3)
    torch.manual_seed(0)
    out = generate(model, ids, LUKVCache(ratio), **kwargs)
    assert out.sequences.shape == (4, T + 3)
    assert [s.shape for s in out.scores] == [(4, VOCAB)] * 3
    assert cache_of(out).get_seq_length() == T + 2
    if ratio == 0:
        torch.manual_seed(0)
        assert_same_generation(generate(model, ids, DynamicCache(), **kwargs), out)


ASSISTED = dict(new_tokens=4, output_hidden_states=True, output_attentions=True)


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("assistant_type", ["random", "same"])
def test_assisted_decoding_matches_greedy_search(assistant_type, ratio):
    """Mirrors ``GenerationTesterMixin.test_assisted_decoding_matches_greedy_search``: assisted decoding (2
    draft tokens a call, ``crop`` of the rejected ones) gives greedy search's output: at ratio 0, DynamicCache's
    greedy run. With eviction the drafts take part in the prompt's eviction (documented), so the tokens are
    not compared; the run completes with every score and the cache ends at the logical length."""
    model, ids = tiny_model("llama", "eager"), prompt(1, T, seed=14)
    assistant = copy.deepcopy(tiny_model("llama", "eager", seed=0 if assistant_type == "same" else 3))
    assistant.generation_config.num_assistant_tokens = 2
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    greedy = generate(model, ids, DynamicCache(), **ASSISTED)
    cache = LUKVCache(ratio)
    out = generate(model, ids, cache, assistant_model=assistant, **ASSISTED)
    assert out.sequences.shape == greedy.sequences.shape
    assert cache.get_seq_length() == out.sequences.shape[-1] - 1
    assert [s.shape for s in out.scores] == [(1, VOCAB)] * 4
    assert_evicted(cache, ratio)
    if ratio == 0:
        assert_similar_generation(greedy, out)


@pytest.mark.parametrize("ratio", RATIOS)
def test_prompt_lookup_decoding_matches_greedy_search(ratio):
    """Mirrors ``GenerationTesterMixin.test_prompt_lookup_decoding_matches_greedy_search``: prompt lookup (2
    tokens proposed from the prompt's n-grams) gives greedy search's output; the cache ends at the logical
    length. The prompt repeats itself so that candidates are proposed (and some rejected: ``crop``)."""
    model = tiny_model("llama", "eager")  # sdpa returns no attentions: generate itself fails on them
    half = prompt(1, 12, seed=15)
    ids = torch.cat([half, half], dim=1)
    greedy = generate(model, ids, DynamicCache(), **ASSISTED)
    cache = LUKVCache(ratio)
    out = generate(model, ids, cache, prompt_lookup_num_tokens=2, **ASSISTED)
    assert out.sequences.shape == greedy.sequences.shape
    assert cache.get_seq_length() == out.sequences.shape[-1] - 1
    assert_evicted(cache, ratio)
    if ratio == 0:
        assert_similar_generation(greedy, out)


@pytest.mark.parametrize("ratio", RATIOS)
def test_assisted_decoding_sample(ratio):
    """Mirrors ``GenerationTesterMixin.test_assisted_decoding_sample``: sampling with an assistant through the
    cache produces a full-length output with every score (outputs are not compared: seeded assisted
    sampling need not match plain sampling)."""
    model, ids = tiny_model("llama", "eager"), prompt(1, T, seed=16)
    assistant = copy.deepcopy(model)
    assistant.generation_config.num_assistant_tokens = 2
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    torch.manual_seed(0)
    cache = LUKVCache(ratio)
    out = generate(model, ids, cache, assistant_model=assistant, do_sample=True, **ASSISTED)
    assert out.sequences.shape == (1, T + 4)
    assert [s.shape for s in out.scores] == [(1, VOCAB)] * 4
    assert cache.get_seq_length() == T + 3


def test_assisted_decoding_with_logits_to_keep():
    """Mirrors ``GenerationTesterMixin.test_assisted_decoding_with_logits_to_keep``: assisted decoding with
    ``logits_to_keep=0`` (every position's logits) and the default give similar outputs over the cache."""
    model, ids = tiny_model("llama"), prompt(1, T, seed=17)
    kwargs = dict(new_tokens=10, assistant_model=model)
    with_all = generate(model, ids, LUKVCache(0), logits_to_keep=0, **kwargs)
    default = generate(model, ids, LUKVCache(0), **kwargs)
    assert_similar_generation(with_all, default)


@pytest.mark.parametrize("ratio", RATIOS)
def test_generate_methods_with_logits_to_keep(ratio):
    """Mirrors ``GenerationTesterMixin.test_generate_methods_with_logits_to_keep``: greedy tokens are the same
    with ``logits_to_keep=0`` as with the default (the last position only)."""
    model, ids = tiny_model("llama"), prompt(2, T, seed=18)
    with_all = generate(model, ids, LUKVCache(ratio), logits_to_keep=0, new_tokens=10)
    default = generate(model, ids, LUKVCache(ratio), new_tokens=10)
    assert torch.equal(with_all.sequences, default.sequences)


def padded_inputs(ids, pad: int):
    mask = torch.ones_like(ids)
    if pad:
        ids = F.pad(ids, (pad, 0), value=PAD)
        mask = F.pad(mask, (pad, 0), value=0)
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    return ids, mask, position_ids


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("ratio", RATIOS)
def test_left_padding_compatibility(arch, ratio):
    """Mirrors ``GenerationTesterMixin.test_left_padding_compatibility`` with a cache: the next-token logits
    of a prompt and of the same prompt after 32 masked pad tokens agree within 1e-5, after the prompt's
    forward and after one more token through the (compressed) cache."""
    model, ids = tiny_model(arch), prompt(2, T, seed=19)
    nxt = prompt(2, 1, seed=20)
    logits = []
    for pad in (0, 32):
        padded, mask, position_ids = padded_inputs(ids, pad)
        cache = LUKVCache(ratio)
        first = forward(model, cache, padded, attention_mask=mask, position_ids=position_ids).logits[:, -1]
        mask = F.pad(mask, (0, 1), value=1)
        second = forward(
            model, cache, nxt, attention_mask=mask, position_ids=position_ids[:, -1:] + 1
        ).logits[:, -1]
        logits.append((first, second))
    for a, b in zip(*logits):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("ratio", RATIOS)
def test_generate_continue_from_past_key_values(arch, ratio):
    """Mirrors ``GenerationTesterMixin.test_generate_continue_from_past_key_values``: 4 tokens in one call
    equal 3 tokens and then 1 more from the returned cache (the extended attention mask passed along); at
    ratio 0 both equal DynamicCache's."""
    model, (ids, mask) = tiny_model(arch), left_padded((20, 14))
    once = generate(model, ids, LUKVCache(ratio), mask, new_tokens=4)
    first = generate(model, ids, LUKVCache(ratio), mask, new_tokens=3)
    longer = F.pad(mask, (0, first.sequences.shape[-1] - mask.shape[1]), value=1)
    cont = generate(model, first.sequences, cache_of(first), longer, new_tokens=1)
    assert torch.equal(cont.sequences, once.sequences)
    torch.testing.assert_close(cont.logits[0], once.logits[-1], atol=ATOL, rtol=0)
    assert cache_of(cont).get_seq_length() == cache_of(once).get_seq_length()
    assert_evicted(cache_of(cont), ratio)
    if ratio == 0:
        assert_same_generation(generate(model, ids, DynamicCache(), mask, new_tokens=4), once)


@pytest.mark.parametrize("ratio", RATIOS)
def test_generate_continue_from_inputs_embeds(ratio):
    """Mirrors ``GenerationTesterMixin.test_generate_continue_from_inputs_embeds``: generating 4 tokens from
    ``inputs_embeds`` equals generating 2, then 2 more from the returned cache with the embeddings of
    everything so far."""
    model, ids = tiny_model("llama"), prompt(1, T, seed=21)
    embed = model.get_input_embeddings()
    with torch.no_grad():
        embeds = embed(ids)
        once = model.generate(
            inputs_embeds=embeds, **{cache_kwarg(model): LUKVCache(ratio)}, max_new_tokens=4, do_sample=False,
            return_dict_in_generate=True,
        )  # fmt: skip
        first = model.generate(
            inputs_embeds=embeds, **{cache_kwarg(model): LUKVCache(ratio)}, max_new_tokens=2, do_sample=False,
            return_dict_in_generate=True,
        )  # fmt: skip
        more = torch.cat([embeds, embed(first.sequences)], dim=1)
        cont = model.generate(
            inputs_embeds=more, **{cache_kwarg(model): cache_of(first)}, max_new_tokens=2, do_sample=False,
            return_dict_in_generate=True,
        )  # fmt: skip
    assert torch.equal(torch.cat([first.sequences, cont.sequences], dim=1), once.sequences)
    if ratio == 0:
        with torch.no_grad():
            ref = model.generate(
                inputs_embeds=embeds,
                **{cache_kwarg(model): DynamicCache()},
                max_new_tokens=4,
                do_sample=False,
            )
        assert torch.equal(ref, once.sequences)


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("num_beams", [1, 2], ids=["greedy", "beam_search"])
def test_generate_from_inputs_embeds(num_beams, ratio):
    """Mirrors ``GenerationTesterMixin.test_generate_from_inputs_embeds`` (greedy, beam search): through the
    cache, ids alone and ids with their embeddings generate alike; random embeddings change the scores."""
    model, ids = tiny_model("llama"), prompt(1, T, seed=22)
    kwargs = dict(num_beams=num_beams, new_tokens=5, min_new_tokens=5, output_logits=False)
    from_ids = generate(model, ids, LUKVCache(ratio), **kwargs)
    assert from_ids.sequences.shape == (1, T + 5)
    embeds = model.get_input_embeddings()(ids).detach()
    from_embeds = generate(model, ids, LUKVCache(ratio), inputs_embeds=embeds, **kwargs)
    assert_similar_generation(from_ids, from_embeds)
    torch.manual_seed(0)
    random = generate(model, ids, LUKVCache(ratio), inputs_embeds=torch.rand_like(embeds), **kwargs)
    for a, b in zip(from_embeds.scores, random.scores):
        assert not torch.allclose(a, b)


@pytest.mark.parametrize("ratio", RATIOS)
def test_prepare_inputs_for_generation_decoder_llm(ratio):
    """Mirrors ``GenerationIntegrationTests.test_prepare_inputs_for_generation_decoder_llm`` (steps 5-6): with a
    filled cache the model inputs carry it, the 2-D attention mask stays whole (a non-compileable cache gets
    no 4-D mask), and only the new token is fed."""
    model, ids = tiny_model("llama"), prompt(2, 3, seed=23)
    cache = make(ratio)
    forward(model, cache, ids[:, :2])
    assert cache.is_compileable is False
    mask = torch.ones_like(ids)
    inputs = model.prepare_inputs_for_generation(
        ids, next_sequence_length=ids.shape[-1] - cache.get_seq_length(), **{cache_kwarg(model): cache},
        attention_mask=mask,
    )  # fmt: skip
    assert inputs[cache_kwarg(model)] is cache
    assert inputs["input_ids"].shape[-1] == 1
    assert torch.equal(inputs["attention_mask"], mask)


@pytest.mark.parametrize("ratio", RATIOS)
def test_eager_matches_sdpa_generate(ratio):
    """Mirrors ``GenerationTesterMixin.test_eager_matches_sdpa_generate``: over the cache, eager and SDPA
    attention generate similar outputs (30 tokens, 1e-3 on the scores)."""
    ids = prompt(1, T, seed=24)
    eager = generate(tiny_model("llama", "eager"), ids, LUKVCache(ratio), new_tokens=30)
    sdpa = generate(tiny_model("llama", "sdpa"), ids, LUKVCache(ratio), new_tokens=30)
    assert_similar_generation(eager, sdpa, atol=1e-3)


# ---------------------------------------------------------------- the cache API generate and its modes call


def filled(ratio, batch=3, steps=3, seed=25):
    """A reference DynamicCache and a cache at ``ratio``, both after a prompt and ``steps`` decode tokens."""
    model = tiny_model("llama")
    ref, cache = DynamicCache(), make(ratio)
    ids = prompt(batch, T, seed=seed)
    for c in (ref, cache):
        forward(model, c, ids)
        for step in range(steps):
            forward(model, c, prompt(batch, 1, seed=seed + 1 + step))
    return model, ref, cache


def assert_same_lengths(cache, ref, layers=2):
    assert cache.get_seq_length() == ref.get_seq_length()
    for layer in range(layers):
        assert cache.get_seq_length(layer) == ref.get_seq_length(layer)
        for q in (1, 5):
            assert cache.get_mask_sizes(q, layer) == ref.get_mask_sizes(q, layer)


@pytest.mark.parametrize("ratio", RATIOS)
def test_seq_length_and_mask_sizes_follow_dynamic_cache(ratio):
    """``get_seq_length`` and ``get_mask_sizes``, which ``generate`` and the mask builders read on every
    forward (``test_prepare_inputs_for_generation_decoder_llm`` step 5, ``_check_attentions_for_generate``'s
    key lengths): before any forward, after the prompt and after each decode step, the logical length is
    DynamicCache's, whatever was evicted."""
    model = tiny_model("llama")
    ref, cache = DynamicCache(), make(ratio)
    assert cache.get_seq_length() == 0 and cache.get_mask_sizes(4, 0) == ref.get_mask_sizes(4, 0) == (4, 0)
    ids = prompt(2, T, seed=30)
    for c in (ref, cache):
        forward(model, c, ids)
    assert_same_lengths(cache, ref)
    for step in range(3):
        token = prompt(2, 1, seed=31 + step)
        for c in (ref, cache):
            forward(model, c, token)
        assert_same_lengths(cache, ref)


@pytest.mark.parametrize("ratio", RATIOS)
def test_crop_then_continue(ratio):
    """``crop`` as assisted decoding calls it (``test_assisted_decoding_matches_greedy_search``: rejected draft
    tokens are cropped): after ``crop(-2)`` the logical length and mask sizes are DynamicCache's, and feeding
    the 2 cropped tokens again reproduces the logits they gave before (at ratio 0, DynamicCache's)."""
    model = tiny_model("llama")
    ref, cache = DynamicCache(), make(ratio)
    ids, tokens = prompt(2, T, seed=32), prompt(2, 2, seed=33)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the drafts take part in the prompt's eviction (none here)
        for c in (ref, cache):  # as assisted decoding does first: only the first forward is the prompt
            c.activate_past_recording()
    for c in (ref, cache):
        forward(model, c, ids)
    before = forward(model, cache, tokens).logits
    forward(model, ref, tokens)
    assert_evicted(cache, ratio)
    for c in (ref, cache):
        c.crop(-2)
    assert_same_lengths(cache, ref)
    again = forward(model, cache, tokens).logits
    torch.testing.assert_close(again, before, atol=ATOL, rtol=0)
    theirs = forward(model, ref, tokens).logits
    if ratio == 0:
        torch.testing.assert_close(again, theirs, atol=ATOL, rtol=0)
    nxt = prompt(2, 1, seed=34)
    forward(model, cache, nxt)
    forward(model, ref, nxt)
    assert_same_lengths(cache, ref)


def batch_op_cases():
    ops = [
        ("batch_repeat_interleave", lambda c: c.batch_repeat_interleave(2), [0, 0, 1, 1, 2, 2]),
        ("batch_select_indices_tensor", lambda c: c.batch_select_indices(torch.tensor([2, 0])), [2, 0]),
        ("batch_select_indices_list", lambda c: c.batch_select_indices([0, 2]), [0, 2]),
        ("batch_select_indices_tuple", lambda c: c.batch_select_indices((0, 2)), [0, 2]),
        ("reorder_cache", lambda c: c.reorder_cache(torch.tensor([1, 1, 0])), [1, 1, 0]),
    ]
    return [pytest.param(r, op, rows, id=f"{name}-{r}") for name, op, rows in ops for r in RATIOS]


@pytest.mark.parametrize(("ratio", "op", "rows"), batch_op_cases())
def test_batch_operations_select_rows_like_dynamic_cache(ratio, op, rows):
    """``batch_repeat_interleave`` and ``batch_select_indices`` (the calls contrastive search makes in
    ``test_contrastive_generate*``, Hub-only in 5.23, and ``_expand_inputs_for_generation``-style expansion)
    and ``reorder_cache`` (beam search): the cache then holds the rows named, in that order, with the
    logical length unchanged; each row predicts what its source row predicted (at ratio 0, what the
    DynamicCache given the same operation predicts)."""
    model, ref, cache = filled(ratio)
    token = prompt(3, 1, seed=40)
    before = logits_of_rows(model, cache, token)
    op(cache)
    op(ref)
    assert_same_lengths(cache, ref)
    assert_evicted(cache, ratio)
    assert ref.layers[0].keys.shape[0] == len(rows)
    after = logits_of_rows(model, cache, token[rows])
    torch.testing.assert_close(after, before[rows], atol=ATOL, rtol=0)
    if ratio == 0:
        torch.testing.assert_close(after, logits_of_rows(model, ref, token[rows]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("ratio", RATIOS)
def test_reset_then_reuse_equals_a_fresh_cache(ratio):
    """``reset`` and reusing one cache object across ``generate`` calls (the two sequential generations of
    ``test_generate_compile_model_forward``, without compiling; ``Cache.reset``): after ``reset`` the cache
    is empty like a reset DynamicCache, and a second generation with another prompt equals one from a
    fresh cache."""
    model = tiny_model("llama")
    ids1, ids2 = prompt(2, T, seed=41), prompt(2, T - 4, seed=42)
    cache, ref = LUKVCache(ratio), DynamicCache()
    generate(model, ids1, cache, new_tokens=5)
    generate(model, ids1, ref, new_tokens=5)
    cache.reset()
    ref.reset()
    assert cache.get_seq_length() == ref.get_seq_length() == 0
    assert cache.get_mask_sizes(3, 0) == ref.get_mask_sizes(3, 0) == (3, 0)
    assert not any(layer.is_initialized for layer in cache.layers)
    reused = generate(model, ids2, cache, new_tokens=5)
    assert_evicted(cache, ratio)
    assert_same_generation(generate(model, ids2, LUKVCache(ratio), new_tokens=5), reused, atol=0)
    if ratio == 0:
        assert_same_generation(generate(model, ids2, ref, new_tokens=5), reused)
