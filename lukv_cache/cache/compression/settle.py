"""What :meth:`Compressor.on_update <lukv_cache.cache.compression.compressor.Compressor.on_update>` checks
before a cache stores a layer's keys: that the scorer can rank this forward (:func:`check_scorer`), that
the previous layer's attention read the cache (:func:`check_routed`), and that the batch matches
(:func:`check_batch`); and what an attention call the store cannot serve means (:func:`check_servable`).
Checks only: they raise or return, and write nothing (the compressor owns the forward's state). Functions
taking the cache's parts (:class:`~lukv_cache.cache.compression.contract.CompressedCache`).
"""

from __future__ import annotations

import torch

from ...errors import BatchMismatchError, ConfigurationError, IncompatibleAttentionError
from ..storage.layer import LUKVLayer
from ..storage.report import stock_keys
from .contract import CompressedCache


def check_scorer(cache: CompressedCache, key_states: torch.Tensor, layer_idx: int) -> None:
    """A reconstruction scorer ranks a context only through ``cache.prefill``."""
    scorer = cache.policy.scorer
    if (
        scorer.reconstruction is not None
        and cache.state.phase is None
        and cache.evicts
        and key_states.shape[-2] > 1
        and cache.get_seq_length(layer_idx) == 0
    ):
        raise ConfigurationError(
            f"Scorer {scorer.name!r} scores the context by reconstruction, which needs the model and the "
            "context's token ids: fill the cache with cache.prefill(model, input_ids, tokenizer=tokenizer) "
            "(then generate from it), or pick a scorer that ranks from the prefill alone (e.g. 'keydiff')."
        )


def check_routed(cache: CompressedCache, awaiting: int) -> None:
    """Layer ``awaiting``'s announced attention never ran: an error if the model did not read the cache as
    it holds it; else (ratio 0, nothing compressed) nothing, and the compressor stops announcing calls
    (``ForwardState.unrouted``)."""
    if (cache.evicts or cache.is_compressed) and cache.layout.other_keys:
        raise IncompatibleAttentionError(
            f"LUKVCache layer {awaiting}: the attention received other keys than the cache's update() "
            "returned, so the cache does not hold what attention reads. Multi-head latent attention "
            "(DeepSeek-V2/V3/R1, Kimi-K2, MiniCPM3, GLM-4-MoE-Lite, LongCat, ...) does this: it caches one "
            "compressed latent per token and expands it into keys and values only after update() "
            "(docs/usage.md, 'Model families'). Only ratio=0 works: use transformers' DynamicCache for this "
            "model."
        )
    if cache.evicts or cache.is_compressed:
        raise IncompatibleAttentionError(
            f"LUKVCache layer {awaiting}: the model attended without going through transformers' "
            "attention interface, so no lukv_cache attention function read the layer. This model family "
            "computes attention in its own code (as Bloom, GPT-Neo, MPT, XGLM and CPM-Ant do, GPT-J and CodeGen "
            "before transformers 5.24, and Falcon before transformers 5.25), which cannot read a compressed cache "
            "whatever attn_implementation is set: only ratio=0 works with it, so use transformers' DynamicCache "
            "for this model."
        )


def check_servable(cache: CompressedCache, layer_idx: int, reason: str) -> None:
    """Layer ``layer_idx``'s attention passes what the compressed store's attention cannot read
    (``reason``, the message: a mask of its own per head), seen before the layer is compressed. A cache that
    would compress (it evicts, or holds compressed layers) raises
    :class:`~lukv_cache.errors.IncompatibleAttentionError`; at ratio 0 nothing, and the compressor stops
    announcing calls, as for a model that attends in its own code (:func:`check_routed`): no layer is
    compressed, and the model's own attention reads the dense layers exactly (DynamicCache's logits)."""
    if cache.evicts or cache.is_compressed:
        raise IncompatibleAttentionError(f"LUKVCache layer {layer_idx}: {reason}")


def check_batch(layers: list, key_states: torch.Tensor) -> None:
    """The forward's batch is the one the cache holds (its first filled layer's)."""
    for layer in layers:
        if isinstance(layer, LUKVLayer):
            held = layer.batch_size if layer.is_initialized else None
        else:
            keys = stock_keys(layer)
            held = None if keys is None else keys.shape[0]
        if held is not None:
            if key_states.shape[0] != held:
                raise BatchMismatchError(
                    f"LUKVCache holds a batch of {held} rows but this forward has {key_states.shape[0]}; the "
                    "cache is unchanged. Beam search or num_return_sequences > 1 from a filled cache (after "
                    "cache.prefill) need its rows repeated first: cache.batch_repeat_interleave(n), with n = "
                    "num_beams x num_return_sequences. Otherwise use the same batch for the whole generation "
                    "or start a fresh cache.",
                    expected=held,
                    got=int(key_states.shape[0]),
                )
            return
