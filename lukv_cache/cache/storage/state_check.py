"""How a part of the cache refuses a state that does not fit it (:meth:`RaggedStore.from_state
<lukv_cache.cache.storage.ragged.RaggedStore.from_state>`, :meth:`DenseSuffix.from_state
<lukv_cache.cache.storage.suffix.DenseSuffix.from_state>`, :meth:`LUKVLayer.load_state
<lukv_cache.cache.storage.layer.LUKVLayer.load_state>`): a state read from a file is untrusted input, checked before
any tensor is used, and every refusal is a :class:`~lukv_cache.errors.SavedContextError` naming the field.
The saved-context reader passes one that also names its file.
"""

from __future__ import annotations

import dataclasses
from typing import NoReturn

import torch

from ...errors import SavedContextError


@dataclasses.dataclass(frozen=True)
class StateCheck:
    """``label`` names the part in messages (``"layer 3"``), ``where`` is its field prefix (``"layers.3"``).

    >>> check = StateCheck("layer 0", "layers.0")
    >>> check.tensor(torch.zeros(2, 3), "layers.0.queries", ndim=2).shape
    torch.Size([2, 3])
    """

    label: str = "state"
    where: str = "state"

    def at(self, label: str, where: str) -> StateCheck:
        """The same check for another part (its messages and fields)."""
        return dataclasses.replace(self, label=label, where=where)

    def fail(self, why: str, field: str | None = None) -> NoReturn:
        raise SavedContextError(why, field=field)

    def tensor(
        self,
        t: torch.Tensor,
        name: str,
        *,
        dtype: torch.dtype | None = None,
        shape: tuple | None = None,
        ndim: int | None = None,
    ) -> torch.Tensor:
        """``t`` (tensor ``name``), checked: its dtype, its shape (``None`` entries match any size) or its rank."""
        bad = (dtype is not None and t.dtype != dtype) or (ndim is not None and t.ndim != ndim)
        if shape is not None:
            bad = bad or t.ndim != len(shape) or any(w is not None and w != g for w, g in zip(shape, t.shape))
        if bad:
            want = [("*" if w is None else w) for w in shape] if shape is not None else f"{ndim}-D"
            self.fail(
                f"tensor {name!r} is {dtype_name(t.dtype)} {list(t.shape)}, which does not fit the metadata "
                f"(expected {'' if dtype is None else dtype_name(dtype) + ' '}{want}). Save the context again.",
                name,
            )
        return t


def put_tensor(tensors: dict[str, torch.Tensor], name: str, t: torch.Tensor) -> str:
    """Add ``t`` to a file's ``tensors`` as ``name`` (returned): a fresh, contiguous CPU copy, since
    safetensors refuses tensors that share memory."""
    tensors[name] = t.detach().to("cpu").clone(memory_format=torch.contiguous_format)
    return name


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``, as the saved context writes dtypes."""
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass
class StateShape:
    """What every layer's state must fit: the model's KV heads (of the layer being checked), head dim, query
    heads and dtype, the cache's ``fold_state`` (the ``fold_at``, ``bounded`` and ``kv_bits`` its options set
    on a layer it compresses), the model's positions (``max_length``) and the batch, taken from the first
    layer that holds tokens (:meth:`row_count`)."""

    kv_heads: int
    head_dim: int
    query_heads: int
    dtype: torch.dtype
    max_length: int
    fold_state: dict = dataclasses.field(default_factory=dict)
    batch: int | None = None

    def row_count(self, b: int, check: StateCheck, field: str) -> None:
        """Record the batch of the first layer, refuse another in a later one."""
        if self.batch is None:
            self.batch = b
        elif b != self.batch:
            check.fail(f"{field} holds {b} batch rows, other layers {self.batch} (damaged file).", field)
