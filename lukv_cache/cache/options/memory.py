"""The memory budget (``LUKVCache(memory=0.1)`` or ``max_bytes=N``): bytes instead of tokens and bits.

A budget is a number of bytes per batch row that everything the compressed layers hold after a prompt must
fit: the stored keys and values (codes, scales and zeros when quantized), their positions, their scores
when the cache keeps them, the offsets, and the dense decode room (the suffix buffer each layer decodes
into, ``fold_interval + 1`` tokens at the model's precision). ``memory=f`` is ``f`` times the bytes a full
``DynamicCache`` holds for the prompt (every token of every layer and KV head at the model's dtype);
``max_bytes=N`` is ``N`` bytes per row whatever the prompt's length. Under a budget the protected window
does not stay dense: it is folded into the store with the kept tokens, so every kept token costs the same.

At the first compression the cache knows the model's shapes, its dtype and the prompt's length, and
:func:`choose_bits` picks the precision: for each of ``None`` (the model's dtype), 8 and 4 bits, how many
tokens the budget holds (:func:`tokens_allowed`); then the profile's measured table
(:class:`~lukv_cache.profiles.MemoryTable`, ``lukv build``), when the cache's profile has one, picks the
mix of least loss; without one, :func:`fallback_bits`' rule. A table that also measured each layer's loss
at 4 bits (``layer_loss``) lets it weigh mixed widths too: the layers that lose most at 4 bits kept at 8,
the others at 4 (:func:`choose_mix`). The bits are fixed from then on (the layers' stores are built in them);
each later compression's budget is what the bytes hold at those bits, counted per layer (a token of an 8-bit
layer costs more than one of a 4-bit layer) and enforced like ``max_tokens`` (:mod:`..compression.cap`).

On a model with other layer kinds (:class:`Kinds`) the full cache is what the model's own cache holds for the
prompt, layer by layer (a sliding window at most its window, linear-attention states at their size, a layer
that reads another's KV nothing), and the layers the cache does not compress count as fixed bytes.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import ConfigurationError
from ..storage.quant import PackedRows
from ..storage.ragged import POSITION_LIMIT

logger = logging.getLogger("lukv_cache")

BITS = (None, 8, 4)  # the precisions a budget chooses among, most bits first
OFFSET_BYTES = 8  # one int64 offset per (row, KV head) segment of a layer's store (and its sinks_left)
POSITION_BYTES = 2  # int16 positions (a store's positions are int16 while they fit: every prompt below 32k)
SCORE_BYTES = 4  # float32 scores, when the cache keeps them
# the fallback rule: 8 bits while they keep at least this fraction of the prompt's tokens, else 4 bits
# (docs/memory.md: what the equal-bytes grids of SmolLM2-135M and Qwen2.5-Coder-0.5B support)
MIN_KEPT_AT_8_BITS = 0.15

LayerBits = int | None | tuple[int | None, ...]  # one width for every layer, or one per layer
# why a budget chose its bits (MemoryChoice.by), as its log line says it
BY = {
    "table": "the profile's measured table",
    "rule": "the profile's fallback rule",
    "whole": "keeping every token: on sliding windows the table's eviction losses are not the budget's",
}


@dataclass(frozen=True)
class Kinds:
    """What the model's own cache (``DynamicCache(config=model.config)``) holds per batch row, layer kind by
    kind: the full cache a ``memory=`` fraction is taken of, and the bytes of the layers this cache leaves
    to transformers (fixed bytes of the budget: no eviction changes them).

    ``compressed``: one entry per layer the cache compresses (full attention; a sliding window compressed
    under ``sliding="compress"``), the tokens per KV head the model's own cache holds there at most:
    ``None`` for every token, ``w - 1`` for a sliding window of ``w`` (what transformers'
    ``DynamicSlidingWindowLayer`` keeps). ``stock``: one ``(bytes per token of one row, hold)`` per layer
    left to transformers' own layer that holds per-token keys and values (a sliding window kept whole, a
    chunked window, a layer whose KV later layers read, an indexed layer). ``states``: bytes per row of
    linear-attention / SSM states (conv and recurrent), beside the compressed layers or alone.

    >>> kinds = Kinds(compressed=(None, 7), stock=((64, 7),), states=100)
    >>> kinds.holdable(20), kinds.other(20), kinds.full(torch.tensor([20, 5]), pair_token=64).tolist()
    (27, 548, [2276, 1060])
    """

    compressed: tuple[int | None, ...]
    stock: tuple[tuple[int, int | None], ...] = ()
    states: int = 0

    def holdable(self, length: int) -> int:
        """Tokens per KV head the compressed layers could hold, in all, for ``length`` tokens seen."""
        return sum(_held(length, hold) for hold in self.compressed)

    def other(self, length: int) -> int:
        """Bytes per row of the layers the cache does not compress, once ``length`` columns (padding included)
        have reached them."""
        return sum(cost * _held(length, hold) for cost, hold in self.stock) + self.states

    def full(self, seen: torch.Tensor, pair_token: int) -> torch.Tensor:
        """int64 ``[B]``: the bytes the model's own cache holds for each row's ``seen`` tokens (``pair_token``:
        bytes of one token of every KV head of a compressed layer, at the model's dtype)."""
        seen = seen.long()
        total = torch.full_like(seen, self.states)
        for hold in self.compressed:
            total = total + pair_token * (seen if hold is None else seen.clamp_max(hold))
        for cost, hold in self.stock:
            total = total + cost * (seen if hold is None else seen.clamp_max(hold))
        return total


def _held(length: int, hold: int | None) -> int:
    return length if hold is None else min(length, hold)


@dataclass(frozen=True)
class Shapes:
    """What a budget's arithmetic needs of the model: the compressed layers' count, KV heads (all of the
    model's, under tensor parallelism too), key and value head dims, dtype, and each layer's decode room
    in tokens (``fold_at + 1``)."""

    layers: int
    heads: int
    head_dim: int
    value_dim: int
    dtype: torch.dtype
    room: int
    queries: int = 0  # bytes of the queries a layer keeps for its next fold's scorer, per row
    position_bytes: int = POSITION_BYTES  # 4 where positions pass int16's range (int32)
    scores: int = 0  # bytes per row of the prefill scores the cache keeps (keep_scores=True), every layer's
    # other layer kinds (None: every layer is a compressed full-attention one) and the columns they have seen
    kinds: Kinds | None = None
    length: int = 0

    @property
    def slots(self) -> int:
        """(layer, KV head) pairs of one row."""
        return self.layers * self.heads

    @property
    def dense_token(self) -> int:
        """Bytes of one token of one KV head at the model's precision (a key and a value)."""
        return (self.head_dim + self.value_dim) * self.dtype.itemsize

    def stored_token(self, bits: int | None, scores: bool) -> int:
        """Bytes of one stored token of one KV head in ``bits`` (``None``: the model's dtype): its key and
        value (codes, scales and zeros), its position, and its score when the cache keeps scores."""
        extra = self.position_bytes + (SCORE_BYTES if scores else 0)
        if bits is None:
            return self.dense_token + extra
        return (
            _packed_row(self.head_dim, bits, self.dtype)
            + _packed_row(self.value_dim, bits, self.dtype)
            + extra
        )

    def fixed(self) -> int:
        """Bytes of one row that do not depend on how many tokens are kept: every layer's decode room,
        its store's offsets (one per KV head, and the last), its count of sinks still to keep and the
        queries it keeps for its next fold's scorer; the prefill scores the cache keeps; and what the
        layers it does not compress hold (:meth:`Kinds.other`) once the decode room has filled."""
        per_layer = 2 * OFFSET_BYTES + self.queries
        dense = self.slots * (self.room * self.dense_token + OFFSET_BYTES)
        # the layers left to transformers grow while decoding until the next fold: counted at its length
        other = 0 if self.kinds is None else self.kinds.other(self.length + self.room)
        return dense + self.layers * per_layer + self.scores + other

    def holdable(self, length: int) -> int:
        """Tokens one row's compressed (layer, KV head) pairs could hold in all for ``length`` tokens seen
        (a sliding window's at most its own)."""
        if self.kinds is None:
            return self.slots * length
        return self.heads * self.kinds.holdable(length)

    def full_bytes(self, seen: torch.Tensor) -> torch.Tensor:
        """int64 ``[B]``: what the model's own cache holds for each row's ``seen`` tokens."""
        pair_token = self.heads * self.dense_token
        if self.kinds is None:
            return seen.long() * self.layers * pair_token
        return self.kinds.full(seen, pair_token)


def layer_shapes(
    layer: Any, layers: int, heads: int, queries: int = 0, scores: int = 0, kinds: Kinds | None = None
) -> Shapes:
    """The :class:`Shapes` of a model whose ``layers`` compressed layers are like ``layer`` (a
    :class:`~lukv_cache.cache.storage.layer.LUKVLayer` holding a forward), ``heads`` KV heads each; ``queries``:
    query vectors (of all query heads) each layer keeps for its next fold's scorer; ``scores``: bytes per
    row of the prefill scores the cache keeps (:func:`prefill_scores_bytes`); ``kinds``: the model's other
    layer kinds, ``None`` when every layer is a compressed full-attention one."""
    keys, values = layer.suffix_keys, layer.suffix_values
    query_bytes = queries * keys.shape[-1] * keys.element_size()
    # positions up to the decode room's last are int16 while they fit (lukv_cache.cache.storage.ragged)
    position = 2 if layer.cumulative_length + layer.fold_at < POSITION_LIMIT else 4
    return Shapes(
        layers,
        heads,
        keys.shape[-1],
        values.shape[-1],
        keys.dtype,
        layer.fold_at + 1,
        query_bytes,
        position,
        scores,
        kinds,
        layer.cumulative_length,
    )


def prefill_scores_bytes(layers: int, heads: int, length: int) -> int:
    """Bytes per row of the prefill scores a ``keep_scores=True`` cache keeps once ``layers`` layers of
    ``heads`` KV heads have scored a forward of ``length`` tokens (fp32 ``[H_kv, T]`` per layer)."""
    return layers * heads * length * SCORE_BYTES


def kept_queries(policy: Any, query_heads: int | None, heads: int) -> int:
    """Query vectors a layer keeps between folds under ``policy`` (folds that evict, with a scorer that
    reads queries: its last ``n_queries``, at most ``fold_interval``, of every query head; the model's
    ``query_heads``, its ``heads`` KV heads when unknown)."""
    if not policy.evicts_at_folds or not policy.scorer.n_queries:
        return 0
    return min(policy.scorer.n_queries, policy.fold_interval) * (query_heads or heads)


def budget_shapes(
    policy: Any,
    layer: Any,
    layers: int,
    heads: int,
    query_heads: int | None,
    seen: torch.Tensor,
    scores: int = 0,
    kinds: Kinds | None = None,
) -> tuple[torch.Tensor, Shapes]:
    """int64 ``[B]``: the bytes each row may hold under ``policy``'s budget over ``layers`` compressed
    layers of ``heads`` KV heads like ``layer``, for the real tokens it has ``seen`` (:func:`row_budgets`),
    and the :class:`Shapes` they are counted with (``query_heads``: the model's, whose queries a layer may
    keep for its next fold, ``None`` when unknown; ``scores``: the kept prefill scores' bytes per row;
    ``kinds``: the model's other layer kinds, if any)."""
    shapes = layer_shapes(layer, layers, heads, kept_queries(policy, query_heads, heads), scores, kinds)
    budget = row_budgets(policy.memory, policy.max_bytes, seen, shapes)
    if policy.memory_floor:
        stored_scores = policy.evicts_at_folds and policy.scorer.keeps_scores  # as the stores keep them
        budget = budget.clamp_min(floor_bytes(shapes, policy.sink + policy.window, stored_scores))
    return budget, shapes


def floor_bytes(shapes: Shapes, protected: int, scores: bool) -> int:
    """Bytes per row a budget under ``memory_floor=True`` is at least: the decode room and the other fixed
    bytes, and ``protected`` tokens (sink + window) of every (layer, KV head) at the model's precision.

    >>> shapes = Shapes(layers=2, heads=2, head_dim=8, value_dim=8, dtype=torch.float32, room=5)
    >>> floor_bytes(shapes, 5, False) == shapes.fixed() + 4 * 5 * shapes.stored_token(None, False)
    True
    """
    return shapes.fixed() + protected * shapes.slots * shapes.stored_token(None, scores)


@functools.lru_cache(maxsize=64)
def _packed_row(dim: int, bits: int, dtype: torch.dtype) -> int:
    """Bytes of one quantized row of ``dim`` channels (measured on the store's own format)."""
    return PackedRows.quantize(torch.zeros(1, dim, dtype=dtype), bits).memory_bytes()


def row_budget(memory: float | None, max_bytes: int | None, length: int, shapes: Shapes) -> int:
    """Bytes one row may hold: ``memory`` times the full cache's bytes for ``length`` tokens, or
    ``max_bytes``.

    >>> shapes = Shapes(layers=2, heads=2, head_dim=8, value_dim=8, dtype=torch.float32, room=5)
    >>> row_budget(0.5, None, 100, shapes), row_budget(None, 4096, 100, shapes)
    (12800, 4096)
    """
    if max_bytes is not None:
        return max_bytes
    assert memory is not None
    return int(memory * int(shapes.full_bytes(torch.tensor([length]))[0]))


def row_budgets(
    memory: float | None, max_bytes: int | None, seen: torch.Tensor, shapes: Shapes
) -> torch.Tensor:
    """int64 ``[B]``: the bytes each row may hold, ``memory`` times the full cache's bytes for the real
    tokens it has ``seen`` (padding excluded: a padded row gets what it would alone), or ``max_bytes``.

    >>> shapes = Shapes(layers=2, heads=2, head_dim=8, value_dim=8, dtype=torch.float32, room=5)
    >>> row_budgets(0.5, None, torch.tensor([100, 40]), shapes).tolist()
    [12800, 5120]
    """
    if max_bytes is not None:
        return torch.full(seen.shape, max_bytes, dtype=torch.long)
    assert memory is not None
    return (memory * shapes.full_bytes(seen).double()).long()  # as row_budget rounds


def tokens_allowed(budget: int, shapes: Shapes, bits: int | None, scores: bool) -> int:
    """Tokens one row may keep over all its (layer, KV head) pairs in ``budget`` bytes at ``bits``
    (negative when the fixed bytes alone do not fit).

    >>> shapes = Shapes(layers=2, heads=2, head_dim=8, value_dim=8, dtype=torch.float32, room=5)
    >>> [tokens_allowed(12800, shapes, b, False) for b in (None, 8, 4)]
    [173, 440, 636]
    """
    return (budget - shapes.fixed()) // shapes.stored_token(bits, scores)


@dataclass(frozen=True)
class MemoryChoice:
    """What a budget chose at a cache's first compression: ``kv_bits`` (``None``: the model's dtype; a
    tuple: each layer's, when some layers keep 8 bits and the others 4), the budget in bytes per row for
    that prompt (``budget``), the prompt's ``length``, and for each single precision the fraction of the
    prompt's tokens its bytes hold (``kept``, at most 1); ``by``: ``"table"`` (the profile's measured table)
    or ``"rule"`` (:func:`fallback_bits`); ``mixed_kept``: with per-layer widths, the fraction they hold."""

    kv_bits: LayerBits
    budget: int
    length: int
    kept: dict[int | None, float]
    by: str
    mixed_kept: float | None = None

    @property
    def mixed(self) -> bool:
        """Whether the layers hold different widths (``kv_bits`` is a tuple)."""
        return isinstance(self.kv_bits, tuple)

    def bits_of(self, layer: int) -> int | None:
        """The bits layer ``layer``'s store is built in."""
        return self.kv_bits[layer] if isinstance(self.kv_bits, tuple) else self.kv_bits

    @property
    def ratio(self) -> float:
        """The eviction ratio the chosen precision allows on this prompt (before sinks and window)."""
        if isinstance(self.kv_bits, tuple):
            assert self.mixed_kept is not None  # set with per-layer widths
            return 1.0 - self.mixed_kept
        return 1.0 - self.kept[self.kv_bits]

    def to_json(self) -> dict[str, Any]:
        """The choice as a saved context's JSON (``kept``'s keys as text: ``"none"``, ``"8"``, ``"4"``;
        per-layer widths as a list, with ``mixed_kept``)."""
        entry: dict[str, Any] = {
            "kv_bits": list(self.kv_bits) if isinstance(self.kv_bits, tuple) else self.kv_bits,
            "budget": self.budget,
            "length": self.length,
            "kept": {_bits_key(bits): kept for bits, kept in self.kept.items()},
            "by": self.by,
        }
        if self.mixed_kept is not None:
            entry["mixed_kept"] = self.mixed_kept
        return entry

    @classmethod
    def from_json(cls, entry: Any) -> MemoryChoice | None:
        """The choice of :meth:`to_json`'s ``entry``, or ``None`` if it is malformed."""
        names = {"kv_bits", "budget", "length", "kept", "by"}
        if not isinstance(entry, dict) or set(entry) not in (names, names | {"mixed_kept"}):
            return None
        bits, budget, length, kept, by = (entry[k] for k in ("kv_bits", "budget", "length", "kept", "by"))
        mixed_kept = entry.get("mixed_kept")
        keys = {_bits_key(b): b for b in BITS}
        if isinstance(bits, list):  # per-layer widths: 8 and 4 bits, both, with the fraction they keep
            if not bits or any(b not in (8, 4) or isinstance(b, bool) for b in bits) or len(set(bits)) != 2:
                return None
            if not _fraction(mixed_kept):
                return None
            bits = tuple(bits)
        elif bits not in BITS or isinstance(bits, bool) or mixed_kept is not None:
            return None
        if (
            any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in (budget, length))
            or not isinstance(kept, dict)
            or set(kept) != set(keys)
            or not all(_fraction(v) for v in kept.values())
            or by not in BY
        ):
            return None
        fraction = None if mixed_kept is None else float(mixed_kept)
        return cls(bits, budget, length, {keys[k]: float(v) for k, v in kept.items()}, by, fraction)

    def describe(self) -> str:
        """One line: what was chosen and why."""
        if isinstance(self.kv_bits, tuple):
            wide = [i for i, b in enumerate(self.kv_bits) if b == 8]
            bits = (
                f"8-bit keys and values in layers {', '.join(map(str, wide))}, 4-bit in the other "
                f"{len(self.kv_bits) - len(wide)}"
            )
        elif self.kv_bits is None:
            bits = "the model's precision"
        else:
            bits = f"{self.kv_bits}-bit keys and values"
        return (
            f"lukv_cache: memory budget {self.budget} bytes per row for {self.length} tokens: {bits}, "
            f"keeping {100 * (1 - self.ratio):.1f}% of the tokens (ratio {self.ratio:.3f}; chosen by "
            f"{BY[self.by]})."
        )


def mixed_name(bits: tuple[int | None, ...]) -> str:
    """Per-layer widths in a few words: how many layers keep 8 bits (the others 4).

    >>> mixed_name((4, 8, 4, 4))
    'int8 in 1/4 layers'
    """
    return f"int8 in {sum(b == 8 for b in bits)}/{len(bits)} layers"


def _fraction(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value <= 1


def _bits_text(bits: int | None) -> str:
    return "the model's precision" if bits is None else f"{bits} bits"


def _bits_key(bits: int | None) -> str:
    return "none" if bits is None else str(bits)


def fallback_bits(kept: dict[int | None, float]) -> int | None:
    """The precision of the rule used without a measured table: the model's own when it keeps every
    token; else 8 bits while they keep at least :data:`MIN_KEPT_AT_8_BITS` of the tokens; else 4 bits.

    >>> fallback_bits({None: 1.0, 8: 1.0, 4: 1.0}), fallback_bits({None: 0.3, 8: 0.9, 4: 1.0})
    (None, 8)
    >>> fallback_bits({None: 0.03, 8: 0.1, 4: 0.18})
    4
    """
    if kept[None] >= 1.0:
        return None
    return 8 if kept[8] >= MIN_KEPT_AT_8_BITS else 4


def choose_bits(
    memory: float | None,
    max_bytes: int | None,
    length: int,
    shapes: Shapes,
    scores: bool,
    protected: int,
    table: Any = None,
    precisions: tuple[int | None, ...] = BITS,
    floor: bool = False,
    whole_first: bool = False,
) -> MemoryChoice:
    """The precision for a prompt of ``length`` tokens (see the module docstring). ``protected``: tokens
    each (layer, KV head) keeps whatever the budget (sinks and window): a precision whose bytes cannot hold
    them is out; none can is a :class:`~lukv_cache.errors.ConfigurationError`. ``table``: the profile's
    measured table (its ``choose`` picks among the precisions that fit), or ``None``. ``precisions``: the
    ones to choose among (a benchmark fixes one to compare them at the same bytes). ``floor``
    (``memory_floor=True``): a budget below :func:`floor_bytes` is raised to it instead of refused.
    ``whole_first`` (a model with compressed sliding windows, ``split="global_first"``; not on a prompt the
    floor raised the budget for): where some
    precision keeps every token and another would evict, the most precise that keeps every token (``by``
    ``"whole"``), whatever the table: its losses are measured evicting one ratio of every layer, which is not
    how the budget evicts there (on Gemma-3-270M it preferred 8 bits evicting to 4 bits keeping everything,
    and lost more: docs/memory.md).

    >>> shapes = Shapes(layers=2, heads=2, head_dim=8, value_dim=8, dtype=torch.float32, room=5)
    >>> choice = choose_bits(0.2, None, 100, shapes, False, protected=5)
    >>> choice.kv_bits, {bits: round(kept, 2) for bits, kept in choice.kept.items()}
    (8, {None: 0.14, 8: 0.36, 4: 0.52})
    >>> choose_bits(0.1, None, 100, shapes, False, protected=5).kv_bits  # 8 bits would keep 11%
    4
    """
    budget = row_budget(memory, max_bytes, length, shapes)
    raised = floor_bytes(shapes, protected, scores) if floor else 0
    floored = budget < raised  # a prompt too short for the budget: its protected tokens, as ratio= keeps them
    budget = max(budget, raised)
    slots = max(shapes.holdable(length), 1)
    if shapes.head_dim % 2 or shapes.value_dim % 2:  # 4-bit codes pack two channels per byte
        precisions = tuple(bits for bits in precisions if bits != 4)
        if not precisions:
            raise ConfigurationError(
                f"head_dim {shapes.head_dim} is odd, so 4-bit codes (two channels per byte) cannot hold it: let "
                "the budget choose among the model's precision and 8 bits."
            )
    # a precision left out counts as keeping nothing (its bytes are not even computed)
    counts = {
        bits: tokens_allowed(budget, shapes, bits, scores) if bits in precisions else -1 for bits in BITS
    }
    kept = {bits: min(max(count, 0) / slots, 1.0) for bits, count in counts.items()}
    fits = [bits for bits in BITS if bits in precisions and counts[bits] >= protected * shapes.slots]
    if not fits:
        least = shapes.fixed() + protected * shapes.slots * shapes.stored_token(precisions[-1], scores)
        asked = f"memory={memory}" if max_bytes is None else f"max_bytes={max_bytes}"
        other = 0 if shapes.kinds is None else shapes.kinds.other(shapes.length + shapes.room)
        left = (
            f" ({other} of them for the layers it leaves to transformers: sliding windows kept whole, "
            "linear-attention states, shared KV; sliding='compress' compresses the windows too)"
            if other
            else ""
        )
        raise ConfigurationError(
            f"{asked} gives {budget} bytes per row for this {length}-token prompt, but even at {_bits_text(precisions[-1])} the "
            f"cache needs {least} for the tokens every head keeps (sink + window: {protected} per head) and "
            f"its decode room{left}: raise the budget, or lower sink=, window= or fold_interval=."
        )
    whole = [bits for bits in fits if kept[bits] >= 1.0]
    if whole_first and not floored and whole and len(whole) < len(fits):
        widths = whole_mix(budget, length, shapes, scores, table) if whole[0] == 4 else None
        if widths is not None:  # some layers (those that lose most at 4 bits) at 8, every token kept
            return MemoryChoice(widths, budget, length, kept, "whole", 1.0)
        return MemoryChoice(whole[0], budget, length, kept, "whole")
    if table is not None:
        bits = table.choose({bits: 1.0 - kept[bits] for bits in fits})
        by = "table"
        if precisions == BITS:  # a benchmark that fixes one precision gets it
            mix = choose_mix(
                budget, length, shapes, scores, protected, table, table.loss_at(bits, 1 - kept[bits])
            )
            if mix is not None:
                return MemoryChoice(mix[0], budget, length, kept, by, mix[1])
    else:
        bits = fallback_bits(kept)
        if bits not in fits:  # the rule's precision is ruled out: the next one down that fits, else up
            below = [b for b in fits if BITS.index(b) > BITS.index(bits)]
            bits = below[0] if below else fits[-1]
        by = "rule"
    return MemoryChoice(bits, budget, length, kept, by)


def choose_mix(
    budget: int,
    length: int,
    shapes: Shapes,
    scores: bool,
    protected: int,
    table: Any,
    loss: float,
) -> tuple[tuple[int, ...], float] | None:
    """Per-layer widths whose estimated loss beats ``loss`` (the best single precision's), or ``None``:
    for each ``k``, the ``k`` layers that lose most at 4 bits (``table.layer_order()``) at 8 bits and the
    others at 4, every (layer, KV head) keeping the tokens ``budget``'s bytes then hold (at least
    ``protected``), weighed by ``table.mix_loss``; the ``k`` of least loss. Returns each layer's bits and the
    fraction of the prompt's tokens they keep. ``None`` too without the table's ``layer_loss``, or when it
    does not have one entry per layer of ``shapes``.

    >>> import numpy as np
    >>> from lukv_cache.profiles import MemoryTable
    >>> table = MemoryTable((None, 8, 4), np.array([0.5, 0.9], dtype=np.float32),
    ...                     np.array([[0.1, 0.5], [0.1, 0.5], [0.4, 0.8]], dtype=np.float32),
    ...                     layer_loss=np.array([0.3, 0.0, 0.01, 0.0]))  # layer 0 loses most at 4 bits
    >>> shapes = Shapes(layers=4, heads=2, head_dim=64, value_dim=64, dtype=torch.float16, room=2)
    >>> bits, kept = choose_mix(60_000, 200, shapes, False, 4, table, loss=0.4)
    >>> bits, round(kept, 3)
    ((8, 4, 4, 4), 0.355)
    """
    order = table.layer_order()
    layers = shapes.layers
    if len(order) != layers or layers < 2:
        return None
    wide, narrow = shapes.stored_token(8, scores), shapes.stored_token(4, scores)
    room = budget - shapes.fixed()
    best = None
    for k in range(1, layers):
        per_head = room // (shapes.heads * (k * wide + (layers - k) * narrow))
        if per_head < protected:  # more layers at 8 bits hold fewer tokens still
            break
        kept = min(per_head / max(length, 1), 1.0)
        estimate = table.mix_loss(1.0 - kept, order[k:])
        if estimate < loss:
            loss, best = estimate, (k, kept)
    if best is None:
        return None
    k, kept = best
    at_8_bits = set(order[:k])
    return tuple(8 if i in at_8_bits else 4 for i in range(layers)), kept


def whole_mix(budget: int, length: int, shapes: Shapes, scores: bool, table: Any) -> tuple[int, ...] | None:
    """Per-layer widths that keep every token the model's own cache holds in ``budget``'s bytes, as many
    layers at 8 bits as fit (those that lose most at 4 bits first: ``table.layer_order()``), the rest at 4;
    ``None`` when not even one layer fits at 8 bits, or without the table's ``layer_loss`` for every
    compressed layer (a model whose compressed layers are its decoder layers, in order).

    >>> import numpy as np
    >>> from lukv_cache.profiles import MemoryTable
    >>> table = MemoryTable((8, 4), np.array([0.5], dtype=np.float32), np.zeros((2, 1), dtype=np.float32),
    ...                     layer_loss=np.array([0.0, 0.3, 0.0]))  # layer 1 loses most at 4 bits
    >>> shapes = Shapes(layers=3, heads=1, head_dim=64, value_dim=64, dtype=torch.float32, room=1,
    ...                 kinds=Kinds(compressed=(7, None, 7)), length=20)
    >>> wide, narrow = shapes.stored_token(8, False), shapes.stored_token(4, False)
    >>> budget = shapes.fixed() + 7 * narrow + 20 * wide + 7 * narrow  # room for layer 1 at 8 bits
    >>> whole_mix(budget, 20, shapes, False, table), whole_mix(budget - 1, 20, shapes, False, table)
    ((4, 8, 4), None)
    """
    order = [] if table is None else table.layer_order()
    holds = shapes.kinds.compressed if shapes.kinds is not None else (None,) * shapes.layers
    if len(order) != shapes.layers or len(holds) != shapes.layers:
        return None
    wide, narrow = shapes.stored_token(8, scores), shapes.stored_token(4, scores)
    tokens = [shapes.heads * _held(length, hold) for hold in holds]
    room = budget - shapes.fixed() - narrow * sum(tokens)  # every token at 4 bits, then widen
    at_8_bits: set[int] = set()
    for layer in order:
        extra = (wide - narrow) * tokens[layer]
        if extra > room:
            break
        room -= extra
        at_8_bits.add(layer)
    if not at_8_bits:
        return None
    return tuple(8 if i in at_8_bits else 4 for i in range(shapes.layers))


def log_choice(choice: MemoryChoice) -> None:
    logger.info(choice.describe())
