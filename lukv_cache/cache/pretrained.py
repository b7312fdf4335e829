"""``LUKVCache.from_pretrained``: a cache whose per-head budgets come from the LU-KV profile of a model."""

from __future__ import annotations

import logging
import os
import warnings
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from ..allocation import ALLOCATORS, allocators_reading_profile
from ..errors import (
    ConfigurationError,
    HubUnavailableError,
    ProfileNotFoundError,
    ProfileUnreachableError,
)
from ..scorers import SCORERS, Scorer
from .compression.contract import CacheT
from .layers.layout import refuse_own_cache
from .options.policy import bounded_prompt, default_ratio
from .options.values import check_flag

if TYPE_CHECKING:
    from ..profiles import HubLocation

logger = logging.getLogger("lukv_cache")
ANNOUNCED_IDS = 256  # the model ids the profile-free fallback remembers having said at WARNING level


class RecentIds:
    """The last ``size`` model ids seen, least recently seen dropped first: the fallback says a missing
    profile at WARNING level the first time per model id, and a process that serves many ids (one per
    request, say) must not grow a set by one per id. An id dropped and seen again is said at WARNING again.

    >>> seen = RecentIds(2)
    >>> [seen.saw(i) for i in ("a", "b", "a", "c", "b")]  # "b" was dropped when "c" came
    [False, False, True, False, False]
    >>> len(seen)
    2
    """

    def __init__(self, size: int = ANNOUNCED_IDS):
        self.size = size
        self._ids: OrderedDict[str, None] = OrderedDict()

    def saw(self, model_id: str) -> bool:
        """Whether ``model_id`` is among the recent ids; it is the most recent one afterwards."""
        seen = model_id in self._ids
        self._ids[model_id] = None
        self._ids.move_to_end(model_id)
        while len(self._ids) > self.size:
            self._ids.popitem(last=False)
        return seen

    def __len__(self) -> int:
        return len(self._ids)


_announced = RecentIds()  # the model ids whose missing profile was said at WARNING level (the recent ones)


def _registered(name: str) -> Scorer | None:
    return SCORERS.get(name) if name in SCORERS else None


def profile_scorer(profile: Any, name: str) -> str | Scorer:
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
    cls: type[CacheT],  # the class from_pretrained is called on (or a subclass)
    model_or_profile: Any,
    ratio: float | None = None,
    scorer: str | None = None,
    *,
    allocator: str | None = None,
    revision: str | None = None,
    repo_id: str | None = None,
    token: str | bool | None = None,
    local_dir: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    endpoint: str | None = None,
    local_files_only: bool = False,
    timeout: float | None = None,
    require_profile: bool = False,
    **options: Any,
) -> CacheT:
    """A cache whose per-head budgets come from the LU-KV profile of a model.

    ``ratio``: the fraction of the prompt removed (default 0.5, as in ``LUKVCache()``); or
    ``max_tokens``: at most that many tokens per (layer, KV head) whatever the prompt's length, the
    profile read at each prompt's own ratio; or
    ``decode_max_tokens``: that bound kept for the whole generation (see :class:`LUKVCache`); or
    ``memory`` / ``max_bytes``: a memory budget that chooses the bits and the tokens (docs/memory.md), with
    the profile's measured table when it has one.
    ``options``: any other option of the cache (its ``policy_class``'s fields, as ``LUKVCache(...)`` takes
    them; ``config=`` and ``keep_scores=`` too).

    ``model_or_profile``: a model id (looked up in ``local_dir`` / ``$LUKV_PROFILE_DIR`` first, then
    in the shared Hub repository at ``<model id>/<scorer>.safetensors``), a loaded model (its
    ``config.name_or_path`` is the key and its shape is checked), a path to a profile file, or a
    :class:`~lukv_cache.profiles.Profile` in memory.
    The profile's scorer, sink, window and min_keep become the cache's unless overridden (``sink=None`` or
    ``window=None`` is not overriding). ``allocator``: by
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

    A model with no profile anywhere (local folder, Hub, the shipped copies; offline: the local ones and
    huggingface_hub's cache) gets the profile-free :data:`~lukv_cache.profiles.location.PROFILE_FREE`
    method (``scorer="keydiff", allocator="uniform"``; a ``scorer=`` or ``allocator=`` given is kept),
    ``cache.profile`` is ``None`` and one log line (logger ``"lukv_cache"``: WARNING the first time per
    model id in a process, INFO after) says so and how to build one (``lukv build <model id>``).
    The log remembers the last 256 model ids (a process serving many ids does not grow a set by one per id;
    an id forgotten is said at WARNING again).
    ``require_profile=True`` (a bool: anything else is a ConfigurationError) makes that a
    :class:`~lukv_cache.errors.ProfileNotFoundError`, and so does asking for something only a profile
    gives: a profile file, a ``revision``, an allocator that reads the profile (``"profile"``, ``"hybrid"``,
    ...) or ``scorer="kvzap"``, offline too; with a Hub that cannot be reached these raise a
    :class:`~lukv_cache.errors.ProfileUnreachableError`, both a ProfileNotFoundError and a
    HubUnavailableError (the Hub might hold one). Otherwise a Hub that should answer and cannot (online,
    refused or timed out) is a :class:`~lukv_cache.errors.HubUnavailableError` (it says how to go
    offline); a profile that is there but corrupt or built for another shape always raises. Checked before
    any lookup: an unregistered ``scorer`` or ``allocator`` name (an UnknownNameError, before the fallback
    logs anything), a ``local_dir`` that is missing or is a file, a model id longer than a Hub id can be
    (ConfigurationErrors).

    >>> cache = LUKVCache.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", ratio=0.8)  # doctest: +SKIP
    """
    from ..profiles import HubLocation, resolve_profile
    from ..profiles.location import check_local_dir

    # LUKVCache()'s rules and the names asked for, checked before any lookup (a bad ratio or scorer name
    # fails before the network, and before the fallback says anything)
    require_profile = check_flag("require_profile", require_profile)
    local_files_only = check_flag("local_files_only", local_files_only)
    if isinstance(scorer, str):
        SCORERS.get(scorer)  # an UnknownNameError listing the registered scorers
    if isinstance(allocator, str):
        ALLOCATORS.get(allocator)
    check_local_dir(local_dir)
    refuse_own_cache(model_or_profile)  # a model no LUKVCache can serve: said before any lookup
    budget = options.get("memory") is not None or options.get("max_bytes") is not None
    if (
        not budget
        and bounded_prompt(ratio, options.get("max_tokens"), options.get("decode_max_tokens")) is None
    ):
        ratio = default_ratio(ratio)  # a memory budget or a token bound chooses the ratio itself
    hub = HubLocation(repo_id, revision, token, cache_dir, endpoint, local_files_only, timeout)
    config = getattr(model_or_profile, "config", None)
    if config is None and isinstance(model_or_profile, (str, os.PathLike)):
        config = _local_config(model_or_profile)
    if _evicts_sliding_windows(config or options.get("config"), scorer, allocator, options):
        model = model_or_profile if hasattr(model_or_profile, "named_modules") else None
        ratio = _held_in_bytes(config or options.get("config"), model, ratio, options)
    try:
        profile = resolve_profile(model_or_profile, scorer, hub=hub, local_dir=local_dir)
    except (ProfileNotFoundError, HubUnavailableError, ConfigurationError) as err:
        model_id = _profile_free_candidate(model_or_profile, err, hub, scorer, allocator)
        if model_id is None:
            keyed = _keyed_model_id(model_or_profile)
            asked = _profile_needed_by(hub, scorer, allocator) or (
                "require_profile=True" if require_profile else None
            )
            if (
                isinstance(err, HubUnavailableError)
                and not isinstance(err, ProfileNotFoundError)
                and keyed
                and asked
            ):
                raise _no_profile_to_be_had(err, keyed, asked, hub, scorer, allocator) from err.__cause__
            if isinstance(err, HubUnavailableError) and _profile_free_candidate(
                model_or_profile, None, hub, scorer, allocator
            ):
                raise HubUnavailableError(
                    f"{err} Offline (HF_HUB_OFFLINE=1 or local_files_only=True), from_pretrained uses a cached or "
                    f"shipped profile, else the profile-free {_profile_free_line(scorer, allocator)}."
                ) from err.__cause__  # the network's own error, without this one's first wording
            raise
        places, build = _places_searched(model_id, hub, local_dir)
        if require_profile:
            raise ProfileNotFoundError(
                f"No profile for {model_id!r} ({places}), and require_profile=True. Build one with "
                f"`{build}` (it says how from_pretrained then finds it), or drop require_profile to use the "
                f"profile-free {_profile_free_line(scorer, allocator)}.",
                model_id=model_id,
                scorer=scorer,
            ) from None  # the lookup's own error adds only the same facts, longer
        cache = _profile_free_cache(cls, model_id, (places, build), ratio, scorer, allocator, config, options)
        return _handed(cache, model_or_profile)
    if config is not None:
        profile.validate_for(config)
        options.setdefault("config", config)
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
    for name in ("sink", "window"):  # the profile's, unless given
        if options.get(name) is None:
            options[name] = getattr(profile, name)
    options.setdefault("min_keep", profile.min_keep)
    # the profile's curve, read at the ratio (or each prompt's own ratio under max_tokens)
    options["allocator_kwargs"] = {**allocator_kwargs, **(options.get("allocator_kwargs") or {})}
    cache = cls(ratio, profile_scorer(profile, scorer or profile.scorer), allocator, **options)
    cache.profile = profile
    return _handed(cache, model_or_profile)


def _evicts_sliding_windows(config: Any, scorer: Any, allocator: Any, options: dict[str, Any]) -> bool:
    """Whether the one line (``from_pretrained(model, ratio)``, nothing else chosen) evicts the sliding-window
    layers of ``config``'s model at the ratio (it has some that are not kept whole for others to read)."""
    chosen = (
        "memory",
        "max_bytes",
        "max_tokens",
        "decode_max_tokens",
        "kv_bits",
        "sliding",
        "split",
        "memory_floor",
        "evict_ratio",
    )
    if scorer is not None or allocator is not None or any(options.get(name) is not None for name in chosen):
        return False
    if config is None or not hasattr(config, "get_text_config"):
        return False
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    kinds = get_layer_types_and_kwargs(text)[0]
    modes = getattr(text, "kv_sharing_modes", None) or [None] * len(kinds)
    return any(kind == "sliding_attention" and mode is None for kind, mode in zip(kinds, modes))


def one_line_in_bytes(model: Any) -> bool:
    """Whether ``LUKVCache.from_pretrained(model, ratio=r)`` (nothing else chosen) holds the ratio as
    ``memory=1 - r`` on ``model`` (a loaded model): a sliding-window model whose layers a budget counts."""
    config = getattr(model, "config", None)
    return _evicts_sliding_windows(config, None, None, {}) and _budget_counts(config, model)


def _held_in_bytes(config: Any, model: Any, ratio: float | None, options: dict[str, Any]) -> float | None:
    """The one line on a sliding-window model: ``ratio`` held as a byte budget, ``memory=1 - ratio`` of the
    model's own cache with ``memory_floor=True`` (set in ``options``; ``None`` returned for the ratio), where
    the budget counts the model's layers (:func:`_budget_counts`; ``model``: the loaded model, if given);
    said once per model type. Eviction alone
    lost Gemma-3-270M's text at 0.8 where the budget, choosing fewer bits before fewer tokens and evicting
    the windows before the full-attention layers, kept it in fewer bytes (docs/memory.md). Where the budget
    cannot count the model, ``ratio`` as it is, with a warning."""
    text = config.get_text_config(decoder=True)
    kind = str(getattr(text, "model_type", "") or type(config).__name__)
    if ratio is None:  # never here: the one line's default ratio is set before
        return ratio
    if not _budget_counts(config, model):
        if kind not in _warned_sliding:
            _warned_sliding.add(kind)
            logger.warning(
                "lukv_cache: %s has sliding-window layers, and ratio=%g evicts them and its full-attention "
                "layers alike: on Gemma-3-270M at 0.8 that lost most of the text. A memory budget, which keeps "
                "it there, does not count this model's layers yet (docs/memory.md, 'Every layer kind').",
                kind,
                ratio,
            )
        return ratio
    memory = round(1.0 - ratio, 6)
    options.update(memory=memory, memory_floor=True)
    if kind not in _warned_sliding:
        _warned_sliding.add(kind)
        logger.warning(
            "lukv_cache: %s has sliding-window layers: ratio=%g is held as memory=%g, a byte budget of %g%% of "
            "the model's own cache (fewer bits before fewer tokens, the windows evicted before the "
            "full-attention layers). On Gemma-3-270M eviction alone at 0.8 lost most of the text (recall 42%% "
            "of 93%% at 1k tokens) where this kept it (91%%, in 17%% of the bytes). Pass sliding='compress' "
            "to evict at the ratio instead. docs/memory.md, 'Every layer kind'.",
            kind,
            ratio,
            memory,
            round(100 * memory, 4),
        )
    return None


def _budget_counts(config: Any, model: Any = None) -> bool:
    """Whether a memory budget counts the layers of ``config``'s model as they are: attention layers, full or
    sliding, each with its own KV, all of one shape (not KV-sharing layers, not the linear-attention or
    chunked kinds; not Gemma-4's wider global heads or MiMo-V2-Flash's sliding layers of twice the KV
    heads, which the budget refuses: read off the key and value projections of ``model``, or of the model
    built from ``config`` on the meta device, which allocates nothing)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    kinds = get_layer_types_and_kwargs(text)[0]
    if any(kind not in ("full_attention", "sliding_attention") for kind in kinds):
        return False
    if getattr(text, "num_kv_shared_layers", 0) or any(getattr(text, "kv_sharing_modes", None) or ()):
        return False
    if model is not None:
        return _one_kv_width(model)
    # a process serving many requests builds the meta model once per config, not once per cache
    key = config.to_json_string(use_diff=False)
    if key not in _widths_of_config:
        import torch
        from transformers import AutoModelForCausalLM

        try:
            with torch.device("meta"):
                _widths_of_config[key] = _one_kv_width(AutoModelForCausalLM.from_config(config))
        except Exception:  # noqa: BLE001 - a config transformers cannot build: its layers as the config says
            _widths_of_config[key] = True
        while len(_widths_of_config) > 64:  # the oldest configs forgotten first
            _widths_of_config.pop(next(iter(_widths_of_config)))
    return _widths_of_config[key]


def _one_kv_width(model: Any) -> bool:
    """Whether every key projection of ``model`` has one width, and every value projection one."""
    widths: dict[str, set[int]] = {"k_proj": set(), "v_proj": set()}
    for name, module in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind in widths and hasattr(module, "out_features"):
            widths[kind].add(module.out_features)
    return all(len(found) <= 1 for found in widths.values())


_widths_of_config: dict[str, bool] = {}  # config JSON -> _one_kv_width of its meta model (at most 64)
_warned_sliding: set[str] = set()


def _local_config(model_id: str | os.PathLike) -> Any:
    """The config of ``model_id`` where reading it needs no network (a local folder, or huggingface_hub's
    cache, where loading the model left it), so that the cache is laid out from the start as with
    ``config=`` (hybrid models need it); ``None`` where there is none (a profile file, a model never
    loaded here): the cache then learns the layout at its first attention call."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_id, local_files_only=True)
    except (OSError, ValueError, KeyError):  # not found, not a model id, an unknown model type
        return None


def _handed(cache: CacheT, model_or_profile: Any) -> CacheT:
    """``cache``, told of the loaded model it was made for (it warns when that model takes no cache)."""
    if hasattr(model_or_profile, "config"):
        cache.layout.meet_model(cache, model_or_profile)
    return cache


def _profile_free_candidate(
    model_or_profile: Any,
    err: BaseException | None,
    hub: HubLocation,
    scorer: str | None,
    allocator: str | None,
) -> str | None:
    """The model id when ``err`` only means that the model has no profile where one was looked for and
    nothing asked for needs one, so that :data:`PROFILE_FREE` may stand in; else ``None`` (``err`` is raised).
    ``err=None``: whether it would, were the profile missing.

    Needing a profile: a profile file, a pinned revision, an allocator that reads the profile, a scorer whose
    model-specific part is in it (kvzap). "No profile": not found (locally, in the repository, or the
    repository itself), or offline by intent (``local_files_only``, ``HF_HUB_OFFLINE``) with nothing local,
    or a model from a local folder (which keys no shared profile); a Hub that should answer and does not is
    not that."""
    from huggingface_hub import constants

    model_id = _keyed_model_id(model_or_profile)
    needs_profile = _profile_needed_by(hub, scorer, allocator) is not None
    offline = hub.local_files_only or constants.is_offline_mode()
    if isinstance(err, ConfigurationError):
        missing = bool(model_id) and os.path.isdir(model_id)  # "not a Hub model id": a folder's name
    else:
        missing = err is None or isinstance(err, ProfileNotFoundError) or offline
    return model_id if model_id and missing and not needs_profile else None


def _keyed_model_id(model_or_profile: Any) -> str:
    """The model id a shared profile of ``model_or_profile`` is keyed by ("" for a profile file, or a
    loaded model without a name)."""
    from ..profiles import model_id_of

    if isinstance(model_or_profile, (str, os.PathLike)):
        if str(model_or_profile).endswith(".safetensors") or os.path.isfile(model_or_profile):
            return ""
        return str(model_or_profile)
    return model_id_of(model_or_profile)


def _profile_needed_by(hub: HubLocation, scorer: str | None, allocator: str | None) -> str | None:
    """What was asked that only a profile gives (``"allocator='profile'"``, ...), or ``None``: a pinned
    revision, an allocator that reads the profile, a scorer whose model-specific part is in it (kvzap)."""
    if hub.revision is not None:
        return f"revision={hub.revision!r}"
    if allocator is not None and allocator in allocators_reading_profile():
        return f"allocator={allocator!r}"
    if scorer is not None and scorer in SCORERS and SCORERS.get(scorer).missing is not None:
        return f"scorer={scorer!r}"
    return None


def _no_profile_to_be_had(
    err: HubUnavailableError,
    model_id: str,
    asked: str,
    hub: HubLocation,
    scorer: str | None,
    allocator: str | None,
) -> ProfileNotFoundError:
    """The error for a model whose profile is nowhere here, offline or with the Hub unreachable, when
    ``asked`` needs one: a :class:`ProfileNotFoundError` (the README's promise), offline by intent, else
    a :class:`ProfileUnreachableError` (also a HubUnavailableError: the Hub might have one)."""
    from huggingface_hub import constants

    free = _profile_free_line(
        None if asked.startswith("scorer=") else scorer, None if asked.startswith("allocator=") else allocator
    )
    message = f"{err} {asked} needs this profile; without one, drop {asked} to use the profile-free {free}."
    offline = hub.local_files_only or constants.is_offline_mode()
    kind = ProfileNotFoundError if offline else ProfileUnreachableError
    return kind(message, model_id=model_id, scorer=scorer)


def _places_searched(model_id: str, hub: HubLocation, local_dir: str | os.PathLike | None) -> tuple[str, str]:
    """Where :func:`~lukv_cache.profiles.download.download_profile` looked (``"looked in ..."``), and the
    ``lukv build`` command that makes a profile it would find, for messages."""
    from huggingface_hub import constants

    from ..profiles.location import DEFAULT_SCORER, LOCAL_DIR_ENV

    if os.path.isdir(model_id):
        return (
            "a local folder's name keys no shared profile: pass a profile file",
            f"lukv build {model_id} --out {DEFAULT_SCORER}.safetensors",
        )
    folder = local_dir or os.environ.get(LOCAL_DIR_ENV)
    places = [f"the folder {str(folder)!r}"] if folder else []
    if hub.local_files_only or constants.is_offline_mode():
        places.append(f"huggingface_hub's cache of {hub.repo!r} (offline)")
    else:
        places.append(f"the Hub repository {hub.repo!r} at {hub.endpoint_url()}")
    places.append("the profiles shipped with lukv_cache")
    return "looked in " + ", ".join(places[:-1]) + " and " + places[-1], f"lukv build {model_id}"


# What a profile build costs, as the fallback's log line says it: measured (`lukv build qwen2.5-coder-0.5b
# --scorer keydiff --threads 2` from an empty cache folder, docs/profiles.md "Cost"); the build prints its
# own estimate before its long part
BUILD_TIME = (
    "a keydiff build took 1 min 49 s for Qwen2.5-0.5B on 2 CPU threads, its memory table included; "
    "it says its own estimate before the long part"
)


def _profile_free_line(scorer: str | None, allocator: str | None) -> str:
    from ..profiles.location import PROFILE_FREE

    return f"LUKVCache(ratio=..., scorer={scorer or PROFILE_FREE[0]!r}, allocator={allocator or PROFILE_FREE[1]!r})"


def _profile_free_cache(
    cls: type[CacheT],
    model_id: str,
    said: tuple[str, str],
    ratio: float | None,
    scorer: str | None,
    allocator: str | None,
    config: Any,
    options: dict[str, Any],
) -> CacheT:
    """The cache :func:`from_pretrained` gives a model without a profile (:data:`PROFILE_FREE`, or the
    ``scorer`` / ``allocator`` asked for), after one log line saying so (``said``: where it looked, and
    the ``lukv build`` command)."""
    from ..profiles.location import PROFILE_FREE

    level = logging.INFO if _announced.saw(model_id) else logging.WARNING
    logger.log(
        level,
        "lukv_cache: no profile for %s (%s); using the profile-free %s. For LU-KV's per-head "
        "budgets build one (%s): %s",
        model_id,
        said[0],
        _profile_free_line(scorer, allocator),
        BUILD_TIME,
        said[1],
    )
    if config is not None:
        options.setdefault("config", config)
    for name in ("sink", "window"):  # None: LUKVCache's defaults
        if options.get(name) is None:
            options.pop(name, None)
    cache = cls(ratio, scorer or PROFILE_FREE[0], allocator or PROFILE_FREE[1], **options)
    cache.profile = None
    return cache
