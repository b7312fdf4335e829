"""``lukv check``: before deploying a ratio, measure it on your own texts and questions.

For every context (the calibration JSONL format, or plain text files with a questions file), the full
cache answers each question greedily. Then each allocator at each ratio fills its own compressed cache
with the same context (question-agnostic, as in deployment) and is measured against the full cache:

* **agreement**: how often its greedy answer equals the full cache's, token for token;
* **excess NLL**: the mean negative log-likelihood (nats/token) of the full cache's answer under the
  compressed cache, minus the same under the full cache;
* **accuracy** (only with reference answers): how often the answer, the full cache's and each compressed
  cache's, contains the reference answer (:func:`is_correct`: both normalised, the answer as whole words).

Agreement measures sameness, not correctness: a full cache that answers wrongly makes every compressed
cache that answers rightly "disagree". With reference answers, ratios are recommended on accuracy.

What is shared, so that a check is worth waiting for: each context is prefilled once
(:class:`~lukv_cache.evaluation.prefill.SharedPrefill`); each allocator scores it once, and its other
ratios compress from the same scored prefill; and a compressed cache answers each question in one
teacher-forced forward over the full cache's answer: greedy decoding reproduces that answer exactly when,
at every token of it, the compressed cache predicts the same next token as the full cache does (and stops
where it stops), which that one forward shows, with the answer's NLL. Only ``show_answers`` decodes the
compressed answers themselves.

The recommended ratio is the highest one whose agreement stays at or above ``tolerance`` (at every lower
ratio too) for some allocator; ties go to the lower excess NLL. With reference answers (and a full cache
that answered at least one of them rightly), accuracy replaces agreement: a ratio is safe while its accuracy
stays at or above ``tolerance`` times the full cache's.

    >>> report = check(model, tokenizer, [("text ...", ["question?"], ["answer"])])  # doctest: +SKIP
    >>> print(format_check(report))  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import math
import os
import time
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from .._compat import cache_kwarg
from ..allocation import ALLOCATORS, allocators_reading_profile
from ..cache import check_ratio
from ..cache.quant import check_kv_bits
from ..errors import ConfigurationError, ProfileError
from ..models import check_positions, max_positions
from ..profiling.build import QUESTION_TEMPLATE
from ..profiling.calibration import load_calibration
from ..scorers import get_scorer
from .decoding import greedy_decode, stop_ids
from .methods import (
    CHECK_ALLOCATORS,
    CHECK_RATIOS,
    FULL,
    Method,
    make_cache,
    memory_list,
    one_line_method,
    scorer_reads_profile,
)
from .prefill import SharedPrefill

Context = tuple[str, Sequence[str]] | tuple[str, Sequence[str], Sequence[str | None]]
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


def _normalise(text: str) -> str:
    """Lower case, accents and punctuation dropped, whitespace collapsed: ``"Nine o'clock."`` ->
    ``"nine o clock"``."""
    text = unicodedata.normalize("NFKD", unicodedata.normalize("NFKC", text).casefold())
    kept = "".join(c if c.isalnum() else " " for c in text if not unicodedata.combining(c))
    return " ".join(kept.split())


def is_correct(generated: str, answer: str) -> bool:
    """Whether ``generated`` answers ``answer``: some alternative of ``answer`` (split on ``|``),
    normalised (:func:`_normalise`: case, accents, punctuation and spacing ignored), occurs in the
    normalised ``generated`` as whole words.

    >>> is_correct("The ferry leaves at nine o'clock.", "Nine")
    True
    >>> is_correct("It leaves at ninety.", "nine")
    False
    >>> is_correct("Ada Lovelace", "Ada|the harbour master")
    True
    """
    said = f" {_normalise(generated)} "
    return any(f" {alt} " in said for alt in map(_normalise, answer.split("|")) if alt)


def _answer_lines(path: str | os.PathLike, count: int) -> list[str | None]:
    """The answers file: one line per question, in order (an empty line: that question has none)."""
    lines = _read_text(path, "The answers file").splitlines()
    while len(lines) > count and not lines[-1].strip():  # trailing blank lines beyond the questions
        lines.pop()
    if len(lines) != count:
        raise ConfigurationError(
            f"The answers file {str(path)!r} has {len(lines)} line(s) but there are {count} question(s): give "
            "one answer per question line, in the same order (an empty line for a question without one)."
        )
    return [line.strip() or None for line in lines]


def read_contexts(
    calibration: Sequence[str | os.PathLike] = (),
    texts: Sequence[str | os.PathLike] = (),
    questions: str | os.PathLike | None = None,
    answers: str | os.PathLike | None = None,
) -> list[Context]:
    """Contexts and their questions: calibration JSONL files (or shipped set names), and/or plain text
    files that all share the questions of ``questions`` (one per line).

    Reference answers, for the text files' questions: a ``question<TAB>answer`` line in ``questions``, or
    ``answers``, a file with one answer per question line (an empty line: none for that question). A
    context with answers is ``(text, questions, answers)``."""
    contexts: list[Context] = []
    for item in calibration:
        context, qs, _ = load_calibration(item)
        contexts.append((context, qs))
    if answers is not None and not texts:
        raise ConfigurationError("--answers goes with --text and --questions (one answer per question line).")
    if texts:
        if questions is None:
            raise ConfigurationError(
                "Plain text files need a questions file (--questions, one question per line)."
            )
        lines = [line for line in _read_text(questions, "The questions file").splitlines() if line.strip()]
        qs = [line.partition("\t")[0].strip() for line in lines]
        inline = [line.partition("\t")[2].strip() or None for line in lines]
        if not qs:
            raise ConfigurationError(f"{questions}: no questions (one per line).")
        if not all(qs):
            raise ConfigurationError(f"{questions}: a line has an answer but no question before its TAB.")
        refs = _answer_lines(answers, len(qs)) if answers is not None else inline
        if answers is not None and any(inline):
            raise ConfigurationError(
                f"{questions} has question<TAB>answer lines and --answers was given too: use one or the other."
            )
        for path in texts:
            text = _read_text(path, "The text file")
            if not text.strip():
                raise ConfigurationError(
                    f"The text file {str(path)!r} is empty (or only whitespace): there is no context to "
                    "compress. Put the context's text in it, or drop it from --text."
                )
            contexts.append((text, qs, refs) if any(refs) else (text, qs))
    if not contexts:
        raise ConfigurationError(
            "Nothing to check: pass calibration JSONL files, or text files and --questions."
        )
    return contexts


def check_options(
    *,
    allocators: Sequence[str] | None,
    scorer: str | None,
    max_new_tokens: int,
    tolerance: float,
    ratios: Sequence[float] | None = CHECK_RATIOS,
    memory: Sequence[float] = (),
    kv_bits: int | None = None,
) -> list[float]:
    """Refuse bad settings of :func:`check` before any model loads: unknown scorer or allocator names
    (:class:`~lukv_cache.errors.UnknownNameError`), ratios outside [0, 1), memory budgets outside (0, 1],
    budgets with ratios or ``kv_bits`` (a budget chooses both), no ratio (or budget) or allocator, a
    tolerance outside (0, 1] or fewer than one decoded token (:class:`ConfigurationError`; with none,
    every ratio would trivially "agree"). ``None`` for ``allocators`` or ``scorer``: the defaults, chosen
    once the model is known (:func:`check`); for ``ratios``: :data:`CHECK_RATIOS`, none with budgets.
    Returns the ratios as floats (empty with budgets).

    >>> check_options(allocators=["uniform"], scorer="keydiff", max_new_tokens=8, tolerance=0.9, ratios=[0.5])
    [0.5]
    >>> check_options(allocators=None, scorer=None, max_new_tokens=8, tolerance=0.9, ratios=None, memory=[0.1])
    []
    """
    budgets = memory_list(memory)
    if budgets and ratios is not None:
        raise ConfigurationError(
            "Give memory budgets or ratios, not both: --memory measures each budget (which chooses the ratio "
            "and the bits), --ratios each ratio."
        )
    if budgets and kv_bits is not None:
        raise ConfigurationError(
            "--memory and --kv-bits do not combine: a memory budget chooses the bits itself (the table shows "
            "what it chose). Drop --kv-bits, or use --ratios with --kv-bits."
        )
    checked = [check_ratio(r) for r in (() if budgets else CHECK_RATIOS if ratios is None else ratios)]
    if not (checked or budgets) or (allocators is not None and not allocators):
        raise ConfigurationError(
            "Give at least one ratio and one allocator, e.g. --ratios 0.5 --allocators uniform."
        )
    if scorer is not None:
        get_scorer(scorer)
    for name in allocators or ():
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
    return checked


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
    """Each context's ids and its questions' prompt ids, refusing (:class:`ConfigurationError`) an empty
    context and one whose ids, longest question and answer do not fit the model's positions (``config``).

    A text far too long is refused from its length in characters, before it is tokenised: tokenising
    megabytes costs gigabytes, and prefilling millions of tokens far more."""
    chars_per_token = _max_token_chars(tokenizer)
    encoded = []
    for number, (context, questions, *_) in enumerate(contexts, start=1):
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
        ids = _encode(tokenizer, context) if isinstance(context, str) and context.strip() else None
        if ids is None or ids.shape[1] == 0:
            raise ConfigurationError(
                f"Context {number} is empty (or only whitespace): there is no context to compress. "
                "Give each context some text."
            )
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
    """One allocator at one ratio, or at one memory budget (``memory``, a fraction of the full cache's
    bytes; ``ratio`` is then ``None``): questions asked, answers that agree, excess NLL of each answer and,
    under a budget, the bits it chose for each context (``chosen``: ``"int8"``, ``"int4"`` or the model's
    dtype)."""

    allocator: str
    ratio: float | None
    agree: int = 0
    asked: int = 0
    excess_nll: list[float] = field(default_factory=list)
    skipped: str | None = None
    correct: int = 0  # of the ``graded`` questions (those with a reference answer), answered rightly
    graded: int = 0
    memory: float | None = None
    chosen: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.allocator} {self.setting}"

    @property
    def setting(self) -> str:
        """The ratio (``0.8``) or the memory budget (``mem0.1``), as the table shows it."""
        return f"mem{self.memory:g}" if self.memory is not None else f"{self.ratio:g}"

    @property
    def strength(self) -> float:
        """How much the row compresses, to order the rows: its ratio, or under a budget 1 - the budget."""
        return 1.0 - self.memory if self.memory is not None else cast(float, self.ratio)

    @property
    def bits(self) -> str:
        """The bits a budget chose over the contexts: one value (``int8``) when every context chose it,
        else each with its count (``int8 x2, int4 x1``); ``-`` before any context.

        >>> CheckRow("uniform", None, memory=0.1, chosen=["int8", "int4", "int8"]).bits
        'int8 x2, int4 x1'
        """
        counts: dict[str, int] = {}
        for bits in self.chosen:
            counts[bits] = counts.get(bits, 0) + 1
        if len(counts) <= 1:
            return next(iter(counts), "-")
        return ", ".join(f"{bits} x{n}" for bits, n in counts.items())

    @property
    def agreement(self) -> float:
        return self.agree / self.asked if self.asked else float("nan")

    @property
    def accuracy(self) -> float:
        return self.correct / self.graded if self.graded else float("nan")

    @property
    def mean_excess(self) -> float:
        return sum(self.excess_nll) / len(self.excess_nll) if self.excess_nll else float("nan")


@dataclass
class Answers:
    """One question's answers (``show_answers``): the full cache's, and each row's (by :attr:`CheckRow.name`)
    with whether it agrees."""

    context: int
    question: str
    full: str
    compressed: dict[str, tuple[str, bool]] = field(default_factory=dict)
    expected: str | None = None  # the reference answer, if one was given


@dataclass
class CheckReport:
    scorer: str
    rows: list[CheckRow]
    contexts: int
    questions: int
    tolerance: float
    answers: list[Answers] = field(default_factory=list)
    kv_bits: int | None = None
    seconds: float = 0.0
    full_correct: int = 0  # of the ``graded`` questions, those the full cache answered rightly
    graded: int = 0

    @property
    def full_accuracy(self) -> float:
        return self.full_correct / self.graded if self.graded else float("nan")

    @property
    def by_accuracy(self) -> bool:
        """Whether ratios are judged on accuracy: reference answers were given and the full cache got at
        least one right (with none right, accuracy cannot tell a ratio that loses nothing from one that
        loses everything, so agreement decides)."""
        return self.graded > 0 and self.full_correct > 0

    def passes(self, row: CheckRow) -> bool:
        """Whether ``row`` meets the tolerance: its accuracy at least ``tolerance`` times the full cache's
        (:attr:`by_accuracy`), else its agreement at least ``tolerance``."""
        if self.by_accuracy:
            return row.accuracy >= self.tolerance * self.full_accuracy - 1e-9
        return row.agreement >= self.tolerance

    @property
    def by_memory(self) -> bool:
        """Whether the rows are memory budgets (``lukv check --memory``) rather than ratios."""
        return any(row.memory is not None for row in self.rows)

    def safe_row(self, allocator: str) -> CheckRow | None:
        """The most compressing row of ``allocator`` that meets the tolerance (:meth:`passes`), every less
        compressing one meeting it too: the highest ratio, or the smallest memory budget."""
        safe = None
        for row in sorted(
            (r for r in self.rows if r.allocator == allocator and not r.skipped), key=lambda r: r.strength
        ):
            if not self.passes(row):
                break
            safe = row
        return safe

    def safe_ratio(self, allocator: str) -> float | None:
        """The highest ratio that meets the tolerance (:meth:`passes`), every lower ratio meeting it too."""
        row = self.safe_row(allocator)
        return None if row is None else row.ratio

    def safe_memory(self, allocator: str) -> float | None:
        """The smallest memory budget that meets the tolerance, every larger budget meeting it too."""
        row = self.safe_row(allocator)
        return None if row is None else row.memory

    def recommended(self) -> CheckRow | None:
        """The row to deploy: the highest safe ratio above 0 (0 evicts nothing), or the smallest safe
        memory budget, of any allocator; ties go to the higher accuracy (with answers), then the lower
        excess NLL."""
        best = None
        for allocator in dict.fromkeys(r.allocator for r in self.rows):
            row = self.safe_row(allocator)
            if row is None or (row.memory is None and not row.ratio):
                continue
            if best is None or self._rank(row) > self._rank(best):
                best = row
        return best

    def _rank(self, row: CheckRow) -> tuple[float, float, float]:
        return (row.strength, row.accuracy if self.by_accuracy else 0.0, -row.mean_excess)


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
    """Compare each allocator at each ratio with the full cache on ``contexts`` (see the module docstring).

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
    scorer, and its allocator first), then :data:`CHECK_ALLOCATORS` with that scorer."""
    started = time.perf_counter()
    kv_bits = check_kv_bits(kv_bits)
    budgets = memory_list(memory)
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
    references = _references(contexts, answers)
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
        from ..cache.memory import mixed_name

        return mixed_name(bits)
    if bits is not None:
        return f"int{bits}"
    return str(getattr(model, "dtype", "the model's precision")).removeprefix("torch.")


def _references(
    contexts: Sequence[Context], answers: Sequence[Sequence[str | None] | None] | None
) -> list[list[str | None]]:
    """Each context's reference answers, aligned with its questions (``None``: none given); refuses
    (:class:`ConfigurationError`) lists that do not line up and answers given twice."""
    if answers is not None and len(answers) != len(contexts):
        raise ConfigurationError(
            f"answers has {len(answers)} list(s) but there are {len(contexts)} context(s): give one per context "
            "(None for a context without answers)."
        )
    out: list[list[str | None]] = []
    for number, item in enumerate(contexts, start=1):
        questions = item[1]
        inline = item[2] if len(item) > 2 else None
        given = answers[number - 1] if answers is not None else None
        if inline is not None and given is not None:
            raise ConfigurationError(f"Context {number} has answers in its tuple and in answers=: give one.")
        refs = inline if inline is not None else given
        if refs is None:
            out.append([None] * len(questions))
            continue
        if isinstance(refs, str) or len(refs) != len(questions):
            raise ConfigurationError(
                f"Context {number}: {len(questions)} question(s) but "
                f"{'a string' if isinstance(refs, str) else f'{len(refs)} answer(s)'} as its answers; give a "
                "list with one answer (or None) per question."
            )
        for ref in refs:
            if ref is not None and (not isinstance(ref, str) or not _normalise(ref)):
                raise ConfigurationError(
                    f"Context {number}: the answer {ref!r} is not a string with a letter or digit in it."
                )
        out.append([ref if ref is None else str(ref) for ref in refs])
    return out


def _text(tokenizer: Any, ids: list[int]) -> str:
    return " ".join(tokenizer.decode(ids, skip_special_tokens=True).split())


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
