"""Running the benchmark grid: every method on every sample of every task, one shared prefill per sample.

>>> from lukv_cache.evaluation.runner import BenchSettings, run_benchmark
>>> settings = BenchSettings(tasks=("niah_multikey",), samples=2, ratios=(0.5,), scorers=("keydiff",))
>>> results = run_benchmark(model, tokenizer, settings)  # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from .._compat import cache_kwarg
from ..allocation import allocators_reading_profile
from ..cache import LUKVCache, kv_cache_bytes
from ..errors import ConfigurationError, ProfileError
from ..scorers import get_scorer
from ..texts import Article
from .methods import (
    ALLOCATORS,
    RATIOS,
    SCORERS,
    TASKS,
    Method,
    build_methods,
    check_bench_numbers,
    check_bench_positions,
    make_cache,
)
from .prefill import SharedPrefill, shareable
from .tasks.samples import Sample, check_sample_positions, make_samples
from .tasks.scoring import context_ids, score_prefilled


@dataclass
class BenchSettings:
    """What to run. Defaults are the full grid (about an hour per task at 1k tokens on 2 CPU threads).

    >>> BenchSettings(samples=2, ratios=(0.8,), scorers=("keydiff",)).samples
    2
    """

    tasks: Sequence[str] = ("niah_single", "niah_multikey", "niah_multivalue", "continuation")
    samples: int = 20
    context_tokens: int = 1000
    ratios: Sequence[float] = RATIOS
    scorers: Sequence[str] = SCORERS
    allocators: Sequence[str] = ALLOCATORS
    full: bool = True
    seed: int = 0
    needles: int = 4
    continuation_tokens: int = 128
    profiles_dir: str | None = None
    hub: bool = False
    share_prefill: bool = True
    kv_bits: Sequence[int | None] = (None,)  # the stores' bits per entry, each a column of the grid
    sliding: str | None = None  # what every cache's sliding-window layers do (LUKVCache(sliding=...))
    split: str | None = (
        None  # how every memory budget shares its bytes between layer kinds (LUKVCache(split=...))
    )
    # memory budgets (fractions of the full cache's bytes), each a method per allocator x scorer
    memory: Sequence[float] = ()


@dataclass
class MethodResult:
    """Every sample's score for one (task, method), in sample order, plus what the cache held."""

    task: str
    method: Method
    scores: list[float] = field(default_factory=list)
    question_scores: list[list[float]] = field(default_factory=list)
    outputs: list[list[str]] = field(default_factory=list)
    kv_bytes: list[int] = field(default_factory=list)
    kept_fraction: list[float] = field(default_factory=list)
    # under a memory budget, each sample's choice (MemoryChoice.to_json(): the bits, bytes per row, ...)
    memory_choices: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class BenchResults:
    """The whole run: settings, per-(task, method) results, skipped methods and their reasons."""

    settings: BenchSettings
    results: dict[tuple[str, str], MethodResult] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    context_tokens: dict[str, list[int]] = field(default_factory=dict)
    prefill_seconds: dict[str, list[float]] = field(default_factory=dict)
    seconds: float = 0.0
    command: str = ""
    model_info: dict[str, Any] = field(default_factory=dict)
    started_utc: str = ""


def _kept_fraction(cache: Any, context_tokens: int) -> float:
    if hasattr(cache, "stored_tokens"):
        stored = cache.stored_tokens()
        if stored.numel():
            return float(stored.double().mean()) / context_tokens
    return 1.0


def _n_queries(scorers: Sequence[str]) -> int:

    return max([get_scorer(s).n_queries for s in scorers] + [2])


def run_benchmark(
    model: Any,
    tokenizer: Any,
    settings: BenchSettings,
    *,
    articles: Sequence[Article] | None = None,
    log: Callable[[str], None] | None = print,
    on_task_done: Callable[[BenchResults], None] | None = None,
) -> BenchResults:
    """Run every task of ``settings`` with every method; returns per-sample scores for all of them.

    ``articles`` replaces the real Wikipedia text (tests use synthetic text with a tiny model).
    ``on_task_done`` is called after each task, e.g. to write partial results. Counts that cannot run and
    samples longer than the model's positions raise :class:`~lukv_cache.errors.ConfigurationError` before
    any method runs.

    >>> results = run_benchmark(model, tokenizer, BenchSettings(samples=2, ratios=(0.8,)))  # doctest: +SKIP
    """
    for task in settings.tasks:
        if task not in TASKS:
            raise ConfigurationError(f"Unknown task {task!r}; choose from {', '.join(TASKS)}.")
    check_bench_numbers(
        settings.samples, settings.context_tokens, settings.needles, settings.continuation_tokens
    )
    check_bench_positions(
        model.config, settings.tasks, settings.context_tokens, settings.needles, settings.continuation_tokens
    )
    methods = build_methods(
        settings.allocators,
        settings.scorers,
        settings.ratios,
        full=settings.full,
        kv_bits=settings.kv_bits,
        sliding=settings.sliding,
        memory=settings.memory,
        split=settings.split,
    )
    results = BenchResults(settings, started_utc=datetime.datetime.now(datetime.UTC).isoformat())
    say = log or (lambda _msg: None)
    share = settings.share_prefill and shareable(model)
    n_queries = _n_queries(settings.scorers)
    device = next(model.parameters()).device
    started = time.perf_counter()

    # Every task's samples before anything runs: one that does not fit the model's positions is refused.
    samples_of: dict[str, list[Sample]] = {}
    for task in settings.tasks:
        samples_of[task] = make_samples(
            task,
            tokenizer,
            settings.samples,
            settings.context_tokens,
            seed=settings.seed,
            n_needles=settings.needles,
            continuation_tokens=settings.continuation_tokens,
            articles=articles,
        )
        check_sample_positions(model.config, tokenizer, samples_of[task])

    # Methods whose cache cannot be built (no profile file) are skipped once, with the reason.
    reads_profile = allocators_reading_profile()
    for method in methods:
        if method.allocator in reads_profile and method.name not in results.skipped:
            try:
                make_cache(method, model, settings.profiles_dir, hub=settings.hub)
            except ProfileError as err:
                results.skipped[method.name] = str(err)
    active = [m for m in methods if m.name not in results.skipped]
    for name, reason in results.skipped.items():
        say(f"skip {name}: {reason}")

    for task in settings.tasks:
        samples = samples_of[task]
        for method in active:
            results.results[(task, method.name)] = MethodResult(task, method)
        results.context_tokens[task] = []
        results.prefill_seconds[task] = []
        for index, sample in enumerate(samples):
            ids = context_ids(tokenizer, sample, device)
            results.context_tokens[task].append(int(ids.shape[1]))
            shared = SharedPrefill.record(model, ids, n_queries) if share else None
            if shared is not None:
                results.prefill_seconds[task].append(shared.seconds)
            line = []
            for method in active:
                method_started = time.perf_counter()
                if shared is not None:
                    # one reconstruction pass per context and scorer, shared by its methods
                    cache = shared.cache_with_scores(
                        method, model, tokenizer, settings.profiles_dir, hub=settings.hub
                    )
                    last_logits = cast(torch.Tensor, shared.last_logits)  # set by record
                else:
                    cache = make_cache(method, model, settings.profiles_dir, hub=settings.hub)
                    if isinstance(cache, LUKVCache):
                        out = cache.prefill(model, ids, tokenizer=tokenizer, logits_to_keep=1)
                    else:
                        with torch.no_grad():
                            out = model(
                                input_ids=ids,
                                use_cache=True,
                                logits_to_keep=1,
                                **{cache_kwarg(model): cache},
                            )
                    last_logits = out.logits[:, -1, :]
                held = kv_cache_bytes(cache)
                kept = _kept_fraction(cache, ids.shape[1])
                score, outputs, question_scores = score_prefilled(
                    model, tokenizer, sample, cache, last_logits
                )
                record = results.results[(task, method.name)]
                record.scores.append(score)
                record.outputs.append(outputs)
                record.question_scores.append(question_scores)
                record.kv_bytes.append(held)
                record.kept_fraction.append(kept)
                choice = getattr(cache, "memory_choice", None)  # what a memory budget chose
                if choice is not None:
                    record.memory_choices.append(choice.to_json())
                record.seconds += time.perf_counter() - method_started
                line.append(f"{method.name}={score:.3g}")
            say(
                f"[{task} {index + 1}/{len(samples)}] {ids.shape[1]} tokens, "
                f"{time.perf_counter() - started:.0f}s: " + " ".join(line)
            )
        results.seconds = time.perf_counter() - started
        if on_task_done is not None:
            on_task_done(results)
    results.seconds = time.perf_counter() - started
    return results
