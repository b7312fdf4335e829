"""What the model's layers mean for a :class:`~lukv_cache.LUKVCache`, learned once per cache: which layers it
compresses (full attention; sliding windows that hold the prompt), which keep transformers' own layers
(linear attention / SSM states, chunked windows, KV-sharing producers, indexed layers), the model's layer
and KV-head counts, and under tensor parallelism the rank's block of KV heads (:class:`Layout`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    get_layer_types_and_kwargs,
)

from ...errors import ConfigurationError, IncompatibleAttentionError
from ..storage.layer import LUKVLayer
from .factory import LayerFactory
from .owner import LaidOutCache
from .parallel import HeadShard, head_shard

_WINDOWED = ("sliding_attention", "chunked_attention", "hybrid_sliding")  # stock layers bounded by a window
_HELD_WHOLE = ("indexed_attention",)  # stock attention layers that keep every token
logger = logging.getLogger("lukv_cache")
# (model type, warning text): the layouts already warned of in this process. The text names the layers and
# windows, never the prompt, so a loop of requests on one model is told once; the prompt's own detail is
# on the cache (Layout.left_alone) and in a DEBUG line
_warned: set[tuple[str, str]] = set()


def bounds_given(policy: Any) -> tuple[str, ...]:
    """The token bounds a cache's ``policy`` was given, for its messages: ``max_tokens`` and/or
    ``decode_max_tokens`` (whose bound is ``max_tokens`` too when nothing else bounds the prompt), or none
    (``ratio`` sets what the cache keeps)."""
    given = []
    if policy.max_tokens is not None and policy.max_tokens != policy.decode_max_tokens:
        given.append("max_tokens")
    if policy.decode_max_tokens is not None:
        given.append("decode_max_tokens")
    return tuple(given)


def _lukv_layer(layer: Any, factory: LayerFactory) -> Any:
    """The layer the cache keeps in place of transformers' ``layer``: a compressed one for full attention
    (alone, or beside a linear-attention state), built by ``factory``; transformers' own for everything
    else."""
    if type(layer) is DynamicLayer:
        return factory()
    if type(layer) is LinearAttentionAndFullAttentionLayer:
        return factory.hybrid(layer.number_of_states)
    return layer


def record_in(layers: list[Any]) -> None:
    """Let ``layers`` roll back (assisted decoding crops rejected drafts), as ``activate_past_recording``
    does for the layers that exist when it is called."""
    for layer in layers:
        if hasattr(layer, "activate_past_recording"):
            layer.activate_past_recording()


def refuse_own_cache(model: Any) -> None:
    """Raise :class:`~lukv_cache.IncompatibleAttentionError` when ``model`` (a loaded transformers model)
    takes a cache class of its own, no transformers cache (xLSTM from transformers 5.24: ``cache:
    xLSTMCache``, whose ``rnn_state`` its forward reads): any cache passed to it fails in the model's code
    (:func:`~lukv_cache._compat.own_cache_class`). Anything else passes."""
    from transformers import PreTrainedModel

    from ..._compat import own_cache_class

    own = own_cache_class(model) if isinstance(model, PreTrainedModel) else None
    if own is not None:
        raise IncompatibleAttentionError(
            f"{type(model).__name__} keeps its state in a cache class of its own ({own}), not a transformers "
            "cache, and reads that class's fields: a LUKVCache (or DynamicCache) passed to it cannot hold its "
            "state, so there is nothing to compress. Generate without passing a cache (no cache= / "
            "past_key_values=): the model creates its own."
        )


class Layout:
    """The cache's layer layout and what it learned of the model. Its methods take the cache
    (:class:`~.owner.LaidOutCache`), decide which layer stands at each index and ask the cache to put it
    there (``replace_layer``, ``lay_out``): the cache alone writes its layers. ``mesh_shard``: the rank's
    place in tensor parallelism, from a ``device_mesh=``."""

    def __init__(self, mesh_shard: HeadShard | None = None):
        self.mesh_shard = mesh_shard
        self.kv_heads: int | None = None  # the model's KV heads per layer (from its config)
        self.query_heads: int | None = None  # and its query heads
        self.head_shard: HeadShard | None = None
        self.heads_checked = False
        self.num_layers: int | None = None
        self.last_full_layer: int | None = None
        self.full_layers: list[int] = []
        self.kv_producers: list[int] = []  # layers whose KV later layers read (KV sharing): kept whole
        self.kv_readers: list[int] = []  # and the layers that read it: they hold nothing of their own
        # sliding layers laid out as LUKVLayers until the first forward decides (its length vs the window):
        # layer -> its sliding_window; whether that forward is still to come; the layout's own full-attention
        # layers
        self.sliding_windows: dict[int, int] = {}
        self.undecided = False
        self.attention_layers: list[int] = []
        self.layout_warning: tuple | None = None  # what the warning, deferred to that decision, names
        self.model_type = ""  # the config's model_type: with the layout, what a warning is said once for
        # what this cache leaves alone for its current prompt (that prompt's length included), None if nothing
        self.left_alone: str | None = None
        self.config_checked = False
        self.record_past = False  # assisted decoding: layers record their past (rejected drafts roll back)
        self.other_keys = False  # a layer's attention received other keys than update() returned (MLA)

    def restore(self, full_layers: list[int], *, other_keys: bool, record_past: bool) -> None:
        """The layout a saved context recorded (its reader checked it): these compressed layers, decided."""
        self.full_layers = sorted(full_layers)
        self.last_full_layer = self.full_layers[-1] if self.full_layers else None
        self.undecided = False
        self.layout_warning = None
        self.other_keys, self.record_past = other_keys, record_past

    def saw_other_keys(self) -> None:
        """A layer's attention received other keys than ``update()`` returned (MLA)."""
        self.other_keys = True

    def record_the_past(self) -> None:
        """Assisted decoding: layers record their past from now on (rejected drafts roll back)."""
        self.record_past = True

    def set_num_layers(self, value: int | None) -> None:
        self.num_layers = value

    def set_layout(self, cache: LaidOutCache, config: Any) -> None:
        """transformers' own layer for every layer the cache does not compress (sliding and chunked windows,
        linear-attention / SSM states, KV-sharing placeholders, ...), a :class:`LUKVLayer` for every
        full-attention one (built with the cache's policy's settings, :class:`~.factory.LayerFactory`); then
        learn what the model's layers mean for eviction."""
        text = config.get_text_config(decoder=True)
        kinds = get_layer_types_and_kwargs(text)[0]
        unknown = sorted(set(kinds) - set(DYNAMIC_LAYER_TYPE_MAPPING))
        if unknown:
            raise IncompatibleAttentionError(
                f"{type(text).__name__} has layers of type {unknown}, which keep state of their own that a "
                "LUKVCache cannot hold (transformers' DynamicCache cannot either); use the cache the model "
                "creates itself (generate without past_key_values)."
            )
        stock = DynamicCache(config=config).layers
        # KV sharing (Gemma-3n, Gemma-4 E-models): a layer whose KV later layers read keeps it whole, since
        # they receive the tensors its update() returned, not what a compressed layer holds. From transformers
        # 5.24 every Gemma-4 marks the last layer of each kind "store" even without sharing (an assistant model
        # reads its KV from shared_kv_states): kept whole too, or assisted decoding would read a partial KV
        modes = getattr(text, "kv_sharing_modes", None) or ()
        self.kv_producers = [i for i, mode in enumerate(modes) if mode == "store"]
        self.kv_readers = [i for i, mode in enumerate(modes) if mode == "reuse"]
        factory = LayerFactory.for_policy(cache.policy)
        cache.lay_out(
            [
                layer if i in self.kv_producers else _lukv_layer(layer, factory)
                for i, layer in enumerate(stock)
            ]
        )
        # sliding-window layers: compressed like full ones when the prompt fits their window (decided at the
        # first forward, decide_sliding); chunked layers share the stock class but not the mask: stock
        self.sliding_windows = {
            i: layer.sliding_window
            for i, (layer, kind) in enumerate(zip(stock, kinds))
            if type(layer) is DynamicSlidingWindowLayer
            and kind == "sliding_attention"
            and i not in self.kv_producers
        }
        self.pend_sliding(cache)
        if self.record_past:  # assisted decoding asked before the layers existed
            record_in(cache.layers)
        self.learn_model(cache, config)

    def adopt(self, cache: LaidOutCache, config: Any, length: int) -> None:
        """A cache built without ``config=`` learns the layout at its first attention call, from the
        attention module's config (what transformers' attention interface hands every attention function),
        during the first forward (``length`` tokens): lay every layer out as :meth:`set_layout` does, and
        move what the layers ``update()`` grew hold (each had its first forward's keys only, uncompressed)
        into the layer that layout gives it. Layers that need the layout before any attention (linear
        attention / SSM states, sparse-attention indexers) cannot be grown: they raise a typed error asking
        for ``config=`` (:class:`~lukv_cache.cache.layers.hybrid.HybridRouting`)."""
        grown = list(cache.layers)
        self.set_layout(cache, config)
        if self.undecided:
            self.decide_sliding(cache, length)
        for i, old in enumerate(grown):
            if not getattr(old, "is_initialized", False):
                continue
            new = cache.layers[i] if i < len(cache.layers) else None
            if type(new) is LUKVLayer and new.sliding_window is None and old.compressed:
                cache.replace_layer(i, old)
            elif isinstance(new, (LUKVLayer, DynamicLayer, DynamicSlidingWindowLayer)) and not old.compressed:
                new.update(old.suffix_keys.clone(), old.suffix_values.clone())
            else:
                raise ConfigurationError(
                    f"Layer {i} filled before this LUKVCache learned the model's layout, and that layout gives it "
                    f"another kind of layer ({type(new).__name__}). Build the cache with config=model.config "
                    "(LUKVCache(..., config=model.config), or LUKVCache.from_pretrained(model, ...))."
                )

    def meet_model(self, cache: LaidOutCache, model: Any, *, strict: bool = False) -> None:
        """The cache is handed ``model`` (``from_pretrained(model)``, ``prefill(model, ...)``): learn the
        layout from its config if the cache does not know it yet; and when the model's forward takes no
        cache at all (it keeps a state of its own, as RWKV does, so the cache would stay empty), warn, or
        with ``strict`` raise a :class:`~lukv_cache.ConfigurationError`. A model whose forward takes a cache
        class of its own, no transformers cache (xLSTM from transformers 5.24), would fail reading that
        class's fields from a LUKVCache: an :class:`~lukv_cache.IncompatibleAttentionError`, before the
        layout."""
        from transformers import PreTrainedModel

        from ..._compat import takes_cache

        refuse_own_cache(model)
        config = getattr(model, "config", None)
        if (
            cache.layer_class_to_replicate is not None
            and not cache.layers
            and hasattr(config, "get_text_config")
        ):
            self.set_layout(cache, config)
        if isinstance(model, PreTrainedModel) and not takes_cache(model):
            message = (
                f"{type(model).__name__} takes no cache (neither cache nor past_key_values: it keeps a state of "
                "its own, as RWKV does): this LUKVCache stays empty and compresses nothing."
            )
            if strict:
                raise ConfigurationError(message)
            warnings.warn(message, stacklevel=3)

    def pend_sliding(self, cache: LaidOutCache) -> None:
        """Sliding layers become LUKVLayers that know their window, until the next first forward decides."""
        factory = LayerFactory.for_policy(cache.policy)
        for i, window in self.sliding_windows.items():
            cache.replace_layer(i, factory(sliding_window=window))
        self.undecided = bool(self.sliding_windows)

    def decide_sliding(self, cache: LaidOutCache, length: int) -> None:
        """The first forward (``length`` tokens, padding included) reached the cache: a sliding layer whose
        window holds it stays a compressed LUKVLayer (exact: transformers' sliding mask, built over the
        logical positions, hides what falls out of the window, and folds drop it); a longer prompt gives
        the layer to transformers' stock sliding layer, as a DynamicCache holds it, unless the policy's
        ``sliding`` is ``"compress"``: then it stays a LUKVLayer, which drops what falls out of the window
        at its eviction (:func:`~lukv_cache.cache.compression.region.plan_region`) and at every fold."""
        self.undecided = False
        # a cache that records its past (assisted decoding crops rejected drafts) leaves a long prompt to
        # transformers' sliding layer, which rolls back into what left the window
        compress = cache.policy.sliding == "compress" and not self.record_past
        kept = [i for i, window in self.sliding_windows.items() if compress or length <= window]
        for i, window in self.sliding_windows.items():
            if i not in kept:  # the pending LUKVLayer is empty: an empty stock layer
                cache.replace_layer(i, cache.layers[i].to_sliding(window, record_past=self.record_past))
        self.full_layers = sorted({*self.attention_layers, *kept})
        self.last_full_layer = self.full_layers[-1] if self.full_layers else None
        if self.layout_warning is not None:
            self.warn(cache, *self.layout_warning, kept=kept, length=length)

    def unseat_sliding(self, cache: LaidOutCache, idx: int) -> bool:
        """Sliding layer ``idx``, kept as a LUKVLayer to compress (``sliding="compress"``), is attended over
        other keys than its ``update()`` returned (a latent attention expands them after it, as dots3 does):
        it cannot be compressed, so transformers' own sliding layer takes over what it holds, bounded by its
        window, and it is left alone and said so as under ``"keep"``. False for any other layer."""
        layer = cache.layers[idx]
        if idx not in self.sliding_windows or type(layer) is not LUKVLayer or layer.compressed:
            return False
        cache.replace_layer(idx, layer.to_sliding(self.sliding_windows[idx], record_past=self.record_past))
        self.full_layers = [i for i in self.full_layers if i != idx]
        self.last_full_layer = self.full_layers[-1] if self.full_layers else None
        if self.layout_warning is not None:  # the sliding layers still compressed; the prompt's length
            kept = [i for i in self.sliding_windows if type(cache.layers[i]) is LUKVLayer]
            self.warn(cache, *self.layout_warning, kept=kept, length=layer.cumulative_length)
        return True

    def reset_sliding(self, cache: LaidOutCache) -> None:
        """A new prompt: its length decides again what the sliding layers become."""
        if not self.sliding_windows:
            return
        self.pend_sliding(cache)
        if self.record_past:
            record_in([cache.layers[i] for i in self.sliding_windows])
        self.full_layers = list(self.attention_layers)
        self.last_full_layer = self.full_layers[-1] if self.full_layers else None

    def learn_model(self, cache: LaidOutCache, config: Any) -> None:
        """Once per cache: the model's layers (count, last full-attention one) and the profile's fit."""
        if self.config_checked or config is None or not hasattr(config, "get_text_config"):
            return
        text = config.get_text_config(decoder=True)
        self.num_layers = text.num_hidden_layers
        self.model_type = str(getattr(text, "model_type", "") or type(text).__name__)
        layer_types = get_layer_types_and_kwargs(text)[0]
        producers = self.kv_producers
        full = [
            i
            for i, kind in enumerate(layer_types)
            if kind in ("full_attention", "hybrid") and i not in producers
        ]
        self.attention_layers = full
        self.full_layers = full
        self.last_full_layer = full[-1] if full else None
        heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
        self.kv_heads = heads if isinstance(heads, int) else None
        queries = getattr(text, "num_attention_heads", None)
        self.query_heads = queries if isinstance(queries, int) else self.kv_heads
        # layers without per-token KV (linear attention, SSM, conv, KV-sharing placeholders) hold nothing to evict
        windowed = [i for i, kind in enumerate(layer_types) if kind in _WINDOWED]
        whole = [i for i, kind in enumerate(layer_types) if kind in _HELD_WHOLE]
        policy = cache.policy
        compressible = full or (self.sliding_windows and policy.sliding == "compress")
        if policy.in_bytes and not policy.keeps_whole and not compressible:
            budget = "memory=" if policy.memory is not None else "max_bytes="
            shared = f"; layers {producers} keep their KV whole for later layers to read" if producers else ""
            raise ConfigurationError(
                f"{budget} cannot hold on this model: it has no layer this cache compresses (layer types "
                f"{sorted(set(layer_types))}{shared}), so what it holds is what a DynamicCache holds. Generate "
                "without a budget (memory=1.0 is the whole cache), or on a model with full-attention or "
                "sliding-window layers of its own."
            )
        if self.undecided:  # what the sliding layers become is known at the first forward: warn then
            self.layout_warning = (layer_types, full, windowed, whole, producers)
        else:
            self.warn(cache, layer_types, full, windowed, whole, producers)
        if cache.profile is not None:
            cache.profile.validate_for(config)
        self.config_checked = True

    def warn(
        self,
        cache: LaidOutCache,
        layer_types: list[str],
        full: list[int],
        windowed: list[int],
        whole: list[int],
        producers: list[int],
        *,
        kept: Sequence[int] = (),
        length: int | None = None,
    ) -> None:
        """Say which layers this cache leaves alone, naming those it compresses: ``left_alone`` (and a DEBUG
        line on the ``lukv_cache`` logger) for this prompt, its length included; a UserWarning, when the
        cache evicts, once per process for a model type and layout (its text names layers and windows,
        never the prompt, so a loop of requests is warned once)."""
        stock = [i for i in windowed if i not in kept]
        full = sorted({*full, *kept})
        if not (stock or whole or producers or not full):
            self.left_alone = None
            return
        sizes = (
            []
            if length is None
            else sorted({self.sliding_windows[i] for i in stock if i in self.sliding_windows})
        )
        compress = cache.policy.sliding == "compress"
        bounds = bounds_given(cache.policy)
        text = self.left_alone_text(
            layer_types, stock, whole, producers, full, kept, sizes, "", compress, bounds
        )
        self.left_alone = self.left_alone_text(
            layer_types, stock, whole, producers, full, kept, sizes, f" of {length} tokens", compress, bounds
        )
        logger.debug("%s", self.left_alone)
        if cache.evicts and (self.model_type, text) not in _warned:
            _warned.add((self.model_type, text))
            warnings.warn(text, stacklevel=4)

    def left_alone_text(
        self,
        layer_types: list[str],
        stock: list[int],
        whole: list[int],
        producers: list[int],
        full: list[int],
        kept: Sequence[int],
        sizes: list[int],
        prompt: str,
        compress: bool = False,
        bounds: Sequence[str] = (),
    ) -> str:
        """What :meth:`warn` says; ``prompt`` names the prompt's length in the account of one prompt.
        ``compress``: the policy's ``sliding`` is ``"compress"``, so a sliding layer is left alone only while
        the cache records its past, or for its attention's keys (:meth:`unseat_sliding`). ``bounds``: the
        token bounds the cache was given (:func:`bounds_given`), named instead of ``ratio``."""
        parts = []
        if stock:
            kinds = sorted({layer_types[i] for i in stock})
            why = ""
            if compress and not self.record_past:
                why = " (their attention reads keys expanded after the cache's update(), which it cannot compress)"
            elif sizes:
                read = "" if prompt else ": cache.layout.left_alone gives its length"
                more = (
                    "the cache records their past for assisted decoding, which transformers' layer rolls back"
                    if compress
                    else "with ratio= sliding='compress' compresses them whatever the prompt"
                )
                why = (
                    f" (the prompt{prompt}, padding included, is longer than their window of "
                    f"{', '.join(map(str, sizes))}{read}; a prompt that fits is compressed in them; {more})"
                )
            parts.append(
                f"layers {stock} ({', '.join(kinds)}) keep transformers' stock layers, bounded by their window{why}"
            )
        if whole:
            kinds = sorted({layer_types[i] for i in whole})
            parts.append(
                f"layers {whole} ({', '.join(kinds)}: sparse attention whose indexer keys are kept beside the KV) "
                "keep transformers' stock layers, which hold every token: their memory is not bounded"
            )
        if producers:
            parts.append(
                f"layers {producers} are read again by later layers (KV sharing) and keep every token, uncompressed"
            )
        if not parts:
            kinds = sorted(set(layer_types))
            parts.append(f"no layer is a full-attention one it can compress (layer types {kinds})")
        named = (
            "full-attention layers" if not kept else "layers (full attention, and sliding ones compressed)"
        )
        given = " and ".join(bounds)
        if not full:
            verb = "bounds" if len(bounds) == 1 else "bound"
            tail = f"this cache compresses nothing and {given} {verb} nothing here."
            if not bounds:
                tail = "this cache compresses nothing here."
        else:
            tail = f"eviction and {given or 'ratio'} apply to the {named} {full}."
        which = "every layer" if not full else "some layers"
        return f"LUKVCache leaves {which} of this model alone: {'; '.join(parts)}; {tail}"

    def learn_heads(self, layer: LUKVLayer, module: Any) -> None:
        """Once per cache, at the first full-attention layer: does this rank hold every KV head, or (tensor
        parallelism) which block of them (see :mod:`lukv_cache.cache.layers.parallel`)."""
        if self.heads_checked or not layer.is_initialized:
            return
        self.head_shard = head_shard(layer.num_heads, self.kv_heads, self.mesh_shard, module)
        self.heads_checked = True
