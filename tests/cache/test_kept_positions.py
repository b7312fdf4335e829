"""cache.kept_positions(layer) and lukv_cache.plot.plot_kept (issue 33, item 5): what each KV head holds."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import tiny_model

from lukv_cache import LUKVCache
from lukv_cache.testing import left_padded, prompt


def _prefill(model, ids, mask=None, ratio=0.5):
    cache = LUKVCache(ratio=ratio)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    return cache


def test_kept_positions_are_the_stores_and_the_suffixs():
    model = tiny_model()
    cache = _prefill(model, prompt(2, 24))
    for idx, layer in enumerate(cache.layers):
        kept = cache.kept_positions(idx)
        assert kept.dtype == torch.bool and kept.shape == (2, layer.num_heads, 24)
        s, t = layer.suffix_length, layer.cumulative_length
        for row in range(2):
            for head in range(layer.num_heads):
                seg = row * layer.num_heads + head
                a, b = layer.store.offsets_list[seg], layer.store.offsets_list[seg + 1]
                expected = sorted(layer.store.positions[a:b].tolist() + list(range(t - s, t)))
                assert torch.nonzero(kept[row, head]).flatten().tolist() == expected
        assert kept.sum(-1).tolist() == cache.stored_tokens()[idx].tolist()
    assert not bool(cache.kept_positions(0).all())  # ratio 0.5 evicted something


def test_at_ratio_0_every_real_position_is_kept():
    model = tiny_model()
    ids, mask = left_padded((24, 17, 11))
    cache = _prefill(model, ids, mask, ratio=0.0)
    for idx in range(len(cache.layers)):
        kept = cache.kept_positions(idx)
        assert torch.equal(kept, mask.bool()[:, None, :].expand_as(kept))


def test_a_padded_rows_positions_equal_the_row_alones():
    model = tiny_model()
    ids, mask = left_padded((24, 17, 11))
    batch = _prefill(model, ids, mask)
    for row, n in enumerate((24, 17, 11)):
        alone = _prefill(model, ids[row : row + 1, 24 - n :])
        for idx in range(len(batch.layers)):
            padded = batch.kept_positions(idx)[row]
            assert not bool(padded[:, : 24 - n].any())  # padding is never kept
            assert torch.equal(padded[:, 24 - n :], alone.kept_positions(idx)[0])


def test_decoding_tokens_are_kept_and_an_empty_layer_holds_nothing():
    model = tiny_model()
    ids = prompt(1, 20)
    cache = LUKVCache(ratio=0.5)
    with torch.no_grad():
        model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
    kept = cache.kept_positions(0)
    assert kept.shape[-1] == cache.layers[0].cumulative_length
    assert bool(kept[..., -3:].all())  # the decoded tokens sit in the dense suffix


def test_plot_kept_returns_a_figure_and_highlights_text():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from lukv_cache.plot import plot_kept

    model = tiny_model()
    ids = prompt(1, 24)
    cache = _prefill(model, ids)

    class Tok:  # the one tokenizer method plot_kept uses
        def decode(self, ids):
            return f"t{ids[0]} "

    fig = plot_kept(cache)
    assert fig.axes
    fig, text = plot_kept(cache, input_ids=ids, tokenizer=Tok(), layer=1)
    assert fig.axes and text.count("t") == 24 and set(text) <= set("t0123456789 []")


@pytest.mark.parametrize("ratio", [0.5, 0.8])
def test_the_highlighted_fraction_tracks_the_ratio(ratio):
    """plot_kept's text marks as many tokens as the cache keeps on average, so the marked fraction follows
    the ratio: (1 - ratio) of the evictable tokens plus the sinks and the window (a fixed cut-off of half
    the heads marked 67% at 0.5 and 21% at 0.8 here)."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from lukv_cache.plot import kept_map, plot_kept

    class Tok:
        def decode(self, ids):
            return f"<{ids[0]}>"

    model, n = tiny_model(), 96
    ids = prompt(1, n)
    cache = _prefill(model, ids, ratio=ratio)
    _, text = plot_kept(cache, input_ids=ids, tokenizer=Tok())
    marked = text.count("[")
    assert text.count("<") == n and text.count("]") == marked
    policy = cache.policy
    protected = policy.sink + policy.window
    expected = protected + (1 - ratio) * (n - protected)  # tokens held per (layer, KV head), on average
    assert abs(marked - expected) <= 1.5, (marked, expected)
    held = kept_map(cache, list(range(len(cache.layers))))
    assert marked == round(float(held.mean()) * n)
    # the marked tokens are the most kept: none outside is kept by more heads than one inside
    share = held.mean(0).tolist()
    brackets = [part.split(">")[1].startswith("]") for part in text.split("<")[1:]]  # "<7>]" is marked
    assert sum(brackets) == marked
    assert min(s for s, m in zip(share, brackets) if m) >= max(s for s, m in zip(share, brackets) if not m)


def test_plot_kept_without_matplotlib_names_the_extra(monkeypatch):
    import sys

    from lukv_cache.errors import LUKVError
    from lukv_cache.plot import plot_kept

    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # import fails as if not installed
    with pytest.raises(LUKVError, match=r'pip install -e "\.\[plots\]"'):
        plot_kept(LUKVCache(ratio=0.5))


def _labelled(text: str) -> tuple[list[int], list[bool]]:
    """The token ids of plot_kept's text (each decoded as ``<id>``) and whether each is marked."""
    found = re.findall(r"(\[?)<(\d+)>", text)
    return [int(i) for _, i in found], [bool(bracket) for bracket, _ in found]


class _Tok:
    def decode(self, ids):
        return f"<{ids[0]}>"


def _generated(new_tokens: int = 6):
    model = tiny_model()
    ids = torch.arange(3, 63).view(1, 60)  # 60 distinct ids: a label names its position
    cache = LUKVCache(ratio=0.5)
    with torch.no_grad():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False)
    return ids, out, cache


@pytest.mark.parametrize("given", ["prompt", "generate's output"])
def test_plot_kept_labels_each_position_with_its_own_token_after_generate(given):
    """Column j of the kept map is position j: the prompt's ids label the first columns, generate's output
    (one token longer than the cache, whose last token was never fed back) every column."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from lukv_cache.plot import highlighted, kept_map, plot_kept

    prompt_ids, out, cache = _generated()
    ids = prompt_ids if given == "prompt" else out
    _, text = plot_kept(cache, input_ids=ids, tokenizer=_Tok())
    tokens, marks = _labelled(text)
    width = cache.get_seq_length()  # 65: the prompt and 5 of the 6 new tokens
    assert tokens == ids[0, :width].tolist()
    held = kept_map(cache, list(range(len(cache.layers))))
    assert marks == highlighted(held.mean(0))[: len(tokens)].tolist()


def test_plot_kept_labels_a_padded_rows_positions_with_generates_output():
    """Issue 54, item 11a: generate's output (prompt and new tokens, one more than the cache holds) labels
    column j with token j in every row, a left-padded row's padding included (never kept, never marked);
    ids without the row plotted are a typed error (were a raw IndexError)."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from lukv_cache.errors import ConfigurationError
    from lukv_cache.plot import highlighted, kept_map, plot_kept

    model = tiny_model()
    ids, mask = left_padded((40, 29))
    cache = LUKVCache(ratio=0.5)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6, do_sample=False
        )
    width = cache.get_seq_length()
    assert width == out.shape[1] - 1  # the last new token was never fed back
    for row in (0, 1):
        _, text = plot_kept(cache, input_ids=out, tokenizer=_Tok(), row=row)
        tokens, marks = _labelled(text)
        assert tokens == out[row, :width].tolist()
        held = kept_map(cache, list(range(len(cache.layers))), row)
        assert marks == highlighted(held.mean(0)).tolist()
    assert not any(marks[:11])  # row 1's 11 padding positions
    with pytest.raises(ConfigurationError, match=r"input_ids of shape \[1, 46\] have no row 1"):
        plot_kept(cache, input_ids=out[:1], tokenizer=_Tok(), row=1)  # row 0's ids only


def test_plot_kept_reads_generates_dict_output_and_one_row():
    """generate(..., return_dict_in_generate=True) gives an output whose sequences are the ids, and a row
    may come alone ([n]): the same labels as the [batch, n] tensor (they failed, or labelled nothing right)."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from lukv_cache.plot import plot_kept

    model = tiny_model()
    ids = torch.arange(3, 63).view(1, 60)
    cache = LUKVCache(ratio=0.5)
    with torch.no_grad():
        out = model.generate(
            ids, past_key_values=cache, max_new_tokens=6, do_sample=False, return_dict_in_generate=True
        )
    _, want = plot_kept(cache, input_ids=out.sequences, tokenizer=_Tok())
    assert _labelled(want)[0] == out.sequences[0, :65].tolist()
    for given in (out, out.sequences[0], out.sequences[0].tolist()):
        assert plot_kept(cache, input_ids=given, tokenizer=_Tok())[1] == want


def test_kept_positions_and_plot_kept_refuse_a_layer_or_row_out_of_range():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from lukv_cache.errors import BatchIndexError, ConfigurationError
    from lukv_cache.plot import plot_kept

    _, _, cache = _generated(1)
    with pytest.raises(ConfigurationError, match="layer 99 is out of range; this cache has 2 layers"):
        cache.kept_positions(99)
    with pytest.raises(ConfigurationError, match="layer 99 is out of range"):
        plot_kept(cache, layer=99)
    with pytest.raises(BatchIndexError, match="row 3 is out of range for a cache of 1 batch row"):
        plot_kept(cache, row=3)


def test_a_compressed_sliding_layer_lists_only_the_positions_its_window_can_still_read():
    model = tiny_model("gemma2", "eager")  # layers 0 and 2 slide over 8 tokens
    cache = LUKVCache(ratio=0.5, config=model.config)
    with torch.no_grad():
        model.generate(prompt(1, 8), past_key_values=cache, max_new_tokens=8, do_sample=False)
    layer, length = cache.layers[0], cache.get_seq_length()  # 15 tokens; the next one reads from 8 on
    oldest = length - layer.sliding_window + 1
    assert layer.sliding_window == 8 and int(layer.store.positions.min()) < oldest  # still stored
    kept = cache.kept_positions(0)
    assert not bool(kept[..., :oldest].any())
    assert bool(kept[..., oldest:].all())  # the window's tokens sit in the dense suffix
