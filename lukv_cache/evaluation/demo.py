"""``lukv demo``: plant facts in real long texts, compress them, ask about the facts, count right answers.

Several contexts (seeded, fixed in advance), each with several facts, each cache filled before the
questions arrive (question-agnostic). One compact table: the full cache, uniform eviction, the LU-KV
profile that ``LUKVCache.from_pretrained`` reads, and KVzip, each at two ratios, with KV memory and
correct answers (the keydiff profile; ``from_pretrained`` without a scorer takes a model's kvzap
profile where it has one). The same code runs on any causal LM (the tests use a tiny random Llama).

    >>> from lukv_cache.models import load_model
    >>> from lukv_cache.evaluation.demo import run_demo, format_report
    >>> print(format_report(run_demo(*load_model("smollm2"))))  # doctest: +SKIP
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from ..cache import kv_cache_bytes
from ..errors import ProfileError
from ..profiles import model_id_of
from ..scorers import get_scorer
from ..texts import Article
from .methods import FULL, Method, check_bench_positions
from .prefill import SharedPrefill
from .tasks.samples import RetrievalSample, check_sample_positions, make_samples
from .tasks.scoring import context_ids, score_prefilled

if TYPE_CHECKING:
    import torch

DEFAULT_CONTEXT_TOKENS = 1000
DEFAULT_RATIOS = (0.5, 0.8)
# (label, allocator, scorer): what the demo compares at each ratio
LINEUP = (
    ("uniform, keydiff", "uniform", "keydiff"),
    ("LU-KV profile, keydiff", "profile", "keydiff"),
    ("KVzip, global", "global", "kvzip"),
)


@dataclass
class Row:
    """One cache at one ratio over every question of the demo."""

    label: str
    ratio: float | None
    correct: int = 0
    asked: int = 0
    kv_bytes: list[int] = field(default_factory=list)
    seconds: float = 0.0
    skipped: str | None = None


@dataclass
class DemoReport:
    """What ``run_demo`` found: one row per cache and ratio, and the contexts it used.

    >>> report = run_demo(model, tokenizer)  # doctest: +SKIP
    >>> report.rows[0].label  # doctest: +SKIP
    'full cache'
    """

    model_id: str
    contexts: list[str]
    context_tokens: list[int]
    facts: int
    rows: list[Row]
    seconds: float = 0.0


def run_demo(
    model: Any,
    tokenizer: Any,
    *,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    contexts: int = 3,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    n_facts: int = 4,
    seed: int = 0,
    profiles_dir: str | os.PathLike[str] | None = None,
    hub: bool = False,
    articles: Sequence[Article] | None = None,
    log: Callable[[str], None] | None = None,
) -> DemoReport:
    """Plant ``n_facts`` "special magic numbers" in each of ``contexts`` texts of ~``context_tokens``
    tokens (real Wikipedia, or ``articles``), and ask for every fact through each cache of the lineup at
    each ratio. Contexts and facts come from ``seed``; a cache whose profile is missing is reported as
    skipped, with the reason. ``log`` gets a line per context, then one per stage of it (the prefill, each
    cache), so a slow run never goes quiet for a whole context.

    >>> report = run_demo(model, tokenizer, ratios=(0.5, 0.8), contexts=3)  # doctest: +SKIP
    """
    say = log or (lambda _msg: None)
    started = time.perf_counter()
    check_bench_positions(model.config, ["niah_multikey"], context_tokens, n_facts, 0)
    samples = make_samples(
        "niah_multikey", tokenizer, contexts, context_tokens, seed=seed, n_needles=n_facts, articles=articles
    )
    check_sample_positions(model.config, tokenizer, samples)  # before anything runs
    methods = [("full cache", Method(FULL))] + [
        (label, Method(allocator, scorer, float(ratio)))
        for ratio in ratios
        for label, allocator, scorer in LINEUP
    ]
    rows = [Row(label, method.ratio) for label, method in methods]
    n_queries = max([get_scorer(cast(str, m.scorer)).n_queries for _, m in methods if not m.is_full] + [2])
    device = next(model.parameters()).device
    report = DemoReport(model_id_of(model) or type(model).__name__, [], [], n_facts, rows)
    for index, sample in enumerate(samples):
        assert isinstance(sample, RetrievalSample)  # make_samples returns retrieval samples for this task
        ids = context_ids(tokenizer, sample, device)
        report.contexts.append(sample.source)
        report.context_tokens.append(int(ids.shape[1]))
        say(
            f"Context {index + 1}/{len(samples)}: {ids.shape[1]} tokens of {sample.source!r}, {n_facts} facts."
        )
        prefill_started = time.perf_counter()
        shared = SharedPrefill.record(model, ids, n_queries)
        say(f"  prefill: {time.perf_counter() - prefill_started:.1f} s")
        for row, (_, method) in zip(rows, methods):
            if row.skipped:
                continue
            name = row.label if row.ratio is None else f"{row.label} at ratio {row.ratio:g}"
            method_started = time.perf_counter()
            try:
                cache = shared.cache_with_scores(method, model, tokenizer, profiles_dir, hub=hub)
            except ProfileError as err:
                row.skipped = str(err).split(". ")[0]
                say(f"  {name}: skipped ({row.skipped})")
                continue
            row.kv_bytes.append(kv_cache_bytes(cache))
            last_logits = cast("torch.Tensor", shared.last_logits)  # set by record
            _, _, question_scores = score_prefilled(model, tokenizer, sample, cache, last_logits)
            correct = sum(score == 1.0 for score in question_scores)
            row.correct += correct
            row.asked += len(question_scores)
            seconds = time.perf_counter() - method_started
            row.seconds += seconds
            say(f"  {name}: {correct}/{len(question_scores)} facts, {seconds:.1f} s")
    report.seconds = time.perf_counter() - started
    return report


def _megabytes(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def format_report(report: DemoReport) -> str:
    """One compact table: cache, ratio, KV memory (and its share of the full cache), correct answers.

    >>> print(format_report(report))  # doctest: +SKIP
    """
    n_contexts = len(report.contexts)
    tokens = f"{min(report.context_tokens)}-{max(report.context_tokens)}" if report.context_tokens else "0"
    full = report.rows[0]
    full_bytes = sum(full.kv_bytes) / max(1, len(full.kv_bytes))
    lines = [
        f"LU-KV demo: {report.model_id}",
        f"{n_contexts} Wikipedia contexts ({tokens} tokens: {', '.join(report.contexts)}), {report.facts} planted "
        'facts each ("One of the special magic numbers for <key> is: <7 digits>.").',
        "Question-agnostic: every cache is filled (and compressed) before the questions arrive.",
        "",
        f"{'cache':<26} {'ratio':>5}  {'KV memory':>17}  {'correct':>8}",
    ]
    for row in report.rows:
        ratio = "-" if row.ratio is None else f"{row.ratio:g}"
        if row.skipped:
            lines.append(f"{row.label:<26} {ratio:>5}  skipped: {row.skipped}")
            continue
        held = sum(row.kv_bytes) / max(1, len(row.kv_bytes))
        share = f" ({100 * held / full_bytes:.0f}%)" if full_bytes and row is not full else ""
        lines.append(
            f"{row.label:<26} {ratio:>5}  {_megabytes(held) + share:>17}  {f'{row.correct}/{row.asked}':>8}"
        )
    lines += [
        "",
        f"ratio = fraction of the context's KV removed. {report.seconds:.0f} s in all. LU-KV profile: the budgets "
        "LUKVCache.from_pretrained(model, ratio, scorer='keydiff') reads; KVzip: cache.prefill(model, ids, "
        "tokenizer=...).",
    ]
    return "\n".join(lines)
