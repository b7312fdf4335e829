"""LUKVCache: a DynamicCache that evicts per (layer, KV head) right after each layer's prefill."""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch

from ..attention.calls import AttentionCall
from ..errors import ConfigurationError
from ..integration import announce_attention
from ..scorers.kvzip import RepeatPrompt
from .compression.compressor import Compressor
from .compression.forward_state import ForwardState, Phase
from .compression.prefill import prefill_context, score_round
from .layers.hybrid import HybridRouting
from .layers.layout import Layout
from .layers.parallel import HeadShard, mesh_shard
from .options.docs import options_args
from .options.memory import MemoryChoice
from .options.policy import CompressionPolicy, check_bits_fit
from .options.spec import option_signature
from .options.surface import ChosenBits, add_option_properties
from .options.values import check_flag
from .pretrained import from_pretrained as _from_pretrained
from .storage.layer import LUKVLayer
from .storage.report import CacheReport
from .storage.rows import select_rows

if TYPE_CHECKING:
    from ..attention.calls import WholeStoreView
    from ..profiles import Profile


class LUKVCache(HybridRouting, CacheReport):
    """KV cache with per-head eviction after prefill, stored ragged so the memory is really freed.

    The compression options are the fields of :attr:`policy_class`
    (:class:`~lukv_cache.cache.options.policy.CompressionPolicy`), each declared there once with its default, doc and
    check, and listed first below; ``ratio``, ``scorer`` and ``allocator`` are also taken by position, and
    ``cache.<option>`` reads the built :attr:`policy`. docs/usage.md has them as a table.

    Args:
        config: the model config; lets sliding-window layers use the stock sliding layer from the start.
        keep_scores: keep each layer's prefill scores (fp32 ``[B, H_kv, T]``) in :attr:`prefill_scores`; the
            batch operations (``reorder_cache``, ``batch_repeat_interleave``, ``batch_select_indices``) move them
            with their rows.
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

    policy_class: ClassVar[type[CompressionPolicy]] = CompressionPolicy  # its fields are the options

    def __init__(
        self,
        *args: Any,  # ratio, scorer, allocator (the policy's positional options)
        config: Any = None,
        keep_scores: bool = False,
        device_mesh: Any = None,
        **options: Any,  # the other fields of policy_class
    ):
        policy_class = self.policy_class
        self.policy = policy_class.build(**policy_class.bind(type(self).__name__, args, options))
        super().__init__()
        self.layer_class_to_replicate = LUKVLayer  # until the layout is known (config=, or the model's)
        self.profile: Profile | None = None  # the Profile the budgets come from (set by from_pretrained)
        self.layout = Layout(None if device_mesh is None else mesh_shard(device_mesh))
        self.prefill_scores: dict[int, torch.Tensor] | None = (
            {} if check_flag("keep_scores", keep_scores) else None
        )
        if config is not None:
            check_bits_fit(self.policy.kv_bits, config)  # the head dim is known: refused now
            self.layout.set_layout(self, config)
        self.compressor = Compressor(
            self
        )  # owns compression and the forward's state: the cache forwards to it
        self._refeed_check = False  # activate_past_recording() found the cache filled (see _check_refeed)

    # the policy, read-only: cache.ratio, cache.scorer, ... (one OptionProperty per field, added below)
    kv_bits = ChosenBits()

    @property
    def state(self) -> ForwardState:
        """What a forward leaves pending (the compressor's, which drives the forwards: read it anew each
        time, ``reset`` replaces it whole; nothing but the compressor writes it)."""
        return self.compressor.state

    # ------------------------------------------------------------------ the layers: the cache alone writes them
    def replace_layer(self, idx: int, layer: Any) -> None:
        """Put ``layer`` at index ``idx``: what the layout decides (a sliding layer handed to transformers'
        own, a layer built again), a saved context's layer, a stock layer a reconstruction pass restores."""
        self.layers[idx] = layer

    def lay_out(self, layers: list[Any]) -> None:
        """Take ``layers`` as the cache's layers, one per model layer: the layout is known, ``update()``
        grows no layer any more."""
        self.layers = layers
        self.layer_class_to_replicate = None

    def grow_with(self, factory: Any) -> None:
        """While the layout is unknown, ``update()`` grows the layers it names with ``factory``."""
        if self.layer_class_to_replicate is not None:
            self.layer_class_to_replicate = factory

    @property
    def memory_choice(self) -> MemoryChoice | None:
        """Under ``memory=`` / ``max_bytes=``, what the budget chose at the prompt's compression (the
        bits, the budget in bytes per row, the fraction of tokens each precision could keep, and whether
        the profile's table or the fallback rule chose); ``None`` before it, after :meth:`reset`, or
        without a budget."""
        return self.compressor.memory_choice

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass gets the properties and the signature of its ``policy_class``'s options."""
        super().__init_subclass__(**kwargs)
        add_option_properties(cls, cls.policy_class)
        cls.__signature__ = _signature(cls) if "__init__" not in cls.__dict__ else None  # type: ignore[attr-defined]

    @property
    def num_layers(self) -> int | None:
        """The model's layer count (from its config), ``None`` until known."""
        return self.layout.num_layers

    @num_layers.setter
    def num_layers(self, value: int | None) -> None:
        self.layout.set_num_layers(value)

    @property
    def evicts(self) -> bool:
        """Whether this cache removes anything (a ratio above 0, or a token budget)."""
        policy = self.policy
        return (
            policy.ratio > 0
            or policy.max_tokens is not None
            or policy.decode_max_tokens is not None
            or (policy.in_bytes and not policy.keeps_whole)
        )

    @property
    def allocator_name(self) -> str:
        return self.policy.allocator.name

    # ------------------------------------------------------------------ construction from a profile
    from_pretrained: classmethod[LUKVCache, ..., LUKVCache] = classmethod(_from_pretrained)

    # ------------------------------------------------------------------ the forward
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == 0 and self._refeed_check:
            self._check_refeed(key_states.shape[-2])
        if self.layout.undecided:
            self.layout.decide_sliding(self, key_states.shape[-2])
        self.compressor.on_update(layer_idx, key_states)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        if isinstance(layer, LUKVLayer) and not self.state.unrouted:
            reader = self.compressor.awaits(layer_idx)
            announce_attention(
                AttentionCall(
                    layer_idx,
                    keys,
                    values,
                    # a quantized store's PackedRows rows are read only through dense() or the codes kernel;
                    # rows appended in place since it was built come as a TailedStore
                    cast("WholeStoreView | None", layer.attended_store()),
                    self._after_attention,
                    module=reader,
                    on_other_keys=functools.partial(self._keys_changed, layer_idx),
                    on_unservable=functools.partial(self.compressor.refuse_unservable, layer_idx),
                )
            )
        return keys, values

    def _keys_changed(self, layer_idx: int) -> None:
        if self.layout.unseat_sliding(self, layer_idx):  # transformers' own sliding layer holds it now
            self.compressor.stop_awaiting()
            return
        self.layout.saw_other_keys()

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
        (:meth:`Compressor.on_attention <lukv_cache.cache.compression.compressor.Compressor.on_attention>`), or hand a
        sliding-window layer to the stock sliding layer."""
        idx = call.layer_idx
        self.compressor.attended(idx, module)
        layer = cast(LUKVLayer, self.layers[idx])  # only a LUKVLayer announces a call
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
            self.replace_layer(idx, layer.to_sliding(sliding_window, record_past=self.layout.record_past))
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
        with self.compressor.in_phase(Phase.HOLD):
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

    def activate_past_recording(self, *args: Any, **kwargs: Any) -> None:
        """Let the layers roll back rejected drafts (assisted and prompt-lookup decoding call this before their
        first forward, which holds the prompt and the first draft tokens: the drafts take part in the prompt's
        eviction, rejected ones are cropped out after). transformers 5.25 passes ``recurrent_states_to_keep=``
        (for linear-attention states), and may also call it after a prefill (its deferred stop check)."""
        # a filled cache: assisted generation feeds the whole prompt again (into a DynamicCache too), which
        # would store it a second time; refused at that forward, before anything is stored. A call after a
        # prefill is followed by one-token decoding steps, which disarm the check.
        self._refeed_check = self.get_seq_length() > 0
        if not self._refeed_check and self.evicts:
            warnings.warn(
                "LUKVCache with assisted decoding: the first forward holds the prompt and the assistant's draft "
                "tokens, so the drafts take part in the eviction (rejected ones are cropped out afterwards). "
                "The tokens can differ from plain greedy decoding with the same cache settings.",
                stacklevel=2,
            )
        self.layout.record_the_past()
        super().activate_past_recording(*args, **kwargs)

    def _check_refeed(self, length: int) -> None:
        """The first forward after :meth:`activate_past_recording` on a filled cache: a multi-token one is
        assisted generation feeding the whole prompt again."""
        self._refeed_check = False
        if length > 1:
            raise ConfigurationError(
                "Assisted decoding cannot start from a filled cache: transformers' assisted generation feeds the "
                "whole prompt again (even into a DynamicCache), which would store it a second time, "
                "uncompressed, after the compressed copy; the cache is unchanged. Generate from this cache "
                "without assistant_model=, or pass a fresh LUKVCache to the assisted generate (it then "
                "compresses the prompt itself)."
            )

    def reset(self) -> None:
        """Empty the cache for a new prompt, also after a forward that was interrupted (Ctrl-C, out of
        memory) inside a layer: nothing of that forward is left pending."""
        super().reset()
        self._refeed_check = False
        if self.prefill_scores is not None:
            self.prefill_scores = {}
        self.layout.reset_sliding(self)
        self.compressor.reset()  # a fresh forward state (a call still announced is discarded); bits chosen anew

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
        from .saved.file import write_context

        return write_context(self, Path(path), model)

    @classmethod
    def load(cls, path, model: Any, **kwargs: Any) -> LUKVCache:
        """The cache :meth:`save` wrote to ``path``, checked against ``model`` and ready to continue
        (:func:`lukv_cache.load_cache`; ``kwargs``: its ``device``, ``scorer``, ``allocator``,
        ``allow_other_model_id``).

        >>> cache = LUKVCache.load("context.safetensors", model)  # doctest: +SKIP
        """
        from .saved.file import LoadOptions, read_context

        return read_context(cls, path, model, LoadOptions(**kwargs))

    def __repr__(self) -> str:
        policy = self.policy
        return (
            f"LUKVCache(ratio={policy.ratio}, scorer={policy.scorer.name!r}, allocator={self.allocator_name!r}, "
            f"sink={policy.sink}, window={policy.window}, layers={len(self.layers)})"
        )


def _signature(cls: type[LUKVCache]) -> inspect.Signature:
    """``cls(...)``'s signature: its policy's options with their defaults, then the cache's own keywords."""
    options = option_signature(cls.policy_class)
    own = inspect.signature(LUKVCache.__init__).parameters.values()  # (self, *args, config, ..., **options)
    keywords = [
        p for p in own if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in options.parameters
    ]
    return options.replace(parameters=[*options.parameters.values(), *keywords])


add_option_properties(LUKVCache, LUKVCache.policy_class)
LUKVCache.__signature__ = _signature(LUKVCache)  # type: ignore[attr-defined]
# LUKVCache.__init__ as called: (self, ratio, scorer, allocator, *, ...)
LUKVCache.__init__.__signature__ = LUKVCache.__signature__.replace(  # type: ignore[attr-defined]
    parameters=[
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        *LUKVCache.__signature__.parameters.values(),  # type: ignore[attr-defined]
    ]
)


def _with_options(doc: str) -> str:
    """``doc`` with the policy's options as its Args entries (Python 3.13 strips a docstring's indentation:
    the entries take the ``Args:`` line's own, plus four)."""
    found = re.search(r"^( *)Args:\n", doc, re.M)
    if found is None:
        return doc
    return doc[: found.end()] + options_args(indent=len(found.group(1)) + 4) + doc[found.end() :]


LUKVCache.__doc__ = _with_options(LUKVCache.__doc__ or "")
