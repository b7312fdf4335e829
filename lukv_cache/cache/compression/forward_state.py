"""What a :class:`~lukv_cache.LUKVCache` keeps between the calls of its forwards (:class:`ForwardState`):
``reset`` replaces it whole, so nothing a forward left pending survives a new prompt.

The :class:`~lukv_cache.cache.compression.compressor.Compressor` drives the forwards and owns this state
(``cache.compressor.state``, read as ``cache.state``): only it and this class's own methods assign its
fields (``tests/test_architecture.py``); others read it, or ask it to :meth:`~ForwardState.end_prompt`.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ...scorers.kvzip import ReconstructionRound
from .region import Region, Step


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
    end of the prefill to be evicted (a whole-model allocator) -> its ``Step`` (region, masked scores, window scores);
    ``folding``: with ``decode_max_tokens``, layers whose fold is due in this forward -> (attention module,
    mask); ``phase``: a :class:`Phase` (``HOLD``: multi-token forwards plan their regions into ``held`` and
    keep everything until ``evict_held()``; ``RECONSTRUCT``: a reconstruction scorer's pass, scored into
    ``round.scores`` and cropped afterwards), ``None`` for ordinary forwards; ``cap_ratio``: with ``max_tokens``, each row's ratio in
    this forward (fixed at its first eviction); ``length`` and ``previous_length``: the tokens of this
    forward and of the one before it (``None`` before the first), which tell a chunked prefill's last
    shorter chunk under the cache's ``prefill_chunk_size``.

    ``prompt``: the multi-token forwards into this cache are still its prompt's chunks, each compressed as
    it arrives (:func:`~lukv_cache.cache.compression.evict.wants_compression`; kept by
    :func:`~.settle.begin_forward`). A forward into an empty cache opens the prompt, unless assisted
    decoding records the past already (its first forward holds the whole prompt and the first drafts:
    what follows are verification forwards); it ends at the first forward of one token (decoding) and at
    :meth:`end_prompt` (``cache.prefill``; a copy of the cache, ``fork`` or ``deepcopy``, made for a
    question): a later multi-token forward (a question) is appended whole. ``unsure``: a past recording
    left on by an earlier prompt was on when this one opened, so the cache cannot tell a chunk of this
    prompt from a verification forward (it keeps them whole, and warns once).
    """

    awaiting: int | None = None
    readers: dict[int, weakref.ref] = field(default_factory=dict)
    unrouted: bool = False
    deferred: dict[int, Step] = field(default_factory=dict)
    folding: dict[int, tuple[Any, torch.Tensor | None]] = field(default_factory=dict)
    phase: Phase | None = None
    held: dict[int, Region] = field(default_factory=dict)
    round: ReconstructionRound | None = None
    cap_ratio: torch.Tensor | None = None
    length: int | None = None
    previous_length: int | None = None
    prompt: bool = False
    unsure: bool = False

    def end_prompt(self) -> None:
        """The prompt is complete: later multi-token forwards (a question) are appended whole, until a
        ``reset`` empties the cache."""
        self.prompt = self.unsure = False

    def __deepcopy__(self, memo: dict) -> ForwardState:
        # a copy of the cache (fork, deepcopy) is made for a question: its prompt is complete
        new = copy.copy(self)
        memo[id(self)] = new
        for each in dataclasses.fields(self):
            setattr(new, each.name, copy.deepcopy(getattr(self, each.name), memo))
        new.end_prompt()
        return new

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
