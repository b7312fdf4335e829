"""Sliding-window layers whose window holds the prompt are compressed like full-attention ones (issue 30):
exact at ratio 0 while the window fills and slides during decoding, evicting at 0.5 (a padded row equals
the row alone), bounded by about the window plus the fold interval, under ``max_tokens``; Gemma-2's
sliding layers too when the prompt is shorter than their window."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import greedy_with_logits, tiny_model
from transformers import DynamicCache

from lukv_cache import LUKVCache
from lukv_cache.cache.storage.layer import LUKVLayer
from lukv_cache.testing import left_padded, prompt

WINDOW = 32  # longer than the prompts (24 tokens), shorter than prompt + new tokens
FOLD = 16


def _quiet(ratio=None, **kwargs) -> LUKVCache:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a window that holds the prompt leaves no layer alone: no warning
        return LUKVCache(ratio, sink=2, window=3, **kwargs)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_ratio_0_equals_dynamic_cache_while_the_window_fills_and_slides(attn):
    model = tiny_model("mistral", attn, sliding_window=WINDOW)
    ids = prompt(1, 24)
    cache = _quiet(0.0, fold_interval=FOLD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        seq, logits = greedy_with_logits(model, ids, cache, new_tokens=3 * WINDOW)
    ref_seq, ref_logits = greedy_with_logits(model, ids, DynamicCache(), new_tokens=3 * WINDOW)
    assert all(isinstance(layer, LUKVLayer) and layer.compressed for layer in cache.layers)
    assert torch.equal(seq, ref_seq)
    assert (logits - ref_logits).abs().max() <= 1e-5
    # folds dropped what fell out of the window: at most the window's last W - 1 plus the suffix
    assert int(cache.stored_tokens().max()) < WINDOW - 1 + FOLD + 1


def test_ratio_half_evicts_and_a_padded_row_equals_the_row_alone():
    model = tiny_model("mistral", "sdpa", sliding_window=WINDOW)
    ids, mask = left_padded((24, 17, 11))
    cache = _quiet(0.5, fold_interval=FOLD)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=2 * WINDOW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    after_prompt = _quiet(0.5)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=after_prompt)
    assert int(after_prompt.stored_tokens()[:, 0].max()) < 24  # evicted
    row = 1
    alone = ids[row : row + 1, 24 - 17 :]
    cache_alone = _quiet(0.5, fold_interval=FOLD)
    with torch.no_grad():
        out_alone = model.generate(
            alone,
            past_key_values=cache_alone,
            max_new_tokens=2 * WINDOW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    logits = torch.stack(out.logits)[:, row]
    assert torch.equal(out.sequences[row, 24:], out_alone.sequences[0, 17:])
    assert (logits - torch.stack(out_alone.logits)[:, 0]).abs().max() <= 1e-5


def test_memory_stays_bounded_by_the_window_and_the_fold_interval():
    model = tiny_model("mistral", "sdpa", sliding_window=WINDOW)
    cache = _quiet(0.0, fold_interval=FOLD)
    greedy_with_logits(model, prompt(1, 24), cache, new_tokens=10 * WINDOW)
    assert cache.is_compressed  # the sliding layers are LUKVLayers, not the stock ones
    text = model.config
    layers, heads, dim = text.num_hidden_layers, text.num_key_value_heads, text.head_dim
    per_token = heads * (2 * dim * 4 + 4)  # fp32 keys and values, an int32 position, per KV head
    offsets = (heads + 1) * 8
    bound = layers * ((WINDOW + FOLD + 1) * per_token + offsets)
    assert cache.memory_bytes() <= bound
    dense = DynamicCache()
    greedy_with_logits(model, prompt(1, 24), dense, new_tokens=10 * WINDOW)
    assert cache.memory_bytes() < dense.layers[0].keys.numel() * 4 * 2 * layers  # the stock layers'


def test_max_tokens_holds_on_sliding_layers():
    model = tiny_model("mistral", "sdpa", sliding_window=WINDOW)
    ids, mask = left_padded((24, 17, 11))
    cache = _quiet(max_tokens=10)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
    assert cache.is_compressed
    per_row = cache.stored_tokens().double().mean((0, 2))
    assert bool((per_row <= 10).all()), per_row


def test_decode_max_tokens_holds_and_drops_what_left_the_window():
    model = tiny_model("mistral", "sdpa", sliding_window=WINDOW)
    cache = _quiet(decode_max_tokens=20, fold_interval=FOLD)
    greedy_with_logits(model, prompt(1, 24), cache, new_tokens=4 * WINDOW)
    for layer in cache.layers:
        oldest = layer.cumulative_length - WINDOW + 1
        assert layer.store is None or int(layer.store.positions.min()) >= oldest - FOLD - 3
    assert int(cache.stored_tokens().max()) <= 20 + FOLD + 3


def test_a_prompt_longer_than_the_window_keeps_the_stock_sliding_layer_and_says_so():
    model = tiny_model("mistral", "sdpa", sliding_window=16)
    cache = LUKVCache(0.5, sliding="keep")
    with pytest.warns(UserWarning, match=r"compresses nothing.*|longer than their window"):
        with torch.no_grad():
            model(prompt(1, 24), past_key_values=cache)
    assert not cache.is_compressed
    cache.reset()  # a new, shorter prompt decides again
    with torch.no_grad():
        model(prompt(1, 12), past_key_values=cache)
    assert cache.is_compressed


@pytest.mark.parametrize(
    "options, tail",
    [
        ({"ratio": 0.5}, "; this cache compresses nothing here."),
        ({"max_tokens": 12}, "; this cache compresses nothing and max_tokens bounds nothing here."),
        (
            {"decode_max_tokens": 12},
            "; this cache compresses nothing and decode_max_tokens bounds nothing here.",
        ),
    ],
)
def test_an_all_sliding_model_names_only_the_bound_it_was_given(options, tail):
    """Issue 54, item 9: under ratio= it said 'max_tokens bounds nothing'."""
    model = tiny_model("mistral", "sdpa", sliding_window=16)
    cache = LUKVCache(**options, sliding="keep")
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model(prompt(1, 24), past_key_values=cache)
    said = [str(w.message) for w in caught if "LUKVCache leaves" in str(w.message)]
    assert said and said[0].endswith(tail) and cache.layout.left_alone.endswith(tail)
    if "max_tokens" not in options:
        assert "max_tokens" not in cache.layout.left_alone.replace("decode_max_tokens", "")


@pytest.mark.parametrize("options, named", [({"ratio": 0.5}, "ratio"), ({"max_tokens": 12}, "max_tokens")])
def test_a_partly_sliding_model_names_what_applies_to_its_full_attention_layers(options, named):
    cache = LUKVCache(**options, sliding="keep")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        tiny_model("gemma2", "eager")(prompt(1, 12), past_key_values=cache)
    assert cache.layout.left_alone.endswith(f"; eviction and {named} apply to the full-attention layers [1].")


def _left_alone_warnings(model, length: int, caches: int = 1) -> list[str]:
    """The lukv warnings of ``caches`` fresh caches, one after another, each given a ``length``-token prompt."""
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")  # what the once-per-location filter would dedupe is counted too
        for _ in range(caches):
            model(prompt(1, length), past_key_values=LUKVCache(0.5, sliding="keep"))
    return [str(w.message) for w in caught if "LUKVCache leaves" in str(w.message)]


def test_a_loop_of_caches_on_one_sliding_model_is_warned_once_without_the_prompt_length():
    model = tiny_model("gemma2", "eager")  # windows of 8 on layers 0 and 2
    said = _left_alone_warnings(model, 12, caches=3)
    assert len(said) == 1, said
    assert "window of 8" in said[0] and "12" not in said[0]
    assert _left_alone_warnings(model, 13) == []  # another prompt length, the same layout: said already


def test_another_window_is_another_layout_and_warned_again():
    assert len(_left_alone_warnings(tiny_model("gemma2", "eager"), 12)) == 1
    said = _left_alone_warnings(tiny_model("gemma2", "eager", sliding_window=10), 12)
    assert len(said) == 1 and "window of 10" in said[0], said


def test_the_cache_says_what_it_leaves_alone_for_its_prompt_with_the_prompt_length(caplog):
    model = tiny_model("gemma2", "eager")
    cache = LUKVCache(0.5, sliding="keep")
    with warnings.catch_warnings(), torch.no_grad(), caplog.at_level("DEBUG", logger="lukv_cache"):
        warnings.simplefilter("ignore")
        model(prompt(1, 12), past_key_values=cache)
    said = cache.layout.left_alone
    assert said is not None and "layers [0, 2]" in said and "of 12 tokens" in said and "window of 8" in said
    assert said in caplog.messages
    cache.reset()  # a prompt that fits the window leaves nothing alone
    with torch.no_grad():
        model(prompt(1, 6), past_key_values=cache)
    assert cache.layout.left_alone is None


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_sliding_layers_compress_a_prompt_shorter_than_their_window(arch):
    model = tiny_model(arch, "eager")  # windows of 8
    ids = prompt(1, 6)
    cache = _quiet(0.0, fold_interval=4)
    seq, logits = greedy_with_logits(model, ids, cache, new_tokens=20)
    ref_seq, ref_logits = greedy_with_logits(model, ids, DynamicCache(), new_tokens=20)
    assert [type(layer).__name__ for layer in cache.layers] == ["LUKVLayer"] * 3
    assert cache.layers[0].compressed and cache.layers[0].sliding_window == 8
    assert torch.equal(seq, ref_seq)
    assert (logits - ref_logits).abs().max() <= 1e-5
    assert int(cache.stored_tokens()[[0, 2]].max()) < 8 + 4 + 1  # the sliding layers slid


@pytest.mark.parametrize(
    ("arch", "length", "overrides"), [("mistral", 24, {"sliding_window": WINDOW}), ("gemma2", 8, {})]
)
def test_a_prompt_that_fits_the_window_is_compressed_without_a_warning(arch, length, overrides):
    model = tiny_model(arch, "eager", **overrides)
    cache = LUKVCache(0.5, sink=2, window=3)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model.generate(prompt(1, length), past_key_values=cache, max_new_tokens=3, do_sample=False)
    assert not [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert cache.is_compressed and int(cache.stored_tokens().max()) < cache.get_seq_length()


# sliding="compress": a prompt longer than the window keeps the sliding layers as LUKVLayers, which drop what
# is older than the window at the prompt's eviction and evict from the rest at the ratio (issue 44, item 5)
LONG = [("mistral", "sdpa", {"sliding_window": 16}), ("gemma2", "eager", {}), ("gemma3", "sdpa", {})]


def _windows(model) -> dict[int, int]:
    """layer -> window of the model's sliding layers (every layer of a Mistral with a window)."""
    text = model.config.get_text_config()
    kinds = getattr(text, "layer_types", None) or ["sliding_attention"] * text.num_hidden_layers
    return {i: text.sliding_window for i, kind in enumerate(kinds) if kind == "sliding_attention"}


@pytest.mark.parametrize(("arch", "attn", "overrides"), LONG)
def test_compress_at_ratio_0_equals_dynamic_cache_on_a_prompt_longer_than_the_window(arch, attn, overrides):
    model = tiny_model(arch, attn, **overrides)
    ids = prompt(1, 40)
    cache = _quiet(0.0, fold_interval=FOLD, sliding="compress")
    seq, logits = greedy_with_logits(model, ids, cache, new_tokens=40)
    ref_seq, ref_logits = greedy_with_logits(model, ids, DynamicCache(), new_tokens=40)
    assert all(isinstance(layer, LUKVLayer) and layer.compressed for layer in cache.layers)
    assert torch.equal(seq, ref_seq)
    assert (logits - ref_logits).abs().max() <= 1e-5
    for i, window in _windows(model).items():  # what left the window was dropped: at most one fold behind
        assert int(cache.stored_tokens()[i].max()) <= window - 1 + FOLD + 1


@pytest.mark.parametrize("allocator", ["uniform", "global"])
@pytest.mark.parametrize(("arch", "attn", "overrides"), LONG[1:])
def test_compress_evicts_each_kind_of_layer_at_the_ratio(arch, attn, overrides, allocator):
    """At 0.5 a sliding layer holds the sinks, the recent window and half of the rest of its window; a
    full-attention layer half of its own evictable tokens, also under a whole-model allocator (each kind is
    allocated on its own: a sliding layer has fewer tokens to evict)."""
    model = tiny_model(arch, attn, **overrides)
    length, sink, window = 40, 2, 3
    cache = LUKVCache(0.5, allocator=allocator, sink=sink, window=window, sliding="compress")
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model(prompt(1, length), past_key_values=cache)
    assert not [str(w.message) for w in caught if "LUKVCache leaves" in str(w.message)]
    assert cache.layout.left_alone is None
    stored = cache.stored_tokens()[:, 0]  # [layers, kv_heads]
    windows = _windows(model)
    for i in range(len(cache.layers)):
        held = windows[i] - 1 if i in windows else length  # what a DynamicCache holds in the layer
        evictable = held - sink - window
        kept = stored[i] - sink - window
        assert (
            bool((kept >= 1).all())
            and abs(int(kept.sum()) - evictable * stored.shape[-1] / 2) <= stored.shape[-1]
        )
        if i in windows:
            oldest = length - windows[i] + 1
            assert int(cache.layers[i].store.positions.min()) >= oldest


def test_compress_a_padded_row_equals_the_row_alone():
    model = tiny_model("gemma2", "eager")  # windows of 8
    ids, mask = left_padded((30, 21, 14))
    cache = LUKVCache(0.5, sink=2, window=3, sliding="compress")
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, **_cache_kwarg(model, cache), max_new_tokens=12, do_sample=False
        )
    for row in range(ids.shape[0]):
        real = ids[row][mask[row].bool()].unsqueeze(0)
        alone = LUKVCache(0.5, sink=2, window=3, sliding="compress")
        with torch.no_grad():
            ref = model.generate(real, **_cache_kwarg(model, alone), max_new_tokens=12, do_sample=False)
        assert torch.equal(out[row, ids.shape[1] :], ref[0, real.shape[1] :]), row


def _cache_kwarg(model, cache) -> dict:
    from lukv_cache._compat import cache_kwarg

    return {cache_kwarg(model): cache}


def test_compress_saves_and_loads_with_its_option(tmp_path):
    from lukv_cache import load_cache, save_cache

    model = tiny_model("gemma3", "sdpa")
    cache = LUKVCache(0.5, sink=2, window=3, sliding="compress")
    with torch.no_grad():
        model(prompt(1, 30), past_key_values=cache)
    loaded = load_cache(save_cache(cache, tmp_path / "context.safetensors", model=model), model)
    assert loaded.sliding == "compress"
    assert torch.equal(loaded.stored_tokens(), cache.stored_tokens())
    assert [type(layer).__name__ for layer in loaded.layers] == ["LUKVLayer"] * 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ratio": 0.5, "sliding": "drop"}, "sliding must be one of 'keep', 'compress'"),
        ({"max_tokens": 64, "sliding": "compress"}, "does not combine with max_tokens"),
        ({"decode_max_tokens": 64, "sliding": "compress"}, "does not combine with decode_max_tokens="),
    ],
)
def test_a_bad_sliding_option_is_a_configuration_error(kwargs, match):
    from lukv_cache.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=match):
        LUKVCache(**kwargs)


def test_compress_drops_what_left_the_window_before_the_rest_of_the_prefill_runs():
    """Under a whole-model allocator (global waits for the last layer) a sliding layer does not hold the
    whole prompt while the later layers run: what is older than its window is gone once it attended."""
    model = tiny_model("gemma3", "sdpa")  # windows of 8 on layers 0 and 2, layer 1 global
    cache = LUKVCache(0.5, allocator="global", sink=2, window=3, sliding="compress")
    seen = []
    hook = model.model.layers[-1].register_forward_pre_hook(
        lambda module, args: seen.append(cache.layers[0].suffix_length)
    )
    try:
        with torch.no_grad():
            model(prompt(1, 40), past_key_values=cache)
    finally:
        hook.remove()
    assert seen == [8 - 1]


def test_compress_with_kvzip_drops_what_left_the_window_after_its_passes():
    from lukv_cache.scorers.kvzip import RepeatPrompt

    model = tiny_model("gemma3", "sdpa")
    cache = LUKVCache(0.5, "kvzip", "global", sliding="compress", config=model.config)
    cache.prefill(
        model, prompt(1, 40), repeat_prompt=RepeatPrompt(first=(5, 6, 7), next=(8, 9), suffix=(10,))
    )
    stored = cache.stored_tokens()[:, 0]
    assert int(stored[[0, 2]].max()) <= 8 - 1  # the window's last 7 at most (kvzip protects its last 32)
    assert int(stored[1].min()) > 8


def test_ratio_compresses_sliding_layers_by_default_and_a_token_bound_keeps_them():
    assert LUKVCache(0.5).sliding == "compress"
    assert LUKVCache(max_tokens=64).sliding == LUKVCache(0.5, decode_max_tokens=64).sliding == "keep"
    model = tiny_model("gemma3", "sdpa")  # windows of 8
    cache = LUKVCache(0.5, sink=2, window=3)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model(prompt(1, 40), past_key_values=cache)
    assert not [str(w.message) for w in caught if "LUKVCache leaves" in str(w.message)]  # nothing left alone
    assert all(isinstance(layer, LUKVLayer) and layer.compressed for layer in cache.layers)
    assert int(cache.stored_tokens()[[0, 2]].max()) < 8 - 1  # evicted within the window
