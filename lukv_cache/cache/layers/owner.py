"""What the layout reads of a cache, and the one way it changes the cache's layers (:class:`LaidOutCache`),
typed in a leaf module so that :mod:`.layout` imports no cache.

The cache owns its ``layers`` and ``layer_class_to_replicate``: no other object assigns them. The layout
decides which layer stands at an index and asks the cache to put it there (:meth:`LaidOutCache.replace_layer`,
:meth:`LaidOutCache.lay_out`); ``tests/test_architecture.py`` checks that no other module of
``lukv_cache/cache`` writes them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ..options.policy import CompressionPolicy

if TYPE_CHECKING:
    from ...profiles import Profile


class LaidOutCache(Protocol):
    """A cache as its layout sees it: its policy, its layers (to read), the profile its budgets come from,
    whether it evicts, and the two requests that change its layers."""

    profile: Profile | None  # set by from_pretrained, else None

    @property
    def policy(self) -> CompressionPolicy: ...

    @property
    def layers(self) -> list[Any]: ...  # to read: replace_layer and lay_out write them

    @property
    def layer_class_to_replicate(self) -> Any: ...  # None once the layout is known

    @property
    def evicts(self) -> bool: ...

    def replace_layer(self, idx: int, layer: Any) -> None: ...

    def lay_out(self, layers: list[Any]) -> None: ...
