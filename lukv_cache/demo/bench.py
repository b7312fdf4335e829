"""The benchmark harness: full cache vs allocators x scorers x ratios on question-agnostic real-text tasks.

One context prefill per sample is shared by every method. Compression happens right after each layer's
prefill attention and never changes that layer's output, so every method sees the same keys, values and
queries; the harness records them once (with a full cache) and replays them into each method's fresh
``LUKVCache`` through the installed attention function, which compresses exactly as in a real prefill
(``tests/demo`` checks that the replayed cache equals a real one).

    >>> from lukv_cache.demo.bench import BenchSettings, run_benchmark
    >>> settings = BenchSettings(tasks=("niah_multikey",), samples=2, ratios=(0.5,), scorers=("keydiff",))
    >>> results = run_benchmark(model, tokenizer, settings)  # doctest: +SKIP
    >>> write_results(results, "benchmarks/results")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from ..errors import ConfigurationError, ProfileError, ProfileNotFoundError
from .tasks import (
    RETRIEVAL_TASKS,
    TASKS,
    Sample,
    context_ids,
    kv_bytes,
    make_samples,
    mean_and_sem,
    score_prefilled,
)
from .texts import Article

ALLOCATORS = ("uniform", "pyramid", "adakv", "profile")
SCORERS = ("keydiff", "snapkv", "expected_attention", "knorm")
RATIOS = (0.25, 0.5, 0.8, 0.9)
FULL = "full"
_RECORD_IMPL = "lukv_bench_record"


@dataclass(frozen=True)
class Method:
    """One way to hold the context: the full cache, or an allocator + scorer at a compression ratio.

    >>> Method("uniform", "keydiff", 0.8).name
    'uniform/keydiff@0.8'
    >>> Method(FULL).name
    'full'
    """

    allocator: str
    scorer: str | None = None
    ratio: float | None = None

    @property
    def is_full(self) -> bool:
        return self.allocator == FULL

    @property
    def name(self) -> str:
        return FULL if self.is_full else f"{self.allocator}/{self.scorer}@{self.ratio:g}"


def build_methods(
    allocators: Sequence[str], scorers: Sequence[str], ratios: Sequence[float], *, full: bool = True
) -> list[Method]:
    """The grid: the full cache (first) and every allocator x scorer x ratio.

    >>> [m.name for m in build_methods(["uniform"], ["keydiff"], [0.5])]
    ['full', 'uniform/keydiff@0.5']
    """
    grid = [Method(a, s, float(r)) for a in allocators for s in scorers for r in ratios]
    return ([Method(FULL)] if full else []) + grid


def profile_file(profiles_dir: str | os.PathLike[str], model_id: str, scorer: str) -> Path:
    """Where the local profile mirror keeps a model's profile: ``<dir>/<model id>/<scorer>.safetensors``.

    >>> profile_file("profiles_hub", "HuggingFaceTB/SmolLM2-135M-Instruct", "keydiff").name
    'keydiff.safetensors'
    """
    return Path(profiles_dir) / model_id / f"{scorer}.safetensors"


def model_id_of(model: Any) -> str:
    """The id a profile is keyed by: ``model.config.name_or_path``."""
    config = model.config
    return getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "")


def make_cache(
    method: Method, model: Any, profiles_dir: str | os.PathLike[str] | None = None, *, hub: bool = False
) -> Any:
    """A fresh, empty cache for ``method``. ``profile`` looks up ``<profiles_dir>/<model id>/<scorer>``
    and raises :class:`ProfileNotFoundError` if it is not there (or tries the Hub when ``hub=True``).

    >>> cache = make_cache(Method("adakv", "keydiff", 0.8), model)  # doctest: +SKIP
    """
    if method.is_full:
        return DynamicCache()
    from .. import LUKVCache

    if method.allocator != "profile":
        return LUKVCache(method.ratio, method.scorer, method.allocator, config=model.config)
    if profiles_dir is not None and not hub:
        path = profile_file(profiles_dir, model_id_of(model), method.scorer)
        if not path.is_file():
            raise ProfileNotFoundError(
                f"No {method.scorer!r} profile for {model_id_of(model)!r} at {path}. Build one with "
                f"`lukv build <model> --out {profiles_dir}/{model_id_of(model)}/`, or pass --hub to look in the "
                f"shared Hub repository."
            )
    return LUKVCache.from_pretrained(model, method.ratio, method.scorer, local_dir=profiles_dir)


# --------------------------------------------------------------------------------------- shared prefill

_ACTIVE_RECORDING: list[SharedPrefill] = []


def _recording_attention(module: Any, query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    recording = _ACTIVE_RECORDING[-1]
    recording.queries[module.layer_idx] = query[:, :, -recording.n_queries :].detach().clone()
    recording.modules[module.layer_idx] = module
    return ALL_ATTENTION_FUNCTIONS[recording.attn_implementation](module, query, key, *args, **kwargs)


def _register_recorder() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(_RECORD_IMPL, _recording_attention)
    AttentionMaskInterface.register(_RECORD_IMPL, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


@contextlib.contextmanager
def _recording(model: Any, recording: SharedPrefill) -> Iterator[None]:
    _register_recorder()
    model.set_attn_implementation(_RECORD_IMPL)
    _ACTIVE_RECORDING.append(recording)
    try:
        yield
    finally:
        _ACTIVE_RECORDING.pop()
        model.set_attn_implementation(recording.attn_implementation)


@dataclass
class SharedPrefill:
    """One context's prefill, recorded once: per layer the full keys/values and the last ``n_queries``
    post-RoPE queries, plus the last-position logits. :meth:`cache_for` turns it into any method's cache.

    >>> shared = SharedPrefill.record(model, ids, n_queries=64)  # doctest: +SKIP
    >>> cache = shared.cache_for(Method("uniform", "keydiff", 0.8), model)  # doctest: +SKIP
    """

    n_queries: int
    attn_implementation: str
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    modules: dict[int, Any] = field(default_factory=dict)
    last_logits: torch.Tensor | None = None
    seconds: float = 0.0

    @classmethod
    @torch.no_grad()
    def record(cls, model: Any, input_ids: torch.Tensor, n_queries: int) -> SharedPrefill:
        impl = model.config._attn_implementation
        if impl not in ("sdpa", "eager"):
            raise ConfigurationError(
                f"The shared prefill needs attn_implementation sdpa or eager, got {impl!r}."
            )
        recording = cls(max(2, n_queries), impl)
        cache = DynamicCache()
        started = time.perf_counter()
        with _recording(model, recording):
            out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        recording.seconds = time.perf_counter() - started
        recording.last_logits = out.logits[:, -1, :]
        recording.keys = [layer.keys for layer in cache.layers]
        recording.values = [layer.values for layer in cache.layers]
        return recording

    @torch.no_grad()
    def cache_for(
        self,
        method: Method,
        model: Any,
        profiles_dir: str | os.PathLike[str] | None = None,
        *,
        hub: bool = False,
    ) -> Any:
        """``method``'s cache holding this context, as if the context had been prefilled into it."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        cache = make_cache(method, model, profiles_dir, hub=hub)
        attention = ALL_ATTENTION_FUNCTIONS[self.attn_implementation]
        for layer_idx, (keys, values) in enumerate(zip(self.keys, self.values)):
            k, v = cache.update(keys.clone(), values.clone(), layer_idx)
            if method.is_full:
                continue
            module = self.modules[layer_idx]
            # The installed attention function compresses the layer after a multi-token forward, reading
            # the queries it is given (the scorer takes the last n_queries). Its output is discarded.
            attention(module, self.queries[layer_idx], k, v, None, dropout=0.0, scaling=module.scaling)
        return cache


def shareable(model: Any) -> bool:
    """Whether the shared prefill applies: every layer full attention, attention sdpa or eager."""
    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    no_sliding = all(t == "full_attention" for t in layer_types) and not getattr(
        config, "sliding_window", None
    )
    return no_sliding and model.config._attn_implementation in ("sdpa", "eager")


# --------------------------------------------------------------------------------------- running the grid


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
    profiles_dir: str | None = "profiles_hub"
    hub: bool = False
    share_prefill: bool = True


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
    from ..scorers import get_scorer

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
    ``on_task_done`` is called after each task, e.g. to write partial results.

    >>> results = run_benchmark(model, tokenizer, BenchSettings(samples=2, ratios=(0.8,)))  # doctest: +SKIP
    """
    for task in settings.tasks:
        if task not in TASKS:
            raise ConfigurationError(f"Unknown task {task!r}; choose from {', '.join(TASKS)}.")
    methods = build_methods(settings.allocators, settings.scorers, settings.ratios, full=settings.full)
    results = BenchResults(settings, started_utc=datetime.datetime.now(datetime.timezone.utc).isoformat())
    say = log or (lambda _msg: None)
    share = settings.share_prefill and shareable(model)
    n_queries = _n_queries(settings.scorers)
    device = next(model.parameters()).device
    started = time.perf_counter()

    # Methods whose cache cannot be built (no profile file) are skipped once, with the reason.
    for method in methods:
        if method.allocator == "profile" and method.name not in results.skipped:
            try:
                make_cache(method, model, settings.profiles_dir, hub=settings.hub)
            except ProfileError as err:
                results.skipped[method.name] = str(err)
    active = [m for m in methods if m.name not in results.skipped]
    for name, reason in results.skipped.items():
        say(f"skip {name}: {reason}")

    for task in settings.tasks:
        samples: list[Sample] = make_samples(
            task,
            tokenizer,
            settings.samples,
            settings.context_tokens,
            seed=settings.seed,
            n_needles=settings.needles,
            continuation_tokens=settings.continuation_tokens,
            articles=articles,
        )
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
                    cache = shared.cache_for(method, model, settings.profiles_dir, hub=settings.hub)
                    last_logits = shared.last_logits
                else:
                    cache = make_cache(method, model, settings.profiles_dir, hub=settings.hub)
                    with torch.no_grad():
                        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                    last_logits = out.logits[:, -1, :]
                held = kv_bytes(cache)
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


# --------------------------------------------------------------------------------------- summarising


def _is_retrieval(task: str) -> bool:
    return task in RETRIEVAL_TASKS


def summarize(results: BenchResults) -> list[dict[str, Any]]:
    """One row per (task, method): mean, standard error, 95% CI (normal approximation), sample counts,
    KV bytes and kept fraction; for continuation also the excess NLL over the full cache (paired).

    >>> rows = summarize(results)  # doctest: +SKIP
    """
    rows = []
    for (task, _name), record in results.results.items():
        mean, sem = mean_and_sem(record.scores)
        row: dict[str, Any] = {
            "task": task,
            "method": record.method.name,
            "allocator": record.method.allocator,
            "scorer": record.method.scorer,
            "ratio": record.method.ratio,
            "metric": "accuracy" if _is_retrieval(task) else "nll",
            "n_samples": len(record.scores),
            "n_questions": sum(len(q) for q in record.question_scores) or len(record.scores),
            "mean": mean,
            "sem": sem,
            "ci95": [mean - 1.96 * sem, mean + 1.96 * sem],
            "kv_bytes_mean": sum(record.kv_bytes) / max(1, len(record.kv_bytes)),
            "kept_fraction_mean": sum(record.kept_fraction) / max(1, len(record.kept_fraction)),
            "seconds": record.seconds,
            "per_sample": record.scores,
        }
        full = results.results.get((task, FULL))
        if not _is_retrieval(task) and full is not None and len(full.scores) == len(record.scores):
            excess = [a - b for a, b in zip(record.scores, full.scores)]
            e_mean, e_sem = mean_and_sem(excess)
            row["excess_nll"] = {
                "mean": e_mean,
                "sem": e_sem,
                "ci95": [e_mean - 1.96 * e_sem, e_mean + 1.96 * e_sem],
            }
        rows.append(row)
    return rows


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "–"
    if row["metric"] == "accuracy":
        return f"{100 * row['mean']:.1f} ± {100 * row['sem']:.1f}"
    if "excess_nll" in row:
        return f"{row['excess_nll']['mean']:+.3f} ± {row['excess_nll']['sem']:.3f}"
    return f"{row['mean']:.3f} ± {row['sem']:.3f}"


def _recovery(rows: dict[str, dict[str, Any]], scorer: str, ratio: float, retrieval: bool) -> str:
    """LU-KV's share of the gap between uniform and the full cache: (profile - uniform) / (full - uniform)."""
    full, uniform = rows.get(FULL), rows.get(f"uniform/{scorer}@{ratio:g}")
    lukv = rows.get(f"profile/{scorer}@{ratio:g}")
    if full is None or uniform is None or lukv is None:
        return "–"
    gap = full["mean"] - uniform["mean"]
    if abs(gap) < 1e-9:
        return "no gap"
    return f"{100 * (lukv['mean'] - uniform['mean']) / gap:.0f}%"


def format_markdown(results: BenchResults, rows: list[dict[str, Any]] | None = None) -> str:
    """The results as markdown: the exact command, settings, then one table per task (rows: methods,
    columns: ratios) with ± one standard error, and the share of the uniform-to-full gap LU-KV recovers.

    >>> print(format_markdown(results))  # doctest: +SKIP
    """
    rows = rows if rows is not None else summarize(results)
    s = results.settings
    lines = [
        "# lukv_cache benchmark",
        "",
        f"Command: `{results.command}`" if results.command else "",
        "",
        f"* Model: {results.model_info.get('model_id', '?')} ({results.model_info.get('source', '')})",
        f"* Started {results.started_utc}, {results.seconds / 60:.1f} min on {torch.get_num_threads()} CPU "
        f"thread(s), torch {torch.__version__}",
        f"* {s.samples} samples per task, ~{s.context_tokens} context tokens, seed {s.seed}, "
        f"{s.needles} needles; shared prefill: {s.share_prefill}",
        "* Retrieval cells: accuracy % ± one standard error over contexts (all questions of a context share "
        "its prefill; the SE treats contexts as the unit). Continuation cells: excess NLL (nats/token) over "
        "the full cache, paired per document, ± SE. 95% CI ≈ ± 1.96 SE (in the JSON).",
        "* `ratio` = fraction of the context's KV entries removed (0.8 keeps 20%).",
    ]
    for name, reason in results.skipped.items():
        lines.append(f"* Skipped {name}: {reason}")
    for task in s.tasks:
        task_rows = {r["method"]: r for r in rows if r["task"] == task}
        if not task_rows:
            continue
        tokens = results.context_tokens.get(task, [])
        n_q = task_rows[next(iter(task_rows))]["n_questions"]
        span = f"{min(tokens, default=0)}-{max(tokens, default=0)} tokens"
        lines += ["", f"## {task}", ""]
        if _is_retrieval(task):
            lines.append(f"{len(tokens)} contexts ({span}), {n_q} questions per method.")
        else:
            lines.append(
                f"{len(tokens)} documents, {span} compressed, {s.continuation_tokens} tokens teacher-forced."
            )
        if FULL in task_rows:
            lines.append(
                f"Full cache: {_cell(task_rows[FULL]) if _is_retrieval(task) else _full_nll(task_rows)}."
            )
        ratios = list(s.ratios)
        lines += [
            "",
            "| allocator | scorer | " + " | ".join(f"ratio {r:g}" for r in ratios) + " |",
            "|---|---|" + "---|" * len(ratios),
        ]
        for allocator in s.allocators:
            for scorer in s.scorers:
                cells = [_cell(task_rows.get(f"{allocator}/{scorer}@{r:g}")) for r in ratios]
                lines.append(f"| {allocator} | {scorer} | " + " | ".join(cells) + " |")
        kept = [
            f"{r:g}: {100 * task_rows[m]['kept_fraction_mean']:.1f}%"
            for r in ratios
            for m in [f"uniform/{s.scorers[0]}@{r:g}"]
            if m in task_rows
        ]
        if kept:
            lines += ["", "Mean share of context tokens stored per head (uniform): " + ", ".join(kept) + "."]
        if "profile" in s.allocators:
            lines += [
                "",
                "LU-KV (profile) recovery of the uniform→full gap:",
                "",
                "| scorer | " + " | ".join(f"ratio {r:g}" for r in ratios) + " |",
                "|---|" + "---|" * len(ratios),
            ]
            for scorer in s.scorers:
                cells = [_recovery(task_rows, scorer, r, _is_retrieval(task)) for r in ratios]
                lines.append(f"| {scorer} | " + " | ".join(cells) + " |")
    return "\n".join(line for line in lines) + "\n"


def _full_nll(task_rows: dict[str, dict[str, Any]]) -> str:
    full = task_rows[FULL]
    return f"NLL {full['mean']:.3f} ± {full['sem']:.3f} nats/token"


def plot_results(
    results: BenchResults, path: str | os.PathLike[str], rows: list[dict[str, Any]] | None = None
) -> Path:
    """Accuracy (or excess NLL) vs ratio, one panel per (task, scorer), one line per allocator; the full
    cache as a dashed line. Returns the PNG path.

    >>> plot_results(results, "benchmarks/results/bench.png")  # doctest: +SKIP
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rows if rows is not None else summarize(results)
    s = results.settings
    tasks = [t for t in s.tasks if any(r["task"] == t for r in rows)]
    fig, axes = plt.subplots(
        len(tasks), len(s.scorers), figsize=(4 * len(s.scorers), 3.2 * len(tasks)), squeeze=False
    )
    for i, task in enumerate(tasks):
        task_rows = {r["method"]: r for r in rows if r["task"] == task}
        retrieval = _is_retrieval(task)

        def value(row: dict[str, Any], retrieval: bool = retrieval) -> tuple[float, float]:
            if retrieval:
                return 100 * row["mean"], 100 * 1.96 * row["sem"]
            e = row.get("excess_nll", {"mean": row["mean"], "sem": row["sem"]})
            return e["mean"], 1.96 * e["sem"]

        for j, scorer in enumerate(s.scorers):
            ax = axes[i][j]
            for allocator in s.allocators:
                points = [(r, task_rows.get(f"{allocator}/{scorer}@{r:g}")) for r in sorted(s.ratios)]
                points = [(r, value(row)) for r, row in points if row is not None]
                if points:
                    ax.errorbar(
                        [p[0] for p in points],
                        [p[1][0] for p in points],
                        yerr=[p[1][1] for p in points],
                        marker="o",
                        capsize=3,
                        label=allocator,
                    )
            if FULL in task_rows:
                ax.axhline(value(task_rows[FULL])[0], color="black", linestyle="--", label="full")
            ax.set_title(f"{task} / {scorer}", fontsize=9)
            ax.set_xlabel("ratio (fraction evicted)")
            ax.set_ylabel("accuracy %" if retrieval else "excess NLL (nats/token)")
            ax.grid(alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def to_json(results: BenchResults, rows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Everything needed to re-read the run: command, settings, model, per-row statistics, per-sample scores.

    >>> json.dumps(to_json(results))  # doctest: +SKIP
    """
    rows = rows if rows is not None else summarize(results)
    return {
        "command": results.command,
        "started_utc": results.started_utc,
        "seconds": results.seconds,
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "model": results.model_info,
        "settings": asdict(results.settings) | {"tasks": list(results.settings.tasks)},
        "context_tokens": results.context_tokens,
        "prefill_seconds": results.prefill_seconds,
        "skipped": results.skipped,
        "results": rows,
        "outputs": {f"{t}|{m}": r.outputs for (t, m), r in results.results.items() if _is_retrieval(t)},
    }


def write_results(
    results: BenchResults, out_dir: str | os.PathLike[str], name: str | None = None
) -> dict[str, Path]:
    """Write ``<name>.md``, ``<name>.json`` and ``<name>.png`` under ``out_dir``; return their paths.

    >>> paths = write_results(results, "benchmarks/results", "multikey_1k")  # doctest: +SKIP
    """
    s = results.settings
    name = name or f"{'-'.join(s.tasks)}_{s.context_tokens}tok_{s.samples}s"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(results)
    paths = {"md": out / f"{name}.md", "json": out / f"{name}.json", "png": out / f"{name}.png"}
    paths["md"].write_text(format_markdown(results, rows) + f"\nPlot: `{paths['png'].name}`\n")
    paths["json"].write_text(json.dumps(to_json(results, rows), indent=1, default=_json_default) + "\n")
    try:
        plot_results(results, paths["png"], rows)
    except ImportError:
        paths.pop("png")  # matplotlib is optional (the `plots` / `demo` extras)
    return paths


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed, for the results header."""
    argv = list(sys.argv if argv is None else argv)
    program = argv[0] if argv else "lukv"
    if " " not in program:  # an installed entry point: its name, not its path
        program = os.path.basename(program)
    return " ".join([program] + [_quote(a) for a in argv[1:]])


def _quote(arg: str) -> str:
    return arg if arg and all(c.isalnum() or c in "-_./=:,@" for c in arg) else json.dumps(arg)
