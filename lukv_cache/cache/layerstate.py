"""A :class:`~lukv_cache.cache.layer.LUKVLayer`'s state checked before it is used (a saved context is
untrusted input): :func:`checked_parts` checks the state :meth:`LUKVLayer.state_dict
<lukv_cache.cache.layer.LUKVLayer.state_dict>` gives and builds the layer's parts from it, the dense suffix
and the ragged store, each checked by its own ``from_state``."""

from __future__ import annotations

from .ragged import RaggedStore
from .statecheck import StateCheck, StateShape
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
