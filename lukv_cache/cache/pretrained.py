"""``LUKVCache.from_pretrained``: a cache whose per-head budgets come from the LU-KV profile of a model."""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

from ..allocation import allocators_reading_profile
from ..scorers import SCORERS, Scorer
from .policy import check_ratio

if TYPE_CHECKING:
    from .cache import LUKVCache


def _registered(name: str) -> Scorer | None:
    return SCORERS.get(name) if name in SCORERS else None


def _profile_scorer(profile: Any, name: str) -> str | Scorer:
    """``name``, or for a learned scorer (``kvzap``) the scorer bound to the surrogate stored in ``profile``
    (:meth:`~lukv_cache.scorers.Scorer.from_profile`)."""
    registered = _registered(name)
    if registered is None or registered.from_surrogate is None:
        return name
    return registered.from_profile(profile)


def _default_allocator(profile: Any) -> str:
    """The allocator the profile's scorer declares (:attr:`~lukv_cache.scorers.Scorer.default_allocator`),
    else ``"profile"``."""
    registered = _registered(profile.scorer)
    return (registered.default_allocator if registered is not None else None) or "profile"


def from_pretrained(
    cls: type[LUKVCache],  # the class from_pretrained is called on (or a subclass)
    model_or_profile: Any,
    ratio: float | None = None,
    scorer: str | None = None,
    *,
    max_tokens: int | None = None,
    allocator: str | None = None,
    revision: str | None = None,
    repo_id: str | None = None,
    token: str | bool | None = None,
    local_dir: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    endpoint: str | None = None,
    local_files_only: bool = False,
    timeout: float | None = None,
    sink: int | None = None,
    window: int | None = None,
    **kwargs: Any,
) -> LUKVCache:
    """A cache whose per-head budgets come from the LU-KV profile of a model.

    ``ratio``: the fraction of the prompt removed (default 0.5, as in ``LUKVCache()``); or
    ``max_tokens``: at most that many tokens per (layer, KV head) whatever the prompt's length, the
    profile read at each prompt's own ratio; or
    ``decode_max_tokens``: that bound kept for the whole generation (see :class:`LUKVCache`).

    ``model_or_profile``: a model id (looked up in ``local_dir`` / ``$LUKV_PROFILE_DIR`` first, then
    in the shared Hub repository at ``<model id>/<scorer>.safetensors``), a loaded model (its
    ``config.name_or_path`` is the key and its shape is checked), or a path to a profile file.
    The profile's scorer, sink and window become the cache's unless overridden. ``allocator``: by
    default the one the profile's scorer declares (its ``default_allocator``): ``"global"`` for a ``kvzap``
    profile (its scores are comparable across layers and heads, and one model-wide top-k lost the least on
    SmolLM2-135M: docs/kvzap.md) and ``"profile"`` for every other scorer; ``"profile"`` (LU-KV's budgets as they are), ``"hybrid"`` (the profile's layer totals, spread over
    each layer's heads by score), ``"hybrid_global"``, ``"threshold"`` (a kvzap profile's score
    thresholds: every token above the one for the ratio; see :mod:`lukv_cache.allocation.builtin`), or
    any other registered allocator (``"global"``: the profile then gives the scorer, sink and window).
    ``scorer``: by default the model's ``kvzap`` profile when it has one (its surrogate scores), else
    ``keydiff``. ``revision``,
    ``repo_id``, ``token``, ``cache_dir``, ``endpoint``, ``local_files_only`` and ``timeout`` (seconds before the Hub counts as
    unreachable; default ``$LUKV_HUB_TIMEOUT`` or 5) go to huggingface_hub.

    >>> cache = LUKVCache.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", ratio=0.8)  # doctest: +SKIP
    """
    from ..profiles import HubLocation, resolve_profile

    if max_tokens is None and ratio is None and kwargs.get("decode_max_tokens") is not None:
        max_tokens = kwargs["decode_max_tokens"]  # the prompt is bounded too, as in LUKVCache()
    if max_tokens is None:
        ratio = check_ratio(0.5 if ratio is None else ratio)  # LUKVCache()'s default too
    hub = HubLocation(repo_id, revision, token, cache_dir, endpoint, local_files_only, timeout)
    profile = resolve_profile(model_or_profile, scorer, hub=hub, local_dir=local_dir)
    config = getattr(model_or_profile, "config", None)
    if config is not None:
        profile.validate_for(config)
        kwargs.setdefault("config", config)
    if scorer is not None and scorer != profile.scorer:
        warnings.warn(
            f"The profile {profile.model_id}/{profile.scorer} was built for scorer {profile.scorer!r}; "
            f"its budgets are used with scorer {scorer!r} instead.",
            stacklevel=2,
        )
    if allocator is None:
        allocator = _default_allocator(profile)
    reads_profile = allocator in allocators_reading_profile()
    allocator_kwargs = {"profile": profile} if reads_profile else {}
    cache = cls(
        ratio,
        _profile_scorer(profile, scorer or profile.scorer),
        allocator,
        sink=profile.sink if sink is None else sink,
        window=profile.window if window is None else window,
        min_keep=kwargs.pop("min_keep", profile.min_keep),
        max_tokens=max_tokens,
        # the profile's curve, read at the ratio (or each prompt's own ratio under max_tokens)
        allocator_kwargs={**allocator_kwargs, **(kwargs.pop("allocator_kwargs", None) or {})},
        **kwargs,
    )
    cache.profile = profile
    return cache
