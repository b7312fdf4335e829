"""Budget allocation: how many tokens each (layer, KV head) keeps.

An allocator receives an :class:`AllocationRequest` for one or more layers of one forward and returns int64
keep counts ``[L, B, H_kv]`` over the *evictable* tokens (sinks, the protected window and padding are not
evictable; sinks and window are kept on top of the budget).

Most allocators decide layer by layer, so the cache compresses each layer right after its prefill
attention (only one layer's full KV alive at a time). An allocator registered with ``whole_model=True``
(``global``) compares tokens across layers: the cache then keeps every layer's full KV until the whole
prefill has run and asks once, for all layers.

An allocator registered with ``reads_profile=True`` (``profile``, ``hybrid``, ``hybrid_global``,
``calibrated``, ``threshold``) takes ``profile=`` (a :class:`~lukv_cache.Profile`): :meth:`lukv_cache.LUKVCache.from_pretrained`
passes it the profile it loaded, and the evaluation reads the model's profile for it
(:func:`allocators_reading_profile` lists them).

Register your own with :func:`register_allocator`; look one up with :func:`get_allocator`.
"""

from __future__ import annotations

from . import builtin as _builtin  # noqa: F401  (registers the built-ins)
from .base import (
    ALLOCATORS,
    AllocationRequest,
    Allocator,
    Registration,
    allocators_reading_profile,
    get_allocator,
    largest_remainder,
    register_allocator,
)
from .base import AllocateFn as AllocateFn  # a type, not in __all__; importable from here as before

__all__ = [
    "ALLOCATORS",
    "AllocationRequest",
    "Allocator",
    "Registration",
    "allocators_reading_profile",
    "get_allocator",
    "largest_remainder",
    "register_allocator",
]
