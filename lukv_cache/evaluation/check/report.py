"""What ``lukv check`` measured (a row per allocator and ratio or budget, each question's answers), and the
rows it recommends from that."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast


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
