"""LUKVCache: a DynamicCache that evicts per (layer, KV head) right after each layer's prefill."""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers.cache_utils import (
    DynamicCache,
    LinearAttentionCacheLayerMixin,
)

from ..allocation import AllocationRequest
from ..attention.calls import AttentionCall, announce_attention, discard_attention, guard_attention
from ..errors import BatchMismatchError, ConfigurationError, IncompatibleAttentionError
from ..scorers import Scorer
from ..scorers.kvzip import RepeatPrompt
from .callstack import calling_model, generate_prefill_chunk
from .cap import row_ratios, token_cap
from .compression import (
    Region,
    keep_mask,
    masked_scores,
    plan_region,
    score_suffix,
    trim_counts,
)
from .folding import fold_due, fold_evict, keeps_scores, scorer_context, set_fold, suffix_valid
from .layer import FOLD_AT, LUKVLayer
from .layout import Layout
from .parallel import HeadShard, mesh_shard
from .policy import build_policy, policy_property
from .prefill import prefill_context, score_round
from .pretrained import from_pretrained as _from_pretrained
from .state import ForwardState, in_phase

if TYPE_CHECKING:
    from transformers.cache_utils import DynamicLayer

    from ..attention.calls import WholeStoreView
    from ..profiles import Profile


def kv_cache_bytes(cache: Any) -> int:
    """Bytes of every tensor a transformers cache holds: a LUKVCache's stores, positions, offsets and suffix
    buffers, the keys/values of stock layers (``DynamicCache``, sliding and indexed layers) and the
    conv / recurrent states of linear-attention and SSM layers.

    >>> kv_cache_bytes(DynamicCache())
    0
    """
    total = 0
    for layer in getattr(cache, "layers", []):
        if isinstance(layer, LUKVLayer):  # a LUKVHybridLayer counts its linear states itself
            total += layer.memory_bytes()
            continue
        tensors = []
        if getattr(layer, "is_initialized", False):
            tensors += [getattr(layer, name, None) for name in ("keys", "values", "indexer_keys")]
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            tensors += [*layer.conv_states.values(), *layer.recurrent_states.values()]
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


def _stock_keys(layer: Any) -> torch.Tensor | None:
    """``[B, H, S, D]``: the keys a stock transformers layer holds, or ``None`` (not filled yet, or a layer
    without per-token keys: linear-attention, SSM and placeholder layers)."""
    keys = getattr(layer, "keys", None) if getattr(layer, "is_initialized", False) else None
    return keys if isinstance(keys, torch.Tensor) and keys.ndim == 4 else None


class LUKVCache(DynamicCache):
    """KV cache with per-head eviction after prefill, stored ragged so the memory is really freed.

    Args:
        ratio: fraction of the prompt's evictable KV entries to remove (``0.8`` keeps 20%; default 0.5).
        max_tokens: instead of ``ratio``, a hard bound: after the prompt's forward, each row holds at most
            this many tokens per (full-attention layer, KV head) on average, sinks and window included,
            whatever the prompt's length (each prompt gets its own ratio, budgets are trimmed if an
            allocator asks for more; a prompt that already fits is kept whole). At least ``sink + window``.
        scorer: name of a registered scorer (``keydiff``, ``snapkv``, ``expected_attention``, ``knorm``,
            ``tova``, ``streaming``, ``random``) or a :class:`~lukv_cache.scorers.Scorer`.
        allocator: ``uniform``, ``pyramid``, ``adakv``, ``profile`` (needs ``evict_ratio`` or a ``profile``) or any
            registered name; ``allocator_kwargs`` go to its factory.
        sink: first tokens of each row always kept (attention sinks).
        window: last prompt tokens always kept, dense (default: the scorer's, 1 or 32 for snapkv).
        min_keep: every head keeps at least this fraction of its evictable tokens (and >= 1 token).
        prefill_chunk_size: also compress later multi-token forwards once this many uncompressed tokens
            pile up (chunked prefill); by default only the first forward (the context) is compressed.
        evict_ratio: ``[layers, kv_heads]`` fixed local evict ratios for ``allocator="profile"`` (or
            ``hybrid``); they set the ratio (their mean), so ``ratio``/``max_tokens`` cannot be given too.
            ``allocator_kwargs={"profile": profile}`` reads a profile's curve at the ratio instead.
        config: the model config; lets sliding-window layers use the stock sliding layer from the start.
        keep_scores: keep each layer's prefill scores (fp32 ``[B, H_kv, T]``) in :attr:`prefill_scores`.
        decode_max_tokens: bound the whole generation, not just the prompt: every ``fold_interval`` tokens
            after the prompt, the budgets are applied again to everything the cache holds, so that each row
            keeps at most this many tokens per (full-attention layer, KV head) on average (sinks and window
            included), the allocator's budgets read at the ratio that total implies. Without ``ratio`` or
            ``max_tokens`` it bounds the prompt too (``max_tokens`` is this). Needs a scorer that decodes
            (not ``kvzip``). Off by default.
        fold_interval: the dense suffix of decoded tokens is folded into the ragged store every this many
            tokens (default 256), and with ``decode_max_tokens`` evicted there.
        kv_bits: store the kept keys and values in 8 or 4 bits (per token, groups of 32 channels with an
            fp16 scale and zero each; :mod:`lukv_cache.cache.quant`) instead of the model's dtype; the dense
            suffix (window, new tokens) stays at full precision until it folds. Scores are computed before
            quantization, so the prompt's eviction is the same for every ``kv_bits``. Default ``None``.
        decode_window: with ``decode_max_tokens``, the most recent tokens each head keeps at every fold
            (part of the bound). Default: a quarter of ``decode_max_tokens`` (at least ``window``); recent
            tokens matter most to the next ones, and a quarter measured best for kvzap and keydiff
            (``benchmarks/results/decode_window_tuning/``).
        device_mesh: tensor parallelism's ``DeviceMesh`` (1-D, or one with a ``"tp"`` dimension such as
            transformers' ``model._device_mesh``). Rarely needed: a model loaded with ``tp_plan="auto"`` is
            recognised from its sharded attention weights. Under tensor parallelism each rank's cache holds
            the rank's block of KV heads (:attr:`head_shard`), with the budgets of a single-process run.

    Example:
        >>> cache = LUKVCache(ratio=0.8, scorer="keydiff", allocator="uniform")
        >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=4, do_sample=False)
        >>> cache.stored_tokens().shape  # [layers, batch, kv_heads]
        torch.Size([2, 1, 2])
    """

    def __init__(
        self,
        ratio: float | None = None,
        scorer: str | Scorer = "keydiff",
        allocator: Any = "uniform",
        *,
        max_tokens: int | None = None,
        sink: int = 4,
        window: int | None = None,
        min_keep: float = 0.01,
        prefill_chunk_size: int | None = None,
        evict_ratio: Any = None,
        allocator_kwargs: dict | None = None,
        config: Any = None,
        keep_scores: bool = False,
        device_mesh: Any = None,
        decode_max_tokens: int | None = None,
        fold_interval: int = FOLD_AT,
        decode_window: int | None = None,
        kv_bits: int | None = None,
    ):
        self.policy = build_policy(
            ratio,
            scorer,
            allocator,
            max_tokens=max_tokens,
            sink=sink,
            window=window,
            min_keep=min_keep,
            prefill_chunk_size=prefill_chunk_size,
            evict_ratio=evict_ratio,
            allocator_kwargs=allocator_kwargs,
            decode_max_tokens=decode_max_tokens,
            fold_interval=fold_interval,
            decode_window=decode_window,
            kv_bits=kv_bits,
        )
        super().__init__()
        self.layer_class_to_replicate = LUKVLayer  # until the layout is known (config=, or the model's)
        self.profile: Profile | None = None  # the Profile the budgets come from (set by from_pretrained)
        self.layout = Layout(None if device_mesh is None else mesh_shard(device_mesh))
        self.prefill_scores: dict[int, torch.Tensor] | None = {} if keep_scores else None
        self.state = ForwardState()  # what a forward leaves pending: reset() replaces it whole
        if config is not None:
            self.layout.set_layout(self, config)

    # ------------------------------------------------------------------ the policy, read-only
    ratio = policy_property("ratio")
    scorer = policy_property("scorer")
    max_tokens = policy_property("max_tokens")
    decode_max_tokens = policy_property("decode_max_tokens")
    fold_interval = policy_property("fold_interval")
    kv_bits = policy_property(
        "kv_bits", "Bits per entry of the stored keys and values (8 or 4), ``None`` at the model's precision."
    )
    decode_window = policy_property(
        "decode_window", "The recent tokens each head keeps at every fold (0 without ``decode_max_tokens``)."
    )
    allocator = policy_property("allocator")
    sink = policy_property("sink")
    window = policy_property("window")
    min_keep = policy_property("min_keep")
    prefill_chunk_size = policy_property("prefill_chunk_size")

    @property
    def num_layers(self) -> int | None:
        """The model's layer count (from its config), ``None`` until known."""
        return self.layout.num_layers

    @num_layers.setter
    def num_layers(self, value: int | None) -> None:
        self.layout.num_layers = value

    @property
    def evicts(self) -> bool:
        """Whether this cache removes anything (a ratio above 0, or a token budget)."""
        policy = self.policy
        return policy.ratio > 0 or policy.max_tokens is not None or policy.decode_max_tokens is not None

    @property
    def allocator_name(self) -> str:
        return self.policy.allocator.name

    # ------------------------------------------------------------------ construction from a profile
    from_pretrained = classmethod(_from_pretrained)

    # ------------------------------------------------------------------ the model's layer layout
    def _adopt_layout(self) -> None:
        """Built without ``config=``: when the model first reaches the cache, learn the layout from the
        model itself (the config of the module calling in), so that hybrid models' linear-attention / SSM
        layers, chunked and KV-sharing layers get their own layers from the start, as with ``config=``."""
        if self.layer_class_to_replicate is None or self.layers:
            return
        model = calling_model()
        if model is None:
            return
        from transformers import PreTrainedModel

        accepts = inspect.signature(type(model).forward).parameters
        if isinstance(model, PreTrainedModel) and not {"past_key_values", "past_key_value"} & set(accepts):
            warnings.warn(
                f"{type(model).__name__} takes no past_key_values (it keeps a state of its own, as RWKV and Mamba "
                "do): this LUKVCache stays empty and compresses nothing.",
                stacklevel=4,
            )
        self.layout.set_layout(self, model.config)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        self._adopt_layout()
        return super().get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        self._adopt_layout()
        return super().get_mask_sizes(query_length, layer_idx)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        self._adopt_layout()
        return super().has_previous_state(layer_idx, state_idx)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        self._adopt_layout()
        return super().get_conv_state(self._linear(layer_idx), state_idx)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        self._adopt_layout()
        return super().update_conv_state(conv_states, self._linear(layer_idx), state_idx, **kwargs)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        self._adopt_layout()
        return super().get_recurrent_state(self._linear(layer_idx), state_idx)

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ):
        self._adopt_layout()
        return super().update_recurrent_state(recurrent_states, self._linear(layer_idx), state_idx, **kwargs)

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        self._adopt_layout()
        if layer_idx >= len(self.layers) or not hasattr(self.layers[layer_idx], "update_indexer"):
            raise IncompatibleAttentionError(
                f"Layer {layer_idx} attends through a sparse-attention indexer (DeepSeek-V3.2's DSA and kin), whose "
                "indexer keys this LUKVCache has no layer for. Build the cache with config=model.config "
                "(LUKVCache(..., config=model.config), or LUKVCache.from_pretrained(model, ...)): the indexed "
                "layers then keep transformers' own layer, uncompressed."
            )
        return super().update_indexer(indexer_key_states, layer_idx)

    def _linear(self, layer_idx: int) -> int:
        """``layer_idx``, once it is known to be a linear-attention / SSM layer; else a typed error."""
        if layer_idx < len(self.layers) and isinstance(
            self.layers[layer_idx], LinearAttentionCacheLayerMixin
        ):
            return layer_idx
        raise ConfigurationError(
            f"Layer {layer_idx} of this model is a linear-attention or state-space layer, and this LUKVCache does "
            "not know the model's layer layout. Build it with config=model.config (LUKVCache(..., "
            "config=model.config), or LUKVCache.from_pretrained(model, ...))."
        )

    # ------------------------------------------------------------------ the forward
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self._adopt_layout()
        if self.layout.undecided:
            self.layout.decide_windows(self, key_states.shape[-2])
        if layer_idx == 0:
            guard_attention()  # implementations registered since import must not read this cache silently
            self.state.cap_ratio = None
            if self.state.awaiting is not None:  # a previous forward raised between update() and attention
                self.state.awaiting = None
                discard_attention()
            if self.state.deferred:  # a forward ended before its last full-attention layer compressed
                self._evict_deferred()
            if self.state.folding:  # likewise for a fold
                self._fold_evict()
        if (
            self.scorer.reconstruction is not None
            and self.state.phase is None
            and self.evicts
            and key_states.shape[-2] > 1
            and self.get_seq_length(layer_idx) == 0
        ):
            raise ConfigurationError(
                f"Scorer {self.scorer.name!r} scores the context by reconstruction, which needs the model and the "
                "context's token ids: fill the cache with cache.prefill(model, input_ids, tokenizer=tokenizer) "
                "(then generate from it), or pick a scorer that ranks from the prefill alone (e.g. 'keydiff')."
            )
        if self.state.awaiting is not None:
            awaiting, self.state.awaiting = self.state.awaiting, None
            discard_attention()
            if (self.evicts or self.is_compressed) and self.layout.other_keys:
                raise IncompatibleAttentionError(
                    f"LUKVCache layer {awaiting}: the attention received other keys than the cache's update() "
                    "returned, so the cache does not hold what attention reads. Multi-head latent attention "
                    "(DeepSeek-V2/V3/R1, Kimi-K2, MiniCPM3, GLM-4-MoE-Lite, LongCat, ...) does this: it caches one "
                    "compressed latent per token and expands it into keys and values only after update() "
                    "(docs/usage.md, 'Model families'). Only ratio=0 works: use transformers' DynamicCache for this "
                    "model."
                )
            if self.evicts or self.is_compressed:
                raise IncompatibleAttentionError(
                    f"LUKVCache layer {awaiting}: the model attended without going through transformers' "
                    "attention interface, so no lukv_cache attention function read the layer. This model family "
                    "computes attention in its own code (as Bloom, Falcon, GPT-J, GPT-Neo, MPT, CodeGen, XGLM and "
                    "CPM-Ant do), which cannot read a compressed cache whatever attn_implementation is set: only "
                    "ratio=0 works with it, so use transformers' DynamicCache for this model."
                )
            # ratio 0, nothing compressed: the model's own attention code reads the dense layers exactly;
            # announce nothing more (no call may wait for an attention function that never comes)
            self.state.unrouted = True
        self._check_batch(key_states)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        if isinstance(layer, LUKVLayer) and not self.state.unrouted:
            set_fold(layer, self.policy)
            self.state.awaiting = layer_idx
            reader = self.state.readers.get(layer_idx)
            announce_attention(
                AttentionCall(
                    layer_idx,
                    keys,
                    values,
                    # a quantized store's PackedRows rows are read only through dense() or the codes kernel
                    cast("WholeStoreView | None", layer.store),
                    self._after_attention,
                    module=reader,
                    on_other_keys=self._keys_changed,
                )
            )
        return keys, values

    def _keys_changed(self) -> None:
        self.layout.other_keys = True

    def _check_batch(self, key_states: torch.Tensor) -> None:
        for layer in self.layers:
            if isinstance(layer, LUKVLayer):
                held = layer.batch_size if layer.is_initialized else None
            else:
                keys = _stock_keys(layer)
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

    def _after_attention(
        self,
        call: AttentionCall,
        module: Any,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        sliding_window: int | None,
        scaling: float,
        softcap: float | None,
    ) -> None:
        """The layer's attention ran (see :class:`~lukv_cache.attention.AttentionCall`): compress it, or
        hand a sliding-window layer to the stock sliding layer."""
        self.state.awaiting = None
        idx = call.layer_idx
        layer = cast(LUKVLayer, self.layers[idx])  # only a LUKVLayer announces a call
        if idx not in self.state.readers:
            self.state.readers[idx] = weakref.ref(module)
        if self.state.phase == "reconstruct":
            score_round(self, idx, module, query, scaling, softcap)
            return
        self.layout.learn_model(self, getattr(module, "config", None))
        if sliding_window is not None and layer.sliding_window is None and not layer.compressed:
            self.layers[idx] = layer.to_sliding(sliding_window, record_past=self.layout.record_past)
            return
        self.layout.learn_heads(layer, module)
        if not self._wants_compression(layer, query.shape[2]):
            decoding = self.policy.decode_max_tokens is not None and self.state.phase is None
            if decoding and fold_due(layer, self.policy, query):
                self.state.folding[idx] = (module, attention_mask)
                if idx == self.layout.last_full_layer:
                    self._fold_evict()
            return
        region = plan_region(layer, self.policy, attention_mask)
        if self.state.phase == "hold":
            self.state.held[idx] = region
            return
        scores = None
        evictable = region.length and bool(region.n_evictable.any())
        # ratio 0 keeps every token: no scoring needed (a reconstruction scorer could not score here anyway)
        wanted = (evictable and self.evicts) or self.prefill_scores is not None
        if wanted and self.scorer.reconstruction is None:
            context = scorer_context(self.policy, self.layout.head_shard, idx, module, layer, attention_mask)
            raw = score_suffix(self.policy.scorer, layer, query, suffix_valid(attention_mask, layer), context)
            if self.prefill_scores is not None:
                self.prefill_scores[idx] = raw
            scores = masked_scores(raw, region) if evictable and self.evicts else None
        if self.policy.defers:
            self.state.deferred[idx] = (region, scores)
            if idx == self.layout.last_full_layer:
                self._evict_deferred()
        else:
            self._evict({idx: (region, scores)})

    # ------------------------------------------------------------------ eviction at fold time
    def _fold_evict(self) -> None:
        """Eviction at fold time of the layers whose fold is due (:func:`~lukv_cache.cache.folding.fold_evict`)."""
        folding, self.state.folding = self.state.folding, {}
        fold_evict(self.layers, folding, self.policy, self.layout.head_shard, self.num_layers)

    def _wants_compression(self, layer: LUKVLayer, query_length: int) -> bool:
        """Compress after a multi-token forward: always the first time; every chunk of transformers'
        chunked prefill (``generate(prefill_chunk_size=...)``, the last shorter chunk too); otherwise
        whenever the cache's own ``prefill_chunk_size`` has piled up that many uncompressed tokens (every
        time under a ``max_tokens`` cap). Other later forwards (a question after a context) are kept whole."""
        if not layer.compressed and layer.cumulative_length == query_length:
            return True  # the prompt, even of one token: what comes after it is decoding, as in a batch
        if query_length <= 1:
            return False
        if not layer.compressed or generate_prefill_chunk() is not None:
            return True
        chunk = self.policy.prefill_chunk_size
        if chunk is not None and self.policy.max_tokens is not None:
            return True  # a cap holds after every chunk, the last shorter one too
        return chunk is not None and layer.suffix_length - self.policy.window >= chunk

    def _evict_deferred(self) -> None:
        deferred, self.state.deferred = self.state.deferred, {}
        self._evict(deferred)

    def _evict(self, steps: dict[int, tuple[Region, torch.Tensor | None]]) -> None:
        """Evict the regions of ``steps`` (layer -> region, masked scores or None); one allocator call."""
        scores: torch.Tensor | None
        scored = [idx for idx, (_, scores) in steps.items() if scores is not None]
        counts = {}
        if scored:
            region = steps[scored[0]][0]
            scores = torch.stack([cast(torch.Tensor, steps[idx][1]) for idx in scored])
            shard = self.layout.head_shard
            if shard is not None:  # allocate over every head of the model, keep this rank's block
                scores = shard.gather(scores, dim=2)
            cap, slots = token_cap(
                self.policy, self.layers, self.layout.full_layers, shard, region, scored, scores.shape[2]
            )
            ratio, self.state.cap_ratio = row_ratios(self.policy, region, cap, slots, self.state.cap_ratio)
            request = AllocationRequest(
                scores=scores,
                n_evictable=region.n_evictable.cpu(),
                ratio=ratio,
                layers=tuple(scored),
                num_layers=self.num_layers or max(scored) + 1,
                min_keep=self.policy.min_keep,
            )
            allocated = self.policy.allocator(request)
            # a row at ratio 0 (a prompt that fits its bound) keeps every token, whatever the allocator
            # (a threshold read at a ratio below its table's smallest would still cut)
            fits = request.ratio <= 0
            if bool(fits.any()):
                allocated = allocated.clone()
                allocated[:, fits.to(allocated.device)] = (
                    request.n_evictable[fits].to(allocated).view(1, -1, 1)
                )
            if cap is not None:  # a hard bound: whatever the allocator or profile asked for
                allocated = trim_counts(allocated, cap)
            if shard is not None:
                allocated = allocated[:, :, shard.heads(request.num_heads)]
            counts = dict(zip(scored, allocated))
        for idx, (region, scores) in steps.items():
            layer = cast(LUKVLayer, self.layers[idx])  # steps come from full-attention layers
            if scores is None:  # nothing to rank: keep every real token (none evictable, or ratio 0)
                b, h = layer.batch_size, layer.num_heads
                keep = (region.sinks | region.evictable).unsqueeze(1).expand(b, h, region.length)
            else:
                keep = keep_mask(region, scores, counts[idx])
            layer.evict(keep, scores if keeps_scores(self.policy) else None)

    # ------------------------------------------------------------------ prefill, and reconstruction scorers
    @torch.no_grad()
    def prefill(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        tokenizer: Any = None,
        repeat_prompt: RepeatPrompt | None = None,
        **model_kwargs: Any,
    ) -> Any:
        """Run the context ``input_ids [B, T]`` (left-padded with ``attention_mask``) through ``model`` into
        this cache and compress it; returns the model's output. Then generate from the cache as usual
        (``model.generate(torch.cat([input_ids, question_ids], 1), past_key_values=cache)``).

        Any scorer works; a reconstruction scorer (``kvzip``) needs it: after the context's forward the
        model repeats the context chunk by chunk (prompt from ``tokenizer``'s chat template, or
        ``repeat_prompt``), the scores come from those passes, and only then is every layer compressed.
        The full context KV is alive until then, and the passes cost about 2x the prefill.

        >>> cache = LUKVCache(0.8, scorer="kvzip", allocator="global")
        >>> out = cache.prefill(model, inputs["input_ids"], repeat_prompt=RepeatPrompt((5, 6), (7,), (8,)))
        >>> cache.get_seq_length(), int(cache.stored_tokens()[:, 0].sum()) < 2 * 2 * 48
        (48, True)
        """
        return prefill_context(
            self,
            model,
            input_ids,
            attention_mask,
            tokenizer=tokenizer,
            repeat_prompt=repeat_prompt,
            **model_kwargs,
        )

    @contextlib.contextmanager
    def holding(self) -> Iterator[LUKVCache]:
        """Within this block, multi-token forwards fill the cache without compressing it; then rank the
        held tokens with your own scores (:meth:`evict_held`). ``prefill`` uses it for KVzip."""
        with in_phase(self, "hold"):
            yield self

    def evict_held(self, scores: Mapping[int, torch.Tensor]) -> None:
        """Compress what :meth:`holding` kept, ranking each layer's tokens by ``scores[layer]`` (fp32
        ``[B, H_kv, T]`` over the layer's dense tokens, higher = keep), with this cache's allocator."""
        held, self.state.held = self.state.held, {}
        steps = {}
        for idx, region in held.items():
            layer = cast(LUKVLayer, self.layers[idx])  # only a LUKVLayer holds
            raw = scores[idx]
            expected = (layer.batch_size, layer.num_heads, layer.suffix_length)
            if not isinstance(raw, torch.Tensor) or tuple(raw.shape) != expected:
                got = tuple(raw.shape) if isinstance(raw, torch.Tensor) else type(raw).__name__
                raise ConfigurationError(
                    f"Scores for layer {idx} must have shape {list(expected)}, got {got}."
                )
            assert layer.suffix_keys is not None  # it held a forward
            raw = raw.float().to(layer.suffix_keys.device)
            if self.prefill_scores is not None:
                self.prefill_scores[idx] = raw
            evictable = region.length and bool(region.n_evictable.any())
            steps[idx] = (region, masked_scores(raw, region) if evictable else None)
        self._evict(steps)

    # ------------------------------------------------------------------ the model

    @property
    def head_shard(self) -> HeadShard | None:
        """Under tensor parallelism, this rank's block of KV heads (``head_shard.heads(num_kv_heads)`` is
        the slice of the model's heads that :meth:`stored_tokens` and :attr:`prefill_scores` cover);
        ``None`` when the cache holds every head. Known after the first forward.

        >>> LUKVCache(0.5).head_shard is None
        True
        """
        return self.layout.head_shard

    def activate_past_recording(self):
        # generate() calls this before assisted decoding, whose first forward is the prompt plus draft tokens
        if self.get_seq_length() > 0:
            raise ConfigurationError(
                "Assisted decoding cannot start from a filled cache: transformers' assisted generation feeds the "
                "whole prompt again (even into a DynamicCache), which would store it a second time, "
                "uncompressed, after the compressed copy. Generate from this cache without assistant_model=, "
                "or pass a fresh LUKVCache to the assisted generate (it then compresses the prompt itself)."
            )
        if self.evicts:
            warnings.warn(
                "LUKVCache with assisted decoding: the first forward holds the prompt and the assistant's draft "
                "tokens, so the drafts take part in the eviction (rejected ones are cropped out afterwards). "
                "The tokens can differ from plain greedy decoding with the same cache settings.",
                stacklevel=2,
            )
        self.layout.record_past = True
        super().activate_past_recording()

    def reset(self) -> None:
        """Empty the cache for a new prompt, also after a forward that was interrupted (Ctrl-C, out of
        memory) inside a layer: nothing of that forward is left pending."""
        super().reset()
        if self.state.awaiting is not None:
            discard_attention()
        self.state = ForwardState()
        if self.prefill_scores is not None:
            self.prefill_scores = {}
        self.layout.reset_windows(self)

    # ------------------------------------------------------------------ reporting
    @property
    def is_compressed(self) -> bool:
        """Whether any layer holds a compressed store."""
        return any(isinstance(layer, LUKVLayer) and layer.compressed for layer in self.layers)

    def kept_positions(self, layer_idx: int) -> torch.Tensor:
        """bool ``[batch, kv_heads, T]``: which logical positions (absolute columns of the input, ``T`` so
        far, padding included) each (row, KV head) of layer ``layer_idx`` still holds, in its ragged store
        or its dense suffix. Padding is never held by a compressed layer; transformers' own layers (e.g. a
        sliding window shorter than the prompt) report their last columns, as they hold them.

        >>> cache = LUKVCache(ratio=0.0)
        >>> _ = cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
        >>> cache.kept_positions(0).int().tolist()
        [[[1, 1, 1], [1, 1, 1]]]
        """
        layer = self.layers[layer_idx]
        if not getattr(layer, "is_initialized", False):
            return torch.zeros(0, 0, 0, dtype=torch.bool)
        if isinstance(layer, LUKVLayer):
            kept = torch.zeros(layer.batch_size, layer.num_heads, layer.cumulative_length, dtype=torch.bool)
            for row in range(layer.batch_size):
                for head in range(layer.num_heads):
                    kept[row, head, layer.head_tokens(row, head)[0].cpu()] = True
            return kept
        stock = cast("DynamicLayer", layer)  # transformers' own attention layer
        assert stock.keys is not None  # initialized
        b, h, s, _ = stock.keys.shape
        kept = torch.zeros(b, h, max(s, stock.get_seq_length()), dtype=torch.bool)
        kept[:, :, kept.shape[-1] - s :] = True
        return kept

    def fork(self) -> LUKVCache:
        """A copy for one question that shares this cache's compressed stores: they are read-only (every
        eviction, fold, crop or row selection builds a new store), so a copy holds only what it appends
        (the dense suffix and what a question adds) and its own bookkeeping. ``copy.deepcopy`` copies the
        stores too. Each fork's :meth:`memory_bytes` counts the shared stores as its own.

        >>> question_cache = cache.fork()  # doctest: +SKIP
        """
        memo = {
            id(layer.store): layer.store
            for layer in cast("list[Any]", self.layers)  # any layer with a store
            if getattr(layer, "store", None) is not None
        }
        return copy.deepcopy(self, memo)

    def save(self, path, *, model: Any = None):
        """Write this filled cache to ``path`` as one safetensors file (:func:`lukv_cache.save_cache`, whose
        format and checks docs/saved.md describes); returns the path.

        >>> cache.save("context.safetensors")  # doctest: +SKIP
        """
        from .savefile import write_context

        return write_context(self, Path(path), model)

    @classmethod
    def load(cls, path, model: Any, **kwargs: Any) -> LUKVCache:
        """The cache :meth:`save` wrote to ``path``, checked against ``model`` and ready to continue
        (:func:`lukv_cache.load_cache`; ``kwargs``: its ``device``, ``scorer``, ``allocator``,
        ``allow_other_model_id``).

        >>> cache = LUKVCache.load("context.safetensors", model)  # doctest: +SKIP
        """
        from .savefile import read_context

        return read_context(LUKVCache, path, model, **kwargs)

    def memory_bytes(self) -> int:
        """Bytes held by every tensor of the cache (ragged stores, positions, offsets, suffix buffers,
        stock sliding layers)."""
        return kv_cache_bytes(self)

    def stored_tokens(self) -> torch.Tensor:
        """int64 ``[layers, batch, kv_heads]``: tokens stored per (layer, row, KV head), one row per layer that
        holds keys (layers without per-token KV, such as linear-attention or SSM layers, have none); when
        layers have different KV-head counts, a layer's missing heads count 0."""
        rows = []
        for layer in self.layers:
            if isinstance(layer, LUKVLayer):
                if layer.is_initialized:
                    rows.append(layer.stored_counts())
                continue
            keys = _stock_keys(layer)
            if keys is not None:
                b, h, s, _ = keys.shape
                rows.append(torch.full((b, h), s, dtype=torch.long))
        if not rows:
            return torch.zeros(0, 0, 0, dtype=torch.long)
        heads = max(row.shape[1] for row in rows)
        return torch.stack([torch.nn.functional.pad(row, (0, heads - row.shape[1])) for row in rows])

    def __repr__(self) -> str:
        return (
            f"LUKVCache(ratio={self.ratio}, scorer={self.scorer.name!r}, allocator={self.allocator_name!r}, "
            f"sink={self.sink}, window={self.window}, layers={len(self.layers)})"
        )
