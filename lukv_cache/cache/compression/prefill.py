"""Filling a cache with a context (``LUKVCache.prefill``), and the passes of reconstruction scorers (KVzip):
after the context's forward the cache runs the model through the rounds the scorer's strategy plans
(``scorer.reconstruction``: the prompt, the rounds, the scoring), each pass scored by the strategy and
cropped afterwards, and only then is every layer compressed.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..._compat import cache_kwarg
from ...errors import ConfigurationError
from ...scorers.kvzip import RepeatPrompt
from ..storage.layer import LUKVLayer
from .forward_state import Phase
from .prefill_inputs import check_prefill_inputs


def _positions(mask: torch.Tensor, length: int, past: int) -> torch.Tensor | None:
    """Position ids of the last ``length`` tokens as ``generate()`` numbers a left-padded batch (each row
    from 0, padding at 1), from a mask over the past and new tokens; None if the mask covers neither."""
    if mask.shape[-1] != past + length:  # e.g. a mask of the new tokens alone: the model numbers them
        return None
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)[:, -length:]


def prefill_context(
    cache: Any,
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    tokenizer: Any = None,
    repeat_prompt: RepeatPrompt | None = None,
    **model_kwargs: Any,
) -> Any:
    """:meth:`LUKVCache.prefill <lukv_cache.LUKVCache.prefill>`: run the context through ``model`` into
    ``cache`` and compress it (with a reconstruction scorer: after its repeat passes); the model's output.
    The prompt is then complete (``ForwardState.end_prompt``): a question sent next is appended whole."""
    out = _prefill(cache, model, input_ids, attention_mask, tokenizer, repeat_prompt, model_kwargs)
    cache.state.end_prompt()
    return out


def _prefill(
    cache: Any,
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    tokenizer: Any,
    repeat_prompt: RepeatPrompt | None,
    model_kwargs: dict[str, Any],
) -> Any:
    cache.layout.meet_model(cache, model, strict=True)
    recon = cache.scorer.reconstruction
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    mask = check_prefill_inputs(
        input_ids, attention_mask, left_padding_only=recon is not None, vocab_size=vocab
    )
    if attention_mask is not None:
        attention_mask = mask
    model_kwargs.setdefault("position_ids", _positions(mask, input_ids.shape[1], cache.get_seq_length()))
    if recon is None or not cache.evicts and cache.prefill_scores is None:
        return model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            use_cache=True,
            **{cache_kwarg(model): cache},
            **model_kwargs,
        )
    if cache.get_seq_length() > 0:
        raise ConfigurationError(
            f"Scorer {cache.scorer.name!r} scores a whole context at once: prefill an empty cache "
            "(a fresh LUKVCache, or cache.reset())."
        )
    if repeat_prompt is None:
        if tokenizer is None:
            raise ConfigurationError(
                f"Scorer {cache.scorer.name!r} asks the model to repeat the context, in the model's own words: "
                "pass tokenizer=<the model's tokenizer> (or repeat_prompt=RepeatPrompt(...))."
            )
        repeat_prompt = recon.repeat_prompt(tokenizer)
    if isinstance(vocab, int):
        repeat_prompt.check_vocabulary(vocab)
    with cache.compressor.in_phase(Phase.HOLD):
        out = model(
            input_ids=input_ids,
            attention_mask=mask,
            use_cache=True,
            **{cache_kwarg(model): cache},
            **model_kwargs,
        )
    scores = reconstruct(cache, model, input_ids, mask, repeat_prompt)
    cache.evict_held(scores)
    return out


def reconstruct(
    cache: Any, model: Any, input_ids: torch.Tensor, mask: torch.Tensor, prompt: RepeatPrompt
) -> dict[int, torch.Tensor]:
    """The reconstruction passes: one forward per round of chunks, cropped after each; per-layer scores."""
    recon = cache.scorer.reconstruction
    held = [
        i for i, layer in enumerate(cache.layers) if isinstance(layer, LUKVLayer) and i in cache.state.held
    ]
    scores = {
        i: torch.zeros(
            cache.layers[i].batch_size,
            cache.layers[i].num_heads,
            input_ids.shape[1],
            device=input_ids.device,
        )
        for i in held
    }
    stock = {i: layer for i, layer in enumerate(cache.layers) if not isinstance(layer, LUKVLayer)}
    for round_ in recon.rounds(input_ids, mask, prompt, cache.policy.sink):
        round_.scores = scores
        saved = {i: copy.deepcopy(layer) for i, layer in stock.items()}  # sliding layers would slide
        try:
            with cache.compressor.reconstructing(round_):
                model(
                    input_ids=round_.input_ids,
                    attention_mask=torch.cat([mask, round_.mask.long()], dim=1),
                    position_ids=round_.position_ids,
                    use_cache=True,
                    logits_to_keep=1,
                    **{cache_kwarg(model): cache},
                )
        finally:
            for layer in cache.layers:
                if isinstance(layer, LUKVLayer):
                    layer.crop(-round_.length)
            for i, layer in saved.items():
                cache.replace_layer(i, layer)
    return scores


def score_round(
    cache: Any, idx: int, module: Any, query: torch.Tensor, scaling: float, softcap: float | None
) -> None:
    """Layer ``idx``'s attention ran during a reconstruction pass: the strategy scores it into the round."""
    round_, layer = cache.state.round, cache.layers[idx]
    if round_ is None or idx not in round_.scores:
        return
    cache.scorer.reconstruction.score(
        round_,
        round_.scores[idx],
        module,
        query,
        layer.suffix_keys,
        layer.suffix_values,
        scaling=scaling,
        softcap=softcap,
    )
