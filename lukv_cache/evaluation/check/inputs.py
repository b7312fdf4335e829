"""The inputs of ``lukv check``: contexts, questions and reference answers read from files, and settings and
contexts refused before any model runs."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ...allocation import ALLOCATORS
from ...cache import check_ratio
from ...errors import ConfigurationError
from ...models import check_positions, max_positions
from ...profiling.build import QUESTION_TEMPLATE
from ...profiling.calibration import load_calibration
from ...scorers import get_scorer
from ..methods import CHECK_RATIOS, memory_list
from .grading import normalise

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


def reference_answers(
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
            if ref is not None and (not isinstance(ref, str) or not normalise(ref)):
                raise ConfigurationError(
                    f"Context {number}: the answer {ref!r} is not a string with a letter or digit in it."
                )
        out.append([ref if ref is None else str(ref) for ref in refs])
    return out
