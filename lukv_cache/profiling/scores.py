"""The scores a cache ranks a context by, read with exactly the cache's own code (for profiles)."""

from __future__ import annotations

import torch

from ..cache import LUKVCache
from ..scorers import Scorer


def prefill_scores(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    scorer: str | Scorer,
    attention_mask: torch.Tensor | None = None,
    *,
    tokenizer=None,
) -> list[torch.Tensor | None]:
    """The scores a ``LUKVCache`` ranks by at prefill, per layer: fp32 ``[B, H_kv, T]`` (None for layers
    that are never compressed, e.g. sliding-window ones).

    The context goes through a keep-everything cache (``ratio=0``, no sinks, no window) that records its
    scores, so a profile ranks tokens exactly as the cache will. Reconstruction scorers (``kvzip``) need
    the ``tokenizer`` for their repeat prompt.

    >>> scores = prefill_scores(model, inputs["input_ids"], "keydiff")
    >>> scores[0].shape
    torch.Size([1, 2, 48])
    """
    cache = LUKVCache(ratio=0.0, scorer=scorer, config=model.config, sink=0, window=0, keep_scores=True)
    cache.prefill(model, input_ids, attention_mask, tokenizer=tokenizer)
    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    return [cache.prefill_scores.get(idx) for idx in range(num_layers)]
