"""Seeing what a :class:`~lukv_cache.LUKVCache` kept: a layer x KV head x position map, and the prompt's
text with each token's keep share. Needs matplotlib (``pip install "lukv-cache[plots]"``), imported only
when :func:`plot_kept` runs.

>>> from lukv_cache.plot import plot_kept                               # doctest: +SKIP
>>> fig, text = plot_kept(cache, input_ids=ids, tokenizer=tokenizer)    # doctest: +SKIP
>>> fig.savefig("kept.png"); print(text)                                # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import ConfigurationError, PlotUnavailableError

PIP_PLOTS = 'pip install "lukv-cache[plots]"'


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise PlotUnavailableError(f"lukv_cache.plot needs matplotlib: {PIP_PLOTS}") from err
    return plt


def kept_map(cache: Any, layers: list[int], row: int = 0) -> torch.Tensor:
    """float ``[len(layers) * kv_heads, T]``: 1 where (layer, KV head) holds the position (layers with
    fewer heads or positions padded with 0)."""
    maps = [cache.kept_positions(i)[row].float() for i in layers]
    heads = max(m.shape[0] for m in maps)
    width = max(m.shape[1] for m in maps)
    out = torch.zeros(len(maps) * heads, width)
    for n, m in enumerate(maps):
        out[n * heads : n * heads + m.shape[0], width - m.shape[1] :] = m
    return out


def highlighted_text(share: torch.Tensor, tokens: list[str]) -> str:
    """The tokens back to back, each kept by under half the heads in ``[brackets]``.

    >>> highlighted_text(torch.tensor([1.0, 0.2, 0.6]), ["The", " cat", " sat"])
    'The[ cat] sat'
    """
    return "".join(
        tok if float(s) >= 0.5 else f"[{tok}]" for tok, s in zip(tokens, share.tolist(), strict=False)
    )


def plot_kept(
    cache: Any,
    input_ids: torch.Tensor | None = None,
    tokenizer: Any = None,
    layer: int | None = None,
    row: int = 0,
):
    """A figure of which positions every (layer, KV head) of ``cache`` holds for batch row ``row`` (one
    layer's heads with ``layer=``), with each position's keep share across those heads beneath. With
    ``input_ids`` and a ``tokenizer``, returns ``(figure, text)``: the row's text with the tokens kept by
    under half the heads in ``[brackets]`` (also the x labels of short prompts); else the figure alone.
    """
    plt = _pyplot()
    layers = (
        [layer]
        if layer is not None
        else [i for i, lay in enumerate(cache.layers) if cache.kept_positions(i).numel()]
    )
    if not layers:
        raise ConfigurationError("plot_kept: the cache holds nothing yet; run a forward with it first.")
    kept = kept_map(cache, layers, row)
    share = kept.mean(0)
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(10, 6), sharex=True, gridspec_kw={"height_ratios": [4, 1]}, constrained_layout=True
    )
    top.imshow(kept.numpy(), aspect="auto", interpolation="nearest", cmap="Greys", vmin=0, vmax=1)
    heads = kept.shape[0] // len(layers)
    step = max(1, len(layers) // 10)
    top.set_yticks(
        [n * heads for n in range(0, len(layers), step)],
        [str(layers[n]) for n in range(0, len(layers), step)],
    )
    top.set_ylabel(f"layer ({heads} KV heads each)")
    top.set_title(f"kept positions (black), row {row}: {kept.mean():.0%} of (head, position) pairs held")
    bottom.bar(range(share.numel()), share.numpy(), width=1.0, color="tab:blue")
    bottom.set_ylim(0, 1)
    bottom.set_ylabel("keep share")
    bottom.set_xlabel("position")
    if input_ids is None or tokenizer is None:
        return fig
    ids = input_ids[row].tolist()[-share.numel() :]
    decode = getattr(tokenizer, "decode", None)
    tokens = [decode([i]) for i in ids] if decode else tokenizer.convert_ids_to_tokens(ids)
    if len(tokens) <= 80:
        bottom.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=7)
    return fig, highlighted_text(share[-len(tokens) :], tokens)
