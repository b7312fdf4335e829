"""``lukv check``: before deploying a ratio, measure it on your own texts and questions.

For every context (the calibration JSONL format, or plain text files with a questions file), the full
cache answers each question greedily. Then each allocator at each ratio fills its own compressed cache
with the same context (question-agnostic, as in deployment) and is measured against the full cache:

* **agreement**: how often its greedy answer equals the full cache's, token for token;
* **excess NLL**: the mean negative log-likelihood (nats/token) of the full cache's answer under the
  compressed cache, minus the same under the full cache.

The suggested ratio is the highest one whose agreement stays at or above ``tolerance`` for that allocator.

    >>> report = check(model, tokenizer, [("text ...", ["question?"])])  # doctest: +SKIP
    >>> print(format_check(report))  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigurationError, ProfileError
from ..profiling.build import QUESTION_TEMPLATE
from ..profiling.calibration import load_calibration
from ..scorers import get_scorer
from .methods import FULL, Method
from .prefill import SharedPrefill
from .tasks import greedy_decode, stop_ids

Context = tuple[str, Sequence[str]]


def read_contexts(
    calibration: Sequence[str | os.PathLike] = (),
    texts: Sequence[str | os.PathLike] = (),
    questions: str | os.PathLike | None = None,
) -> list[Context]:
    """Contexts and their questions: calibration JSONL files (or shipped set names), and/or plain text
    files that all share the questions of ``questions`` (one per line)."""
    contexts: list[Context] = []
    for item in calibration:
        context, qs, _ = load_calibration(item)
        contexts.append((context, qs))
    if texts:
        if questions is None:
            raise ConfigurationError(
                "Plain text files need a questions file (--questions, one question per line)."
            )
        qs = [
            line.strip() for line in Path(questions).read_text(encoding="utf-8").splitlines() if line.strip()
        ]
        if not qs:
            raise ConfigurationError(f"{questions}: no questions (one per line).")
        for path in texts:
            contexts.append((Path(path).read_text(encoding="utf-8"), qs))
    if not contexts:
        raise ConfigurationError(
            "Nothing to check: pass calibration JSONL files, or text files and --questions."
        )
    return contexts


@dataclass
class CheckRow:
    allocator: str
    ratio: float
    agree: int = 0
    asked: int = 0
    excess_nll: list[float] = field(default_factory=list)
    skipped: str | None = None

    @property
    def agreement(self) -> float:
        return self.agree / self.asked if self.asked else float("nan")

    @property
    def mean_excess(self) -> float:
        return sum(self.excess_nll) / len(self.excess_nll) if self.excess_nll else float("nan")


@dataclass
class CheckReport:
    scorer: str
    rows: list[CheckRow]
    contexts: int
    questions: int
    tolerance: float

    def safe_ratio(self, allocator: str) -> float | None:
        """The highest ratio whose agreement is at least ``tolerance`` (and every lower ratio's too)."""
        safe = None
        for row in sorted(
            (r for r in self.rows if r.allocator == allocator and not r.skipped), key=lambda r: r.ratio
        ):
            if row.agreement < self.tolerance:
                break
            safe = row.ratio
        return safe


@torch.no_grad()
def _answer_nll(model: Any, cache: Any, question_ids: torch.Tensor, answer: list[int]) -> float:
    """Mean NLL of ``answer`` after ``question_ids``, teacher-forced through ``cache`` (consumed)."""
    if not answer:
        return 0.0
    target = torch.tensor([answer], device=question_ids.device)
    ids = torch.cat([question_ids, target[:, :-1]], dim=1)
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -len(answer) :].float()
    return float(torch.nn.functional.cross_entropy(logits[0], target[0]))


def check(
    model: Any,
    tokenizer: Any,
    contexts: Sequence[Context],
    *,
    ratios: Sequence[float] = (0.5, 0.8, 0.9),
    allocators: Sequence[str] = ("uniform", "adakv", "profile"),
    scorer: str = "keydiff",
    max_new_tokens: int = 24,
    tolerance: float = 0.9,
    profiles_dir: str | os.PathLike | None = None,
    hub: bool = False,
    show_progress: bool = True,
) -> CheckReport:
    """Compare each allocator at each ratio with the full cache on ``contexts`` (see the module docstring)."""
    from tqdm.auto import tqdm

    if not 0.0 < tolerance <= 1.0:
        raise ConfigurationError(f"tolerance must be in (0, 1], got {tolerance}.")
    get_scorer(scorer)
    methods = [Method(a, scorer, float(r)) for a in allocators for r in ratios]
    rows = [CheckRow(m.allocator, m.ratio) for m in methods]
    device = next(model.parameters()).device
    stops = stop_ids(tokenizer)
    total = sum(len(qs) for _, qs in contexts)
    n_queries = max(2, get_scorer(scorer).n_queries)
    with tqdm(total=total * (len(methods) + 1), desc="lukv check", disable=not show_progress) as progress:
        for context, questions in contexts:
            ids = tokenizer(context, return_tensors="pt", add_special_tokens=False).input_ids.to(device)
            shared = SharedPrefill.record(model, ids, n_queries)
            full = shared.cache_for(Method(FULL), model)
            prompts = [
                tokenizer(
                    QUESTION_TEMPLATE.format(question=q), return_tensors="pt", add_special_tokens=False
                ).input_ids.to(device)
                for q in questions
            ]
            answers, base_nll = [], []
            for prompt in prompts:
                answers.append(greedy_decode(model, copy.deepcopy(full), prompt, max_new_tokens, stops)[0])
                base_nll.append(_answer_nll(model, copy.deepcopy(full), prompt, answers[-1]))
                progress.update(1)
            for row, method in zip(rows, methods):
                if row.skipped:
                    progress.update(len(prompts))
                    continue
                try:
                    cache = shared.cache_with_scores(method, model, tokenizer, profiles_dir, hub=hub)
                except ProfileError as err:
                    row.skipped = str(err).split(". ")[0]
                    progress.update(len(prompts))
                    continue
                for prompt, answer, base in zip(prompts, answers, base_nll):
                    got = greedy_decode(model, copy.deepcopy(cache), prompt, max_new_tokens, stops)[0]
                    row.agree += int(got == answer)
                    row.asked += 1
                    row.excess_nll.append(_answer_nll(model, copy.deepcopy(cache), prompt, answer) - base)
                    progress.update(1)
    return CheckReport(scorer, rows, len(contexts), total, tolerance)


def format_check(report: CheckReport) -> str:
    """The table: agreement with the full cache and excess NLL per allocator and ratio; the suggested ratio."""
    lines = [
        f"lukv check: scorer {report.scorer}, {report.contexts} context(s), {report.questions} question(s); "
        f"agreement = the compressed cache's greedy answer equals the full cache's.",
        "",
        f"{'allocator':<14} {'ratio':>5}  {'agreement':>9}  {'excess NLL':>10}",
    ]
    for row in report.rows:
        if row.skipped:
            lines.append(f"{row.allocator:<14} {row.ratio:>5g}  skipped: {row.skipped}")
            continue
        lines.append(
            f"{row.allocator:<14} {row.ratio:>5g}  {100 * row.agreement:>8.0f}%  {row.mean_excess:>+10.3f}"
        )
    lines.append("")
    for allocator in dict.fromkeys(r.allocator for r in report.rows):
        safe = report.safe_ratio(allocator)
        verdict = f"up to ratio {safe:g}" if safe is not None else "none of the ratios checked"
        lines.append(f"{allocator}: agreement >= {100 * report.tolerance:.0f}% {verdict}.")
    return "\n".join(lines)
