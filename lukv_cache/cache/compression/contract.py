"""What the compression parts of a cache read of it (:class:`CompressedCache`), typed in a leaf module so
that none of them imports the cache: :class:`~lukv_cache.cache.compression.compressor.Compressor`,
:mod:`~lukv_cache.cache.compression.evict` and :mod:`~lukv_cache.cache.compression.settle` take any object with these members,
and :class:`~lukv_cache.LUKVCache` is one.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, TypeVar

import torch

from ..layers.layout import Layout
from ..layers.owner import LaidOutCache
from ..options.memory import MemoryChoice
from ..options.policy import CompressionPolicy
from .forward_state import ForwardState


class ForwardDriver(Protocol):
    """What a cache's other parts see of its :class:`~.compressor.Compressor`, the owner of the forward's
    state: the state, to read, and the one change a saved context asks of it."""

    @property
    def state(self) -> ForwardState: ...

    def set_unrouted(self, unrouted: bool) -> None: ...


class CompressedCache(LaidOutCache, Protocol):
    """A cache as its compression parts see it: what its layout sees (:class:`~..layers.owner.LaidOutCache`:
    its policy, its layers, to read, and the requests that replace them), its layout, what a forward leaves
    pending (``state``, the :class:`~.compressor.Compressor`'s, replaced whole by ``reset``: read it anew
    each time, never write it), and the prefill scores it keeps (``None`` unless asked).
    ``layer_class_to_replicate``: what ``DynamicCache`` grows a layer with while the layout is unknown
    (``None`` once it is known); :meth:`grow_with` changes it, the cache writes it."""

    policy_class: ClassVar[type[CompressionPolicy]]  # the policy its options build

    @property
    def layout(self) -> Layout: ...

    @property
    def state(self) -> ForwardState: ...  # its compressor's, to read

    @property
    def compressor(self) -> ForwardDriver: ...

    @property
    def prefill_scores(self) -> dict[int, torch.Tensor] | None: ...

    @property
    def is_compressed(self) -> bool: ...

    @property
    def num_layers(self) -> int | None: ...

    @property
    def memory_choice(self) -> MemoryChoice | None: ...  # what a memory budget chose

    def __init__(self, *args: Any, **kwargs: Any) -> None: ...  # a cache class is called with its options

    def get_seq_length(self, layer_idx: int = 0) -> int: ...

    def grow_with(self, factory: Any) -> None: ...  # while the layout is unknown, grow layers with factory


CacheT = TypeVar("CacheT", bound=CompressedCache)
"""A cache class's instances, for the functions a class calls with itself (``from_pretrained``, ``load``):
they build ``cls(...)`` and return it, whatever subclass ``cls`` is."""
