"""Tensor parallelism: which KV heads this rank holds, and the one collective exact budgets need.

Under transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")``, i.e.
``DistributedConfig(tp_size=N)``) ``k_proj`` and ``v_proj`` are ``"colwise"``: their weight is a DTensor
``Shard(0)`` over the ``"tp"`` mesh, so rank ``r`` of ``N`` computes the ``r``-th contiguous block of output
columns (``torch.chunk`` order), i.e. KV heads ``r * H / N`` to ``(r + 1) * H / N``. Each rank's cache
therefore sees ``H / N`` heads per layer; the model's config still says ``H``.

Budgets must not depend on how the heads are split, so every allocator is asked about all ``H`` heads:
each rank all-gathers the step's scores over the tensor-parallel group (``[L, B, H / N, R]`` fp32: 4 bytes
per token and head, where bf16 keys and values take ``4 * head_dim``), every rank runs the same
allocation on the same ``[L, B, H, R]`` request, and keeps its own block of the counts. So per-(layer,
head) budgets are those of a single-process run for every allocator: the profile's (computed on the full
table, never renormalised over the local heads), ``uniform``'s and ``pyramid``'s remainders, and the
cross-head competitions of ``adakv``, ``global``, ``hybrid`` and ``hybrid_global`` (up to the last bits
of the scores, which tensor-parallel matmuls and all-reduces may round differently).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...errors import TensorParallelError


@dataclass(frozen=True)
class HeadShard:
    """This rank's contiguous block of every layer's KV heads: rank ``rank`` of ``size``; ``group``: the
    tensor-parallel process group (``None``: no collectives, only the arithmetic).

    >>> shard = HeadShard(rank=1, size=2)
    >>> shard.heads(4)
    slice(2, 4, None)
    """

    rank: int
    size: int
    group: Any = None

    def __deepcopy__(self, memo: dict) -> HeadShard:
        return self  # immutable; a copied cache talks to the same process group (which cannot be copied)

    def heads(self, num_heads: int) -> slice:
        """The slice of ``num_heads`` (the model's KV heads per layer) this rank holds."""
        per_rank = num_heads // self.size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    @classmethod
    def check(cls, local_heads: int, kv_heads: int, rank: int, size: int, group: Any = None) -> HeadShard:
        """The shard of rank ``rank`` of ``size`` that holds ``local_heads`` of ``kv_heads``; raises
        :class:`~lukv_cache.errors.TensorParallelError` unless the heads split evenly and this rank holds
        its share.

        >>> HeadShard.check(2, 4, rank=0, size=2)
        HeadShard(rank=0, size=2, group=None)
        """
        info = {"kv_heads": kv_heads, "local_heads": local_heads, "tp_size": size}
        if size < 1 or not 0 <= rank < size:
            raise TensorParallelError(
                f"Tensor-parallel rank {rank} of size {size} is not a valid rank.", **info
            )
        if kv_heads % size:
            raise TensorParallelError(
                f"The model has {kv_heads} KV heads per layer, which do not split evenly over tensor-parallel "
                f"size {size}: LUKVCache keeps per-head budgets and needs whole heads on every rank. Use a "
                f"tensor-parallel size that divides {kv_heads}.",
                **info,
            )
        if local_heads * size != kv_heads:
            raise TensorParallelError(
                f"This rank's cache sees {local_heads} KV heads per layer, but the model's {kv_heads} KV heads "
                f"over tensor-parallel size {size} give {kv_heads // size} per rank. The device mesh passed to "
                "LUKVCache(device_mesh=...) must be the one the model's k_proj/v_proj are sharded over.",
                **info,
            )
        return cls(rank, size, group)

    def gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """All ranks' ``local`` blocks concatenated along ``dim`` in rank order (an all-gather over
        ``group``; every rank of the group must call it)."""
        if self.size == 1:
            return local
        if self.group is None:
            raise TensorParallelError(
                "HeadShard without a process group cannot gather the other ranks' heads.", tp_size=self.size
            )
        import torch.distributed as dist

        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=dim)


def mesh_shard(mesh: Any) -> HeadShard:
    """This rank's place in the tensor-parallel dimension of ``mesh``: a 1-D ``DeviceMesh``, or the
    ``"tp"`` dimension of an n-D one (transformers' ``model._device_mesh`` is ``("pp", "fsdp", "tp")``)."""
    mesh_type: type | tuple[()]
    try:
        from torch.distributed.device_mesh import DeviceMesh

        mesh_type = DeviceMesh
    except ImportError:  # torch built without distributed
        mesh_type = ()
    if not isinstance(mesh, mesh_type):
        raise TensorParallelError(
            f"device_mesh must be a torch.distributed DeviceMesh (the model's tensor-parallel mesh), got "
            f"{type(mesh).__name__}."
        )
    if mesh.ndim > 1:
        names = mesh.mesh_dim_names or ()
        if "tp" not in names:
            raise TensorParallelError(
                f"device_mesh has {mesh.ndim} dimensions {tuple(names)} and none is named 'tp': pass the "
                "tensor-parallel mesh (a 1-D DeviceMesh, or one with a 'tp' dimension)."
            )
        mesh = mesh["tp"]
    return HeadShard(mesh.get_local_rank(), mesh.size(), mesh.get_group())


def module_tp_mesh(module: Any) -> Any:
    """The tensor-parallel mesh an attention module's weights are sharded over, or ``None``: the mesh of
    its first DTensor parameter with a ``Shard`` placement on a 1-D mesh or on a ``"tp"`` dimension."""
    if module is None or not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor, Shard

    for param in module.parameters():
        if not isinstance(param, DTensor):
            continue
        mesh = param.device_mesh
        names = mesh.mesh_dim_names or ()
        dim = 0 if mesh.ndim == 1 else names.index("tp") if "tp" in names else None
        if dim is not None and isinstance(param.placements[dim], Shard):
            return mesh if mesh.ndim == 1 else mesh["tp"]
    return None


def head_shard(
    local_heads: int, kv_heads: int | None, given: HeadShard | None = None, module: Any = None
) -> HeadShard | None:
    """This rank's :class:`HeadShard` when the cache sees fewer KV heads than the model has (``None`` when
    it sees them all: no tensor parallelism, or replicated KV). Rank and size are ``given`` (from the
    cache's ``device_mesh``) or come from the mesh ``module``'s sharded weights live on. Without either, a
    single process is left alone (some configs count KV heads differently from what reaches the cache)
    and a multi-process run raises."""
    if kv_heads is None or local_heads == kv_heads:
        return None
    if given is None:
        mesh = module_tp_mesh(module)
        given = None if mesh is None else mesh_shard(mesh)
    if given is None:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if not distributed or torch.distributed.get_world_size() == 1:
            return None
        raise TensorParallelError(
            f"LUKVCache sees {local_heads} KV heads per layer but the model's config has {kv_heads}, and the "
            "attention weights are not sharded DTensors. If the model is tensor-parallel, pass its mesh: "
            "LUKVCache(..., device_mesh=<the tensor-parallel DeviceMesh>).",
            kv_heads=kv_heads,
            local_heads=local_heads,
        )
    return HeadShard.check(local_heads, kv_heads, given.rank, given.size, given.group)
