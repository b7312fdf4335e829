"""The dense suffix of a :class:`~lukv_cache.cache.storage.layer.LUKVLayer`: ``[B, H, S, D]`` keys and values, the
protected recent window and every token that arrives after compression, appended in place into buffers of
``capacity`` tokens (the rest is room to decode into; the layer decides when they grow or fold).

:attr:`DenseSuffix.keys` / :attr:`DenseSuffix.values` are views of the buffers' first :attr:`length`
tokens, refreshed on every change and otherwise the same tensor objects (attention matches a layer's
announced call by them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .state_check import StateCheck, StateShape

MIN_CAPACITY = 16  # room to decode after compression before the buffer first grows


@dataclasses.dataclass(eq=False)
class DenseSuffix:
    """``key_buffer`` / ``value_buffer`` ``[B, H, capacity, D]``, of which the first ``length`` tokens are held.

    >>> suffix = DenseSuffix.of(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), capacity=8)
    >>> suffix.write(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
    >>> suffix.length, suffix.capacity, suffix.keys.shape
    (4, 8, torch.Size([1, 2, 4, 4]))
    """

    key_buffer: torch.Tensor
    value_buffer: torch.Tensor
    length: int = 0
    keys: torch.Tensor = dataclasses.field(init=False, repr=False)
    values: torch.Tensor = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._sync()

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor, capacity: int | None = None) -> DenseSuffix:
        """A suffix holding ``keys`` / ``values`` ``[B, H, S, D]`` in fresh buffers of at least ``capacity``
        tokens (never views of a larger tensor: that would pin it)."""
        s = keys.shape[-2]
        cap = max(s, capacity or 0)
        kbuf = keys.new_empty((*keys.shape[:2], cap, keys.shape[-1]))
        vbuf = values.new_empty((*values.shape[:2], cap, values.shape[-1]))
        kbuf[:, :, :s] = keys
        vbuf[:, :, :s] = values
        return cls(kbuf, vbuf, s)

    def _sync(self) -> None:
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    @property
    def capacity(self) -> int:
        return int(self.key_buffer.shape[-2])

    @property
    def batch_size(self) -> int:
        return int(self.key_buffer.shape[0])

    @property
    def num_heads(self) -> int:
        return int(self.key_buffer.shape[1])

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append ``[B, H, n, D]`` in place; the caller made room (``length + n <= capacity``)."""
        s, n = self.length, keys.shape[-2]
        self.key_buffer[:, :, s : s + n] = keys
        self.value_buffer[:, :, s : s + n] = values
        self.length = s + n
        self._sync()

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (the buffers stay)."""
        self.length = length
        self._sync()

    def to(self, device) -> DenseSuffix:
        """The same suffix on ``device`` (offloading)."""
        kbuf, vbuf = (t.to(device, non_blocking=True) for t in (self.key_buffer, self.value_buffer))
        return DenseSuffix(kbuf, vbuf, self.length)

    def memory_bytes(self) -> int:
        """Bytes of both buffers, their room included."""
        return sum(t.numel() * t.element_size() for t in (self.key_buffer, self.value_buffer))

    def state_dict(self) -> dict[str, Any]:
        """``keys`` / ``values``: the held tokens ``[B, H, S, D]`` (not the buffers' room) and ``capacity``."""
        return {"keys": self.keys, "values": self.values, "capacity": self.capacity}

    @classmethod
    def from_state(
        cls, state: dict, check: StateCheck, shape: StateShape, length: int, most: int, device
    ) -> DenseSuffix:
        """The suffix of :meth:`state_dict`, checked: ``length`` tokens of the model's KV heads, head dim
        and dtype, the batch of the other layers, a capacity in ``[length, most]``. The buffers are room
        to decode into, not data: never more than the tokens imply (a larger saved capacity, after a fold
        or a crop, regrows on demand as decoding needs it)."""
        where, heads = check.where, shape.kv_heads
        keys = check.tensor(
            state["keys"],
            f"{where}.suffix_keys",
            dtype=shape.dtype,
            shape=(None, heads, length, shape.head_dim),
        )
        b = int(keys.shape[0])
        shape.row_count(b, check, f"{where}.suffix_keys")
        values = check.tensor(
            state["values"], f"{where}.suffix_values", dtype=shape.dtype, shape=(b, heads, length, None)
        )
        capacity = state.get("capacity")
        if not isinstance(capacity, int) or not length <= capacity <= most:
            check.fail(
                f"{check.label}'s suffix capacity {capacity!r} is out of range.", f"{where}.suffix_capacity"
            )
        capacity = min(capacity, max(2 * length, length + MIN_CAPACITY))
        return cls.of(keys.to(device), values.to(device), capacity)
