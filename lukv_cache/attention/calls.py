"""The contract between a :class:`~lukv_cache.LUKVCache` and the attention functions that read it.

transformers calls ``past_key_values.update(key, value, layer_idx)`` and then, in the same module
forward, the attention function with the tensors ``update`` returned. A LUKVCache announces each such
call as an :class:`AttentionCall`; the attention function claims it (:func:`claim_attention`, matched on
the very key tensor it received), reads the compressed store from it, and hands the queries back with
:meth:`AttentionCall.finish` (that is where the cache compresses). Nothing is attached to tensors or
modules, and neither side touches the other's private state.

An implementation that cannot read the ragged store never claims the call; :func:`guarded` wraps such
implementations so they raise :class:`~lukv_cache.errors.IncompatibleAttentionError` instead, and the cache
raises on its next ``update`` if a call went unclaimed. The thread-local slot the call waits in is one of the
process-wide changes :mod:`lukv_cache.integration` owns: the cache announces and discards calls through it,
and it puts the guards in transformers' registry (``guard_attention``).

>>> call = claim_attention(module, key)  # inside an attention function  # doctest: +SKIP
>>> if call is not None and call.store is not None:  # doctest: +SKIP
...     ...  # attend over call.store and the dense key/value, then:
...     call.finish(module, query, attention_mask)
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from ..errors import IncompatibleAttentionError


class StoreView(Protocol):
    """What attention reads of a layer's ragged store (``lukv_cache.cache.storage.ragged.RaggedStore``), or of a
    block of its rows. Read-only (the store is a frozen dataclass)."""

    @property
    def keys(self) -> torch.Tensor: ...
    @property
    def values(self) -> torch.Tensor: ...
    @property
    def positions(self) -> torch.Tensor: ...
    @property
    def offsets(self) -> torch.Tensor: ...
    @property
    def offsets_list(self) -> tuple[int, ...]: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...

    def segment_ids(self) -> torch.Tensor: ...


class WholeStoreView(StoreView, Protocol):
    """A whole layer's store, which also gives its rows back at the model's precision (a quantized
    store's ``keys`` / ``values`` are ``PackedRows``: attention reads them through this, or the kernel
    that takes the codes)."""

    def dense(self, start: int = 0, stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...


class TailView(Protocol):
    """The rows decoding appended to a quantized store in place since it was built
    (``lukv_cache.cache.storage.tail.StoreTail``): ``length`` rows per segment, segment ``s``'s at rows
    ``s * capacity`` on of ``keys`` / ``values`` (``PackedRows``, in the store's bits)."""

    @property
    def keys(self) -> Any: ...
    @property
    def values(self) -> Any: ...
    @property
    def length(self) -> int: ...
    @property
    def capacity(self) -> int: ...


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """One layer's attention over a LUKVCache, announced by the cache in ``update()``.

    ``keys``/``values``: the dense suffix ``update()`` returned (what the attention function receives);
    ``store``: the layer's compressed prefix, or ``None`` before compression (then the dense tensors are
    the whole layer and the stock attention is exact).
    """

    layer_idx: int
    keys: torch.Tensor
    values: torch.Tensor
    store: WholeStoreView | None
    on_finish: Callable[..., None]
    # the attention module that read this layer last time (a weak reference), once known: only that module
    # receiving other keys is a model changing them between update() and attention
    module: weakref.ref | None = None
    # told when the layer's attention received other keys than update() returned (the call is dropped)
    on_other_keys: Callable[[], None] | None = None
    # told, before anything is compressed, that the layer's attention passes what the compressed store's
    # attention cannot read (the reason, a message): the cache raises if it would compress, else it leaves
    # every layer dense (the call is dropped, and the stock attention reads the layer)
    on_unservable: Callable[[str], None] | None = None

    def finish(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        sliding_window: int | None = None,
        scaling: float | None = None,
        softcap: float | None = None,
    ) -> None:
        """Tell the cache this layer's attention ran with these post-RoPE ``query [B, Hq, q, D]`` (and this
        ``scaling`` and logit ``softcap``); the cache then compresses (after a prefill) or converts a
        sliding-window layer to the stock one."""
        if scaling is None:
            scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        self.on_finish(self, module, query, attention_mask, sliding_window, scaling, softcap)


# This thread's pending call. A threading.local rather than a ContextVar: torch.compile traces reads and
# writes of it (a ContextVar breaks fullgraph tracing of every model once lukv_cache is imported), and a
# forward never interleaves with another one in the same thread.
_PENDING = threading.local()


def _pending() -> AttentionCall | None:
    return getattr(_PENDING, "call", None)


def any_pending() -> bool:
    """Whether a LUKVCache call waits for its attention in this thread (cheap; torch.compile traces it)."""
    return _pending() is not None


def announce_attention(call: AttentionCall) -> None:
    """Called by the cache in ``update()``: ``call`` awaits this forward's attention function."""
    _PENDING.call = call


def claimed_again(key: torch.Tensor) -> bool:
    """Whether ``key`` are the keys of the compressed call claimed last in this thread: a model attending
    twice over one ``update()`` (DiffLlama), whose second call could not read the store."""
    ref = getattr(_PENDING, "claimed", None)
    return ref is not None and ref() is key


def discard_attention() -> None:
    """Forget this thread's pending call, if any (a cache that is reset, or starts a new forward)."""
    _PENDING.call = None


def peek_attention(key: torch.Tensor) -> AttentionCall | None:
    """The pending call whose keys are ``key`` (without claiming it), else ``None``."""
    call = _pending()
    return call if call is not None and call.keys is key else None


def claim_attention(module: Any, key: torch.Tensor) -> AttentionCall | None:
    """The pending call for ``key`` (the tensor ``update()`` returned), claimed; ``None`` for keys that no
    LUKVCache announced (another cache, a sliding layer): those go to the stock attention.

    Every attention call consumes the pending call, claimed or not, so nothing a cache announced outlives
    the next attention call of its thread: a call left unclaimed (a forward that raised, ``update()`` called
    by hand) cannot touch a later forward of any cache. Raises
    :class:`~lukv_cache.errors.IncompatibleAttentionError` only when the very module that read this layer
    before receives other keys than the cache returned (the model changed them between ``update`` and
    attention, so the store could not be merged exactly).
    """
    call = _pending()
    if call is None:
        return None
    _PENDING.call = None
    if call.keys is key:
        # weakly: a second attention over these keys is recognised, and nothing is kept alive by it
        _PENDING.claimed = weakref.ref(key) if call.store is not None else None
        return call
    if call.module is not None and call.module() is module:
        raise IncompatibleAttentionError(
            f"Layer {call.layer_idx}: the attention function received other keys than the LUKVCache returned "
            f"({type(module).__name__} changes them between update() and attention), so the compressed tokens "
            "cannot be attended to exactly. This model family cannot use LUKVCache; use transformers' "
            "DynamicCache."
        )
    if call.on_other_keys is not None and call.layer_idx == getattr(module, "layer_idx", None):
        call.on_other_keys()
    return None


# ---------------------------------------------------------------------------------------- the guard

_AWARE: weakref.WeakSet[Callable] = weakref.WeakSet()


def lukv_aware(fn: Callable) -> Callable:
    """Mark an attention function as one that reads a LUKVCache correctly (it claims the cache's calls
    itself, or delegates to a function that does), so :func:`lukv_cache.integration.guard_attention` leaves
    it unwrapped.

    >>> @lukv_aware
    ... def my_attention(module, query, key, value, attention_mask, **kwargs):
    ...     return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)
    """
    _AWARE.add(fn)
    return fn


def is_lukv_aware(fn: Callable) -> bool:
    """Whether ``fn`` was marked with :func:`lukv_aware` (lukv's own functions are)."""
    try:
        return fn in _AWARE
    except TypeError:  # not weak-referenceable: a builtin, never ours
        return False


def guarded(name: str, fn: Callable) -> Callable:
    """Attention implementation ``name`` (``fn``, which cannot read a LUKVCache) wrapped: calls with other
    keys pass through unchanged; a LUKVCache's keys raise instead of being attended to partially
    (:func:`lukv_cache.integration.guard_attention` registers it)."""

    def attention(module, query, key, *args, **kwargs):
        if peek_attention(key) is not None:
            discard_attention()  # the forward ends here: nothing may wait for an attention that never comes
            raise IncompatibleAttentionError(
                f"attn_implementation={name!r} cannot read a LUKVCache (its compressed tokens live in a ragged "
                "store). Use attn_implementation='sdpa' or 'eager' for this model, e.g. "
                "model.set_attn_implementation('sdpa'), or use transformers' DynamicCache."
            )
        return fn(module, query, key, *args, **kwargs)

    cast(Any, attention).__wrapped__ = fn  # a plain function's attribute, not declared on its type
    attention.__name__ = f"lukv_guarded_{name}"
    return lukv_aware(attention)
