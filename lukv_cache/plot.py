"""Seeing what a :class:`~lukv_cache.LUKVCache` kept: a layer x KV head x position map, and the prompt's
text with its most-kept tokens marked, as many as the cache keeps on average (:func:`highlighted_text`). Needs matplotlib (``pip install -e ".[plots]"``), imported only
when :func:`plot_kept` runs.

>>> from lukv_cache.plot import plot_kept                               # doctest: +SKIP
>>> fig, text = plot_kept(cache, input_ids=ids, tokenizer=tokenizer)    # doctest: +SKIP
>>> fig.savefig("kept.png"); print(text)                                # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import BatchIndexError, ConfigurationError, PlotUnavailableError

PIP_PLOTS = 'pip install -e ".[plots]"'


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise PlotUnavailableError(f"lukv_cache.plot needs matplotlib: {PIP_PLOTS}") from err
    return plt


def kept_map(cache: Any, layers: list[int], row: int = 0) -> torch.Tensor:
    """float ``[len(layers) * kv_heads, T]``: 1 where (layer, KV head) holds the position; column ``j`` is
    position ``j`` of the input (layers with fewer heads or positions padded with 0)."""
    full = [cache.kept_positions(i) for i in layers]
    batch = max(m.shape[0] for m in full)
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < batch:
        raise BatchIndexError(
            f"plot_kept: row {row!r} is out of range for a cache of {batch} batch row(s); pass row=0 to "
            f"{batch - 1}.",
            index=row if isinstance(row, int) else -1,
            batch=batch,
        )
    maps = [m[row].float() for m in full]
    heads = max(m.shape[0] for m in maps)
    width = max(m.shape[1] for m in maps)
    out = torch.zeros(len(maps) * heads, width)
    for n, m in enumerate(maps):
        out[n * heads : n * heads + m.shape[0], : m.shape[1]] = m
    return out


def highlighted(share: torch.Tensor, fraction: float | None = None) -> torch.Tensor:
    """bool ``[n]``: the ``round(fraction * n)`` positions with the highest keep ``share`` (ties at the cut go
    to the earlier position). ``fraction`` defaults to the mean of ``share``: the fraction of (head, position)
    pairs held, so the marked fraction follows what was kept (at ratio 0.8, about a fifth of the evictable
    tokens plus the sinks and the window), where a fixed cut-off (say, kept by half the heads) would mark
    nearly every token or almost none depending on the ratio.

    >>> highlighted(torch.tensor([1.0, 0.2, 0.6])).tolist()     # mean 0.6: the top 2 of 3
    [True, False, True]
    """
    share = share.flatten().float()
    n = share.numel()
    if fraction is None:
        fraction = float(share.mean()) if n else 0.0
    count = min(n, max(0, round(fraction * n)))
    order = torch.sort(-share, stable=True).indices
    marked = torch.zeros(n, dtype=torch.bool)
    marked[order[:count]] = True
    return marked


def highlighted_text(share: torch.Tensor, tokens: list[str], fraction: float | None = None) -> str:
    """The tokens back to back, the most-kept ones in ``[brackets]``: the ``round(fraction * n)`` tokens
    with the highest keep share, ``fraction`` the mean share unless given (see :func:`highlighted`).

    >>> highlighted_text(torch.tensor([1.0, 0.2, 0.6]), ["The", " cat", " sat"])
    '[The] cat[ sat]'
    """
    return _bracketed(tokens, highlighted(share[: len(tokens)], fraction))


def _bracketed(tokens: list[str], marked: torch.Tensor) -> str:
    return "".join(f"[{tok}]" if m else tok for tok, m in zip(tokens, marked.tolist(), strict=False))


def plot_kept(
    cache: Any,
    input_ids: torch.Tensor | None = None,
    tokenizer: Any = None,
    layer: int | None = None,
    row: int = 0,
):
    """A figure of which positions every (layer, KV head) of ``cache`` holds for batch row ``row`` (one
    layer's heads with ``layer=``), with each position's keep share across those heads beneath. With
    ``input_ids`` and a ``tokenizer``, returns ``(figure, text)``: the row's text (also the x labels of short
    prompts) with its most-kept tokens in ``[brackets]``, as many as the cache keeps on average: if it holds
    a fraction ``f`` of the (head, position) pairs, the ``round(f * T)`` tokens of highest keep share
    (:func:`highlighted`; their bars are blue, the others grey); else the figure alone.

    ``input_ids`` are the ids the cache was filled with from position 0 on, ``[batch, n]`` (or one row's
    ``[n]``): id ``j`` labels position ``j``, the column of the token at position ``j``. The prompt (padding
    included) labels the first columns; ``model.generate``'s output (its tensor, or its
    ``return_dict_in_generate=True`` output, whose ``sequences`` are read) labels every column, and its last
    token, which was never fed back and so is not in the cache, has no column and is left out of the text.
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
    marked = highlighted(share)  # as many as the cache holds on average: kept.mean() of the positions
    colors = ["tab:blue" if m else "lightgrey" for m in marked.tolist()]
    bottom.bar(range(share.numel()), share.numpy(), width=1.0, color=colors)
    bottom.set_ylim(0, 1)
    bottom.set_ylabel("keep share")
    bottom.set_xlabel("position")
    if input_ids is None or tokenizer is None:
        return fig
    # id j is position j: the prompt's ids label the first columns, generate's output (one token past the
    # cache: the last one was never fed back) every column
    ids = _row_ids(input_ids, row)[: share.numel()]
    decode = getattr(tokenizer, "decode", None)
    tokens = [decode([i]) for i in ids] if decode else tokenizer.convert_ids_to_tokens(ids)
    if len(tokens) <= 80:
        bottom.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=7)
    return fig, _bracketed(tokens, marked[: len(tokens)])


def _row_ids(input_ids: Any, row: int) -> list[int]:
    """Row ``row`` of ``input_ids`` (``[batch, n]``, one row's ``[n]``, or generate's dict output) as ids."""
    ids = getattr(input_ids, "sequences", input_ids)  # return_dict_in_generate=True: the tokens
    ids = torch.as_tensor(ids)
    if ids.ndim == 1:
        return ids.tolist()
    if ids.ndim != 2 or not 0 <= row < ids.shape[0]:
        raise ConfigurationError(
            f"plot_kept: input_ids of shape {list(ids.shape)} have no row {row}; pass the ids the cache was "
            "filled with, [batch, n] (the prompt, or generate's output), or one row's [n]."
        )
    return ids[row].tolist()
