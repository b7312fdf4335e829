"""What a memory budget counts on each kind of layer (:class:`~lukv_cache.cache.options.memory.Kinds`), read
off the cache's layers: the layers it compresses (full attention, sliding windows under ``sliding="compress"``,
the attention part of a parallel hybrid) and what the model's own cache would hold in them; the layers left to
transformers (sliding windows kept whole, chunked windows, KV-sharing producers, indexed layers) at the bytes
they hold; linear-attention / SSM states at their size; layers that read another layer's KV at nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

from ...errors import ConfigurationError
from ..options.memory import Kinds
from ..storage.layer import LUKVLayer


def cache_kinds(cache: Any, template: LUKVLayer, heads: int) -> Kinds:
    """:func:`layer_kinds` of ``cache``'s layers (a :class:`~.contract.CompressedCache`)."""
    return layer_kinds(cache.layers, cache.layout.kv_readers, template, heads)


def layer_kinds(layers: list[Any], readers: list[int], template: LUKVLayer, heads: int) -> Kinds:
    """The :class:`Kinds` of ``layers`` (a cache's), ``readers`` the layers that read another layer's KV (they
    hold nothing: transformers' cache neither); ``template``: a compressed layer holding a forward, whose
    dtype, head dims and batch give the bytes of a layer not filled yet in this forward (the same heads,
    ``heads`` of them, as the compressed layers), and whose length is the columns every layer has seen.

    A linear-attention state not filled yet counts as a filled one of the same class (the model's layers of
    one kind hold states of one size); with none filled, as nothing until it is (the first forward's layers
    fill it in order: the hybrids we know run their linear layers before their first attention one)."""
    assert template.suffix_keys is not None and template.suffix_values is not None  # it holds a forward
    batch = template.batch_size
    keys, values = template.suffix_keys, template.suffix_values
    token = heads * (keys.shape[-1] + values.shape[-1]) * keys.element_size()  # one row, every head
    own = [_state_bytes(layer, batch) for layer in layers]  # 0 where none, or not filled yet
    states = {type(layer): size for layer, size in zip(layers, own) if size}
    compressed: list[int | None] = []
    stock: list[tuple[int, int | None]] = []
    state_bytes = 0
    for i, layer in enumerate(layers):
        if i in readers:
            continue
        if isinstance(layer, LinearAttentionCacheLayerMixin):  # alone, or beside compressed attention
            state_bytes += own[i] or states.get(type(layer), 0)
        if isinstance(layer, LUKVLayer):
            _check_shape(i, layer, template)
            window = layer.sliding_window
            compressed.append(None if window is None else window - 1)
        elif isinstance(layer, DynamicLayer):  # transformers' own attention layer (a sliding one too)
            window = getattr(layer, "sliding_window", None)
            stock.append((_token_bytes(layer) or token, None if window is None else window - 1))
    return Kinds(tuple(compressed), tuple(stock), state_bytes)


def _token_bytes(layer: Any) -> int:
    """Bytes of one token of one row in a filled stock layer (its keys, values and indexer keys), 0 if empty."""
    if not getattr(layer, "is_initialized", False):
        return 0
    tensors = [getattr(layer, name, None) for name in ("keys", "values", "indexer_keys")]
    return sum(
        t.shape[1] * t.shape[-1] * t.element_size()
        for t in tensors
        if isinstance(t, torch.Tensor) and t.ndim == 4
    )


def _state_bytes(layer: Any, batch: int) -> int:
    """Bytes per row of a linear-attention / SSM layer's conv and recurrent states (0: none, or not filled)."""
    if not isinstance(layer, LinearAttentionCacheLayerMixin):
        return 0
    tensors = [*layer.conv_states.values(), *layer.recurrent_states.values()]
    total = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total // max(batch, 1)


def _check_shape(idx: int, layer: LUKVLayer, template: LUKVLayer) -> None:
    """A budget counts every compressed layer's tokens at ``template``'s shape: refuse a layer of another
    (Gemma-4's global layers have wider heads than its sliding ones) rather than count it wrong."""
    keys, values = layer.suffix_keys, layer.suffix_values
    if keys is None or values is None or template.suffix_keys is None or template.suffix_values is None:
        return  # not filled yet: checked when it is
    shape = (layer.num_heads, keys.shape[-1], values.shape[-1])
    expected = (template.num_heads, template.suffix_keys.shape[-1], template.suffix_values.shape[-1])
    if shape != expected:
        raise ConfigurationError(
            f"memory= / max_bytes= count every compressed layer at one shape, and this model's differ: layer "
            f"{idx} holds {shape[0]} KV heads of key / value dims {shape[1]} / {shape[2]}, others "
            f"{expected[0]} of {expected[1]} / {expected[2]}. Use ratio= with kv_bits= on it for now."
        )
