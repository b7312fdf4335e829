"""The scores a cache ranks a context by, read with exactly the cache's own code (for profiles)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from ..cache import LUKVCache
from ..cache.compression.recorded import RecordedPrefill
from ..scorers import Scorer

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

_SCORING_RATIO = 0.99  # any ratio records the same scores; this one keeps ~1% of the context per layer


def prefill_scores(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    scorer: str | Scorer,
    attention_mask: torch.Tensor | None = None,
    *,
    tokenizer=None,
    repeat_prompt=None,
    sliding: str = "keep",
) -> list[torch.Tensor | None]:
    """The scores a ``LUKVCache`` ranks by at prefill, per layer: fp32 ``[B, H_kv, T]`` (None for layers
    that are never compressed, e.g. sliding-window ones).

    The context goes through a cache (no sinks, no window) that records its scores, so a profile ranks
    tokens exactly as the cache will. A layer's scores are read before anything is evicted and do not
    depend on the ratio, so the cache evicts (nearly) everything right after each layer's attention: the
    context's KV is never held whole (with ``ratio=0`` it would be, for the whole forward). Reconstruction
    scorers (``kvzip``) need the ``tokenizer`` for their repeat prompt (or ``repeat_prompt``).
    ``sliding="compress"``: a sliding-window layer's scores too, ``[B, H_kv, W - 1]`` over the prompt's last
    tokens (what it holds and ranks at the end of a prefill longer than its window).

    >>> scores = prefill_scores(model, inputs["input_ids"], "keydiff")
    >>> scores[0].shape
    torch.Size([1, 2, 48])
    """
    cache = _scoring_cache(model.config, scorer, sliding)
    # logits_to_keep=1: only the scores are read; the prompt's logits would be [B, T, vocab] fp32
    cache.prefill(
        model, input_ids, attention_mask, tokenizer=tokenizer, repeat_prompt=repeat_prompt, logits_to_keep=1
    )
    return _read_scores(cache, model.config)


def replayed_scores(
    recorded: RecordedPrefill, scorer: str | Scorer, config: Any
) -> list[torch.Tensor | None]:
    """:func:`prefill_scores` of a context whose prefill was recorded (a model whose layers are all full
    attention, a scorer without repeat passes that reads at most ``recorded.n_queries`` queries): the same
    scores, without a forward through the model."""
    cache = _scoring_cache(config, scorer, "keep")
    recorded.replay_into(cache)
    return _read_scores(cache, config)


def _scoring_cache(config: Any, scorer: str | Scorer, sliding: str) -> LUKVCache:
    return LUKVCache(
        ratio=_SCORING_RATIO,
        scorer=scorer,
        allocator="uniform",  # layer by layer (a whole-model allocator would hold every layer's KV)
        config=config,
        sink=0,
        window=0,
        keep_scores=True,
        # every context token's score in the layers a profile optimises: under "keep", a sliding layer given a
        # context longer than its window is left out of the optimisation (its rows are rho)
        sliding=sliding,
    )


def _read_scores(cache: LUKVCache, config: Any) -> list[torch.Tensor | None]:
    num_layers = cast("PreTrainedConfig", config).get_text_config(decoder=True).num_hidden_layers
    recorded = cast("dict[int, torch.Tensor]", cache.prefill_scores)  # keep_scores=True: a dict
    return [recorded.get(idx) for idx in range(num_layers)]
