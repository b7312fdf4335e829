"""Hybrid models (linear-attention / SSM layers beside attention ones), on both sides of the cache.

* :class:`LUKVHybridLayer`: a layer that carries a linear-attention (SSM / conv) state *and* attention KV,
  as transformers' ``LinearAttentionAndFullAttentionLayer`` does for parallel hybrids (Falcon-H1's
  attention beside its Mamba mixer, Zamba's shared attention blocks): transformers' own linear state,
  with the attention part stored and compressed as a :class:`~lukv_cache.cache.layer.LUKVLayer`.
* :class:`HybridRouting`: the ``DynamicCache`` methods of :class:`~lukv_cache.LUKVCache` that first learn
  the model's layer layout (a cache built without ``config=``), and route the linear-attention / SSM
  state calls to the layers that hold those states (a typed error where the layout is unknown).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin, LinearAttentionLayer

from .._compat import takes_cache
from ..errors import ConfigurationError, IncompatibleAttentionError
from .callstack import calling_model
from .layer import LUKVLayer

if TYPE_CHECKING:
    from .layout import Layout


# transformers' two bases declare device / dtype / is_croppable differently (LinearAttentionLayer's win, by
# the MRO, as in its own LinearAttentionAndFullAttentionLayer): nothing to annotate here
class LUKVHybridLayer(LinearAttentionLayer, LUKVLayer):  # type: ignore[misc, override]
    """Linear-attention state (transformers') plus compressed attention KV (lukv's), in one layer.

    >>> layer = LUKVHybridLayer()
    >>> keys, _ = layer.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    >>> layer.get_seq_length(), layer.has_previous_state[0]
    (3, False)
    """

    is_compileable = False

    def __init__(self, number_of_states: int = 1, **kwargs) -> None:
        LUKVLayer.__init__(self)
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
    """The layout-learning and linear-state routing of :class:`~lukv_cache.LUKVCache` (a base of it,
    holding nothing itself: the layout is the cache's ``layout``)."""

    layout: Layout

    def _adopt_layout(self) -> None:
        """Built without ``config=``: when the model first reaches the cache, learn the layout from the
        model itself (the config of the module calling in), so that hybrid models' linear-attention / SSM
        layers, chunked and KV-sharing layers get their own layers from the start, as with ``config=``."""
        if self.layer_class_to_replicate is None or self.layers:
            return
        model = calling_model()
        if model is None:
            return
        from transformers import PreTrainedModel

        if isinstance(model, PreTrainedModel) and not takes_cache(model):
            warnings.warn(
                f"{type(model).__name__} takes no cache (neither cache nor past_key_values: it keeps a state of its "
                "own, as RWKV does): this LUKVCache stays empty and compresses nothing.",
                stacklevel=4,
            )
        self.layout.set_layout(self, model.config)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        self._adopt_layout()
        return super().get_seq_length(layer_idx)

    # what kind each layer is: a cache that has not learned the layout yet has no layers, and transformers
    # 5.24's generate reads an empty is_linear as "all linear" and then never asks get_seq_length
    @property
    def is_linear(self) -> list[bool]:
        self._adopt_layout()
        return super().is_linear

    @property
    def is_sliding(self) -> list[bool]:
        self._adopt_layout()
        return super().is_sliding

    @property
    def is_dummy(self) -> list[bool]:
        self._adopt_layout()
        return super().is_dummy

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        self._adopt_layout()
        return super().get_mask_sizes(query_length, layer_idx)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        self._adopt_layout()
        return super().has_previous_state(layer_idx, state_idx)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        self._adopt_layout()
        return super().get_conv_state(self._linear(layer_idx), state_idx)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        self._adopt_layout()
        return super().update_conv_state(conv_states, self._linear(layer_idx), state_idx, **kwargs)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        self._adopt_layout()
        return super().get_recurrent_state(self._linear(layer_idx), state_idx)

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ):
        self._adopt_layout()
        return super().update_recurrent_state(recurrent_states, self._linear(layer_idx), state_idx, **kwargs)

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        self._adopt_layout()
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
