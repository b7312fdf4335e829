"""LUKVCache: a DynamicCache that evicts per (layer, KV head) right after each layer's prefill."""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from ..attention.calls import AttentionCall, announce_attention, discard_attention
from ..errors import ConfigurationError
from ..scorers import Scorer
from ..scorers.kvzip import RepeatPrompt
from .compressor import Compressor
from .hybrid import HybridRouting
from .layer import FOLD_AT, LUKVLayer, select_rows
from .layout import Layout
from .parallel import HeadShard, mesh_shard
from .policy import SINK, build_policy, check_flag, policy_property
from .prefill import prefill_context, score_round
from .pretrained import from_pretrained as _from_pretrained
from .report import CacheReport
from .report import kv_cache_bytes as kv_cache_bytes  # re-exported: it lived here
from .state import ForwardState, Phase, in_phase

if TYPE_CHECKING:
    from ..attention.calls import WholeStoreView
    from ..profiles import Profile


class LUKVCache(HybridRouting, CacheReport):
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
        keep_scores: keep each layer's prefill scores (fp32 ``[B, H_kv, T]``) in :attr:`prefill_scores`; the
            batch operations (``reorder_cache``, ``batch_repeat_interleave``, ``batch_select_indices``) move them
            with their rows.
        decode_max_tokens: bound the whole generation, not just the prompt: every ``fold_interval`` tokens
            after the prompt, the budgets are applied again to everything the cache holds, so that each row
            keeps at most this many tokens per (full-attention layer, KV head) on average (sinks and window
            included), the allocator's budgets read at the ratio that total implies. Without ``ratio`` or
            ``max_tokens`` it bounds the prompt too (``max_tokens`` is this). Needs a scorer that decodes
            (not ``kvzip``). Off by default.
        fold_interval: the dense suffix of decoded tokens is folded into the ragged store every this many
            tokens (default 256), and with ``decode_max_tokens`` evicted there.
        kv_bits: store the kept keys and values in 8 or 4 bits (per token, groups of 32 channels with a
            2-byte scale and zero each, bf16 or an fp16 model's fp16; :mod:`lukv_cache.cache.quant`) instead
            of the model's dtype; the dense suffix (window, new tokens) stays at full precision until it
            folds. Scores are computed before quantization, so the prompt's eviction is the same for every
            ``kv_bits``. A cache that evicts nothing (``ratio=0``) still quantizes: its logits are no longer
            the full cache's (on a tiny fp32 model about 1e-3 off at 8 bits, 1e-2 at 4). Default ``None``.
        decode_window: with ``decode_max_tokens``, the most recent tokens each head keeps at every fold
            (part of the bound). Default: a quarter of ``decode_max_tokens`` (at least ``window``); recent
            tokens matter most to the next ones, and a quarter measured best for kvzap and keydiff
            (``benchmarks/results/decode_window_tuning/``).
        sliding: what a sliding-window layer (Gemma-2/3, Mistral, ...) does with a prompt longer than its
            window. ``"compress"`` (the default with ``ratio``): the layer drops what is older than its
            window, as transformers' own sliding layer does, and ``ratio`` removes that fraction of what is
            left too (allocated apart from the full-attention layers, which hold more tokens), so ``ratio``
            counts every layer's entries. ``"keep"`` (the default with ``max_tokens`` or
            ``decode_max_tokens``, which do not combine with ``"compress"`` yet): transformers' sliding layer
            holds the window whole and ``ratio`` removes entries of the full-attention layers only, so the
            cache saves less than ``ratio`` says. On Gemma-3-270M, at equal bytes ``"compress"`` kept far more
            of the text (``docs/benchmarks.md``). A prompt that fits the window is compressed like a full
            layer's either way.
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
        sink: int = SINK,
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
        sliding: str | None = None,
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
            sliding=sliding,
        )
        super().__init__()
        self.layer_class_to_replicate = LUKVLayer  # until the layout is known (config=, or the model's)
        self.profile: Profile | None = None  # the Profile the budgets come from (set by from_pretrained)
        self.layout = Layout(None if device_mesh is None else mesh_shard(device_mesh))
        self.prefill_scores: dict[int, torch.Tensor] | None = (
            {} if check_flag("keep_scores", keep_scores) else None
        )
        self.state = ForwardState()  # what a forward leaves pending: reset() replaces it whole
        if config is not None:
            self.layout.set_layout(self, config)
        self.compressor = Compressor(self)  # owns compression: the cache forwards to it

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
    sliding = policy_property(
        "sliding",
        "What a sliding-window layer does with a prompt longer than its window ('keep' or 'compress').",
    )

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

    # ------------------------------------------------------------------ the forward
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self.layout.undecided:
            self.layout.decide_sliding(self, key_states.shape[-2])
        self.compressor.on_update(layer_idx, key_states)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        if isinstance(layer, LUKVLayer) and not self.state.unrouted:
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
                    on_other_keys=functools.partial(self._keys_changed, layer_idx),
                )
            )
        return keys, values

    def _keys_changed(self, layer_idx: int) -> None:
        if self.layout.unseat_sliding(self, layer_idx):  # transformers' own sliding layer holds it now
            self.state.awaiting = None
            return
        self.layout.other_keys = True

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
        """The layer's attention ran (see :class:`~lukv_cache.attention.AttentionCall`): compress it
        (:meth:`Compressor.on_attention <lukv_cache.cache.compressor.Compressor.on_attention>`), or hand a
        sliding-window layer to the stock sliding layer."""
        self.state.awaiting = None
        idx = call.layer_idx
        layer = cast(LUKVLayer, self.layers[idx])  # only a LUKVLayer announces a call
        if idx not in self.state.readers:
            self.state.readers[idx] = weakref.ref(module)
        if self.state.phase is Phase.RECONSTRUCT:
            score_round(self, idx, module, query, scaling, softcap)
            return
        config = getattr(module, "config", None)
        if self.layer_class_to_replicate is not None and hasattr(config, "get_text_config"):
            self.layout.adopt(self, config, query.shape[2])  # built without config=: the layout, learned now
            if not isinstance(self.layers[idx], LUKVLayer):
                return
            layer = cast(LUKVLayer, self.layers[idx])
        self.layout.learn_model(self, config)
        if sliding_window is not None and layer.sliding_window is None and not layer.compressed:
            self.layers[idx] = layer.to_sliding(sliding_window, record_past=self.layout.record_past)
            return
        self.layout.learn_heads(layer, module)
        self.compressor.on_attention(idx, layer, module, query, attention_mask)

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
        with in_phase(self, Phase.HOLD):
            yield self

    def evict_held(self, scores: Mapping[int, torch.Tensor]) -> None:
        """Compress what :meth:`holding` kept, ranking each layer's tokens by ``scores[layer]`` (fp32
        ``[B, H_kv, T]`` over the layer's dense tokens, higher = keep), with this cache's allocator."""
        self.compressor.evict_held(scores)

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
        self.layout.reset_sliding(self)

    # ------------------------------------------------------------------ batch rows: the layers', then the scores'
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch rows (beam search): every layer's, and the kept :attr:`prefill_scores`."""
        super().reorder_cache(beam_idx)
        self._score_rows(lambda batch: beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row ``repeats`` times: every layer's, and the kept :attr:`prefill_scores`."""
        super().batch_repeat_interleave(repeats)
        self._score_rows(lambda batch: torch.arange(batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices) -> None:
        """Keep the batch rows ``indices`` selects (see :meth:`LUKVLayer.batch_select_indices`): every
        layer's, and the kept :attr:`prefill_scores`."""
        super().batch_select_indices(indices)
        self._score_rows(lambda batch: select_rows(indices, batch))

    def _score_rows(self, rows: Callable[[int], torch.Tensor]) -> None:
        # prefill_scores [B, H_kv, T] per layer: the same row operation as the layers (rows(B) -> row indices)
        if self.prefill_scores:
            self.prefill_scores = {
                idx: scores.index_select(0, rows(scores.shape[0]).to(scores.device))
                for idx, scores in self.prefill_scores.items()
            }

    # ------------------------------------------------------------------ copies, files (reporting: report.py)
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
        from .savefile import LoadOptions, read_context

        return read_context(cls, path, model, LoadOptions(**kwargs))

    def __repr__(self) -> str:
        return (
            f"LUKVCache(ratio={self.ratio}, scorer={self.scorer.name!r}, allocator={self.allocator_name!r}, "
            f"sink={self.sink}, window={self.window}, layers={len(self.layers)})"
        )
