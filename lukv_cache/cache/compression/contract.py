"""What the compression parts of a cache read of it (:class:`CompressedCache`), typed in a leaf module so
that none of them imports the cache: :class:`~lukv_cache.cache.compression.compressor.Compressor`,
:mod:`~lukv_cache.cache.compression.evict` and :mod:`~lukv_cache.cache.compression.settle` take any object with these members,
and :class:`~lukv_cache.LUKVCache` is one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import torch

from ..layers.layout import Layout
from ..options.memory import MemoryChoice
from ..options.policy import CompressionPolicy
from .forward_state import ForwardState

if TYPE_CHECKING:
    from ...profiles import Profile


class CompressedCache(Protocol):
    """A cache as its compression parts see it: its policy, its layers and layout, what a forward leaves
    pending (``state``, replaced whole by ``reset``: read it anew each time), and the prefill scores it
    keeps (``None`` unless asked). ``layer_class_to_replicate``: what ``DynamicCache`` grows a layer with
    while the layout is unknown (``None`` once it is known)."""

    policy_class: ClassVar[type[CompressionPolicy]]  # the policy its options build
    layer_class_to_replicate: Any
    profile: Profile | None  # the profile its budgets come from (set by from_pretrained), else None

    @property
    def policy(self) -> CompressionPolicy: ...

    @property
    def layers(self) -> list[Any]: ...

    @property
    def layout(self) -> Layout: ...

    @property
    def state(self) -> ForwardState: ...

    @property
    def prefill_scores(self) -> dict[int, torch.Tensor] | None: ...

    @property
    def evicts(self) -> bool: ...

    @property
    def is_compressed(self) -> bool: ...

    @property
    def num_layers(self) -> int | None: ...

    @property
    def memory_choice(self) -> MemoryChoice | None: ...  # what a memory budget chose

    def __init__(self, *args: Any, **kwargs: Any) -> None: ...  # a cache class is called with its options

    def get_seq_length(self, layer_idx: int = 0) -> int: ...


CacheT = TypeVar("CacheT", bound=CompressedCache)
"""A cache class's instances, for the functions a class calls with itself (``from_pretrained``, ``load``):
they build ``cls(...)`` and return it, whatever subclass ``cls`` is."""
