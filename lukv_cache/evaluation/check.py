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

from ..allocation import ALLOCATORS
from ..errors import ConfigurationError, ProfileError
from ..models import check_positions, max_positions
from ..profiling.build import QUESTION_TEMPLATE
from ..profiling.calibration import load_calibration
from ..scorers import get_scorer
from .methods import FULL, Method
from .prefill import SharedPrefill
from .tasks import greedy_decode, stop_ids

Context = tuple[str, Sequence[str]]
Encoded = tuple[torch.Tensor, list[torch.Tensor]]  # context ids [1, T], one [1, Q] prompt per question
_SHORTEN = "split the text into shorter contexts, or pass a smaller --max-new-tokens"


def _read_text(path: str | os.PathLike, what: str) -> str:
    """A user's text file; one that is not UTF-8 is a ConfigurationError naming it."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigurationError(
            f"{what} {str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start}). Save it as UTF-8 "
            f"(e.g. iconv -f latin1 -t utf-8), then retry."
        ) from None


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
            line.strip() for line in _read_text(questions, "The questions file").splitlines() if line.strip()
        ]
        if not qs:
            raise ConfigurationError(f"{questions}: no questions (one per line).")
        for path in texts:
            contexts.append((_read_text(path, "The text file"), qs))
    if not contexts:
        raise ConfigurationError(
            "Nothing to check: pass calibration JSONL files, or text files and --questions."
        )
    return contexts


def check_options(*, allocators: Sequence[str], scorer: str, max_new_tokens: int, tolerance: float) -> None:
    """Refuse bad settings of :func:`check` before any model loads: unknown scorer or allocator names
    (:class:`~lukv_cache.errors.UnknownNameError`), a tolerance outside (0, 1] or fewer than one decoded
    token (:class:`ConfigurationError`; with none, every ratio would trivially "agree")."""
    get_scorer(scorer)
    for name in allocators:
        ALLOCATORS.get(name)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0.0 < tolerance <= 1.0:
        raise ConfigurationError(
            f"tolerance is the agreement a ratio must keep and must be in (0, 1], got {tolerance!r}; e.g. 0.9."
        )
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigurationError(
            f"max_new_tokens must be at least 1 (the answers compared are decoded), got {max_new_tokens!r}; "
            "e.g. 24."
        )


def _max_token_chars(tokenizer: Any) -> int | None:
    """The most characters one token can stand for (its vocabulary's longest entry), or None if unknown.

    A byte-level token of n symbols covers at most n bytes, a SentencePiece one at most n characters, so a
    text of C characters has at least C / this many tokens: a bound read without tokenising the text."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab = get_vocab() if callable(get_vocab) else {}
    return max((len(token) for token in vocab), default=None) or None


def encode_contexts(
    tokenizer: Any, contexts: Sequence[Context], config: Any, max_new_tokens: int
) -> list[Encoded]:
    """Each context's ids and its questions' prompt ids, refusing (:class:`ConfigurationError`) a context
    whose ids, longest question and answer do not fit the model's positions (``config``).

    A text far too long is refused from its length in characters, before it is tokenised: tokenising
    megabytes costs gigabytes, and prefilling millions of tokens far more."""
    chars_per_token = _max_token_chars(tokenizer)
    encoded = []
    for number, (context, questions) in enumerate(contexts, start=1):
        texts = [QUESTION_TEMPLATE.format(question=q) for q in questions]
        limit = max_positions(config)
        if chars_per_token and limit is not None:
            at_least = (len(context) + max(map(len, texts), default=0)) // chars_per_token
            check_positions(
                config,
                at_least + max_new_tokens,
                f"Context {number} ({len(context):,} characters: at least {at_least:,} tokens with its longest "
                f"question) + max_new_tokens={max_new_tokens}",
                _SHORTEN,
            )
        ids = _encode(tokenizer, context)
        prompts = [_encode(tokenizer, text) for text in texts]
        needed = ids.shape[1] + max((p.shape[1] for p in prompts), default=0) + max_new_tokens
        what = (
            f"Context {number} ({ids.shape[1]:,} tokens) + longest question + max_new_tokens={max_new_tokens}"
        )
        check_positions(config, needed, what, _SHORTEN)
        encoded.append((ids, prompts))
    return encoded


def _encode(tokenizer: Any, text: str) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


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
    """Compare each allocator at each ratio with the full cache on ``contexts`` (see the module docstring).

    Bad settings and contexts that do not fit the model's positions raise before anything is prefilled."""
    from tqdm.auto import tqdm

    check_options(allocators=allocators, scorer=scorer, max_new_tokens=max_new_tokens, tolerance=tolerance)
    encoded = encode_contexts(tokenizer, contexts, model.config, max_new_tokens)  # before any prefill
    methods = [Method(a, scorer, float(r)) for a in allocators for r in ratios]
    rows = [CheckRow(m.allocator, m.ratio) for m in methods]
    device = next(model.parameters()).device
    stops = stop_ids(tokenizer)
    total = sum(len(qs) for _, qs in contexts)
    n_queries = max(2, get_scorer(scorer).n_queries)
    with tqdm(total=total * (len(methods) + 1), desc="lukv check", disable=not show_progress) as progress:
        for context_ids, question_ids in encoded:
            shared = SharedPrefill.record(model, context_ids.to(device), n_queries)
            full = shared.cache_for(Method(FULL), model)
            prompts = [ids.to(device) for ids in question_ids]
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
