"""cache.kept_positions(layer) and lukv_cache.plot.plot_kept (issue 33, item 5): what each KV head holds."""

from __future__ import annotations

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
