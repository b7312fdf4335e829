"""A layer's eviction bookkeeping (:class:`EvictionRecord`, ``layer.eviction``): what compression keeps
between its steps about one :class:`~lukv_cache.cache.storage.layer.LUKVLayer`, beside the layer's storage.

Compression owns it: only modules of :mod:`lukv_cache.cache.compression` write it, through its writers
(:meth:`EvictionRecord.keep_sinks`, :meth:`EvictionRecord.settle`, :meth:`EvictionRecord.record_queries`;
``tests/test_architecture.py`` checks it). It lives in storage because the layer carries it through what
transformers does to a layer: the layer forwards its row selection (:meth:`EvictionRecord.select_rows`),
device moves (:meth:`EvictionRecord.move_to`) and ``crop`` (:meth:`EvictionRecord.crop`) to it, builds a
new one at ``reset``, and a fork (a deep copy) copies it. A layer's state (``state_dict``) holds its fields
(:data:`RECORD_FIELDS`) among the layer's own, as the saved-context format always has.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(eq=False)
class EvictionRecord:
    """One layer's eviction bookkeeping (see the module docstring). Its methods act in place.

    >>> record = EvictionRecord()
    >>> record.record_queries(torch.ones(1, 2, 3, 4), count=2)
    >>> record.queries.shape, record.memory_bytes()
    (torch.Size([1, 2, 2, 4]), 64)
    >>> record.settle(7)
    >>> record.settled_length, record.queries
    (7, None)
    """

    # [B] sinks still to protect per row (a chunk of a chunked prefill may be all padding); None before the
    # layer's first eviction step (every row then has the policy's `sink` left)
    sinks_left: torch.Tensor | None = None
    # the layer's logical length at its last eviction or refold: eviction at fold time counts the tokens since
    settled_length: int = 0
    # [B, H_q, W, D]: the last post-RoPE queries, kept while they may score a fold (record_queries)
    queries: torch.Tensor | None = None

    # ------------------------------------------------------------------ the writers (compression's)
    def keep_sinks(self, sinks_left: torch.Tensor) -> None:
        """An eviction step was planned: int64 ``[B]``, the sinks each row still has to protect."""
        self.sinks_left = sinks_left

    def settle(self, length: int) -> None:
        """The layer was evicted or refolded at logical ``length``: the next fold counts from there, with
        queries recorded after it."""
        self.settled_length = length
        self.queries = None

    def record_queries(self, query: torch.Tensor, count: int) -> None:
        """Keep this forward's post-RoPE ``query [B, H_q, q, D]`` after the ones kept before, the last
        ``count`` of them (a scorer that reads queries ranks the tokens at the next fold with them)."""
        recent = query[:, :, -count:]
        if self.queries is not None and self.queries.shape[0] == recent.shape[0]:
            recent = torch.cat([self.queries, recent], dim=2)[:, :, -count:]
        self.queries = recent.clone()  # never a view: it would pin the forward's queries

    # ------------------------------------------------------------------ what the layer forwards to it
    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` (int64, any order, repeats allowed), as the layer does."""
        if self.sinks_left is not None:
            self.sinks_left = self.sinks_left[rows.to(self.sinks_left.device)]
        if self.queries is not None:
            self.queries = self.queries.index_select(0, rows.to(self.queries.device))

    def move_to(self, device) -> None:
        """Move the tensors to ``device`` (the layer's offloading and prefetching)."""
        if self.sinks_left is not None:
            self.sinks_left = self.sinks_left.to(device, non_blocking=True)
        if self.queries is not None:
            self.queries = self.queries.to(device, non_blocking=True)

    def crop(self, length: int) -> None:
        """The layer was cropped to logical ``length``: what was settled stays settled up to it, and the
        recorded queries (of tokens that may be gone) are dropped."""
        self.settled_length = min(self.settled_length, length)
        self.queries = None

    # ------------------------------------------------------------------ accounting and state
    def memory_bytes(self) -> int:
        """Bytes of the tensors held (``sinks_left``, ``queries``)."""
        return sum(t.numel() * t.element_size() for t in (self.sinks_left, self.queries) if t is not None)

    def fields(self) -> dict[str, torch.Tensor | int | None]:
        """The fields by name, as a layer's state holds them (:data:`RECORD_FIELDS`)."""
        return {name: getattr(self, name) for name in RECORD_FIELDS}

    @classmethod
    def from_fields(cls, values: dict) -> EvictionRecord:
        """A record of the fields among ``values`` (a layer's state, checked by its reader); the others
        at their defaults."""
        return cls(**{name: values[name] for name in RECORD_FIELDS if name in values})


RECORD_FIELDS = tuple(f.name for f in fields(EvictionRecord))
