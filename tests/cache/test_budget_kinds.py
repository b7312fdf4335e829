"""A memory budget on every layer kind (issue 57): sliding windows, linear-attention / SSM states, parallel
hybrids and KV sharing. ``memory=f`` is ``f`` times what the model's own ``DynamicCache(config=...)`` holds
(a sliding layer at most its window, linear states at their size, a layer reading another's KV nothing), the
layers left to transformers count as they are, and the bound holds after every forward, as on full-attention
models (``test_budget_property.py``)."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
from helpers import tiny_model
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from lukv_cache import LUKVCache
from lukv_cache._compat import cache_kwarg
from lukv_cache.cache.storage.layer import LUKVLayer
from lukv_cache.cache.storage.report import kv_cache_bytes
from lukv_cache.errors import ConfigurationError
from lukv_cache.testing import flat_profile, left_padded, prompt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "families"))

import families  # noqa: E402

WINDOW = 64  # the tiny Gemmas' sliding window here: a 300-token prompt is longer, 40 tokens fit
QUESTION = 40


def _forward(model, cache, ids, mask=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})


def _own_bytes(model, ids: torch.Tensor) -> int:
    """Bytes the model's own cache (``DynamicCache(config=...)``) holds after ``ids``."""
    cache = DynamicCache(config=model.config)
    _forward(model, cache, ids)
    return kv_cache_bytes(cache)


def _six_layers(model_type: str):
    """A tiny Gemma-3n / Gemma-4 of 6 layers (sliding / full, alternating): the family matrix's has only the
    layers that keep their KV for others (2 of them), which leaves nothing to compress."""
    kwargs = families.config_kwargs(model_type)
    kwargs.update(num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3)
    kwargs["intermediate_size"] = 128
    if model_type == "gemma3n_text":
        kwargs["num_kv_shared_layers"] = 2  # layers 4 and 5 read the KV of layers 2 and 3
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kwargs)).eval()


def _model(kind: str):
    if kind in ("gemma3", "gemma2"):
        return tiny_model(kind, attn="eager", sliding_window=WINDOW)
    if kind == "gemma3n_text":
        return _six_layers(kind)
    model = families.build_model(kind, "sdpa")
    return model[0] if isinstance(model, tuple) else model


def _run_and_check(model, options: dict, ids, mask=None) -> tuple[LUKVCache, list[float]]:
    """The prompt, decoding steps, a question, more steps; after each forward the bytes against the budget
    (``memory`` times the model's own cache for the same tokens, or ``max_bytes`` per row)."""
    rows = ids.shape[0]
    options = dict(options)
    path = options.pop("profile_path", None)  # a profile file (with its memory table) to build the cache from
    if path is None:
        cache = LUKVCache(**options, config=model.config)
    else:
        cache = LUKVCache.from_pretrained(path, **options, config=model.config)
    seen, tokens = [], ids

    def check():
        if "max_bytes" in options:
            bound = options["max_bytes"] * rows
        else:
            bound = int(options["memory"] * _own_bytes(model, tokens))
        seen.append(cache.memory_bytes() / bound)
        assert cache.memory_bytes() <= bound, (len(seen), cache.memory_bytes(), bound)

    out = _forward(model, cache, ids, mask)
    check()
    for step in range(14):
        new = prompt(rows, QUESTION, seed=11) if step == 6 else out.logits[:, -1:].argmax(-1)
        mask = None if mask is None else torch.cat([mask, torch.ones_like(new)], 1)
        tokens = torch.cat([tokens, new], 1)
        out = _forward(model, cache, new, mask)
        check()
    return cache, seen


KINDS = ["gemma3", "gemma2", "qwen3_next", "lfm2", "jamba", "falcon_h1", "gemma3n_text"]
if "dory" in CONFIG_MAPPING:  # from transformers 5.24: a looped model whose cache gains layers (copies of its
    KINDS.append("dory")  # recurrent ones) at the first forward


@pytest.mark.parametrize("options", [dict(memory=0.5), dict(memory=0.3), dict(max_bytes=30_000)], ids=repr)
@pytest.mark.parametrize("kind", KINDS)
def test_the_budget_holds_after_every_forward_on_every_layer_kind(kind, options):
    model = _model(kind)
    length = 300 if kind.startswith("gemma") else 150
    if kind == "gemma3n_text":  # half its KV is in the two layers others read, kept whole
        options = dict(memory=0.7) if "memory" in options else dict(max_bytes=110_000)
    cache, seen = _run_and_check(model, options, prompt(1, length, seed=2))
    assert cache.memory_choice is not None
    if cache.memory_choice.ratio > 0:  # the budget is used, not only respected (unless it holds every token)
        assert max(seen) > 0.75


@pytest.mark.parametrize("kind", ["gemma3", "qwen3_next", "gemma3n_text"])
@pytest.mark.parametrize("length", [40, 300])
def test_memory_is_a_fraction_of_the_models_own_cache(kind, length):
    """The budget is ``memory`` times what ``DynamicCache(config=...)`` holds for the prompt, layer by layer:
    on Gemma the windows hold at most 63 tokens, Qwen3-Next's linear layer its states, Gemma-3n's reading
    layers nothing."""
    model = _model(kind)
    ids = prompt(1, length, seed=3)
    memory = 0.9 if kind == "gemma3n_text" else 0.7  # what gemma3n's layers kept whole leave room for
    cache = LUKVCache(memory=memory, config=model.config)
    _forward(model, cache, ids)
    assert cache.memory_choice.budget == int(memory * _own_bytes(model, ids))


@pytest.mark.parametrize("options", [dict(memory=0.3), dict(memory=0.15), dict(max_bytes=20_000)], ids=repr)
@pytest.mark.parametrize("kind", ["gemma3", "gemma3n_text"])
def test_one_ratio_for_every_layer_holds_the_budget_too(kind, options):
    model = _model(kind)
    if kind == "gemma3n_text":
        options = dict(memory=0.7) if "memory" in options else dict(max_bytes=110_000)
    cache, _ = _run_and_check(model, {**options, "split": "ratio"}, prompt(1, 300, seed=2))
    assert cache.policy.split == "ratio"


@pytest.mark.parametrize("memory", [0.22, 0.15])  # at 0.3, 4 bits keep every token: nothing to split
def test_global_first_keeps_the_full_attention_layers_tokens_before_the_windows(memory):
    """The default split under a budget: the sliding layers give their tokens first (down to their protected
    ones), the full-attention layer keeps what the rest of the bytes hold; one ratio for every layer
    (``split="ratio"``) keeps fewer of the full-attention layer's in the same bytes."""
    model = _model("gemma3")
    ids = prompt(1, 300, seed=7)
    first, ratio = (
        LUKVCache(memory=memory, config=model.config),
        LUKVCache(memory=memory, split="ratio", config=model.config),
    )
    _forward(model, first, ids)
    _forward(model, ratio, ids)
    assert first.policy.split == "global_first"
    kept_first, kept_ratio = first.stored_tokens()[:, 0], ratio.stored_tokens()[:, 0]  # [layers, heads]
    assert int(kept_first[1].sum()) > int(kept_ratio[1].sum())  # layer 1: full attention
    assert int(kept_first[0].sum()) < int(kept_ratio[0].sum())  # layer 0: a window
    budget = first.memory_choice.budget
    assert first.memory_bytes() <= budget and ratio.memory_bytes() <= budget


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(ratio=0.5, split="global_first"), "pass memory= or max_bytes= with it"),
        (dict(memory=0.3, split="kinds"), "split must be one of 'global_first', 'ratio'"),
    ],
)
def test_a_split_without_a_budget_or_unknown_is_a_configuration_error(options, match):
    with pytest.raises(ConfigurationError, match=match):
        LUKVCache(**options)


def test_a_padded_batch_holds_the_budget_on_a_sliding_model():
    model = _model("gemma3")
    ids, mask = left_padded((300, 211), seed=3)
    _run_and_check(model, dict(memory=0.3), ids, mask)


@pytest.mark.parametrize("memory", [0.22, 0.15])  # the same bits for the batch and the row alone
def test_a_padded_row_keeps_what_it_keeps_alone_on_a_sliding_model(memory):
    """Each row's budget counts its real tokens, read off the full-attention layer's mask (a sliding layer's
    hides what left its window, as it hides padding)."""
    model = _model("gemma3")
    ids, mask = left_padded((300, 150), seed=3)
    batch, alone = (LUKVCache(memory=memory, config=model.config) for _ in range(2))
    _forward(model, batch, ids, mask)
    _forward(model, alone, ids[1:, -150:])
    assert batch.kv_bits == alone.kv_bits
    assert torch.equal(batch.stored_tokens()[:, 1], alone.stored_tokens()[:, 0])


def test_sliding_windows_are_compressed_in_the_budget_by_default_and_counted_whole_with_keep():
    model = _model("gemma3")
    ids = prompt(1, 300, seed=4)
    compress, _ = _run_and_check(model, dict(memory=0.45), ids)
    keep, _ = _run_and_check(model, dict(memory=0.45, sliding="keep"), ids)
    assert compress.policy.sliding == "compress" and keep.policy.sliding == "keep"
    assert all(isinstance(layer, LUKVLayer) for layer in compress.layers)
    assert [type(layer) for layer in keep.layers][::2] == [DynamicSlidingWindowLayer] * 2
    # the windows whole leave the full-attention layer less: it keeps fewer tokens
    assert int(keep.stored_tokens()[1].sum()) < int(compress.stored_tokens()[1].sum())


def test_a_budget_that_the_windows_kept_whole_leave_no_room_for_says_so():
    model = _model("gemma3")
    with pytest.raises(ConfigurationError, match="for the layers it leaves to transformers"):
        LUKVCache(memory=0.25, sliding="keep", config=model.config).prefill(model, prompt(1, 300, seed=4))


@pytest.mark.parametrize("kind", ["gemma3", "qwen3_next"])
def test_memory_one_is_the_models_own_cache(kind):
    model = _model(kind)
    ids = prompt(1, 120, seed=5)
    ours, theirs = LUKVCache(memory=1.0, config=model.config), DynamicCache(config=model.config)
    a, b = _forward(model, ours, ids), _forward(model, theirs, ids)
    for step in range(6):
        assert torch.equal(a.logits, b.logits), step
        assert ours.memory_bytes() == kv_cache_bytes(theirs), step
        token = a.logits[:, -1:].argmax(-1)
        a, b = _forward(model, ours, token), _forward(model, theirs, token)


def test_a_model_with_nothing_to_compress_refuses_a_budget():
    """A Qwen3-Next of linear-attention layers alone (from transformers 5.24 the family matrix's 2-layer
    Gemma-4 is one too: both its layers keep their KV for others to read)."""
    kwargs = families.config_kwargs("qwen3_next")
    kwargs["layer_types"] = ["linear_attention", "linear_attention"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_next", **kwargs)).eval()
    with pytest.raises(
        ConfigurationError, match=r"no layer this cache compresses \(layer types \['linear_attention'\]\)"
    ):
        LUKVCache(memory=0.5, config=model.config).prefill(model, prompt(1, 100, seed=1))


def test_layers_of_another_shape_are_refused_rather_than_miscounted():
    """Gemma-4's full-attention layers have wider heads (``global_head_dim``) than its sliding ones."""
    model = _six_layers("gemma4_text")
    with pytest.raises(ConfigurationError, match="count every compressed layer at one shape"):
        LUKVCache(memory=0.5, config=model.config).prefill(model, prompt(1, 150, seed=1))


def test_layers_left_to_transformers_growing_past_a_fixed_budget_warn():
    """Gemma-3n's layers that others read keep every token: past a fixed ``max_bytes`` nothing the cache can
    evict makes room, and it says so."""
    model = _model("gemma3n_text")
    cache = LUKVCache(max_bytes=60_000, config=model.config)
    out = _forward(model, cache, prompt(1, 150, seed=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(60):
            out = _forward(model, cache, out.logits[:, -1:].argmax(-1))
    assert any("grew past what the budget leaves them" in str(w.message) for w in caught)


@pytest.mark.parametrize("kind", ["gemma4_text", "gemma3n_text"])
def test_layers_kept_whole_beside_compressed_sliding_ones_decode_exactly(kind):
    """Ratio 0 under ``sliding="compress"``: the compressed sliding layers and the stock ones that others
    read share one sliding mask (sized by the first, a LUKVLayer's logical positions); decoding past the
    window gives DynamicCache's logits."""
    model = _six_layers(kind)
    ids = prompt(1, 40, seed=6)
    ours, theirs = LUKVCache(0.0, sliding="compress", config=model.config), DynamicCache(config=model.config)
    a, b = _forward(model, ours, ids), _forward(model, theirs, ids)
    for step in range(12):  # the window is 8 (the matrix's tiny config): decoding runs far past it
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-5, msg=f"step {step}")
        token = a.logits[:, -1:].argmax(-1)
        a, b = _forward(model, ours, token), _forward(model, theirs, token)


def test_the_one_line_on_a_sliding_model_holds_its_ratio_in_bytes(tmp_path, caplog):
    """``from_pretrained(model, ratio=0.8)`` with nothing else chosen is, on a sliding-window model,
    ``memory=0.2`` of the model's own cache with ``memory_floor=True`` (eviction alone lost Gemma's text):
    said once per model type; any other choice, or a full-attention model, keeps the ratio and says nothing."""
    from lukv_cache.cache import pretrained

    gemma, llama = _model("gemma3"), tiny_model("llama", "sdpa")
    path = tmp_path / "keydiff.safetensors"
    flat_profile(3, 2, model_id="org/gemma").save(path)
    pretrained._warned_sliding.discard("gemma3_text")
    with caplog.at_level("WARNING", logger="lukv_cache"):
        cache = LUKVCache.from_pretrained(path, ratio=0.8, config=gemma.config)
        LUKVCache.from_pretrained(path, ratio=0.8, config=gemma.config)  # once per model type
    assert (cache.policy.memory, cache.policy.memory_floor, cache.policy.sliding) == (0.2, True, "compress")
    assert caplog.text.count("ratio=0.8 is held as memory=0.2") == 1
    assert LUKVCache.from_pretrained(path, ratio=0.0, config=gemma.config).policy.keeps_whole
    caplog.clear()
    pretrained._warned_sliding.discard("gemma3_text")
    with caplog.at_level("WARNING", logger="lukv_cache"):
        for chosen in (dict(sliding="compress"), dict(allocator="uniform"), dict(memory=0.3)):
            cache = LUKVCache.from_pretrained(
                path, **({"ratio": 0.8} if "memory" not in chosen else {}), config=gemma.config, **chosen
            )
            assert not cache.policy.memory_floor and cache.policy.memory in (None, 0.3)
        flat_profile(2, 2).save(tmp_path / "llama.safetensors")
        cache = LUKVCache.from_pretrained(tmp_path / "llama.safetensors", ratio=0.8, config=llama.config)
        assert (cache.ratio, cache.policy.memory) == (0.8, None)
    assert "sliding-window layers" not in caplog.text


def test_the_one_line_on_a_sliding_model_keeps_its_bytes_and_short_prompts(tmp_path):
    """The one line's budget on Gemma holds after every forward of a long prompt and its decoding; a prompt
    too short for 20% of its bytes (the protected tokens and the decode room do not fit) keeps those, where
    the same ``memory=0.2`` without the floor refuses it."""
    model = _model("gemma3")
    path = tmp_path / "keydiff.safetensors"
    flat_profile(3, 2, model_id="org/gemma").save(path)
    ids = prompt(1, 300, seed=3)
    cache = LUKVCache.from_pretrained(path, ratio=0.8, config=model.config)
    tokens = ids
    out = _forward(model, cache, ids)
    for _ in range(12):
        assert cache.memory_bytes() <= int(0.2 * _own_bytes(model, tokens))
        token = out.logits[:, -1:].argmax(-1)
        tokens = torch.cat([tokens, token], -1)
        out = _forward(model, cache, token)
    short = prompt(1, 12, seed=4)
    with pytest.raises(ConfigurationError, match="memory=0.2 gives"):
        _forward(model, LUKVCache(memory=0.2, config=model.config), short)
    cache = LUKVCache.from_pretrained(path, ratio=0.8, config=model.config)
    floor = LUKVCache(memory=0.2, memory_floor=True, config=model.config)
    for each in (cache, floor):
        generated = model.generate(short, max_new_tokens=6, do_sample=False, **{cache_kwarg(model): each})
        assert generated.shape[-1] == 18
        assert each.memory_choice is not None and each.memory_choice.budget > int(
            0.2 * _own_bytes(model, short)
        )


@pytest.mark.parametrize("given", ["config", "model"])
@pytest.mark.parametrize("kind", ["gemma3n_text", "mimo_v2_flash"])
def test_the_one_line_keeps_its_ratio_where_a_budget_cannot_count_the_model(tmp_path, caplog, kind, given):
    """A sliding model whose layers a budget does not count yet keeps the ratio as asked, with a warning:
    KV-sharing layers (Gemma-3n), sliding layers of twice the KV heads (MiMo-V2-Flash: read off the model's
    projections, or off the model built from the config on the meta device)."""
    from lukv_cache.cache import pretrained

    model = _model(kind) if kind == "gemma3n_text" else families.build_model(kind, "eager")
    model.config.name_or_path = f"org/{kind}"
    pretrained._warned_sliding.discard(kind)
    with caplog.at_level("WARNING", logger="lukv_cache"):
        if given == "model":
            cache = LUKVCache.from_pretrained(model, ratio=0.8, local_files_only=True)
        else:
            cache = LUKVCache.from_pretrained(
                f"org/{kind}", ratio=0.8, local_files_only=True, config=model.config
            )
    assert (cache.ratio, cache.policy.memory) == (0.8, None)
    assert "does not count this model's layers yet" in caplog.text


@pytest.mark.parametrize(
    "options", [dict(ratio=0.5, memory_floor=True), dict(memory=0.2, memory_floor="yes")]
)
def test_memory_floor_needs_a_budget_and_a_bool(options):
    with pytest.raises(ConfigurationError, match="memory_floor"):
        LUKVCache(**options)


def _flat_table(loss_none: float, loss_8: float, loss_4: float):
    import numpy as np

    from lukv_cache.profiles.memory_table import MemoryTable

    loss = np.array([[loss_none] * 2, [loss_8] * 2, [loss_4] * 2], dtype=np.float32)
    return MemoryTable((None, 8, 4), np.array([0.5, 0.9], dtype=np.float32), loss, "test")


@pytest.mark.parametrize("split, by", [("global_first", "whole"), ("ratio", "table")])
def test_on_sliding_windows_a_budget_keeps_every_token_before_the_table_evicts(tmp_path, split, by):
    """Where 4 bits keep every token the model's own cache holds and 8 bits would evict, a budget on a model
    with compressed sliding windows (``global_first``) keeps every token in 4 bits, though the table says 8
    bits lose less: the table measured eviction at one ratio of every layer, not the budget's split. With
    ``split="ratio"`` (how the table measured) the table decides."""
    import dataclasses

    model = _model("gemma3")
    path = tmp_path / "keydiff.safetensors"
    dataclasses.replace(
        flat_profile(3, 2, model_id="org/gemma"), memory_table=_flat_table(0.5, 0.01, 0.3)
    ).save(path)
    cache = LUKVCache.from_pretrained(path, memory=0.3, split=split, config=model.config)
    _forward(model, cache, prompt(1, 300, seed=2))
    choice = cache.memory_choice
    assert choice.kept[4] == 1.0 and choice.kept[8] < 1.0  # the case: 4 bits keep everything, 8 evict
    assert (choice.by, choice.kv_bits) == (by, 4 if by == "whole" else 8)


def test_keeping_every_token_on_sliding_windows_spends_the_bytes_left_on_8_bit_layers(tmp_path):
    """With the table's per-layer losses, the bytes that every token at 4 bits leaves go to 8-bit layers (those
    that lose most at 4 bits first), every token still kept; the bound holds after every forward."""
    import dataclasses

    import numpy as np

    model = _model("gemma3")
    table = dataclasses.replace(_flat_table(0.5, 0.01, 0.3), layer_loss=np.array([0.0, 0.2, 0.1]))
    path = tmp_path / "keydiff.safetensors"
    dataclasses.replace(flat_profile(3, 2, model_id="org/gemma"), memory_table=table).save(path)
    options = dict(memory=0.38, profile_path=path)
    cache, _ = _run_and_check(model, options, prompt(1, 300, seed=2))
    choice = cache.memory_choice
    assert choice.by == "whole" and choice.mixed_kept == 1.0
    assert choice.kv_bits[1] == 8 and 4 in choice.kv_bits  # layer 1 loses most at 4 bits: widened first
    saved = cache.save(tmp_path / "context.safetensors")
    assert LUKVCache.load(saved, model).memory_choice == choice  # "whole" is a reason a saved file may give


def test_the_one_lines_padded_short_prompts_keep_what_each_row_keeps_alone(tmp_path):
    """Prompts too short for the one line's budget (the floor raised it): a padded row chooses the bits and
    keeps the tokens it does alone (the keep-every-token rule does not apply to a floored budget, where each
    row's length would pick other bits: the family matrix's Dory caught it)."""
    model = _model("gemma3")
    path = tmp_path / "keydiff.safetensors"
    flat_profile(3, 2, model_id="org/gemma").save(path)
    ids, mask = left_padded((24, 14), seed=5)
    batch, alone = (LUKVCache.from_pretrained(path, ratio=0.5, config=model.config) for _ in range(2))
    _forward(model, batch, ids, mask)
    _forward(model, alone, ids[1:, -14:])
    assert batch.kv_bits == alone.kv_bits
    assert torch.equal(batch.stored_tokens()[:, 1], alone.stored_tokens()[:, 0])
