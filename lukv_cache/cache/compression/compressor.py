"""The one object that owns a cache's compression (:class:`Compressor`): built once per cache from its
policy, it builds the cache's compressed layers (:class:`~lukv_cache.cache.layers.factory.LayerFactory`), settles
and checks each forward as it reaches a layer (:meth:`~Compressor.on_update`), compresses a layer once its
attention has run or notes a fold that is due (:meth:`~Compressor.on_attention`), evicts what waits for the
end of a forward (:meth:`~Compressor.flush`), and tells its observers what each step did and how long it
took (:meth:`~Compressor.observe`). The cache forwards to it; it reads the cache only through
:class:`~lukv_cache.cache.compression.contract.CompressedCache`.

It drives the forward, so it owns the forward's state (:attr:`Compressor.state`, a
:class:`~lukv_cache.cache.compression.forward_state.ForwardState`, which the cache reads as ``cache.state``):
no other module assigns its fields (``tests/test_architecture.py``); the helpers it calls return what they
decide (a region, the rows' cap ratio, the held steps) and it writes them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

from ...integration import discard_attention, guard_attention
from ..layers.factory import LayerFactory
from ..options.memory import (
    BITS,
    MemoryChoice,
    choose_bits,
    kept_queries,
    layer_shapes,
    log_choice,
    prefill_scores_bytes,
)
from ..options.policy import CompressionPolicy
from ..storage.layer import LUKVLayer
from .contract import CompressedCache
from .evict import evict, held_steps, score_step, wants_compression
from .fold import fold_due, fold_evict, keeps_scores
from .forward_state import ForwardState, Phase
from .kinds import cache_kinds
from .region import Region, Step, plan_region
from .settle import check_batch, check_routed, check_scorer, check_servable


@dataclass(frozen=True)
class CompressionStep:
    """What one compression step did, as :meth:`Compressor.observe` reports it.

    ``kind``: ``"evict"`` (a prompt's or chunk's eviction, or :meth:`~lukv_cache.LUKVCache.evict_held`'s:
    one allocator call per group of layers) or ``"fold"`` (eviction at fold time, ``decode_max_tokens``);
    ``layers``: the layers it compressed, ascending; ``seconds``: its wall-clock time.
    """

    kind: Literal["evict", "fold"]
    layers: tuple[int, ...]
    seconds: float


class Compressor:
    """Owns the compression of one cache (``cache.compressor``; see the module docstring).

    ``new_layer``: the :class:`~lukv_cache.cache.layers.factory.LayerFactory` every compressed layer of the cache
    is built with (while the layout is unknown, also the cache's ``layer_class_to_replicate``);
    ``observers``: the functions :meth:`observe` added, called after every step (a
    :meth:`~lukv_cache.LUKVCache.fork` copy starts with the same ones, in a list of its own); ``state``:
    what a forward leaves pending (:meth:`reset` replaces it whole).

    >>> from lukv_cache import LUKVCache
    >>> cache = LUKVCache(decode_max_tokens=32, fold_interval=8)
    >>> steps = []
    >>> _ = cache.compressor.observe(steps.append)
    >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=10, do_sample=False)
    >>> [(step.kind, step.layers) for step in steps]  # the prompt layer by layer, then one fold of both
    [('evict', (0,)), ('evict', (1,)), ('fold', (0, 1))]
    """

    def __init__(self, cache: CompressedCache) -> None:
        self.cache = cache
        self.state = ForwardState()  # what a forward leaves pending: reset() replaces it whole
        self.new_layer = LayerFactory.for_policy(cache.policy)
        self.observers: list[Callable[[CompressionStep], Any]] = []
        # under a memory budget: what it chose at the first compression (None before, and after reset),
        # and the precisions it chooses among (a benchmark fixes one to compare them at the same bytes)
        self.memory_choice: MemoryChoice | None = None
        self.precisions: tuple[int | None, ...] = BITS
        # the cache recorded its past (assisted decoding) at the last forward; warned of an unsure prompt
        self.recorded = self.warned_unsure = False
        self.warned_growth = False  # warned that decoding grows past a memory budget (see on_attention)
        cache.grow_with(self.new_layer)  # while the layout is unknown: grown layers are ours too

    @property
    def policy(self) -> CompressionPolicy:
        """The cache's policy (fixed when the cache is built)."""
        return self.cache.policy

    def __deepcopy__(self, memo: dict) -> Compressor:
        # a copy of the cache (fork, deepcopy) gets its own compressor, reporting to the same observers
        new = Compressor.__new__(Compressor)
        memo[id(self)] = new
        new.cache = copy.deepcopy(self.cache, memo)
        new.state = copy.deepcopy(self.state, memo)  # its prompt is complete (ForwardState.__deepcopy__)
        new.new_layer, new.observers = self.new_layer, list(self.observers)
        new.memory_choice, new.precisions = self.memory_choice, self.precisions
        new.recorded, new.warned_unsure = self.recorded, self.warned_unsure
        new.warned_growth = self.warned_growth
        return new

    # ------------------------------------------------------------------ observers
    def observe(self, observer: Callable[[CompressionStep], Any]) -> Callable[[CompressionStep], Any]:
        """Call ``observer`` with a :class:`CompressionStep` after every eviction and fold of this cache
        (and of its :meth:`~lukv_cache.LUKVCache.fork` copies made afterwards); returns ``observer``.
        Remove it from :attr:`observers` to stop."""
        self.observers.append(observer)
        return observer

    def _report(self, kind: Literal["evict", "fold"], layers: Any, started: float) -> None:
        if self.observers:
            step = CompressionStep(kind, tuple(sorted(layers)), time.perf_counter() - started)
            for observer in self.observers:
                observer(step)

    # ------------------------------------------------------------------ the forward, as the cache sees it
    def on_update(self, layer_idx: int, key_states: torch.Tensor) -> None:
        """Layer ``layer_idx`` is about to store ``key_states``: at a forward's first layer, settle what
        the previous forward left (its state, then what it left to evict: :meth:`flush`); then check this
        forward (:func:`~lukv_cache.cache.compression.settle.check_forward`)."""
        if layer_idx == 0:
            self.begin(key_states.shape[-2])
            self.flush()
        cache, state = self.cache, self.state
        check_scorer(cache, key_states, layer_idx)
        awaiting = state.awaiting
        if awaiting is not None:  # the previous layer's announced attention never ran
            state.awaiting = None
            discard_attention()
            check_routed(cache, awaiting)
            # ratio 0, nothing compressed: the model's own attention code reads the dense layers exactly;
            # announce nothing more (no call may wait for an attention function that never comes)
            state.unrouted = True
        check_batch(cache.layers, key_states)

    def begin(self, length: int) -> None:
        """A forward of ``length`` tokens starts (its layer 0): its lengths, whether it is a chunk of the
        prompt (``state.prompt``: the cache holds nothing yet; or it records its past for assisted decoding,
        and did at an earlier forward already), the attention guard, and no call left waiting by an earlier
        forward. (What an earlier forward left to evict, :meth:`flush` evicts next.) A multi-token forward
        before the first decode, while a past recording left on by an earlier prompt is on, is one the cache
        cannot place (a chunk of this prompt, or assisted decoding's verification forward): it is kept
        whole, and the cache warns once."""
        cache, state = self.cache, self.state
        empty = not any(isinstance(each, LUKVLayer) and each.cumulative_length for each in cache.layers)
        recording, recorded = cache.layout.record_past, self.recorded
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
        self.recorded = recording
        if unsure and cache.evicts and self.policy.prefill_chunk_size is None and not self.warned_unsure:
            self.warned_unsure = True
            warnings.warn(
                "LUKVCache: assisted decoding left this cache recording its past, so a multi-token forward "
                "before the first decoded token may be a chunk of generate(prefill_chunk_size=C)'s prompt or "
                "a verification forward of assisted decoding: it is appended uncompressed. To compress every "
                "chunk, build the cache with LUKVCache(..., prefill_chunk_size=C), or use a fresh cache.",
                stacklevel=2,
            )

    def on_attention(
        self,
        idx: int,
        layer: LUKVLayer,
        module: Any,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> None:
        """Full-attention layer ``idx`` attended (``query``: this forward's): compress what it holds, or
        note a fold that is due; a whole-model allocator's layers, and folds, wait for the last
        full-attention layer; in a :meth:`~lukv_cache.LUKVCache.holding` block the layer's region waits for
        :meth:`evict_held`."""
        policy, state = self.policy, self.state
        if policy.keeps_whole:  # memory=1.0: the whole cache, nothing compressed or folded
            return
        last = idx == self.cache.layout.last_full_layer
        if not wants_compression(policy, layer, query.shape[2], state):
            decoding = policy.evicts_at_folds and state.phase is None
            if decoding and fold_due(layer, policy, query):
                state.folding[idx] = (module, attention_mask)
                if last:
                    self.fold()
            elif policy.in_bytes and not policy.evicts_at_folds and not self.warned_growth:
                self.warned_growth = True  # a scorer that cannot rank decoded tokens: nothing can evict them
                warnings.warn(
                    f"LUKVCache(memory= / max_bytes=) with scorer {policy.scorer.name!r}: it cannot rank the "
                    "tokens that arrive after the prompt, so they are kept and the cache grows past its budget "
                    "while decoding (the budget holds after the prompt). Use a scorer that ranks decoded "
                    "tokens (e.g. 'kvzap' or 'keydiff') for a bound over the whole generation.",
                    stacklevel=2,
                )
            return
        if state.phase is Phase.HOLD:  # held layers are read whole by the passes that score them
            state.held[idx] = self.plan(layer, attention_mask)
            return
        layer.drop_out_of_window()  # a sliding layer's prompt older than its window: gone before it waits
        step = score_step(
            self.cache, idx, layer, self.plan(layer, attention_mask), module, query, attention_mask
        )
        if self.defers:
            state.deferred[idx] = step
            if last:
                self.evict_deferred()
        else:
            self.evict({idx: step})

    @property
    def defers(self) -> bool:
        """Whether the prompt's eviction waits for the last compressed layer: a whole-model allocator's, and
        any under a memory budget on a model whose sliding windows it compresses (their bytes share the
        budget with the full-attention layers', whose regions give each row's real tokens: a sliding
        layer's mask hides what left its window)."""
        policy = self.policy
        sliding = policy.in_bytes and policy.sliding == "compress" and bool(self.cache.layout.sliding_windows)
        return policy.defers or sliding

    def flush(self) -> None:
        """Evict what a forward left waiting (it ended before its last full-attention layer): the deferred
        layers of a whole-model allocator, then a fold that was due."""
        if self.state.deferred:
            self.evict_deferred()
        if self.state.folding:
            self.fold()

    # ------------------------------------------------------------------ the steps
    def evict(self, steps: dict[int, Step]) -> None:
        """Evict the regions of ``steps`` (layer -> its :class:`~.region.Step`; see
        :func:`~lukv_cache.cache.compression.evict.evict`); under a budget or ``kv_bits`` each window then joins
        its store, with its scores where the store keeps them."""
        started = time.perf_counter()
        budgeted = self.policy.in_bytes and bool(steps)
        if budgeted and self.memory_choice is None:
            self.choose_bits(min(steps))
        # a step of several layers (deferred or held) is every layer this forward compresses
        self.state.cap_ratio = evict(self.cache, steps, self.state.cap_ratio, whole=len(steps) > 1)
        if budgeted:  # every kept token costs the same: the window joins the store, in its bits
            for idx, step in steps.items():
                cast(LUKVLayer, self.cache.layers[idx]).fold(scores=step.window)
        elif self.policy.kv_bits is not None and self.policy.max_tokens is None:
            # so with kv_bits: no kept token stays at full precision (the buffer grows from the first decoded
            # token, as after any eviction). Not under a token bound, whose cap counts every layer's window
            # as dense (cap.token_cap)
            for idx, step in steps.items():
                cast(LUKVLayer, self.cache.layers[idx]).fold(room=0, scores=step.window)
        self._report("evict", steps, started)

    def choose_bits(self, idx: int) -> MemoryChoice:
        """Under a memory budget, at the first compression (layer ``idx``'s, holding the prompt): choose
        the bits (:func:`~lukv_cache.cache.options.memory.choose_bits`, with the profile's measured table when it
        has one), build every compressed layer's store in them from now on, log the choice in one line."""
        cache, policy = self.cache, self.policy
        layout = cache.layout
        layer = cast(LUKVLayer, cache.layers[idx])
        heads = layer.num_heads * (1 if layout.head_shard is None else layout.head_shard.size)
        kinds = cache_kinds(cache, layer, heads)
        compressed = len(kinds.compressed)
        # keep_scores: every layer's prefill scores of this forward count in the budget too
        scores = (
            0
            if cache.prefill_scores is None
            else prefill_scores_bytes(compressed, heads, layer.suffix_length)
        )
        queries = kept_queries(policy, layout.query_heads, heads)
        shapes = layer_shapes(layer, compressed, heads, queries, scores, kinds)
        profile = (policy.allocator_kwargs or {}).get("profile") or getattr(cache, "profile", None)
        choice = choose_bits(
            policy.memory,
            policy.max_bytes,
            layer.cumulative_length,
            shapes,
            keeps_scores(policy),
            policy.sink + policy.window,
            getattr(profile, "memory_table", None),
            self.precisions,
            policy.memory_floor,
            policy.split == "global_first" and any(hold is not None for hold in kinds.compressed),
        )
        self.adopt_choice(choice)
        log_choice(choice)
        return choice

    def adopt_choice(self, choice: MemoryChoice) -> None:
        """Build every compressed layer's store in ``choice``'s bits from now on (the layers without one;
        with per-layer widths each layer's own). Every layer exists by then: the first forward learns the
        layout before layer 0 attends (``tests/cache/test_memory_mixed.py`` checks a cache built without the
        model's config)."""
        self.memory_choice = choice
        self._build_layers_with(dataclasses.replace(self.new_layer, kv_bits=choice.bits_of(0)))

    def forget_choice(self) -> None:
        """A memory budget chooses again for the next prompt (the cache was reset: no layer has a store)."""
        if self.memory_choice is not None:
            self.memory_choice = None
            self._build_layers_with(LayerFactory.for_policy(self.policy))

    def _build_layers_with(self, factory: LayerFactory) -> None:
        """``factory`` builds the layers from now on; the layers without a store take its bits (or each
        its own, from the memory budget's choice)."""
        self.new_layer = factory
        self.cache.grow_with(factory)
        choice = self.memory_choice
        for i, each in enumerate(self.cache.layers):
            if isinstance(each, LUKVLayer) and each.store is None:
                each.kv_bits = factory.kv_bits if choice is None else choice.bits_of(i)

    def evict_deferred(self) -> None:
        """Evict the layers a whole-model allocator left waiting in this forward, in one step."""
        state = self.state
        deferred, state.deferred = state.deferred, {}
        self.evict(deferred)

    def fold(self) -> None:
        """Eviction at fold time of the layers whose fold is due
        (:func:`~lukv_cache.cache.compression.fold.fold_evict`)."""
        started = time.perf_counter()
        state, cache = self.state, self.cache
        folding, state.folding = state.folding, {}
        layout = cache.layout
        held = cache.prefill_scores or {}  # keep_scores: the prompt's scores count in a memory budget
        rows = max((scores.shape[0] for scores in held.values()), default=1)
        scores_bytes = sum(scores.numel() * scores.element_size() for scores in held.values()) // rows
        if layout.head_shard is not None:  # a rank holds its block of heads: the budget counts every head's
            scores_bytes *= layout.head_shard.size
        fold_evict(
            cache.layers,
            folding,
            self.policy,
            layout.head_shard,
            cache.num_layers,
            layout.query_heads,
            scores_bytes,
            layout.kv_readers,
        )
        self._report("fold", folding, started)

    def evict_held(self, scores: Mapping[int, torch.Tensor]) -> None:
        """Compress what the cache's :meth:`~lukv_cache.LUKVCache.holding` block kept, each layer ranked
        by ``scores[layer]`` (see :meth:`~lukv_cache.LUKVCache.evict_held`)."""
        held, self.state.held = self.state.held, {}
        self.evict(held_steps(self.cache, held, scores))

    # ------------------------------------------------------------------ the forward's state: the one writer
    def plan(self, layer: LUKVLayer, attention_mask: torch.Tensor | None) -> Region:
        """The region of ``layer``'s suffix this step decides about
        (:func:`~lukv_cache.cache.compression.region.plan_region`); the sinks it protects are used."""
        region = plan_region(layer, self.policy, attention_mask)
        layer.eviction.keep_sinks(region.sinks_left)
        return region

    def awaits(self, idx: int) -> Any:
        """Layer ``idx`` announced its attention call: it waits for it; the module that read it last time
        (weakly), or None."""
        self.state.awaiting = idx
        return self.state.readers.get(idx)

    def attended(self, idx: int, module: Any) -> None:
        """Layer ``idx``'s announced attention ran, in ``module`` (remembered, weakly, as its reader)."""
        state = self.state
        state.awaiting = None
        if idx not in state.readers:
            state.readers[idx] = weakref.ref(module)

    def stop_awaiting(self) -> None:
        """The awaited layer's call will not come (transformers' own layer holds it now)."""
        self.state.awaiting = None

    def refuse_unservable(self, idx: int, reason: str) -> None:
        """Layer ``idx``'s attention passes what the compressed store's attention cannot read
        (:func:`~lukv_cache.cache.compression.settle.check_servable`): an error for a cache that compresses;
        at ratio 0 the cache stops announcing calls."""
        self.state.awaiting = None
        check_servable(self.cache, idx, reason)
        self.state.unrouted = True

    def set_unrouted(self, unrouted: bool) -> None:
        """A saved context says whether the model attends in its own code (the cache announces no calls)."""
        self.state.unrouted = unrouted

    @contextlib.contextmanager
    def in_phase(self, phase: Phase) -> Iterator[None]:
        """Within this block the forwards into the cache run in ``phase`` (``ForwardState.phase``); the
        phase before it comes back afterwards, also into a state that :meth:`reset` replaced meanwhile."""
        previous, self.state.phase = self.state.phase, phase
        try:
            yield
        finally:
            self.state.phase = previous

    @contextlib.contextmanager
    def reconstructing(self, round_: Any) -> Iterator[None]:
        """Within this block a reconstruction scorer's pass runs (``Phase.RECONSTRUCT``), scored into
        ``round_`` (``ForwardState.round``, None again afterwards)."""
        self.state.round = round_
        try:
            with self.in_phase(Phase.RECONSTRUCT):
                yield
        finally:
            self.state.round = None

    def reset(self) -> None:
        """The cache was emptied for a new prompt: nothing a forward left pending survives (a fresh
        state; a call still announced is discarded), and a memory budget chooses again."""
        if self.state.awaiting is not None:
            discard_attention()
        self.state = ForwardState()
        self.forget_choice()
