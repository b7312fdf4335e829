"""A :class:`~lukv_cache.cache.storage.layer.LUKVLayer`'s state: what it gives and takes (:class:`LayerState`,
``state_dict`` / ``load_state``), checked before it is used (a saved context is untrusted input):
:func:`checked_parts` checks the state and builds the layer's parts from it, the dense suffix and the
ragged store, each checked by its own ``from_state``."""

from __future__ import annotations

from typing import Any

import torch

from .ragged import RaggedStore
from .record import RECORD_FIELDS, EvictionRecord
from .state_check import StateCheck, StateShape
from .suffix import DenseSuffix


def checked_parts(
    state: dict, check: StateCheck, shape: StateShape, device
) -> tuple[DenseSuffix | None, RaggedStore | None]:
    """The suffix and the store of a layer's ``state``, after checking that its lengths, fold state, flags
    and tensors agree with each other, with ``shape`` (the model's sizes, the cache's fold settings, the
    other layers' batch) and with ``check``'s messages; ``state["attrs"]`` have the types a fresh layer's
    have (the caller checks them) and its tensors are on ``device``. ``(None, None)`` for an empty layer."""
    attrs, tensors, label, where = state["attrs"], state["tensors"], check.label, check.where
    length = attrs.get("cumulative_length", 0)
    if not attrs.get("is_initialized"):
        if length or state.get("store") is not None:
            check.fail(f"{label} holds tokens but is marked empty (damaged file).", where)
        return None, None
    s, settled, fold_at = attrs.get("_suffix_len"), attrs.get("settled_length", 0), attrs.get("fold_at", 1)
    if not isinstance(s, int) or not 0 <= s <= length:
        check.fail(f"{label}'s suffix length {s!r} is out of range [0, {length}].", f"{where}._suffix_len")
    if not 0 <= settled <= length or fold_at < 1:
        check.fail(f"{label}'s fold state (settled_length, fold_at) is out of range.", where)
    compressed, stored = attrs.get("compressed"), state.get("store") is not None
    if compressed != stored or not compressed and length != s:
        check.fail(
            f"{label} says compressed={compressed!r} but holds {'a' if stored else 'no'} store and "
            f"{s} of its {length} tokens in its suffix (an uncompressed layer holds them all there).",
            f"{where}.compressed",
        )
    for name, want in shape.fold_state.items() if compressed else ():  # what the cache's options set
        if attrs.get(name) != want:
            check.fail(
                f"{label} has {name}={attrs.get(name)!r}, its cache's options give {want!r} (altered file).",
                f"{where}.{name}",
            )
    suffix = DenseSuffix.from_state(state["suffix"], check, shape, s, 2 * length + fold_at + 17, device)
    b = suffix.batch_size
    sinks, queries = tensors.get("sinks_left"), tensors.get("queries")
    if sinks is not None and (sinks.shape != (b,) or sinks.is_floating_point()):
        check.fail(f"{label}'s sinks_left {list(sinks.shape)} does not fit {b} rows.", f"{where}.sinks_left")
    if queries is not None and (
        queries.ndim != 4 or queries.shape[:2] != (b, shape.query_heads) or queries.dtype != shape.dtype
    ):
        check.fail(
            f"{label}'s recorded queries {list(queries.shape)} do not fit the model.", f"{where}.queries"
        )
    value_dim = int(suffix.values.shape[-1])
    store = state["store"]
    return suffix, None if store is None else RaggedStore.from_state(
        store, check, shape, b, length - s, value_dim
    )


# what state_dict gives as parts of their own, or leaves out: the store (``_store``, given with its tail
# joined), the dtype and device (the suffix's), the sliding window's tensor (rebuilt from sliding_window, on the
# layer's device); the eviction record's fields are given among the layer's own
_PARTS = {"suffix", "store", "_store", "tail", "eviction", "dtype", "device", "_sliding_window_tensor"}


class LayerState:
    """A layer's state as a plain dict (a mixin of LUKVLayer): its own attributes (``vars``: every plain
    attribute the layer sets, transformers' included, travels), its eviction record's fields beside them,
    its parts' states and its dtype.

    A mixin, not a part the layer holds: the state is the layer's own attributes (``vars(layer)``, as the
    saved-context format records them) and ``load_state`` sets them back on the layer."""

    suffix: DenseSuffix | None
    store: RaggedStore | None
    eviction: EvictionRecord
    is_initialized: bool
    sliding_window: int | None
    _sliding_window_tensor: torch.Tensor  # a sliding layer's window, on its device (transformers' name)
    dtype: Any
    device: Any

    def state_dict(self) -> dict[str, Any]:
        """The layer's state: ``attrs`` (its plain attributes by name, transformers' included, its eviction
        record's fields (:data:`~lukv_cache.cache.storage.record.RECORD_FIELDS`) and ``_suffix_len``, the
        suffix's length, under the saved-context format's names), ``tensors`` (its other tensors, the
        record's: ``sinks_left``, ``queries``), ``dtype`` (None before the first update) and its parts'
        states, ``suffix`` (:meth:`DenseSuffix.state_dict`) and ``store`` (:meth:`RaggedStore.state_dict`),
        each None when the layer has none."""
        own = {name: value for name, value in vars(self).items() if name not in _PARTS}
        own.update(self.eviction.fields())
        own["_suffix_len"] = 0 if self.suffix is None else self.suffix.length
        return {
            "attrs": {name: value for name, value in own.items() if not isinstance(value, torch.Tensor)},
            "tensors": {name: value for name, value in own.items() if isinstance(value, torch.Tensor)},
            "dtype": self.dtype if self.is_initialized else None,
            "suffix": None if self.suffix is None else self.suffix.state_dict(),
            "store": None if self.store is None else self.store.state_dict(),
        }

    def load_state(self, state: dict, check: StateCheck, shape: StateShape, device) -> None:
        """Take :meth:`state_dict`'s ``state``, its tensors on ``device``, checked against ``shape`` (the
        model's sizes, the cache's fold settings, the other layers' batch) by :func:`checked_parts`;
        ``state["attrs"]`` have the types a fresh layer's have (the caller checks them)."""
        values = {**state["attrs"], **state["tensors"]}
        for name, value in values.items():
            if name != "_suffix_len" and name not in RECORD_FIELDS:
                setattr(self, name, value)
        self.eviction = EvictionRecord.from_fields(values)
        if self.sliding_window is not None:
            self._sliding_window_tensor = self._sliding_window_tensor.to(device)
        if self.is_initialized:
            self.dtype, self.device = state["dtype"], device
        self.suffix, self.store = checked_parts(state, check, shape, device)
