"""What the allocators of :mod:`lukv_cache.allocation` share: the request an allocator sees, the built
allocator, the registry and :func:`register_allocator`, and :func:`largest_remainder` (integer counts
proportional to weights: :mod:`.budget`'s water-filling). The built-ins (:mod:`.builtin`) and the
package both import it; the package re-exports every public name, registered built-ins included.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .._registry import Registry
from ..errors import ConfigurationError
from .budget import water_fill


@dataclass(frozen=True)
class AllocationRequest:
    """What an allocator sees: the scores of ``L`` layers of one forward.

    ``scores``: fp32 ``[L, B, H_kv, R]``, the scorer's scores over the compressed region, ``-inf`` where a
    token is not evictable. ``n_evictable``: int64 ``[B]`` evictable tokens per batch row (the same for
    every head and layer). ``ratio``: float64 ``[B]``, the fraction of evictable tokens to remove in each
    row. ``layers``: the model layer index of each of the ``L`` rows of ``scores``. ``num_layers``: the
    model's decoder layers. ``min_keep``: fraction of a head's evictable tokens it keeps at least (and at
    least one token).

    >>> req = AllocationRequest(torch.zeros(1, 1, 2, 10), torch.tensor([10]), torch.tensor([0.8]), (0,), 1)
    >>> req.layer_total().tolist()
    [4]
    """

    scores: torch.Tensor
    n_evictable: torch.Tensor
    ratio: torch.Tensor
    layers: tuple[int, ...]
    num_layers: int
    min_keep: float = 0.01

    @property
    def num_heads(self) -> int:
        return int(self.scores.shape[2])

    @property
    def batch_size(self) -> int:
        return int(self.scores.shape[1])

    def min_counts(self) -> torch.Tensor:
        """Per-row minimum keep count ``[B]``: ceil(min_keep * n), at least 1, at most n."""
        n = self.n_evictable
        return torch.minimum(torch.clamp(torch.ceil(self.min_keep * n.double()).long(), min=1), n)

    def layer_total(self) -> torch.Tensor:
        """Tokens one layer keeps in total per row ``[B]``: round((1 - ratio) * n * H)."""
        return torch.round((1.0 - self.ratio) * self.n_evictable.double() * self.num_heads).long()

    def per_layer(self, counts_of: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Stack ``counts_of(layer_index, scores [B, H, R]) -> [B, H]`` over the request's layers."""
        return torch.stack([counts_of(layer, self.scores[i]) for i, layer in enumerate(self.layers)])


AllocateFn = Callable[[AllocationRequest], torch.Tensor]


@dataclass(frozen=True)
class Allocator:
    """A built allocator: ``fn(request) -> keep counts [L, B, H_kv]``.

    ``whole_model``: it needs every layer's scores in one request (the cache defers compression to the end
    of the prefill, holding the full KV until then). ``adaptive``: its total follows the scores (a
    threshold), so a prompt's kept share differs from the ratio; ``max_tokens`` still bounds it.
    """

    name: str
    fn: AllocateFn
    whole_model: bool = False
    params: dict[str, Any] = field(default_factory=dict)
    adaptive: bool = False

    def __call__(self, request: AllocationRequest) -> torch.Tensor:
        counts = self.fn(request)
        expected = (len(request.layers), request.batch_size, request.num_heads)
        if not isinstance(counts, torch.Tensor) or tuple(counts.shape) != expected:
            got = tuple(counts.shape) if isinstance(counts, torch.Tensor) else type(counts).__name__
            raise ConfigurationError(
                f"Allocator {self.name!r} returned {got}; an allocator returns int64 keep counts of shape "
                f"[layers, batch, kv_heads] = {list(expected)}."
            )
        return counts.long()


_Factory = Callable[..., AllocateFn]


class Registration(NamedTuple):
    """What :func:`register_allocator` records: the factory and the allocator's abilities (see there)."""

    factory: _Factory
    whole_model: bool = False
    adaptive: bool = False
    reads_profile: bool = False


ALLOCATORS: Registry[Registration] = Registry("allocator")


def register_allocator(
    name: str,
    factory: _Factory | None = None,
    *,
    whole_model: bool = False,
    adaptive: bool = False,
    reads_profile: bool = False,
    overwrite: bool = False,
):
    """Register an allocator *factory* (called with the cache's allocator kwargs) under ``name``.

    The factory returns ``allocate(request) -> [L, B, H_kv]`` keep counts. ``whole_model``: it compares
    tokens across layers (see :class:`Allocator`); ``adaptive``: its total follows the scores;
    ``reads_profile``: the factory takes ``profile=`` (a :class:`~lukv_cache.Profile`), which
    ``LUKVCache.from_pretrained`` passes it. Usable as a decorator:

    >>> @register_allocator("first_head_first")
    ... def first_head_first():
    ...     def allocate(req):
    ...         weights = torch.linspace(2.0, 1.0, req.num_heads).unsqueeze(0)
    ...         return req.per_layer(lambda layer, s: largest_remainder(weights, req.layer_total(), req))
    ...     return allocate
    """

    def add(f: _Factory) -> _Factory:
        ALLOCATORS.add(name, Registration(f, whole_model, adaptive, reads_profile), overwrite=overwrite)
        return f

    return add(factory) if factory is not None else add


def get_allocator(name: str | Allocator | AllocateFn, **kwargs: Any) -> Allocator:
    """Build the registered allocator ``name`` with ``kwargs`` (e.g. ``evict_ratio=`` for ``"profile"``).

    An :class:`Allocator` passes through; a plain callable becomes a layer-by-layer allocator.

    >>> get_allocator("uniform").name
    'uniform'
    """
    if isinstance(name, Allocator):
        return name
    if callable(name) and not isinstance(name, str):
        return Allocator(getattr(name, "__name__", "custom"), name)
    entry = ALLOCATORS.get(name)
    _check_options(name, entry.factory, kwargs)
    return Allocator(name, entry.factory(**kwargs), entry.whole_model, dict(kwargs), entry.adaptive)


def _check_options(name: str, factory: _Factory, kwargs: dict[str, Any]) -> None:
    """Refuse options the factory does not take, and required ones missing, before it is called."""
    params = inspect.signature(factory).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(kwargs) - set(params))
    missing = [n for n, p in params.items() if p.default is p.empty and p.kind != p.VAR_POSITIONAL]
    missing = [n for n in missing if n not in kwargs]
    if unknown or missing:
        problem = f"has no option {', '.join(map(repr, unknown))}" if unknown else f"needs {missing}"
        raise ConfigurationError(
            f"Allocator {name!r} {problem} (its options: {', '.join(params) or 'none'}). Pass an allocator's "
            "own options in allocator_kwargs= (evict_ratio= and profile= are the 'profile' allocator's), or "
            "choose the allocator they belong to."
        )


def allocators_reading_profile() -> tuple[str, ...]:
    """The registered allocators that take ``profile=`` (registered with ``reads_profile=True``), sorted.

    >>> allocators_reading_profile()
    ('calibrated', 'hybrid', 'hybrid_global', 'profile', 'threshold')
    """
    return tuple(name for name in ALLOCATORS.names() if ALLOCATORS.get(name).reads_profile)


def largest_remainder(weights: torch.Tensor, totals: torch.Tensor, req: AllocationRequest) -> torch.Tensor:
    """Integer keep counts ``[B, K]`` proportional to ``weights [B or 1, K]`` summing to ``totals [B]``.

    Each entry lies in ``[min_keep, n]``: a scale ``c`` is found (bisection, "water-filling") so that
    ``sum(clamp(c * w, min, n)) == total``; then floor, and the leftover tokens go to the largest
    remainders. The sum is exact whenever the total is feasible (between K * min and K * n).
    """
    return water_fill(weights, totals, req.min_counts(), req.n_evictable)
