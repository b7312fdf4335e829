"""Hybrid models (linear-attention / SSM layers beside attention ones), on both sides of the cache.

* :class:`LUKVHybridLayer`: a layer that carries a linear-attention (SSM / conv) state *and* attention KV,
  as transformers' ``LinearAttentionAndFullAttentionLayer`` does for parallel hybrids (Falcon-H1's
  attention beside its Mamba mixer, Zamba's shared attention blocks): transformers' own linear state,
  with the attention part stored and compressed as a :class:`~lukv_cache.cache.storage.layer.LUKVLayer`.
* :class:`HybridRouting`: the ``DynamicCache`` methods of :class:`~lukv_cache.LUKVCache` that route the
  linear-attention / SSM state calls to the layers that hold those states: a typed error asking for
  ``config=`` where the layout is unknown (a cache built without it learns the layout at its first
  attention call, after the layers such a model calls first).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin, LinearAttentionLayer

from ...errors import ConfigurationError, IncompatibleAttentionError
from ..storage.layer import FOLD_AT, LUKVLayer


# transformers' two bases declare device / dtype / is_croppable differently (LinearAttentionLayer's win, by
# the MRO, as in its own LinearAttentionAndFullAttentionLayer): nothing to annotate here (5.25 needs no
# "override": unused there)
class LUKVHybridLayer(LinearAttentionLayer, LUKVLayer):  # type: ignore[misc, override, unused-ignore]
    """Linear-attention state (transformers') plus compressed attention KV (lukv's), in one layer.

    >>> layer = LUKVHybridLayer()
    >>> keys, _ = layer.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    >>> layer.get_seq_length(), layer.has_previous_state[0]
    (3, False)
    """

    is_compileable = False

    def __init__(
        self,
        number_of_states: int = 1,
        *,
        kv_bits: int | None = None,
        fold_at: int = FOLD_AT,
        bounded: bool = False,
    ) -> None:
        # kv_bits, fold_at, bounded: the attention part's settings (LUKVLayer's)
        LUKVLayer.__init__(self, kv_bits=kv_bits, fold_at=fold_at, bounded=bounded)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        # update() initialises the attention part with (keys, values); the linear state's updates pass keywords
        if len(args) == 2 and not kwargs:
            LUKVLayer.lazy_initialization(self, *args)
        elif not args:
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return LUKVLayer.update(self, key_states, value_states, *args, **kwargs)

    def get_max_length(self) -> int:
        return LUKVLayer.get_max_length(self)

    def get_seq_length(self) -> int:
        # the attention part's length (from transformers 5.25 LinearAttentionLayer has its own, a tensor)
        return LUKVLayer.get_seq_length(self)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        LUKVLayer.reset(self)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        LinearAttentionLayer.reorder_cache(self, beam_idx)
        LUKVLayer.reorder_cache(self, beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        LinearAttentionLayer.crop(self, tokens_to_remove)
        LUKVLayer.crop(self, tokens_to_remove)

    def offload(self) -> None:
        LinearAttentionLayer.offload(self)
        LUKVLayer.offload(self)

    def prefetch(self) -> None:
        LinearAttentionLayer.prefetch(self)
        LUKVLayer.prefetch(self)

    def memory_bytes(self) -> int:
        states = [*self.conv_states.values(), *self.recurrent_states.values()]
        linear = sum(t.numel() * t.element_size() for t in states if isinstance(t, torch.Tensor))
        return LUKVLayer.memory_bytes(self) + linear


class HybridRouting(DynamicCache):
    """The linear-state routing of :class:`~lukv_cache.LUKVCache` (a base of it, holding nothing itself:
    it finds the linear-attention / SSM layers among the cache's ``layers``)."""

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return super().get_conv_state(self._linear(layer_idx), state_idx)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        return super().update_conv_state(conv_states, self._linear(layer_idx), state_idx, **kwargs)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return super().get_recurrent_state(self._linear(layer_idx), state_idx)

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ):
        return super().update_recurrent_state(recurrent_states, self._linear(layer_idx), state_idx, **kwargs)

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        if layer_idx >= len(self.layers) or not hasattr(self.layers[layer_idx], "update_indexer"):
            raise IncompatibleAttentionError(
                f"Layer {layer_idx} attends through a sparse-attention indexer (DeepSeek-V3.2's DSA and kin), whose "
                "indexer keys this LUKVCache has no layer for. Build the cache with config=model.config "
                "(LUKVCache(..., config=model.config), or LUKVCache.from_pretrained(model, ...)): the indexed "
                "layers then keep transformers' own layer, uncompressed."
            )
        return super().update_indexer(indexer_key_states, layer_idx)

    def _linear(self, layer_idx: int) -> int:
        """``layer_idx``, once it is known to be a linear-attention / SSM layer; else a typed error."""
        if layer_idx < len(self.layers) and isinstance(
            self.layers[layer_idx], LinearAttentionCacheLayerMixin
        ):
            return layer_idx
        raise ConfigurationError(
            f"Layer {layer_idx} of this model is a linear-attention or state-space layer, and this LUKVCache does "
            "not know the model's layer layout. Build it with config=model.config (LUKVCache(..., "
            "config=model.config), or LUKVCache.from_pretrained(model, ...))."
        )
