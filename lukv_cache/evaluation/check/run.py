"""``lukv check`` itself: each allocator at each ratio (or memory budget) against the full cache, on shared
prefills, one teacher-forced forward per compressed answer."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Sequence
from typing import Any, cast

import torch

from ..._compat import cache_kwarg
from ...allocation import allocators_reading_profile
from ...cache.pretrained import one_line_in_bytes
from ...cache.storage.quant import check_kv_bits
from ...errors import ConfigurationError, ProfileError
from ...scorers import get_scorer
from ..decoding import greedy_decode, stop_ids
from ..methods import (
    CHECK_ALLOCATORS,
    CHECK_RATIOS,
    FULL,
    Method,
    make_cache,
    memory_list,
    one_line_method,
    scorer_reads_profile,
)
from ..prefill import SharedPrefill
from .grading import is_correct
from .inputs import Context, check_options, encode_contexts, reference_answers
from .report import Answers, CheckReport, CheckRow

_STOP = -1  # every stop token predicts the same thing: the answer ends


@torch.no_grad()
def _predictions(
    model: Any, cache: Any, prompt: torch.Tensor, answer: list[int], stops: Sequence[int], max_new_tokens: int
) -> tuple[list[int], float]:
    """One teacher-forced forward of ``prompt`` + ``answer`` through ``cache`` (consumed): the greedy
    prediction after the prompt and after each answer token (stop tokens as ``_STOP``; none after an answer
    that ran to ``max_new_tokens``), and the mean NLL of ``answer`` (nats/token; 0 for an empty one)."""
    target = torch.tensor([answer], dtype=prompt.dtype, device=prompt.device)
    ids = torch.cat([prompt, target], dim=1)
    logits = model(
        input_ids=ids, use_cache=True, logits_to_keep=len(answer) + 1, **{cache_kwarg(model): cache}
    ).logits
    logits = logits[0].float()
    predicted = [_STOP if t in stops else t for t in logits.argmax(-1).tolist()]
    if len(answer) >= max_new_tokens:  # decoding ended on the length, not on a prediction
        predicted = predicted[: len(answer)]
    nll = float(torch.nn.functional.cross_entropy(logits[: len(answer)], target[0])) if answer else 0.0
    return predicted, nll


def _progress(total: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc="lukv check",
        disable=not enabled,
        bar_format="{desc}: {percentage:3.0f}%|{bar:16}| {elapsed} elapsed, ETA {remaining}{postfix}",
    )


def check(
    model: Any,
    tokenizer: Any,
    contexts: Sequence[Context],
    *,
    ratios: Sequence[float] | None = None,
    allocators: Sequence[str] | None = None,
    scorer: str | None = None,
    max_new_tokens: int = 24,
    tolerance: float = 0.9,
    profiles_dir: str | os.PathLike | None = None,
    hub: bool = False,
    show_progress: bool = True,
    show_answers: bool = False,
    answers: Sequence[Sequence[str | None] | None] | None = None,
    kv_bits: int | None = None,
    memory: Sequence[float] = (),
) -> CheckReport:
    """Compare each allocator at each ratio with the full cache on ``contexts`` (see
    :mod:`lukv_cache.evaluation.check`).

    Bad settings and contexts that do not fit the model's positions raise before anything is prefilled; an
    allocator whose profile cannot be found is skipped (with the reason) before any prefill too.
    ``show_answers``: also decode every compressed cache's answers (:attr:`CheckReport.answers`).

    Reference answers (to measure accuracy, and recommend on it): a context ``(text, questions, answers)``,
    or ``answers``, one list per context aligned with its questions (``None`` for a question, or a context,
    without one). An answer is right when :func:`is_correct`; a compressed cache's answer is decoded only
    where it differs from the full cache's. ``kv_bits``: every compressed cache stores its kept keys and
    values in that many bits (8 or 4; ``LUKVCache(kv_bits=...)``), so the table shows what it costs.
    ``ratios``: default :data:`CHECK_RATIOS`. ``memory``: memory budgets (fractions of the full cache's
    bytes, ``LUKVCache(memory=...)``) measured instead of ratios: each chooses its bits and tokens per
    context (the table shows the bits chosen), and the smallest budget that keeps the tolerance is
    recommended; not with ``ratios`` or ``kv_bits``. A budget too small for a context (the tokens every
    head keeps do not fit) skips its rows, saying so.

    By default (``scorer`` / ``allocators`` ``None``) it measures what ``LUKVCache.from_pretrained(model,
    ratio=..., scorer=scorer)`` would use (:func:`~lukv_cache.evaluation.methods.one_line_method`: its
    scorer, and its allocator first), then :data:`CHECK_ALLOCATORS` with that scorer; on a sliding-window
    model whose one line holds the ratio as a byte budget (``memory=1 - ratio``: docs/memory.md), with
    nothing chosen, the budgets ``1 -`` :data:`CHECK_RATIOS` instead of the ratios."""
    started = time.perf_counter()
    kv_bits = check_kv_bits(kv_bits)
    budgets = memory_list(memory)
    defaults = ratios is None and not budgets and kv_bits is None and scorer is None and allocators is None
    if defaults and one_line_in_bytes(model):  # what the one line does there: 1 - ratio of the bytes
        budgets = memory_list([round(1.0 - ratio, 6) for ratio in CHECK_RATIOS])
    check_options(  # the ratios, budgets and kv_bits together, before the model's defaults are looked up
        allocators=allocators, scorer=scorer, max_new_tokens=max_new_tokens, tolerance=tolerance,
        ratios=ratios, memory=budgets, kv_bits=kv_bits,
    )  # fmt: skip
    if scorer is None or allocators is None:
        scorer, one_allocator = one_line_method(model, profiles_dir, hub=hub, scorer=scorer)
        if allocators is None:
            allocators = [one_allocator, *CHECK_ALLOCATORS]
    ratios = check_options(
        allocators=allocators,
        scorer=scorer,
        max_new_tokens=max_new_tokens,
        tolerance=tolerance,
        ratios=ratios,
        memory=budgets,
        kv_bits=kv_bits,
    )
    references = reference_answers(contexts, answers)
    encoded = encode_contexts(tokenizer, contexts, model.config, max_new_tokens)  # before any prefill
    rows = [CheckRow(a, r) for a in dict.fromkeys(allocators) for r in dict.fromkeys(ratios)]
    rows += [CheckRow(a, None, memory=m) for a in dict.fromkeys(allocators) for m in budgets]

    def method_of(row: CheckRow) -> Method:
        if row.memory is not None:
            return Method(row.allocator, scorer, memory=row.memory)
        return Method(row.allocator, scorer, row.ratio, kv_bits)

    reads_profile = allocators_reading_profile()
    for row in rows:  # a profile that is not there: said once, before any work
        if row.allocator in reads_profile or scorer_reads_profile(scorer):
            try:
                make_cache(method_of(row), model, profiles_dir, hub=hub)
            except ProfileError as err:
                row.skipped = str(err).split(". ")[0]
    active = [row for row in rows if not row.skipped]
    device = next(model.parameters()).device
    stops = stop_ids(tokenizer)
    n_queries = max(2, get_scorer(scorer).n_queries)
    report = CheckReport(
        scorer, rows, len(contexts), sum(len(item[1]) for item in contexts), tolerance, kv_bits=kv_bits
    )

    # progress in units of about one forward of one token: a prefill ~ its tokens / 64, the full answers
    # max_new_tokens each, a compression 1, a compressed answer 1 (+ max_new_tokens with show_answers)
    def prefill_units(ids: torch.Tensor) -> int:
        return max(1, ids.shape[1] // 64)

    per_answer = 1 + (max_new_tokens if show_answers else 0)
    total = sum(
        prefill_units(ids) + len(qs) * max_new_tokens + len(active) * (1 + len(qs) * per_answer)
        for ids, qs in encoded
    )
    with _progress(total, show_progress) as progress:
        for number, (context_ids, question_ids) in enumerate(encoded, start=1):
            where = f"context {number}/{len(encoded)}"
            progress.set_postfix_str(f"{where}: prefill", refresh=True)
            shared = SharedPrefill.record(model, context_ids.to(device), n_queries)
            progress.update(prefill_units(context_ids))
            full, _ = shared.scored_cache(Method(FULL), model, tokenizer)
            prompts = [ids.to(device) for ids in question_ids]
            full_answers, reference, base_nll = [], [], []
            progress.set_postfix_str(f"{where}: full cache's answers", refresh=True)
            for prompt in prompts:
                answer = greedy_decode(model, copy.deepcopy(full), prompt, max_new_tokens, stops)[0]
                predicted, nll = _predictions(
                    model, copy.deepcopy(full), prompt, answer, stops, max_new_tokens
                )
                full_answers.append(answer)
                reference.append(predicted)
                base_nll.append(nll)
                progress.update(max_new_tokens)
            refs = references[number - 1]
            full_texts = [_text(tokenizer, a) for a in full_answers]
            full_right = [ref is not None and is_correct(t, ref) for t, ref in zip(full_texts, refs)]
            report.graded += sum(ref is not None for ref in refs)
            report.full_correct += sum(full_right)
            if show_answers:
                questions = contexts[number - 1][1]
                shown = [Answers(number, q, t, expected=r) for q, t, r in zip(questions, full_texts, refs)]
                report.answers.extend(shown)
            scores: dict[str, Any] = {}  # allocator -> its scored prefill of this context
            for row in active:
                progress.set_postfix_str(f"{where}: {row.name}", refresh=True)
                if row.skipped:  # a budget too small for an earlier context
                    progress.update(1 + len(prompts) * per_answer)
                    continue
                try:
                    cache, scores[row.allocator] = shared.scored_cache(
                        method_of(row),
                        model,
                        tokenizer,
                        profiles_dir,
                        hub=hub,
                        scores=scores.get(row.allocator),
                    )
                except ConfigurationError as err:
                    if row.memory is None:
                        raise
                    # the budget cannot hold the tokens every head keeps for this context: the row is out
                    row.skipped = f"context {number}: {err}"
                    progress.update(1 + len(prompts) * per_answer)
                    continue
                choice = getattr(cache, "memory_choice", None)
                if choice is not None:
                    row.chosen.append(_bits_name(choice.kv_bits, model))
                progress.update(1)
                for i, (prompt, answer) in enumerate(zip(prompts, full_answers)):
                    predicted, nll = _predictions(
                        model, copy.deepcopy(cache), prompt, answer, stops, max_new_tokens
                    )
                    agrees = predicted == reference[i]
                    row.agree += int(agrees)
                    row.asked += 1
                    row.excess_nll.append(nll - base_nll[i])
                    got = full_texts[i]
                    if not agrees and (show_answers or refs[i] is not None):
                        ids = greedy_decode(model, copy.deepcopy(cache), prompt, max_new_tokens, stops)[0]
                        got = _text(tokenizer, ids)
                    if refs[i] is not None:
                        row.graded += 1
                        row.correct += int(full_right[i] if agrees else is_correct(got, cast(str, refs[i])))
                    if show_answers:
                        shown[i].compressed[row.name] = (got, agrees)
                    progress.update(per_answer)
        progress.set_postfix_str("done", refresh=True)
    report.seconds = time.perf_counter() - started
    return report


def _bits_name(bits: int | None | tuple[int | None, ...], model: Any) -> str:
    """``int8`` / ``int4``, or the model's dtype (``float32``) for a budget that kept the model's precision;
    ``int8 in 4/24 layers`` for per-layer widths (the other layers at 4 bits)."""
    if isinstance(bits, tuple):
        from ...cache.options.memory import mixed_name

        return mixed_name(bits)
    if bits is not None:
        return f"int{bits}"
    return str(getattr(model, "dtype", "the model's precision")).removeprefix("torch.")


def _text(tokenizer: Any, ids: list[int]) -> str:
    return " ".join(tokenizer.decode(ids, skip_special_tokens=True).split())
