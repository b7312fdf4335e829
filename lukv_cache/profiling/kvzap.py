"""Training a KVzap surrogate (:mod:`lukv_cache.scorers.kvzap`) for a model: corpus, features, targets.

Targets are the library's own KVzip+ scores (``kvzip_plus``: repeat passes through the model, attention
times ``||v W_O||``), in log; features are each token's pre-RoPE key and value, read from a plain forward
through the model's own attention. Ridge regression runs on sufficient statistics, so a corpus of any size
trains in ``O(layers x F^2)`` memory.

The default corpus is news (gensim's 300 Australian news articles, concatenated into ~1k-token
documents): real, varied prose that the benchmarks do not report on (they use Wikipedia).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..attention.swap import attention_swapped
from ..errors import ConfigurationError
from ..scorers.kvzap import RidgeStats, Surrogate, rope_inverse, token_features
from ..scorers.kvzip import RepeatPrompt
from ..texts import news_articles
from .scores import prefill_scores

_FEATURES_IMPL = "lukv_kvzap_features"
KVZAP_TOKENS = 1024  # tokens per training document (KVzap trains on ~1k-token texts)
SKIP_FIRST = 4  # attention sinks: always kept, and their scores are outliers a surrogate need not learn


def news_documents(tokenizer: Any, count: int, tokens: int = 1024, seed: int = 0) -> list[torch.Tensor]:
    """``count`` documents ``[1, tokens]`` of news articles (shuffled with ``seed``) joined by blank lines.

    >>> docs = news_documents(tokenizer, 4)  # doctest: +SKIP
    """
    articles = [a.text for a in news_articles()]
    random.Random(seed).shuffle(articles)
    docs, current = [], []
    for text in articles:
        current.extend(tokenizer.encode(text + "\n\n", add_special_tokens=False))
        if len(current) >= tokens:
            docs.append(torch.tensor([current[:tokens]]))
            current = []
            if len(docs) == count:
                return docs
    raise ConfigurationError(f"The news corpus holds {len(docs)} documents of {tokens} tokens, not {count}.")


@torch.no_grad()
def token_feature_maps(model: Any, input_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """fp32 ``{layer: [B, T, F]}``: the KVzap features of every token, from a plain forward through the
    model's own attention (whose position ids place RoPE)."""
    impl = model.config._attn_implementation
    stock = ALL_ATTENTION_FUNCTIONS[impl]
    features: dict[int, torch.Tensor] = {}

    def observe(module, query, key, value, attention_mask, **kwargs):
        b, _, t, _ = key.shape
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(t, device=key.device).expand(b, t)
        features[module.layer_idx] = token_features(rope_inverse(module)(key, positions), value).flatten(2)
        return stock(module, query, key, value, attention_mask, **kwargs)

    with attention_swapped(model, _FEATURES_IMPL, observe, mask=impl):
        model(input_ids=input_ids.to(model.device), use_cache=False, logits_to_keep=1)
    return features


def kvzip_plus_targets(model: Any, tokenizer: Any, input_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """fp32 ``{layer: [B, T, H_kv]}``: log KVzip+ scores (full-attention layers only). ``tokenizer``
    gives the repeat prompt (a :class:`~lukv_cache.scorers.kvzip.RepeatPrompt` works too)."""
    prompt = {"repeat_prompt": tokenizer} if isinstance(tokenizer, RepeatPrompt) else {"tokenizer": tokenizer}
    scores = prefill_scores(model, input_ids, "kvzip_plus", **prompt)
    return {i: s.clamp_min(1e-12).log().transpose(1, 2) for i, s in enumerate(scores) if s is not None}


def train_surrogate(
    model: Any,
    tokenizer: Any,
    documents: Iterable[torch.Tensor],
    *,
    alpha: float = 1.0,
    progress: Callable[[int], None] | None = None,
    meta: dict | None = None,
    targets_of: Callable[[int, torch.Tensor], dict[int, torch.Tensor]] | None = None,
) -> Surrogate:
    """A linear KVzap surrogate for ``model``: ridge regression of log KVzip+ on token features, per layer
    and KV head, over ``documents`` (each ``[1, T]``). ``targets_of(index, ids)``: the log KVzip+ scores of
    a document (default :func:`kvzip_plus_targets`; a build passes one that caches them, so an
    interrupted build resumes without the repeat passes it already ran)."""
    targets_of = targets_of or (lambda _, ids: kvzip_plus_targets(model, tokenizer, ids))
    stats: dict[int, RidgeStats] = {}
    for i, ids in enumerate(documents):
        features = token_feature_maps(model, ids)
        for layer, targets in targets_of(i, ids).items():
            x = features[layer][0, SKIP_FIRST:]  # [T, F]
            y = targets[0, SKIP_FIRST:]  # [T, H]
            stats.setdefault(layer, RidgeStats(x.shape[-1], y.shape[-1])).add(x, y)
        if progress is not None:
            progress(i + 1)
    if not stats:
        raise ConfigurationError("No full-attention layer was scored: nothing to train a surrogate on.")
    return _surrogate_from(stats, model, alpha, meta or {})


def _surrogate_from(stats: dict[int, RidgeStats], model: Any, alpha: float, meta: dict) -> Surrogate:
    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    some = next(iter(stats.values()))
    surrogate = Surrogate.zeros(num_layers, some.sy.shape[0], some.sx.shape[0])
    for layer, layer_stats in stats.items():
        weight, bias, mean, std = layer_stats.solve(alpha)
        surrogate.weight[layer], surrogate.bias[layer] = weight.T, bias
        surrogate.mean[layer], surrogate.std[layer] = mean, std
    surrogate.layers = sorted(stats)
    surrogate.meta = {"alpha": alpha, "tokens_per_layer": some.n, **meta}
    return surrogate


@torch.no_grad()
def score_thresholds(
    model: Any, surrogate: Surrogate, documents: Iterable[torch.Tensor], grid: Sequence[float], window: int
) -> dict[str, list[float]]:
    """For each global ratio of ``grid``: the predicted log-score below which that share of the evictable
    tokens of ``documents`` fall, over every trained layer and head (the ``threshold`` allocator reads it,
    so its average kept share on text like these documents is the ratio asked for)."""
    pooled = []
    for ids in documents:
        features = token_feature_maps(model, ids)
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
        features = token_feature_maps(model, ids)
        for layer, targets in kvzip_plus_targets(model, tokenizer, ids).items():
            predicted = surrogate.predict(layer, features[layer])[0]  # [H, T]
            for h in range(targets.shape[-1]):
                rho = spearman(predicted[h, SKIP_FIRST:], targets[0, SKIP_FIRST:, h])
                sums.setdefault(layer, []).append(rho)
    return {layer: sum(v) / len(v) for layer, v in sorted(sums.items())}
