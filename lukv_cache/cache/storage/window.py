"""What a sliding-window :class:`~lukv_cache.cache.storage.layer.LUKVLayer` does with its window (a sliding layer
compressed like a full one because its prompt fit the window): it drops what no later query can attend,
from its ragged store (:meth:`SlidingWindow.slide`, at each fold) and from its dense suffix
(:meth:`SlidingWindow.drop_out_of_window`, after an eviction), unless assisted decoding asked it to keep its
past; and it hands what it holds to transformers' own sliding layer (:meth:`SlidingWindow.to_sliding`).

The part reads the layer's ``sliding_window`` (None: a full-attention layer, for which every method here
does nothing), ``keeps_past``, ``cumulative_length``, and replaces its ``store`` and ``suffix``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from .ragged import RaggedStore
from .suffix import DenseSuffix


class SlidingWindow:
    """The sliding-window operations of a layer (a mixin of LUKVLayer; see the module docstring).

    A mixin, not a part the layer holds: its fields are transformers' sliding-layer contract, read on the
    layer itself (``sliding_window``, ``is_sliding``, ``_sliding_window_tensor``; transformers calls
    ``activate_past_recording`` on the layer), and its operations replace the layer's own store and suffix.

    >>> from lukv_cache.cache.storage.layer import LUKVLayer
    >>> import torch
    >>> layer = LUKVLayer(sliding_window=4)
    >>> _ = layer.update(torch.zeros(1, 1, 6, 2), torch.zeros(1, 1, 6, 2))
    >>> layer.window_start  # the next token (column 6) reads columns 3, 4, 5 and itself
    3
    """

    sliding_window: int | None
    keeps_past: bool
    is_sliding: bool
    _sliding_window_tensor: torch.Tensor  # transformers' name for it
    cumulative_length: int
    store: RaggedStore | None
    suffix: DenseSuffix | None

    def set_window(self, sliding_window: int | None) -> None:
        """The layer's window (``None``: a full-attention layer), as transformers' sliding layer names it."""
        self.sliding_window = sliding_window
        self.keeps_past = False  # assisted decoding may crop back into the window: drop nothing
        if sliding_window is not None:
            self.is_sliding = True
            self._sliding_window_tensor = torch.tensor(sliding_window, dtype=torch.long)

    def activate_past_recording(self, *args, **kwargs) -> None:
        """Assisted decoding crops rejected drafts: a sliding layer then keeps the tokens it could drop
        (transformers 5.25 passes ``recurrent_states_to_keep=``, which concerns linear-attention states)."""
        self.keeps_past = True

    @property
    def window_start(self) -> int | None:
        """A sliding layer: the oldest logical column a later query can read (the next token, at column
        ``cumulative_length``, reads columns after ``cumulative_length - sliding_window``, as transformers'
        sliding mask and ``DynamicSlidingWindowLayer``, which keeps the last ``sliding_window - 1``); ``None``
        for a full-attention layer."""
        return None if self.sliding_window is None else self.cumulative_length - self.sliding_window + 1

    def slide(self) -> None:
        """A sliding layer: drop the stored tokens no later query can attend (older than :attr:`window_start`)."""
        oldest = self.window_start
        if oldest is None or self.keeps_past or self.store is None or not self.store.num_tokens:
            return
        if oldest > 0 and int(self.store.positions.min()) < oldest:
            self.store = self.store.select(self.store.positions >= oldest)

    def drop_out_of_window(self) -> None:
        """A sliding layer: drop what no later query can attend from the dense suffix too (the prompt's
        tokens older than the window, once its forward attended them), so that a sliding layer never holds
        a long prompt whole while the rest of the prefill runs; nothing while it keeps its past."""
        oldest, suffix = self.window_start, self.suffix
        if oldest is None or self.keeps_past or suffix is None or not suffix.length:
            return
        drop = oldest - (self.cumulative_length - suffix.length)  # suffix tokens before it
        if drop > 0:
            self.suffix = DenseSuffix.of(suffix.keys[:, :, drop:], suffix.values[:, :, drop:])
        self.slide()

    def to_sliding(self, sliding_window: int, *, record_past: bool = False) -> DynamicSlidingWindowLayer:
        """The stock sliding layer holding what this (never compressed) layer holds."""
        layer = DynamicSlidingWindowLayer(sliding_window=sliding_window)
        if record_past:
            layer.activate_past_recording()
        if self.suffix is not None and self.suffix.length:
            layer.update(self.suffix.keys.clone(), self.suffix.values.clone())
        return layer
