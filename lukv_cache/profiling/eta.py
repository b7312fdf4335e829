"""What a profile build says of its own time before the long work (``show_progress``; ``lukv build`` without
``--quiet``): what it will run, then, once, an estimate of the rest from the first unit of work it really
does (a question decoded, a document's repeat pass; not one read back from an earlier build's cache).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

Say = Callable[[str], object]


def sayer(show: bool) -> Say | None:
    """Where the build's lines go: stderr beside its tqdm bar (``tqdm.write`` keeps the bar whole), or nowhere."""
    if not show:
        return None
    from tqdm.auto import tqdm

    return lambda line: tqdm.write(line, file=sys.stderr)


def duration(seconds: float) -> str:
    """A duration as a person reads it.

    >>> duration(42.4), duration(1500), duration(4000)
    ('42 s', '25 min', '1 h 7 min')
    """
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless one.

    >>> count(1, "question"), count(2, "question")
    ('1 question', '2 questions')
    """
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def estimate_line(
    what: str, first: str, seconds: float, rest_seconds: float, rest: str, how: str = ""
) -> str:
    """One line: the first ``first`` took ``seconds``; about ``rest_seconds`` for ``rest``, labelled as an
    estimate measured on the first (``how``: what else it assumed).

    >>> estimate_line("LU-KV profile", "question", 30, 60, "2 questions left")
    'LU-KV profile: the first question took 30 s; about 60 s for the 2 questions left (an estimate, measured on the first)'
    """
    return (
        f"{what}: the first {first} took {duration(seconds)}; about {duration(rest_seconds)} for the {rest} "
        f"(an estimate, measured on the first{how})"
    )


class DocumentClock:
    """A kvzap build's training documents (``kept``: whether an earlier build kept each one's targets): says
    up front how many documents and tokens it runs, and after the first document whose repeat pass it runs,
    once, an estimate for the other such documents, scaled by their tokens. :meth:`done` is the progress
    callback (``finished`` documents done; it moves ``bar`` too)."""

    def __init__(self, say: Say | None, documents: Sequence[Any], kept: Sequence[bool]):
        self.say = say
        self.tokens = [int(ids.shape[1]) for ids in documents]
        self.kept = list(kept)
        self.last = time.perf_counter()
        self.estimated = False
        if say is not None:
            runs = [n for n, k in zip(self.tokens, self.kept) if not k]
            say(
                f"KVzap surrogate: {count(len(self.tokens), 'document')}, {count(sum(self.tokens), 'token')}; "
                f"KVzip's repeat pass (most of the time) runs on the {len(runs)} whose targets no earlier build "
                f"kept ({count(sum(runs), 'token')})"
            )

    def done(self, finished: int, bar: Any = None) -> None:
        if bar is not None:  # the build's tqdm bar
            bar.update(finished - bar.n)
        now, first = time.perf_counter(), finished - 1
        if self.say is not None and not self.estimated and not self.kept[first]:
            self.estimated = True
            seconds = now - self.last
            runs = [n for n, k in zip(self.tokens[finished:], self.kept[finished:]) if not k]
            rest = seconds / self.tokens[first] * sum(runs)
            self.say(
                estimate_line(
                    "KVzap surrogate",
                    f"document ({count(self.tokens[first], 'token')})",
                    seconds,
                    rest,
                    f"{count(len(runs), 'document')} left ({count(sum(runs), 'token')})",
                    ", scaled by tokens; a longer document costs more per token, and training the surrogate "
                    "comes after",
                )
            )
        self.last = now
