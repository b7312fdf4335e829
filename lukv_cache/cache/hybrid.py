"""A layer that carries a linear-attention (SSM / conv) state *and* attention KV, as transformers'
``LinearAttentionAndFullAttentionLayer`` does for parallel hybrids (Falcon-H1's attention beside its Mamba
mixer, Zamba's shared attention blocks): transformers' own linear state, with the attention part stored
and compressed as a :class:`~lukv_cache.cache.layer.LUKVLayer`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionLayer

from .layer import LUKVLayer


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
