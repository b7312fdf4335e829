"""``lukv demo``: plant facts in a real long text, compress it with LU-KV, ask about the facts.

The same code runs on any causal LM: ``run_demo(model, tokenizer)`` (the tests use a tiny random Llama).

    >>> from lukv_cache.models import load_smollm2
    >>> from lukv_cache.evaluation.demo import run_demo, format_report
    >>> model, tokenizer = load_smollm2()  # doctest: +SKIP
    >>> print(format_report(run_demo(model, tokenizer, ratio=0.8)))  # doctest: +SKIP
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import DynamicCache

from ..cache import kv_cache_bytes
from ..errors import ProfileError
from ..profiles import DEFAULT_SCORER, model_id_of
from .tasks import RetrievalSample, context_ids, make_samples, prefill, score_prefilled
from .texts import Article

DEFAULT_CONTEXT_TOKENS = 1000


@dataclass
class CacheRun:
    """One cache's pass over the demo: its answers and what it cost."""

    label: str
    answers: list[str]
    correct: list[bool]
    kv_bytes: int
    prefill_seconds: float
    answer_seconds: float


@dataclass
class DemoReport:
    """What ``run_demo`` found: the planted facts, both caches' answers, memory and time.

    >>> report = run_demo(model, tokenizer)  # doctest: +SKIP
    >>> report.compressed.kv_bytes < report.full.kv_bytes  # doctest: +SKIP
    True
    """

    model_id: str
    source: str
    context_tokens: int
    ratio: float
    cache_description: str
    keys: list[str]
    expected: list[str]
    full: CacheRun
    compressed: CacheRun
    notes: list[str] = field(default_factory=list)


def demo_cache(
    model: Any,
    ratio: float,
    *,
    scorer: str | None = None,
    profiles_dir: str | os.PathLike[str] | None = None,
    hub: bool = False,
) -> tuple[Any, str, list[str]]:
    """``LUKVCache.from_pretrained(model, ratio)`` with the model's LU-KV profile from ``profiles_dir``
    (or, with ``hub=True``, the shared Hub repository); when there is none, a uniform-allocation cache
    with the same scorer and a note saying so.

    Returns ``(cache, description, notes)``.

    >>> cache, description, notes = demo_cache(model, 0.8, profiles_dir="profiles_hub")  # doctest: +SKIP
    """
    from ..cache import LUKVCache

    wanted = scorer or DEFAULT_SCORER
    try:
        cache = LUKVCache.from_pretrained(
            model, ratio, scorer, local_dir=profiles_dir, local_files_only=not hub
        )
    except ProfileError as err:
        note = (
            f"No LU-KV profile for {model_id_of(model)!r} ({err}). Falling back to the uniform allocator with "
            f"the {wanted!r} scorer: every head keeps the same share. Build a profile with "
            f"`lukv build smollm2 --scorer {wanted} --out profiles_hub/{model_id_of(model)}/` to see LU-KV's "
            f"own budgets."
        )
        cache = LUKVCache(ratio, wanted, "uniform", config=model.config)
        return cache, f"LUKVCache(ratio={ratio:g}, scorer={wanted!r}, allocator='uniform')", [note]
    where = getattr(cache.profile, "source", None) or "the shared repository"
    description = f"LUKVCache.from_pretrained(..., ratio={ratio:g}): LU-KV profile {where} (scorer {cache.scorer.name!r})"
    return cache, description, []


def _run_cache(model: Any, tokenizer: Any, sample: RetrievalSample, cache: Any, label: str) -> CacheRun:
    ids = context_ids(tokenizer, sample, next(model.parameters()).device)
    started = time.perf_counter()
    last_logits = prefill(model, ids, cache)
    prefill_seconds = time.perf_counter() - started
    held = kv_cache_bytes(cache)
    started = time.perf_counter()
    _, outputs, scores = score_prefilled(model, tokenizer, sample, cache, last_logits)
    return CacheRun(
        label, outputs, [s == 1.0 for s in scores], held, prefill_seconds, time.perf_counter() - started
    )


def run_demo(
    model: Any,
    tokenizer: Any,
    *,
    ratio: float = 0.8,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    n_facts: int = 4,
    seed: int = 0,
    scorer: str | None = None,
    profiles_dir: str | os.PathLike[str] | None = None,
    hub: bool = False,
    articles: Sequence[Article] | None = None,
    log: Callable[[str], None] | None = None,
) -> DemoReport:
    """Plant ``n_facts`` "special magic numbers" in ~``context_tokens`` tokens of real Wikipedia text (or
    ``articles``), prefill it into a full ``DynamicCache`` and into an LU-KV cache at ``ratio``, and ask
    for every fact through each cache (question-agnostic: the cache is compressed before the question).

    >>> report = run_demo(model, tokenizer, ratio=0.8, context_tokens=1000)  # doctest: +SKIP
    """
    say = log or (lambda _msg: None)
    sample = make_samples(
        "niah_multikey", tokenizer, 1, context_tokens, seed=seed, n_needles=n_facts, articles=articles
    )[0]
    assert isinstance(sample, RetrievalSample)  # make_samples returns retrieval samples for this task
    n_tokens = int(context_ids(tokenizer, sample).shape[1])
    say(f"Context: {n_tokens} tokens of {sample.source!r} with {n_facts} planted facts.")
    say("Full cache: prefill and answers...")
    full = _run_cache(model, tokenizer, sample, DynamicCache(), "full cache")
    cache, description, notes = demo_cache(model, ratio, scorer=scorer, profiles_dir=profiles_dir, hub=hub)
    say(f"{description}: prefill and answers...")
    compressed = _run_cache(
        model, tokenizer, sample, cache, f"LU-KV {ratio:g}" if not notes else f"uniform {ratio:g}"
    )
    keys = [q.prompt.split(" for ", 1)[1].split(" mentioned", 1)[0] for q in sample.questions]
    return DemoReport(
        model_id=model_id_of(model) or type(model).__name__,
        source=sample.source,
        context_tokens=n_tokens,
        ratio=ratio,
        cache_description=description,
        keys=keys,
        expected=[q.answers[0] for q in sample.questions],
        full=full,
        compressed=compressed,
        notes=notes,
    )


def _megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def format_report(report: DemoReport) -> str:
    """The short printed report: answers side by side, KV memory before/after, time.

    >>> print(format_report(report))  # doctest: +SKIP
    """
    full, comp = report.full, report.compressed

    def answer(text: str, ok: bool) -> str:
        shown = text.strip().splitlines()[0] if text.strip() else "(nothing)"
        return f"{'✓' if ok else '✗'} {shown[:18]}"

    width = max(len(k) for k in report.keys) + 2 if report.keys else 10
    lines = [
        f"LU-KV demo: {report.model_id}",
        f"Context: {report.context_tokens} tokens of the Wikipedia article {report.source!r} "
        f'with {len(report.keys)} planted facts ("One of the special magic numbers for <key> is: <7 digits>.").',
        f"Compressed cache: {report.cache_description}",
        "Question-agnostic: each cache is filled (and compressed) before the question arrives.",
        "",
        f"{'fact':<{width}} {'expected':<10} {full.label:<22} {comp.label:<22}",
    ]
    for i, key in enumerate(report.keys):
        lines.append(
            f"{key:<{width}} {report.expected[i]:<10} {answer(full.answers[i], full.correct[i]):<22} "
            f"{answer(comp.answers[i], comp.correct[i]):<22}"
        )
    n = len(report.keys)
    share = comp.kv_bytes / full.kv_bytes if full.kv_bytes else float("nan")
    lines += [
        "",
        f"{'correct':<{width + 11}} {f'{sum(full.correct)}/{n}':<22} {f'{sum(comp.correct)}/{n}':<22}",
        f"{'KV memory':<{width + 11}} {_megabytes(full.kv_bytes):<22} "
        f"{f'{_megabytes(comp.kv_bytes)} ({100 * share:.0f}%)':<22}",
        f"{'prefill time':<{width + 11}} {f'{full.prefill_seconds:.2f} s':<22} {f'{comp.prefill_seconds:.2f} s':<22}",
        f"{'answer time':<{width + 11}} {f'{full.answer_seconds:.2f} s':<22} {f'{comp.answer_seconds:.2f} s':<22}",
    ]
    for note in report.notes:
        lines += ["", f"Note: {note}"]
    return "\n".join(lines)
