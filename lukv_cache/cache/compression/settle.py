"""What :meth:`Compressor.on_update <lukv_cache.cache.compression.compressor.Compressor.on_update>` settles and checks
before a cache stores a layer's keys: at a forward's first layer, the state the previous forward left
(:func:`begin_forward`; the compressor then evicts what it left pending); then that the scorer can rank
this forward, that the previous layer's attention read the cache, and that the batch matches. Functions
taking the cache's parts (:class:`~lukv_cache.cache.compression.contract.CompressedCache`).
"""

from __future__ import annotations

import torch

from ...errors import BatchMismatchError, ConfigurationError, IncompatibleAttentionError
from ...integration import discard_attention, guard_attention
from ..storage.layer import LUKVLayer
from ..storage.report import stock_keys
from .contract import CompressedCache
from .forward_state import ForwardState


def begin_forward(
    state: ForwardState, length: int, *, empty: bool = False, recording: bool = False, recorded: bool = False
) -> bool:
    """A forward of ``length`` tokens starts (its layer 0): its lengths, whether it is a chunk of the
    prompt (``state.prompt``: ``empty``, the cache holds nothing yet; ``recording``, the cache records its
    past for assisted decoding; ``recorded``, it did at an earlier forward already), the attention guard,
    and no call left waiting by an earlier forward. (What an earlier forward left to evict, the compressor
    evicts next: :meth:`~lukv_cache.cache.compression.compressor.Compressor.flush`.) Returns whether this forward is
    one the cache cannot place: a multi-token forward before the first decode, while a past recording
    left on by an earlier prompt is on (a chunk of this prompt, or assisted decoding's verification
    forward); it is kept whole, and the caller warns once."""
    state.previous_length, state.length = state.length, length
    if empty:
        # a new prompt; assisted decoding records the past from before its first forward, which holds the
        # whole prompt and the first drafts: the multi-token forwards after it are verification forwards
        state.prompt, state.unsure = not recording, recording and recorded
    unsure = state.unsure and not empty and length > 1
    if length <= 1:  # decoding: what comes after is a question or a verification forward
        state.end_prompt()
    guard_attention()  # implementations registered since import must not read this cache silently
    state.cap_ratio = None
    if state.awaiting is not None:  # a previous forward raised between update() and attention
        state.awaiting = None
        discard_attention()
    return unsure


def check_forward(cache: CompressedCache, key_states: torch.Tensor, layer_idx: int) -> None:
    """Before layer ``layer_idx`` stores ``key_states``: the checks of :func:`check_scorer`,
    :func:`check_routed` and :func:`check_batch`, in that order."""
    check_scorer(cache, key_states, layer_idx)
    check_routed(cache)
    check_batch(cache.layers, key_states)


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


def check_routed(cache: CompressedCache) -> None:
    """The previous layer's announced attention never ran: an error if the model did not read the cache
    as it holds it, else (ratio 0, nothing compressed) the cache stops announcing calls."""
    state, layout = cache.state, cache.layout
    if state.awaiting is None:
        return
    awaiting, state.awaiting = state.awaiting, None
    discard_attention()
    if (cache.evicts or cache.is_compressed) and layout.other_keys:
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
    # ratio 0, nothing compressed: the model's own attention code reads the dense layers exactly;
    # announce nothing more (no call may wait for an attention function that never comes)
    state.unrouted = True


def refuse_unservable(cache: CompressedCache, layer_idx: int, reason: str) -> None:
    """Layer ``layer_idx``'s attention passes what the compressed store's attention cannot read
    (``reason``, the message: a mask of its own per head), seen before the layer is compressed. A cache that
    would compress (it evicts, or holds compressed layers) raises
    :class:`~lukv_cache.errors.IncompatibleAttentionError`; at ratio 0 it stops announcing calls, as for a
    model that attends in its own code (:func:`check_routed`): no layer is compressed, and the model's own
    attention reads the dense layers exactly (DynamicCache's logits)."""
    state = cache.state
    state.awaiting = None
    if cache.evicts or cache.is_compressed:
        raise IncompatibleAttentionError(f"LUKVCache layer {layer_idx}: {reason}")
    state.unrouted = True


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
