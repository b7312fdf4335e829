"""Training a KVzap surrogate (:mod:`lukv_cache.scorers.kvzap`) for a model: corpus, features, targets.

Targets are the library's own KVzip scores (``kvzip``: repeat passes through the model; a build's
default) or KVzip+ scores (``kvzip_plus``: that attention times ``||v W_O||``, the paper's), in log;
features are each token's pre-RoPE key and value, read from a plain forward through the model's own
attention. Ridge regression runs on sufficient statistics, so a corpus of any size
trains in ``O(layers x F^2)`` memory.

The default corpus is news (gensim's 300 Australian news articles, concatenated into ~1k-token
documents): real, varied prose that the benchmarks do not report on (they use Wikipedia).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..attention.swap import attention_swapped
from ..errors import ConfigurationError
from ..scorers.kvzap import (
    FEATURES,
    FeatureSet,
    Surrogate,
    module_window_attention,
    reads_window,
    rope_inverse,
    surrogate_inputs,
    token_features,
)
from ..scorers.kvzip import RepeatPrompt
from .kvzap_corpora import CORPORA as CORPORA  # the training documents, importable from here as before
from .kvzap_corpora import news_documents as news_documents
from .kvzap_corpora import python_docs_documents as python_docs_documents
from .kvzap_options import FAMILIES, HIDDEN, SKIP_FIRST, TARGETS
from .ridge import RidgeStats
from .scores import prefill_scores

if TYPE_CHECKING:
    import numpy as np

_FEATURES_IMPL = "lukv_kvzap_features"


@torch.no_grad()
def token_feature_maps(
    model: Any, input_ids: torch.Tensor, feature_set: str = FEATURES
) -> dict[int, torch.Tensor]:
    """fp32 ``{layer: [B, T, F]}``: the KVzap features of every token, from a plain forward through the
    model's own attention (whose position ids place RoPE); with the window attention when ``feature_set``
    reads it (the last :data:`~lukv_cache.scorers.kvzap.WINDOW_QUERIES` queries, as the scorer sees them)."""
    impl = model.config._attn_implementation
    stock = ALL_ATTENTION_FUNCTIONS[impl]
    features: dict[int, torch.Tensor] = {}
    with_window_attention = reads_window(feature_set)

    def observe(module, query, key, value, attention_mask, **kwargs):
        b, _, t, _ = key.shape
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(t, device=key.device).expand(b, t)
        attention = module_window_attention(module, key, query) if with_window_attention else None
        maps = token_features(rope_inverse(module)(key, positions), value, attention)
        features[module.layer_idx] = maps.flatten(2)
        return stock(module, query, key, value, attention_mask, **kwargs)

    with attention_swapped(model, _FEATURES_IMPL, observe, mask=impl):
        model(input_ids=input_ids.to(model.device), use_cache=False, logits_to_keep=1)
    return features


def kvzip_targets(
    model: Any, tokenizer: Any, input_ids: torch.Tensor, target: str = "kvzip_plus"
) -> dict[int, torch.Tensor]:
    """fp32 ``{layer: [B, T, H_kv]}``: the log reconstruction scores a surrogate learns, full-attention layers
    only: KVzip+'s (``target="kvzip_plus"``) or KVzip's (``target="kvzip"``, without ``||v W_O||``).
    ``tokenizer`` gives the repeat prompt (a
    :class:`~lukv_cache.scorers.kvzip.RepeatPrompt` works too)."""
    if target not in TARGETS:
        raise ConfigurationError(f"kvzap target must be one of {list(TARGETS)}, got {target!r}.")
    prompt = {"repeat_prompt": tokenizer} if isinstance(tokenizer, RepeatPrompt) else {"tokenizer": tokenizer}
    scores = prefill_scores(model, input_ids, target, **prompt)
    return {i: s.clamp_min(1e-12).log().transpose(1, 2) for i, s in enumerate(scores) if s is not None}


def train_surrogate(
    model: Any,
    tokenizer: Any,
    documents: Iterable[torch.Tensor],
    *,
    family: str = "linear",
    features: str = FEATURES,
    alpha: float = 1.0,
    samples: int = 512,
    hidden: int = HIDDEN,
    seed: int = 0,
    progress: Callable[[int], object] | None = None,
    meta: dict | None = None,
    targets_of: Callable[[torch.Tensor], dict[int, torch.Tensor]] | None = None,
    spill: str | os.PathLike | None = None,
) -> Surrogate:
    """A KVzap surrogate for ``model``: log KVzip+ (or KVzip, through ``targets_of``) regressed on token
    features, per layer and KV head, over ``documents`` (each ``[1, T]``). ``family``: ``"linear"`` (ridge
    regression with strength ``alpha``, closed form on every token) or ``"mlp"`` (:func:`fit_mlp` with
    ``hidden`` units on ``samples`` random positions per 1,024 tokens of each document, drawn with
    ``seed``). ``features``: one of :data:`~lukv_cache.scorers.kvzap.FEATURE_SETS` (whether the document's
    length is an input). ``targets_of(ids)``: the log KVzip+ scores of a document (default
    :func:`kvzip_targets`; a build passes one that caches them, so an interrupted build resumes
    without the repeat passes it already ran). ``spill``: an empty folder where the MLP's
    rows wait on disk until their layer is fitted (:class:`TrainingRows`), so memory holds one layer's rows
    at a time instead of every layer's; ``None`` keeps them in memory. Both train the same surrogate."""
    if family not in FAMILIES:
        raise ConfigurationError(f"Unknown kvzap surrogate family {family!r}; use 'linear' or 'mlp'.")
    FeatureSet.named(features)  # an unknown name is refused before any work
    targets_of = targets_of or (lambda ids: kvzip_targets(model, tokenizer, ids))
    generator = torch.Generator().manual_seed(seed)
    stats: dict[int, RidgeStats] = {}
    rows = TrainingRows(spill)
    for i, ids in enumerate(documents):
        maps = token_feature_maps(model, ids, features)
        if family == "mlp":  # the rows it learns from: `samples` random positions per 1,024 tokens
            length = ids.shape[1] - SKIP_FIRST
            pick = torch.randperm(length, generator=generator)[: max(1, samples * length // 1024)]
        for layer, targets in targets_of(ids).items():
            x = surrogate_inputs(maps[layer], None, features)[0, SKIP_FIRST:]  # [T, F]
            y = targets[0, SKIP_FIRST:]  # [T, H]
            if family == "linear":
                stats.setdefault(layer, RidgeStats(x.shape[-1], y.shape[-1])).add(x, y)
            else:
                rows.add(layer, x[pick], y[pick])
        if progress is not None:
            progress(i + 1)
    if not stats and not rows.layers:
        raise ConfigurationError("No full-attention layer was scored: nothing to train a surrogate on.")
    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    if family == "linear":
        surrogate = _linear_surrogate(stats, num_layers, alpha)
    else:
        surrogate = _mlp_surrogate(rows, num_layers, seed, hidden)
    surrogate.features = features
    surrogate.meta = {**surrogate.meta, "family": family, **(meta or {})}
    return surrogate


def _linear_surrogate(stats: dict[int, RidgeStats], num_layers: int, alpha: float) -> Surrogate:
    some = next(iter(stats.values()))
    surrogate = Surrogate.zeros(num_layers, some.sy.shape[0], some.sx.shape[0])
    for layer, layer_stats in stats.items():
        weight, bias, mean, std = layer_stats.solve(alpha)
        surrogate.weight[layer], surrogate.bias[layer] = weight.T, bias
        surrogate.mean[layer], surrogate.std[layer] = mean, std
    surrogate.layers = sorted(stats)
    surrogate.meta = {"alpha": alpha, "tokens_per_layer": some.n}
    return surrogate


class TrainingRows:
    """The MLP's training rows ``x [n, F]`` -> ``y [n, H]`` per layer, gathered document by document: kept
    in memory (``folder=None``), or appended as raw float32 to ``<folder>/<layer>.x`` and ``.y`` and read
    back one layer at a time (:meth:`take`), so a build holds one layer's rows instead of every layer's
    (for a model with 8 KV heads of 128 dims, ~4,100 inputs per token: hundreds of MiB against tens of GiB).

    >>> rows = TrainingRows()
    >>> rows.add(3, torch.ones(2, 5), torch.zeros(2, 1)); rows.add(3, torch.ones(1, 5), torch.zeros(1, 1))
    >>> [tuple(t.shape) for t in rows.take(3)], rows.layers
    ([(3, 5), (3, 1)], [3])
    """

    def __init__(self, folder: str | os.PathLike | None = None):
        self.folder = None if folder is None else Path(folder)
        self._memory: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._shapes: dict[int, tuple[int, int, int]] = {}  # layer -> (rows, F, H)

    @property
    def layers(self) -> list[int]:
        return sorted(self._shapes)

    def count(self, layer: int) -> int:
        """Rows gathered for ``layer``."""
        return self._shapes[layer][0]

    def add(self, layer: int, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.float().contiguous(), y.float().contiguous()
        n, f, h = self._shapes.get(layer, (0, x.shape[1], y.shape[1]))
        if (x.shape[1], y.shape[1]) != (f, h) or x.shape[0] != y.shape[0]:
            raise ConfigurationError(
                f"kvzap training rows of layer {layer}: {tuple(x.shape)} -> {tuple(y.shape)}, expected [n, {f}] -> "
                f"[n, {h}] as before; every document's targets (targets_of) must give one score per KV head and "
                "token, for the same layers."
            )
        self._shapes[layer] = (n + x.shape[0], f, h)
        if self.folder is None:
            self._memory.setdefault(layer, []).append((x.clone(), y.clone()))
            return
        for suffix, t in (("x", x), ("y", y)):
            with open(self.folder / f"{layer}.{suffix}", "ab") as f_out:
                f_out.write(t.numpy().tobytes())

    def take(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row of ``layer``, in the order added; a spilled layer's files are removed once read."""
        n, f, h = self._shapes[layer]
        if self.folder is None:
            pairs = self._memory.pop(layer)
            return torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
        out = []
        for suffix, width in (("x", f), ("y", h)):
            path = self.folder / f"{layer}.{suffix}"
            out.append(
                torch.from_file(str(path), shared=False, size=n * width, dtype=torch.float32).view(n, width)
            )
            path.unlink()
        return out[0], out[1]


def _mlp_surrogate(rows: TrainingRows, num_layers: int, seed: int, hidden: int):
    surrogate = None
    for layer in rows.layers:
        x, y = rows.take(layer)
        first, _, last = fit_mlp(x, y, hidden=hidden, seed=seed)
        first, last = cast(torch.nn.Linear, first), cast(torch.nn.Linear, last)
        if surrogate is None:
            surrogate = Surrogate.zeros(num_layers, y.shape[1], x.shape[1], hidden=first.out_features)
        hidden_weight, hidden_bias = (
            cast(torch.Tensor, surrogate.hidden_weight),
            cast(torch.Tensor, surrogate.hidden_bias),
        )
        hidden_weight[layer], hidden_bias[layer] = first.weight, first.bias
        surrogate.weight[layer], surrogate.bias[layer] = last.weight, last.bias
        del x, y
    surrogate = cast(Surrogate, surrogate)  # rows.layers is never empty
    surrogate.layers = rows.layers
    surrogate.meta = {"rows_per_layer": rows.count(rows.layers[0])}
    return surrogate


def fit_mlp(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    hidden: int = 512,
    epochs: int = 10,
    batch: int = 512,
    lr: float = 1e-3,
    seed: int = 0,
) -> torch.nn.Sequential:
    """An MLP ``Linear(F, hidden) - GELU - Linear(hidden, H)`` fitted to rows ``x [N, F]`` -> ``y [N, H]``
    (MSE, AdamW, cosine-decayed learning rate, as kvpress' KVzap MLP, 512 wide unless ``hidden`` says
    otherwise; :func:`train_surrogate` passes the build's width), with the inputs' standardisation folded
    into its first layer: it reads raw features.

    >>> x = torch.randn(2000, 4)
    >>> mlp = fit_mlp(x * 3 + 5, x[:, :1] ** 2, hidden=32, epochs=20, batch=64, lr=1e-2)
    >>> float(((mlp(x * 3 + 5) - x[:, :1] ** 2) ** 2).mean()) < 0.1  # the variance of x0^2 is 2
    True
    """
    generator = torch.Generator().manual_seed(seed)
    x, y = x.float(), y.float()
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    y_mean, y_std = y.mean(0), y.std(0).clamp_min(1e-6)
    xs, ys = (x - mean) / std, (y - y_mean) / y_std
    first, last = torch.nn.Linear(x.shape[1], hidden), torch.nn.Linear(hidden, y.shape[1])
    with torch.no_grad():  # seeded initialisation, independent of the global RNG
        for layer in (first, last):
            bound = layer.in_features**-0.5
            layer.weight.copy_(torch.rand(layer.weight.shape, generator=generator) * 2 * bound - bound)
            layer.bias.zero_()
    mlp = torch.nn.Sequential(first, torch.nn.GELU(), last)
    steps = epochs * max(1, math.ceil(len(xs) / batch))
    optimizer = torch.optim.AdamW(mlp.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    with torch.enable_grad():
        for _ in range(epochs):
            for rows in torch.randperm(len(xs), generator=generator).split(batch):
                loss = torch.nn.functional.mse_loss(mlp(xs[rows]), ys[rows])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
    with torch.no_grad():  # fold the standardisations into the two linear layers
        first.bias -= first.weight @ (mean / std)  # type: ignore[misc]  # in place: still the Parameter
        first.weight /= std
        last.weight *= y_std[:, None]
        last.bias.mul_(y_std).add_(y_mean)
    return mlp.eval().requires_grad_(False)


@torch.no_grad()
def score_thresholds(
    model: Any,
    surrogate: Surrogate,
    documents: Iterable[torch.Tensor],
    grid: Sequence[float] | np.ndarray,
    window: int,
) -> dict[str, list[float]]:
    """For each global ratio of ``grid``: the predicted log-score below which that share of the evictable
    tokens of ``documents`` fall, over every trained layer and head (the ``threshold`` allocator reads it,
    so its average kept share on text like these documents is the ratio asked for)."""
    pooled = []
    for ids in documents:
        features = token_feature_maps(model, ids, surrogate.features)
        end = ids.shape[1] - window
        for layer in surrogate.layers:
            pooled.append(surrogate.predict(layer, features[layer])[0, :, SKIP_FIRST:end].flatten())
    scores = torch.cat(pooled).double()
    values = torch.quantile(scores, torch.tensor(list(grid), dtype=torch.float64))
    return {"grid": [float(g) for g in grid], "values": values.tolist()}


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two 1-D tensors (ties broken by order; scores here are continuous).

    >>> spearman(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 25.0]))
    1.0
    """
    ra = a.double().argsort().argsort().double()
    rb = b.double().argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum()) / denom if denom else 0.0


def fidelity(
    model: Any, tokenizer: Any, surrogate: Surrogate, documents: Iterable[torch.Tensor]
) -> dict[int, float]:
    """Per layer: Spearman correlation of predicted vs true log KVzip+ scores, averaged over heads and
    documents (past the sinks)."""
    sums: dict[int, list[float]] = {}
    for ids in documents:
        features = token_feature_maps(model, ids, surrogate.features)
        for layer, targets in kvzip_targets(model, tokenizer, ids).items():
            predicted = surrogate.predict(layer, features[layer])[0]  # [H, T]
            for h in range(targets.shape[-1]):
                rho = spearman(predicted[h, SKIP_FIRST:], targets[0, SKIP_FIRST:, h])
                sums.setdefault(layer, []).append(rho)
    return {layer: sum(v) / len(v) for layer, v in sorted(sums.items())}
