"""The ways to hold a context that the evaluation compares: the full cache, or allocator x scorer x ratio
(or x memory budget).

Light on purpose (torch and transformers load in :func:`make_cache`): the ``lukv`` command line reads the
defaults below for its help.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from ..errors import ConfigurationError

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "continuation", "recall")  # made by .tasks
DEFAULT_TASKS = TASKS[:4]  # what `lukv bench` runs without --tasks (recall is asked for by name)
ALLOCATORS = ("uniform", "pyramid", "adakv", "profile")
SCORERS = ("keydiff", "snapkv", "expected_attention", "knorm")
RATIOS = (0.25, 0.5, 0.8, 0.9)
# `lukv check`'s defaults: the scorer and allocator of the README's one line for the model
# (one_line_method: kvzap / global where it has a kvzap profile, keydiff / uniform where it has none), then
# the allocators a user is likely to choose between instead, at the ratios worth deploying
CHECK_ALLOCATORS = ("uniform", "adakv", "profile")
CHECK_RATIOS = (0.5, 0.8, 0.9)
FULL = "full"
# the tasks' sizes (.tasks builds them; here, light, so that `lukv bench` refuses bad numbers before torch)
MIN_CONTEXT_TOKENS = 32  # a shorter context has nothing to compress around its sink and window
ANSWER_TOKENS = (
    12  # decoded per retrieval answer (a 7-digit number and its period); niah_multivalue: per value
)
MAX_NEEDLES = 900  # the distinct "adjective-noun" keys needles are named by (.tasks.samples: 30 x 30)
RECALL_MIN_TOKENS = 8  # recall: a sentence's rest shorter than this is not asked
MIN_CONTINUATION_TOKENS = 2  # the first is predicted by the prefill, the rest by one teacher-forced forward


def check_bench_numbers(
    samples: Any, context_tokens: Any, needles: Any, continuation_tokens: Any, *, flags: bool = False
) -> None:
    """Refuse the benchmark's counts that cannot run (a :class:`ConfigurationError` saying what is allowed),
    before anything is loaded: ``flags`` names them as ``lukv bench``'s flags (``--needles``), else as
    :class:`~lukv_cache.evaluation.runner.BenchSettings`' fields.

    >>> check_bench_numbers(20, 1000, 4, 128)
    >>> check_bench_numbers(20, 1000, -1, 128, flags=True)
    Traceback (most recent call last):
    ...
    lukv_cache.errors.ConfigurationError: --needles (needles per retrieval context, sentences quoted per recall context) must be an integer in [1, 900], got -1.
    """
    rules = (
        ("samples", samples, 1, None, "contexts per task"),
        ("context_tokens", context_tokens, MIN_CONTEXT_TOKENS, None, "context length in tokens"),
        (
            "needles",
            needles,
            1,
            MAX_NEEDLES,
            "needles per retrieval context, sentences quoted per recall context",
        ),
        (
            "continuation_tokens",
            continuation_tokens,
            MIN_CONTINUATION_TOKENS,
            None,
            "teacher-forced tokens after each continuation context",
        ),
    )
    for name, value, low, high, what in rules:
        check_count(f"--{name.replace('_', '-')}" if flags else name, value, low, what, high)


def check_count(option: str, value: Any, low: int, what: str, high: int | None = None) -> None:
    """``value`` of ``option`` (``what`` it counts) is an integer in ``[low, high]`` (``high``: ``None``, no
    upper bound), else a :class:`ConfigurationError` saying what is allowed (one ``error:`` line on the CLI).

    >>> check_count("--samples", 0, 1, "contexts per task")
    Traceback (most recent call last):
    ...
    lukv_cache.errors.ConfigurationError: --samples (contexts per task) must be an integer of at least 1, got 0.
    """
    valid = isinstance(value, int) and not isinstance(value, bool)
    if valid and low <= value and (high is None or value <= high):
        return
    if high is not None:
        allowed = f"an integer in [{low}, {high}]"
    else:
        allowed = "a non-negative integer" if low == 0 else f"an integer of at least {low}"
    raise ConfigurationError(f"{option} ({what}) must be {allowed}, got {value!r}.")


def tokens_after_context(task: str, needles: int, continuation_tokens: int) -> int:
    """At least how many positions ``task`` uses after its context: what it teacher-forces (continuation,
    recall) or decodes (a retrieval answer); a lower bound, known without a tokenizer.

    >>> tokens_after_context("continuation", 4, 128), tokens_after_context("niah_multivalue", 4, 128)
    (128, 48)
    """
    if task == "continuation":
        return continuation_tokens
    if task == "recall":
        return RECALL_MIN_TOKENS
    return ANSWER_TOKENS * needles if task == "niah_multivalue" else ANSWER_TOKENS


def check_bench_positions(
    config: Any, tasks: Sequence[str], context_tokens: int, needles: int, continuation_tokens: int
) -> None:
    """Refuse (:class:`ConfigurationError`, as ``lukv check`` does) a context length whose tasks need more
    positions than the model has (``config``'s ``max_position_embeddings``), before any text is read: the
    context and at least :func:`tokens_after_context` after it. The samples' exact lengths are checked
    again once they are built (:func:`~lukv_cache.evaluation.tasks.samples.check_sample_positions`).

    >>> from transformers import LlamaConfig
    >>> check_bench_positions(LlamaConfig(max_position_embeddings=512), ["continuation"], 1000, 4, 128)
    Traceback (most recent call last):
    ...
    lukv_cache.errors.ConfigurationError: --context-tokens 1000 + 128 tokens after the context (continuation) needs 1128 positions but the model has 512; pass a --context-tokens of at most 384.
    """
    from ..models import check_positions, max_positions

    limit = max_positions(config)
    for task in tasks:
        after = tokens_after_context(task, needles, continuation_tokens)
        room = (limit or 0) - after
        if room >= MIN_CONTEXT_TOKENS:
            remedy = f"pass a --context-tokens of at most {room}"
        else:
            flag = {"continuation": "--continuation-tokens", "niah_multivalue": "--needles"}.get(task)
            remedy = f"pass fewer {flag}" if flag else "use a model with more positions"
        check_positions(
            config,
            context_tokens + after,
            f"--context-tokens {context_tokens} + {after} tokens after the context ({task})",
            remedy,
        )


@dataclass(frozen=True)
class Method:
    """One way to hold the context: the full cache, or an allocator + scorer at a compression ratio, or
    at a memory budget (``memory``: a fraction of the full cache's bytes, ``LUKVCache(memory=...)``, which
    chooses the bits and the tokens kept; ``ratio`` and ``kv_bits`` are then ``None``).

    >>> Method("uniform", "keydiff", 0.8).name
    'uniform/keydiff@0.8'
    >>> Method(FULL).name
    'full'
    >>> Method("global", "kvzap", 0.6, kv_bits=4).name  # the kept keys and values in 4 bits
    'global/kvzap@0.6/int4'
    >>> Method("global", "kvzap", memory=0.1).name  # a tenth of the full cache's bytes
    'global/kvzap@mem0.1'
    """

    allocator: str
    scorer: str | None = None
    ratio: float | None = None
    kv_bits: int | None = None
    # LUKVCache(sliding=...): one value per run (`lukv bench --sliding`), not in the name; None: its default
    sliding: str | None = None
    memory: float | None = None
    # LUKVCache(split=...) of a memory budget: one value per run (`lukv bench --split`), not in the name
    split: str | None = None

    def __post_init__(self) -> None:
        if self.memory is not None and (self.ratio is not None or self.kv_bits is not None):
            raise ConfigurationError(
                f"A method with a memory budget ({self.memory:g}) has no ratio or kv_bits: the budget chooses "
                f"them (got ratio={self.ratio!r}, kv_bits={self.kv_bits!r})."
            )

    @property
    def is_full(self) -> bool:
        return self.allocator == FULL

    @property
    def name(self) -> str:
        if self.is_full:
            return FULL
        if self.memory is not None:
            return f"{self.allocator}/{self.scorer}@mem{self.memory:g}"
        bits = "" if self.kv_bits is None else f"/int{self.kv_bits}"
        return f"{self.allocator}/{self.scorer}@{self.ratio:g}{bits}"


def kv_bits_list(values: list[str]) -> tuple[int | None, ...]:
    """``--kv-bits none 8 4`` as the grid's ``kv_bits`` column values (refused before torch is imported).

    >>> kv_bits_list(["none", "4"])
    (None, 4)
    """
    out = []
    for value in values or ["none"]:
        if value.lower() not in ("none", "8", "4"):
            raise ConfigurationError(
                f"--kv-bits takes none (the model's precision), 8 or 4 (bits per stored key / value entry), got "
                f"{value!r}."
            )
        out.append(None if value.lower() == "none" else int(value))
    return tuple(dict.fromkeys(out))


def memory_list(values: Sequence[Any]) -> tuple[float, ...]:
    """``--memory 0.2 0.1`` as the grid's budgets: fractions in (0, 1] of the full cache's bytes, repeats
    dropped (refused before torch is imported).

    >>> memory_list(["0.2", "0.1", "0.2"])
    (0.2, 0.1)
    """
    out = []
    for value in values:
        try:
            memory = float(value)
        except (TypeError, ValueError):
            memory = math.nan
        if math.isnan(memory) or not 0.0 < memory <= 1.0:
            raise ConfigurationError(
                f"--memory takes fractions in (0, 1] of the full cache's bytes (0.1: a tenth), got {value!r}."
            )
        out.append(memory)
    return tuple(dict.fromkeys(out))


def build_methods(
    allocators: Sequence[str],
    scorers: Sequence[str],
    ratios: Sequence[float],
    *,
    full: bool = True,
    kv_bits: Sequence[int | None] = (None,),
    sliding: str | None = None,
    memory: Sequence[float] = (),
    split: str | None = None,
) -> list[Method]:
    """The grid: the full cache (first) and every allocator x scorer x ratio (x ``kv_bits``), then every
    allocator x scorer x ``memory`` budget (the budget chooses the bits: ``kv_bits`` does not apply;
    ``split``: how the budgets share their bytes between layer kinds, ``LUKVCache(split=...)``).

    >>> [m.name for m in build_methods(["uniform"], ["keydiff"], [0.5])]
    ['full', 'uniform/keydiff@0.5']
    >>> [m.name for m in build_methods(["uniform"], ["keydiff"], [0.5], full=False, kv_bits=(None, 4))]
    ['uniform/keydiff@0.5', 'uniform/keydiff@0.5/int4']
    >>> [m.name for m in build_methods(["global"], ["kvzap"], [], memory=(0.1, 0.05))]
    ['full', 'global/kvzap@mem0.1', 'global/kvzap@mem0.05']
    """
    grid = [
        Method(a, s, float(r), b, sliding)
        for a in allocators
        for s in scorers
        for r in ratios
        for b in dict.fromkeys(kv_bits)
    ]
    grid += [
        Method(a, s, sliding=sliding, memory=float(m), split=split)
        for a in allocators
        for s in scorers
        for m in dict.fromkeys(memory)
    ]
    return ([Method(FULL)] if full else []) + grid


def scorer_reads_profile(scorer: Any) -> bool:
    """Whether the registered scorer ``scorer`` takes its model-specific part from the model's profile: a
    placeholder registered with :attr:`~lukv_cache.scorers.Scorer.missing` set (``kvzap``, whose surrogate
    the profile holds). Anything else (an unregistered name, a :class:`~lukv_cache.scorers.Scorer`): no.

    >>> scorer_reads_profile("kvzap"), scorer_reads_profile("keydiff")
    (True, False)
    """
    from ..scorers import SCORERS

    return scorer in SCORERS and SCORERS.get(scorer).missing is not None


def make_cache(
    method: Method, model: Any, profiles_dir: str | os.PathLike[str] | None = None, *, hub: bool = False
) -> Any:
    """A fresh, empty cache for ``method``. The allocators registered with ``reads_profile=True``
    (:func:`~lukv_cache.allocation.allocators_reading_profile`), and every allocator with a scorer whose
    surrogate the profile holds (``kvzap``: :func:`scorer_reads_profile`), read the model's profile for the
    scorer (``profiles_dir`` first, the Hub only when ``hub=True``, then the profiles shipped with
    lukv_cache; a model loaded from a folder: see :func:`profile_source`); a missing profile, or one of
    another shape, raises a ``ProfileError``.

    >>> make_cache(Method("adakv", "keydiff", 0.8), model).allocator_name
    'adakv'
    """
    if method.is_full:
        from transformers import DynamicCache

        # the model's own cache (what generate builds): sliding-window layers hold their window only
        return DynamicCache(config=model.config)
    from ..allocation import allocators_reading_profile
    from ..cache import LUKVCache

    # a memory budget chooses the ratio and the bits (passing either with it is refused)
    sizing: dict[str, Any] = (
        {"memory": method.memory, **({"split": method.split} if method.split else {})}
        if method.memory is not None
        else {"kv_bits": method.kv_bits}
    )
    if method.allocator not in allocators_reading_profile() and not scorer_reads_profile(method.scorer):
        return LUKVCache(
            *([] if method.memory is not None else [method.ratio]),
            scorer=cast(str, method.scorer),
            allocator=method.allocator,
            config=model.config,
            sliding=method.sliding,
            **sizing,
        )
    # the model's profile: the budgets, or (kvzap) the surrogate whatever the allocator
    source = profile_source(model, method.scorer, profiles_dir)
    # Any: from_pretrained always sets cache.profile, whose type (Profile | None) allows None
    cache: Any = LUKVCache.from_pretrained(
        source,
        method.ratio,
        method.scorer,
        allocator=method.allocator,
        local_dir=profiles_dir,
        local_files_only=not hub,
        sliding=method.sliding,
        **sizing,
        **({} if source is model else {"config": model.config}),
    )
    if source is not model:  # a file or a model id: from_pretrained saw no model to check the shape against
        cache.profile.validate_for(model.config)
    return cache


def one_line_method(
    model: Any,
    profiles_dir: str | os.PathLike[str] | None = None,
    *,
    hub: bool = False,
    scorer: str | None = None,
) -> tuple[str, str]:
    """The scorer and allocator ``LUKVCache.from_pretrained(model, ratio=..., scorer=scorer)`` uses for
    ``model``, its profiles looked up as :func:`make_cache` does: without a scorer ``("kvzap", "global")``
    where it has a kvzap profile; :data:`~lukv_cache.profiles.location.PROFILE_FREE` (or ``scorer`` and its
    allocator) where it has none. ``lukv check`` compares it first."""
    from ..cache import LUKVCache
    from ..errors import ProfileError
    from ..profiles.location import PROFILE_FREE

    try:
        source = profile_source(model, scorer, profiles_dir)
        cache = LUKVCache.from_pretrained(
            source, 0.5, scorer, local_dir=profiles_dir, local_files_only=not hub, config=model.config
        )
    except ProfileError:  # none for a scorer that needs one, or a bad one: check skips those rows, saying why
        return scorer or PROFILE_FREE[0], PROFILE_FREE[1]
    return cache.policy.scorer.name, cache.allocator_name


def profile_source(model: Any, scorer: str | None, profiles_dir: str | os.PathLike[str] | None = None) -> Any:
    """What :func:`make_cache` reads ``model``'s profile from: the model itself when its name is a Hub id
    (``from_pretrained`` looks it up in ``profiles_dir``, the Hub, the shipped profiles). A model loaded from
    a folder has the folder as its name, which keys no shared profile: then ``<profiles_dir>/<scorer>.safetensors``
    (what ``lukv build <folder> --scorer <scorer> --out <profiles_dir>`` writes), else the Hub id the folder's
    ``config.json`` names (``_name_or_path``, which older transformers saved), else a
    :class:`~lukv_cache.errors.ProfileNotFoundError` saying how to build one (``lukv check`` skips the
    rows that need it, with that note)."""
    from pathlib import Path

    from ..errors import ConfigurationError, ProfileNotFoundError
    from ..profiles.download import model_id_of
    from ..profiles.location import PREFERRED_SCORERS, check_model_id

    name = model_id_of(model)
    try:
        check_model_id(name)
        hub_id = not Path(name).is_dir()
    except ConfigurationError:
        hub_id = False
    if hub_id or not name:
        return model  # from_pretrained says what is wrong with a nameless model
    for candidate in [scorer] if scorer else PREFERRED_SCORERS:
        if profiles_dir is not None and (Path(profiles_dir) / f"{candidate}.safetensors").is_file():
            return Path(profiles_dir) / f"{candidate}.safetensors"
    named = _config_model_id(Path(name))
    if named is not None:
        return named
    try:
        check_model_id(name)
        return model  # a folder named like a Hub id: its shared profile, as for the Hub model
    except ConfigurationError:
        pass
    wanted = scorer or PREFERRED_SCORERS[-1]
    looked = (
        f"{profiles_dir}/{wanted}.safetensors" if profiles_dir is not None else "no --profiles folder given"
    )
    raise ProfileNotFoundError(
        f"no {wanted} profile for the model folder {name!r} (looked for {looked}; build one with "
        f"`lukv build {name} --scorer {wanted} --out <folder>` and pass --profiles <folder>)",
        model_id=name,
        scorer=wanted,
    )


def _config_model_id(folder: Any) -> str | None:
    """The Hub id a model folder's ``config.json`` names as its origin (``_name_or_path``), if any."""
    import json

    from ..errors import ConfigurationError
    from ..profiles.location import check_model_id

    try:
        named = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("_name_or_path")
        check_model_id(named)
    except (OSError, ValueError, AttributeError, ConfigurationError):
        return None
    return named
