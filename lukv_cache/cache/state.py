"""What a :class:`~lukv_cache.LUKVCache` keeps between the calls of its forwards (:class:`ForwardState`):
``reset`` replaces it whole, so nothing a forward left pending survives a new prompt.
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..scorers.kvzip import ReconstructionRound
from .compression import Region


class Phase(enum.Enum):
    """What the forwards into a cache are for while a :meth:`~lukv_cache.LUKVCache.holding` block or a
    reconstruction scorer's passes run (``ForwardState.phase``; ``None`` outside them: ordinary forwards)."""

    HOLD = (
        "hold"  # multi-token forwards plan their regions into ``held``; everything stays until evict_held()
    )
    RECONSTRUCT = "reconstruct"  # a reconstruction scorer's pass: scored into ``round.scores``, then cropped


@dataclass
class ForwardState:
    """The mutable per-prompt state of a cache, between ``update`` and the attention callback and across
    the layers of a forward.

    ``awaiting``: the layer whose announced attention has not run yet; ``readers``: layer -> the attention
    module that read it (weak; a call announced for the layer names its reader); ``unrouted``: the model
    attends in its own code, never through the attention interface; ``deferred``: layers waiting for the
    end of the prefill to be evicted (a whole-model allocator) -> (region, masked scores or None);
    ``folding``: with ``decode_max_tokens``, layers whose fold is due in this forward -> (attention module,
    mask); ``phase``: a :class:`Phase` (``HOLD``: multi-token forwards plan their regions into ``held`` and
    keep everything until ``evict_held()``; ``RECONSTRUCT``: a reconstruction scorer's pass, scored into
    ``round.scores`` and cropped afterwards), ``None`` for ordinary forwards; ``cap_ratio``: with ``max_tokens``, each row's ratio in
    this forward (fixed at its first eviction); ``length`` and ``previous_length``: the tokens of this
    forward and of the one before it (``None`` before the first), which tell a chunked prefill's last
    shorter chunk (:func:`~lukv_cache.cache.eviction.wants_compression`).
    """

    awaiting: int | None = None
    readers: dict[int, weakref.ref] = field(default_factory=dict)
    unrouted: bool = False
    deferred: dict[int, tuple[Region, torch.Tensor | None]] = field(default_factory=dict)
    folding: dict[int, tuple[Any, torch.Tensor | None]] = field(default_factory=dict)
    phase: Phase | None = None
    held: dict[int, Region] = field(default_factory=dict)
    round: ReconstructionRound | None = None
    cap_ratio: torch.Tensor | None = None
    length: int | None = None
    previous_length: int | None = None

    def pending(self) -> list[str]:
        """What this state still waits for, in words (empty between forwards)."""
        waits = {
            "a layer's attention has not run yet": self.awaiting is not None,
            "layers wait for the end of the prefill to be compressed": bool(self.deferred),
            "a fold is due": bool(self.folding),
            "a holding() block or KVzip's repeat passes are running": self.phase is not None
            or self.round is not None,
            "held tokens wait for evict_held()": bool(self.held),
        }
        return [reason for reason, waiting in waits.items() if waiting]


@contextlib.contextmanager
def in_phase(cache: Any, phase: Phase) -> Iterator[None]:
    """Within this block the forwards into ``cache`` run in ``phase`` (``ForwardState.phase``); the phase
    before it comes back afterwards, also into a state that ``reset`` replaced meanwhile."""
    previous, cache.state.phase = cache.state.phase, phase
    try:
        yield
    finally:
        cache.state.phase = previous
