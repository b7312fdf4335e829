"""Diagnostics for profiles: what a profile allocates, and what that buys on the calibration set.

* :func:`profile_summary`: plain text for terminals (``lukv show``);
* :func:`plot_heatmap`: per-head keep ratios at chosen global ratios (layers x heads);
* :func:`plot_curves`: each head's keep ratio over the grid (the paper's figures 7-9);
* :func:`loss_decomposition` + :func:`plot_loss_decomposition`: eviction loss per layer and head for LU-KV,
  uniform, PyramidKV and AdaKV budgets, split into the **oracle floor** (what the best possible ranking
  would lose with the same budget) and the **optimality gap** (what the scorer's ranking loses on top;
  the paper's figures 1, 3 and 4).

Plots need matplotlib (``pip install -e ".[plots]"``); everything else works without it.

    >>> from lukv_cache.profiling.diagnostics import profile_summary, plot_heatmap
    >>> print(profile_summary(profile, ratios=[0.8]).splitlines()[0])
    profile   org/tiny-llama / keydiff
    >>> plot_heatmap(profile, [0.5, 0.8]).savefig("heatmap.png")
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from ..errors import ConfigurationError
from ..scorers import get_scorer
from .build import prepare_run

METHODS = ("lukv", "uniform", "pyramid", "adakv", "global", "hybrid", "hybrid_global")
_BARS = "·▁▂▃▄▅▆▇█"


def _pyplot():
    try:
        import matplotlib

        if not os.environ.get("MPLBACKEND"):
            matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigurationError(
            'Plots need matplotlib: pip install -e ".[plots]" (or pip install matplotlib).'
        ) from None
    return plt


# ----------------------------------------------------------------------------------------------------------
# the profile alone


def profile_summary(profile, ratios: Sequence[float] = (0.5, 0.8, 0.9)) -> str:
    """A plain-text report: metadata, then per ratio the spread of keep ratios and a bar per layer.

    >>> "ratio 0.80: keep ratio per head" in profile_summary(profile, [0.8])
    True
    """
    lines = [
        f"profile   {profile.model_id} / {profile.scorer} {profile.scorer_params or ''}".rstrip(),
        f"shape     {profile.num_layers} layers x {profile.num_kv_heads} KV heads x {len(profile.grid)} ratios "
        f"({profile.grid[0]:.2f} ... {profile.grid[-1]:.2f})",
        f"settings  sink={profile.sink} window={profile.window} min_keep={profile.min_keep} k_max={profile.k_max}",
        f"calib     {profile.calibration or '-'}",
        f"built     {profile.created} with lukv_cache {profile.library_version}",
    ]
    if profile.extra:
        # json.dumps keeps multi-line values (the prompt format) on one line
        lines.append(
            "extra     " + ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(profile.extra.items()))
        )
    if getattr(profile, "memory_table", None) is not None:
        lines += memory_table_lines(profile.memory_table)
    for rho in ratios:
        keep = 1.0 - profile.at(rho).astype(np.float64)
        lo, hi = np.unravel_index(keep.argmin(), keep.shape), np.unravel_index(keep.argmax(), keep.shape)
        lines += [
            "",
            f"ratio {rho:.2f}: keep ratio per head min {keep.min():.3f} (layer {lo[0]} head {lo[1]}), "
            f"mean {keep.mean():.3f}, max {keep.max():.3f} (layer {hi[0]} head {hi[1]}); uniform {1 - rho:.3f}",
            "  layer  mean keep  heads",
        ]
        for layer, row in enumerate(keep):
            bars = "".join(_BARS[min(len(_BARS) - 1, int(round(k * (len(_BARS) - 1))))] for k in row)
            lines.append(f"  {layer:5d}  {row.mean():9.3f}  {bars}")
    return "\n".join(lines)


def memory_table_lines(table) -> list[str]:
    """A :class:`~lukv_cache.profiles.memory_table.MemoryTable` as text: what it measured, then one row of
    losses per precision (``model``: the model's own).

    >>> import numpy as np
    >>> from lukv_cache.profiles.memory_table import MemoryTable
    >>> print("\\n".join(memory_table_lines(MemoryTable((None, 4), np.array([0.5]), np.array([[0.1], [0.2]]), "m"))))
    memory    loss of model, int4 at ratios 0.50 (m)
              model  +0.100
               int4  +0.200

    With each layer's loss at 4 bits (``layer_loss``), the layers that lose most, most first:

    >>> table = MemoryTable((8, 4), np.array([0.5]), np.array([[0.1], [0.2]]), "m", np.array([0.01, 0.3]))
    >>> memory_table_lines(table)[-1].strip()
    'one layer at int4, the rest int8: 1 +0.300, 0 +0.010 (sum +0.310)'
    """
    names = ["model" if b is None else f"int{b}" for b in table.bits]
    ratios = " ".join(f"{r:.2f}" for r in table.ratios)
    lines = [
        f"memory    loss of {', '.join(names)} at ratios {ratios} ({table.measure or 'unnamed measure'})"
    ]
    for name, row in zip(names, table.loss, strict=True):
        lines.append(f"          {name:>5}  " + " ".join(f"{v:+.3f}" for v in row))
    if table.layer_loss is not None:  # each layer at 4 bits, the others at 8, nothing evicted
        order = table.layer_order()
        top = ", ".join(f"{i} {table.layer_loss[i]:+.3f}" for i in order[:8])
        lines.append(
            f"          one layer at int4, the rest int8: {top}{' ...' if len(order) > 8 else ''} "
            f"(sum {float(table.layer_loss.sum()):+.3f})"
        )
    return lines


def plot_heatmap(profile, ratios: Sequence[float] = (0.5, 0.8)):
    """Heatmaps of per-head keep ratios (layers x KV heads), one panel per global ratio: a matplotlib Figure.

    Each panel has its own colour scale (0 ... its largest keep ratio), so high ratios stay readable.

    >>> plot_heatmap(profile, [0.8]).savefig("heatmap.png")
    """
    plt = _pyplot()
    ratios = list(ratios)
    panel_width = 1.6 + 0.35 * profile.num_kv_heads
    fig, axes = plt.subplots(
        1, len(ratios), figsize=(panel_width * len(ratios), 1.8 + 0.16 * profile.num_layers), squeeze=False
    )
    for ax, rho in zip(axes[0], ratios):
        keep = 1.0 - profile.at(rho)
        image = ax.imshow(keep, aspect="auto", cmap="viridis", vmin=0, vmax=max(float(keep.max()), 1e-6))
        ax.invert_yaxis()  # layer 0 at the bottom, like a network diagram
        ax.set(title=f"rho={rho:.2f} (uniform {1 - rho:.2f})", xlabel="KV head", ylabel="layer")
        ax.set_xticks(range(profile.num_kv_heads))
        fig.colorbar(image, ax=ax, shrink=0.8, label="keep ratio")
    fig.suptitle(f"{profile.model_id} / {profile.scorer}: per-head keep ratio")
    fig.tight_layout()
    return fig


def plot_curves(profile):
    """Each head's keep ratio over the grid, coloured by layer, with the uniform diagonal: a Figure.

    >>> plot_curves(profile).savefig("curves.png")
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    cmap = plt.get_cmap("plasma")
    keep = 1.0 - profile.evict_ratio
    for layer in range(profile.num_layers):
        colour = cmap(layer / max(1, profile.num_layers - 1))
        for head in range(profile.num_kv_heads):
            ax.plot(profile.grid, keep[:, layer, head], color=colour, lw=0.8, alpha=0.7)
    ax.plot(profile.grid, 1.0 - profile.grid, "k--", lw=1.2, label="uniform")
    ax.set(xlabel="global compression ratio rho", ylabel="head keep ratio", xlim=(0, 1), ylim=(0, 1))
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, profile.num_layers - 1))
    fig.colorbar(sm, ax=ax, label="layer")
    ax.legend(loc="upper right")
    ax.set_title(f"{profile.model_id} / {profile.scorer}: per-head curves")
    return fig


def profile_correlation(a, b, ratios: Sequence[float] = (0.5, 0.8, 0.9)) -> dict[float, float]:
    """Pearson correlation of two profiles' per-head keep ratios at each ratio (e.g. built from two
    calibration sets: how well a profile transfers). Heads with identical ratios in both give ``nan``.

    >>> profile_correlation(profile_default, profile_expository)  # doctest: +SKIP
    {0.5: 0.93, 0.8: 0.95, 0.9: 0.94}
    """
    if (a.num_layers, a.num_kv_heads) != (b.num_layers, b.num_kv_heads):
        raise ConfigurationError(
            f"Profiles of different shapes: {a.num_layers}x{a.num_kv_heads} vs {b.num_layers}x{b.num_kv_heads}."
        )
    out = {}
    for rho in ratios:
        x, y = a.at(rho).astype(np.float64).ravel(), b.at(rho).astype(np.float64).ravel()
        with np.errstate(invalid="ignore", divide="ignore"):
            out[float(rho)] = float(np.corrcoef(x, y)[0, 1]) if x.std() > 0 and y.std() > 0 else float("nan")
    return out


# ----------------------------------------------------------------------------------------------------------
# loss decomposition on the calibration set


@dataclass
class LossDecomposition:
    """Eviction loss on the calibration set, averaged over questions: ``floor`` and ``gap`` ``[M, L, H_kv]``.

    ``floor``: oracle mass lost by the oracle's own top-b (the unavoidable part of the budget); ``gap``: the
    scorer's extra loss (oracle mass of its misses minus its false positives). Layers that are never
    compressed (sliding-window ones) are zero. Loss = floor + gap.
    """

    methods: tuple[str, ...]
    ratio: float
    scorer: str
    floor: np.ndarray
    gap: np.ndarray
    questions: int

    def table(self) -> str:
        """Totals per method, as plain text.

        >>> print(decomposition.table())  # doctest: +SKIP
        """
        lines = [
            f"eviction loss at ratio {self.ratio:.2f}, scorer {self.scorer}, {self.questions} questions",
            f"  {'method':8s} {'loss':>9s} {'floor':>9s} {'gap':>9s}",
        ]
        for m, method in enumerate(self.methods):
            f, g = self.floor[m].sum(), self.gap[m].sum()
            lines.append(f"  {method:8s} {f + g:9.4g} {f:9.4g} {g:9.4g}")
        return "\n".join(lines)


def method_keep_counts(
    method: str, scores: np.ndarray, layers: list[int], n: int, ratio: float, profile, min_keep
):
    """Keep counts ``[L, H]`` over the evictable tokens, from the library's own allocators."""
    from ..allocation import AllocationRequest, allocators_reading_profile, get_allocator

    if method == "lukv":
        allocator = get_allocator("profile", evict_ratio=profile.at(ratio))
    elif method in allocators_reading_profile():  # hybrid, hybrid_global: the profile's table at the ratio
        allocator = get_allocator(method, evict_ratio=profile.at(ratio))
    else:
        allocator = get_allocator(method)
    keep = np.zeros(scores.shape[:2], dtype=np.int64)
    if not layers:
        return keep
    request = AllocationRequest(
        scores=torch.from_numpy(np.ascontiguousarray(scores[layers][:, None], dtype=np.float32)),
        n_evictable=torch.tensor([n]),
        ratio=torch.tensor([float(ratio)], dtype=torch.float64),
        layers=tuple(layers),
        num_layers=scores.shape[0],
        min_keep=min_keep,
    )
    keep[layers] = allocator(request)[:, 0].numpy()
    return keep


def head_losses(
    importance: np.ndarray, scores: np.ndarray, keep: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per-head (loss, floor) for keep counts ``[L, H]``: oracle mass outside the scorer's / oracle's top-b."""
    by_scorer = np.take_along_axis(importance, np.argsort(-scores, axis=-1, kind="stable"), axis=-1)
    by_oracle = -np.sort(-importance, axis=-1)
    kept = np.arange(importance.shape[-1]) < keep[..., None]
    total = importance.sum(-1)
    return total - (by_scorer * kept).sum(-1), total - (by_oracle * kept).sum(-1)


def loss_decomposition(
    model,
    tokenizer,
    profile,
    calibration: str | os.PathLike = "default",
    *,
    ratio: float = 0.8,
    methods: Sequence[str] = METHODS,
    max_questions: int | None = None,
    seed: int = 0,
    cache_dir: str | os.PathLike | None | Literal[False] = None,
) -> LossDecomposition:
    """Eviction loss of LU-KV (``profile``'s budgets), uniform, PyramidKV and AdaKV on a calibration set.

    Uses the profile's scorer, sink, window, min keep and k_max; reuses the per-question oracle importances
    cached by :func:`~lukv_cache.profiling.build_profile` when ``cache_dir`` is the same.

    >>> d = loss_decomposition(model, tokenizer, profile, ratio=0.8)  # doctest: +SKIP
    >>> print(d.table())  # doctest: +SKIP
    """
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ConfigurationError(f"Unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}.")
    profile.validate_for(model.config)
    scorer = get_scorer(profile.scorer)
    run = prepare_run(
        model,
        tokenizer,
        calibration,
        k_max=profile.k_max,
        max_questions=max_questions,
        seed=seed,
        cache_dir=cache_dir,
    )
    t, sink, window = run.context_len, profile.sink, profile.window
    n = t - sink - window
    if n < 1:
        raise ConfigurationError(f"The calibration context ({t} tokens) leaves nothing to evict.")
    layer_scores = run.scores(scorer)
    layers = sorted(layer_scores)
    scores = np.zeros((profile.num_layers, profile.num_kv_heads, n), dtype=np.float64)
    for layer, v in layer_scores.items():
        scores[layer] = v[:, sink : t - window]
    keeps = [method_keep_counts(m, scores, layers, n, ratio, profile, profile.min_keep) for m in methods]
    floor = np.zeros((len(methods),) + scores.shape[:2])
    gap = np.zeros_like(floor)
    for index in range(len(run.selected)):
        importance = run.oracle(index)[:, :, sink : t - window].astype(np.float64)
        for m, keep in enumerate(keeps):
            loss, fl = head_losses(importance, scores, keep)
            floor[m, layers] += fl[layers]
            gap[m, layers] += (loss - fl)[layers]
    q = len(run.selected)
    return LossDecomposition(tuple(methods), float(ratio), scorer.name, floor / q, gap / q, q)


def plot_loss_decomposition(decomposition: LossDecomposition):
    """Per-layer loss of each method as stacked bars (oracle floor + optimality gap): a Figure.

    >>> plot_loss_decomposition(decomposition).savefig("loss.png")  # doctest: +SKIP
    """
    plt = _pyplot()
    d = decomposition
    num_layers = d.floor.shape[1]
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * num_layers * len(d.methods) / 2), 4))
    width = 0.8 / len(d.methods)
    x = np.arange(num_layers)
    colours = plt.get_cmap("tab10")
    for m, method in enumerate(d.methods):
        floor, gap = d.floor[m].sum(-1), d.gap[m].sum(-1)
        pos = x - 0.4 + width * (m + 0.5)
        total = floor.sum() + gap.sum()
        ax.bar(pos, floor, width, color=colours(m), alpha=0.45)
        ax.bar(pos, gap, width, bottom=floor, color=colours(m), label=f"{method} (total {total:.3f})")
    ax.set(xlabel="layer (light: oracle floor, dark: optimality gap)", ylabel="oracle mass evicted")
    ax.set_title(f"eviction loss at rho={d.ratio:.2f}, scorer {d.scorer}, {d.questions} questions")
    ax.legend()
    return fig
