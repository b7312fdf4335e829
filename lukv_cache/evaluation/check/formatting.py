"""``lukv check``'s report in words: the table, its legend, each allocator's verdict, the recommendation and
the answers side by side."""

from __future__ import annotations

import math
from typing import cast

from .report import CheckReport, CheckRow

LEGEND = (
    "agreement: share of the questions whose greedy answer through the compressed cache is, token for\n"
    "  token, the full cache's answer.\n"
    "excess NLL: nats per token by which the compressed cache finds the full cache's answer less likely\n"
    "  than the full cache does (the difference of their mean negative log-likelihoods); 0 = no loss.\n"
    "  Below zero, the compressed cache finds that answer more likely: evicting tokens can remove\n"
    "  distractions and sharpen a prediction, and over a few questions noise goes both ways, so read\n"
    "  small values either side of 0 as 0."
)
MEMORY_LEGEND = (
    "memory: the budget, a fraction of the full cache's bytes (LUKVCache(memory=...)); bits: the precision\n"
    "  it chose for the kept keys and values (per context: 'int8 x2, int4 x1' when they differ); it keeps\n"
    "  as many tokens as those bits fit in the budget (docs/memory.md)."
)
ACCURACY_LEGEND = (
    "accuracy: share of the questions with a reference answer whose answer contains it (case, accents,\n"
    "  punctuation and spacing ignored; whole words; '|' separates alternatives). Agreement says whether\n"
    "  an answer changed, accuracy whether it is right: a compressed cache can fix the full cache's mistakes."
)


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.0f}%"


def format_check(report: CheckReport) -> str:
    """The table (agreement with the full cache, accuracy with reference answers, and excess NLL per
    allocator and ratio), a legend, each allocator's highest safe ratio and, last, the recommendation; with
    answers, those first."""
    lines = []
    if report.answers:
        lines += format_answers(report)
    graded = report.graded > 0
    by_memory = report.by_memory
    accuracy_head = f"  {'accuracy':>8}" if graded else ""
    # under budgets: the budget, then the bits it chose (as wide as the widest, e.g. "int8 x2, int4 x1")
    setting = "memory" if by_memory else "ratio"
    width = max([len(r.bits) for r in report.rows if by_memory] + [len("bits")])
    bits_head = f"  {'bits':<{width}}" if by_memory else ""
    lines += [
        f"lukv check: scorer {report.scorer}"
        + ("" if report.kv_bits is None else f", kept keys and values in {report.kv_bits} bits")
        + (", memory budgets (each chooses its bits and tokens per context)" if by_memory else "")
        + f", {report.contexts} context(s), {report.questions} question(s)"
        + (f" ({report.graded} with a reference answer)" if graded else "")
        + (f", {report.seconds:.0f} s" if report.seconds else ""),
        "",
        f"{'allocator':<14} {setting:>6}{bits_head}  {'agreement':>9}{accuracy_head}  {'excess NLL':>10}",
    ]
    if graded:
        blank = f"  {'':<{width}}" if by_memory else ""
        lines.append(f"{'full cache':<14} {'':>6}{blank}  {'':>9}  {_pct(report.full_accuracy):>8}  {'':>10}")
    for row in report.rows:
        value = f"{row.memory if row.memory is not None else row.ratio:>6g}"
        if row.skipped:
            lines.append(f"{row.allocator:<14} {value}  skipped: {row.skipped}")
            continue
        bits = f"  {row.bits:<{width}}" if by_memory else ""
        accuracy = f"  {_pct(row.accuracy):>8}" if graded else ""
        lines.append(
            f"{row.allocator:<14} {value}{bits}  {_pct(row.agreement):>9}{accuracy}  {row.mean_excess:>+10.3f}"
        )
    lines += (
        ["", LEGEND] + ([MEMORY_LEGEND] if by_memory else []) + ([ACCURACY_LEGEND] if graded else []) + [""]
    )
    if graded and not report.by_accuracy:
        lines += [
            "The full cache answered none of the graded questions rightly, so accuracy cannot tell the "
            "ratios apart:",
            "the verdicts below use agreement. Check the reference answers (and --max-new-tokens).",
            "",
        ]
    what, bar = _criterion(report)
    for allocator in dict.fromkeys(r.allocator for r in report.rows):
        measured = [r for r in report.rows if r.allocator == allocator and not r.skipped]
        if not measured:
            lines.append(f"{allocator}: not measured (see the skipped rows).")
            continue
        if by_memory:
            safe_row = report.safe_row(allocator)
            if safe_row is not None:
                lines.append(
                    f"{allocator}: {what} >= {bar} down to memory {safe_row.memory:g} ({safe_row.bits})."
                )
            else:
                best = max(measured, key=lambda r: (_metric(report, r), r.strength))
                lines.append(
                    f"{allocator}: no budget checked keeps {what} >= {bar} "
                    f"(best {_pct(_metric(report, best))} at memory {best.memory:g})."
                )
            continue
        safe = report.safe_ratio(allocator)
        if safe:
            lines.append(f"{allocator}: {what} >= {bar} up to ratio {safe:g}.")
        elif safe == 0:
            lines.append(f"{allocator}: {what} >= {bar} only at ratio 0 (nothing evicted).")
        else:
            best = max(measured, key=lambda r: (_metric(report, r), -r.strength))
            lines.append(
                f"{allocator}: no ratio checked keeps {what} >= {bar} "
                f"(best {_pct(_metric(report, best))} at {best.setting})."
            )
    lines.append("")
    lines.append(recommendation(report))
    return "\n".join(lines)


def _metric(report: CheckReport, row: CheckRow) -> float:
    return row.accuracy if report.by_accuracy else row.agreement


def _criterion(report: CheckReport) -> tuple[str, str]:
    """What a ratio must keep, in words: ``("accuracy", "90% of the full cache's 67%")`` or
    ``("agreement", "90%")``."""
    tolerance = f"{100 * report.tolerance:.0f}%"
    if report.by_accuracy:
        return "accuracy", f"{tolerance} of the full cache's {_pct(report.full_accuracy)}"
    return "agreement", tolerance


def recommendation(report: CheckReport) -> str:
    """The last line: the ratio and allocator to deploy, or that none met the tolerance and what to try."""
    tolerance = f"{100 * report.tolerance:.0f}%"
    best = report.recommended()
    if report.by_memory:
        return _memory_recommendation(report, best, tolerance)
    if best is not None:
        if report.by_accuracy:
            return (
                f"Recommended: ratio {best.ratio:g} with allocator {best.allocator} (scorer {report.scorer}): "
                f"accuracy {_pct(best.accuracy)} against the full cache's {_pct(report.full_accuracy)} "
                f"(tolerance {tolerance} of it), {_pct(best.agreement)} of the answers unchanged, excess NLL "
                f"{best.mean_excess:+.3f}."
            )
        return (
            f"Recommended: ratio {best.ratio:g} with allocator {best.allocator} (scorer {report.scorer}): "
            f"{_pct(best.agreement)} of the answers unchanged (tolerance {tolerance}), excess NLL "
            f"{best.mean_excess:+.3f}."
        )
    measured = [r for r in report.rows if not r.skipped and cast(float, r.ratio) > 0]
    if not measured:
        return "Recommended: none; no allocator was measured at a ratio above 0 (see the skipped rows)."
    lowest = min(cast(float, r.ratio) for r in measured)
    lower = math.floor(lowest / 2 * 20) / 20  # half the lowest ratio checked, on a 0.05 step
    try_ratio = f" (--ratios {lower:g})" if lower > 0 else ""
    if report.by_accuracy:
        kept = f"keeps {tolerance} of the full cache's accuracy ({_pct(report.full_accuracy)})"
        closer = "or a lower --tolerance."
    else:
        kept = f"keeps {tolerance} of the answers unchanged"
        closer = (
            "or a lower --tolerance if close answers are good enough (or give reference answers: --answers)."
        )
    return (
        f"Recommended: none. No ratio checked {kept} with any allocator; try lower ratios{try_ratio}, "
        f"another --scorer (e.g. kvzip), shorter answers (--max-new-tokens 8), {closer}"
    )


def _memory_recommendation(report: CheckReport, best: CheckRow | None, tolerance: str) -> str:
    """:func:`recommendation` for memory budgets: the smallest that keeps the tolerance, or what to try."""
    if best is not None:
        kept = (
            f"accuracy {_pct(best.accuracy)} against the full cache's {_pct(report.full_accuracy)} (tolerance "
            f"{tolerance} of it), {_pct(best.agreement)} of the answers unchanged"
            if report.by_accuracy
            else f"{_pct(best.agreement)} of the answers unchanged (tolerance {tolerance})"
        )
        return (
            f"Recommended: memory={best.memory:g} with allocator {best.allocator} (scorer {report.scorer}; it "
            f"chose {best.bits}): {kept}, excess NLL {best.mean_excess:+.3f}."
        )
    measured = [r for r in report.rows if not r.skipped]
    if not measured:
        return "Recommended: none; no budget was measured (see the skipped rows)."
    largest = max(cast(float, r.memory) for r in measured)
    larger = min(1.0, math.ceil(largest * 2 * 100) / 100)  # twice the largest budget checked, on a 0.01 step
    try_memory = f" (--memory {larger:g})" if larger > largest else ""
    what = (
        f"keeps {tolerance} of the full cache's accuracy ({_pct(report.full_accuracy)})"
        if report.by_accuracy
        else f"keeps {tolerance} of the answers unchanged"
    )
    return (
        f"Recommended: none. No budget checked {what} with any allocator; try larger budgets{try_memory}, "
        "another --scorer (e.g. kvzip), shorter answers (--max-new-tokens 8), or a lower --tolerance."
    )


_EMPTY = "(no answer: a stop token came first)"


def format_answers(report: CheckReport) -> list[str]:
    """The full cache's answer to each question, and each compressed cache's beneath it (``=``: the same
    answer, ``x``: another)."""
    width = max([len(name) for a in report.answers for name in a.compressed] + [len("full cache")])
    lines = []
    for answers in report.answers:
        lines.append(f"Context {answers.context}: {answers.question}")
        if answers.expected is not None:
            lines.append(f"  {'expected':<{width}}    {answers.expected}")
        lines.append(f"  {'full cache':<{width}}    {answers.full or _EMPTY}")
        for name, (text, agrees) in answers.compressed.items():
            lines.append(f"  {name:<{width}}  {'=' if agrees else 'x'} {text or _EMPTY}")
        lines.append("")
    return lines
