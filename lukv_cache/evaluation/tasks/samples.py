"""The tasks' samples: seeded retrieval, continuation and recall samples built from real Wikipedia text.

What each task is: :mod:`lukv_cache.evaluation.tasks`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigurationError
from ...texts import Article, wikipedia_articles
from ..methods import (  # light, for the command line's help and its early checks
    ANSWER_TOKENS,
    RECALL_MIN_TOKENS,
    TASKS,
    check_bench_numbers,
)

RETRIEVAL_TASKS = TASKS[:3]
ACCURACY_TASKS = (*RETRIEVAL_TASKS, "recall")  # scored in [0, 1], higher is better (the rest: NLL)
RECALL_PROMPT = '\n\nQuote the sentence of the text above that begins with "{cue}":\n'
RECALL_CUE_WORDS = 5
RECALL_MAX_TOKENS = 48  # of a sentence's rest, teacher-forced

PREAMBLE = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = (
    "\nWhat is the special magic number for {key} mentioned in the provided text? "
    "The special magic number for {key} mentioned in the provided text is"
)
QUESTION_ALL = (
    "\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
    "The special magic numbers for {key} mentioned in the provided text are"
)
# Around a needle inside the prose. Small formatting details move the full-cache baseline by >10 points
# on this model (single spaces scored ~62% where double spaces scored ~75%).
NEEDLE_SEPARATOR = "  "

_ADJECTIVES = (
    "abundant",
    "brave",
    "calm",
    "curious",
    "distant",
    "eager",
    "fancy",
    "gentle",
    "hollow",
    "icy",
    "jolly",
    "keen",
    "lively",
    "mellow",
    "narrow",
    "odd",
    "polite",
    "quiet",
    "rapid",
    "silent",
    "tender",
    "unusual",
    "vivid",
    "wary",
    "young",
    "zealous",
    "bitter",
    "cheerful",
    "dusty",
    "fierce",
)
_NOUNS = (
    "rake",
    "falcon",
    "harbor",
    "lantern",
    "meadow",
    "pebble",
    "quilt",
    "river",
    "saddle",
    "teapot",
    "umbrella",
    "violin",
    "wagon",
    "anchor",
    "bridge",
    "candle",
    "desert",
    "engine",
    "forest",
    "garden",
    "helmet",
    "island",
    "jacket",
    "kettle",
    "ladder",
    "mirror",
    "needle",
    "orchard",
    "pillow",
    "rocket",
)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


@dataclass(frozen=True)
class Question:
    """One question about a context: the text that follows the context, and what counts as correct.

    ``answers``: strings that must appear in the greedy output (the score is the fraction found).

    >>> Question(prompt="\\nWhat is ...? The special magic number for x is", answers=("1234567",)).answers
    ('1234567',)
    """

    prompt: str
    answers: tuple[str, ...]
    max_new_tokens: int = ANSWER_TOKENS


@dataclass(frozen=True)
class RetrievalSample:
    """A retrieval context (preamble + haystack with needles) and the questions asked of it.

    >>> RetrievalSample("niah_single", "text", (), source="Anarchism").task
    'niah_single'
    """

    task: str
    context: str
    questions: tuple[Question, ...]
    source: str = ""


@dataclass(frozen=True)
class ContinuationSample:
    """The first tokens of a real document (to compress) and the tokens that follow (to teacher-force).

    >>> ContinuationSample("Albedo", (1, 2, 3), (4, 5)).continuation_ids
    (4, 5)
    """

    title: str
    context_ids: tuple[int, ...]
    continuation_ids: tuple[int, ...]

    @property
    def task(self) -> str:
        return "continuation"


@dataclass(frozen=True)
class RecallSample:
    """The first tokens of a real document (to compress) and sentences of it to quote back: each question
    is ``(prompt ids, cue ids, rest ids)``, the prompt and cue forwarded, the rest teacher-forced.

    >>> RecallSample("Albedo", (1, 2, 3), (((9,), (1,), (2, 3)),)).task
    'recall'
    """

    title: str
    context_ids: tuple[int, ...]
    quotes: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]

    @property
    def task(self) -> str:
        return "recall"


Sample = RetrievalSample | ContinuationSample | RecallSample


# --------------------------------------------------------------------------------------- building samples


def _sentences(article: Article) -> list[str]:
    out: list[str] = []
    for paragraph in article.text.split("\n\n"):
        if len(paragraph) < 120:  # headings and list items break the prose
            continue
        out.extend(s.strip() for s in _SENTENCE_END.split(paragraph) if s.strip())
    return out


def _count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _haystack(
    tokenizer: Any, rng: random.Random, articles: Sequence[Article], n_tokens: int
) -> tuple[list[str], str]:
    """Consecutive sentences of one article from a random start (continuing into the next articles if it
    runs out) until they hold about ``n_tokens`` tokens."""
    order = list(range(len(articles)))
    first = rng.randrange(len(order))
    order = order[first:] + order[:first]
    picked: list[str] = []
    total = 0
    for position, index in enumerate(order):
        sentences = _sentences(articles[index])
        start = rng.randrange(max(1, len(sentences) // 3)) if position == 0 else 0
        for sentence in sentences[start:]:
            picked.append(sentence)
            total += _count_tokens(tokenizer, " " + sentence)
            if total >= n_tokens:
                return picked, articles[order[0]].title
    return picked, articles[order[0]].title


def _magic_value(rng: random.Random, used: set[str]) -> str:
    while True:
        value = str(rng.randrange(1_000_000, 10_000_000))
        if value not in used:
            used.add(value)
            return value


def _keys(rng: random.Random, n: int, tokenizer: Any) -> list[str]:
    """``n`` distinct "adjective-noun" keys whose questions have the same token length, so that the
    questions about one context decode together as one batch (no padding)."""
    pool = [f"{a}-{b}" for a in _ADJECTIVES for b in _NOUNS]
    rng.shuffle(pool)
    by_length: dict[int, list[str]] = {}
    for key in pool:
        group = by_length.setdefault(_count_tokens(tokenizer, QUESTION.format(key=key)), [])
        group.append(key)
        if len(group) == n:
            return group
    return pool[:n]  # no length has n keys: the questions decode one by one


def _insert_needles(rng: random.Random, sentences: list[str], needles: list[str]) -> str:
    """Needles go between sentences at random depths; the text reads haystack, needle, haystack."""
    slots = sorted(rng.randrange(len(sentences) + 1) for _ in needles)
    pieces: list[str] = []
    cursor = 0
    for slot, needle in zip(slots, needles, strict=True):
        pieces.append(" ".join(sentences[cursor:slot]))
        pieces.append(needle)
        cursor = slot
    pieces.append(" ".join(sentences[cursor:]))
    return NEEDLE_SEPARATOR.join(p for p in pieces if p)


def _retrieval_sample(
    task: str,
    tokenizer: Any,
    rng: random.Random,
    articles: Sequence[Article],
    context_tokens: int,
    n_needles: int,
) -> RetrievalSample:
    used: set[str] = set()
    if task == "niah_single":
        keys = _keys(rng, 1, tokenizer)
        facts = [(keys[0], _magic_value(rng, used))]
    elif task == "niah_multikey":
        keys = _keys(rng, n_needles, tokenizer)
        facts = [(key, _magic_value(rng, used)) for key in keys]
    else:  # niah_multivalue
        key = _keys(rng, 1, tokenizer)[0]
        facts = [(key, _magic_value(rng, used)) for _ in range(n_needles)]
    needles = [NEEDLE.format(key=k, value=v) for k, v in facts]
    overhead = _count_tokens(tokenizer, PREAMBLE + " ".join(needles))
    sentences, title = _haystack(tokenizer, rng, articles, max(16, context_tokens - overhead))
    context = PREAMBLE + _insert_needles(rng, sentences, needles)
    if task == "niah_multivalue":
        questions: tuple[Question, ...] = (
            Question(
                QUESTION_ALL.format(key=facts[0][0]), tuple(v for _, v in facts), ANSWER_TOKENS * n_needles
            ),
        )
    else:
        questions = tuple(Question(QUESTION.format(key=k), (v,)) for k, v in facts)
    return RetrievalSample(task, context, questions, source=title)


def _long_articles(
    tokenizer: Any, rng: random.Random, articles: Sequence[Article], tokens: int
) -> Iterator[tuple[Article, list[int]]]:
    """The articles of at least ``tokens`` tokens, in a seeded random order, with their token ids."""
    # ~3.5 characters per token is a safe lower bound for English Wikipedia with this tokenizer family.
    candidates = [a for a in articles if len(a.text) >= tokens * 3.5]
    rng.shuffle(candidates)
    for article in candidates:
        ids = tokenizer(article.text, add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens:
            yield article, ids


def _continuation_samples(
    tokenizer: Any,
    rng: random.Random,
    articles: Sequence[Article],
    n_samples: int,
    context_tokens: int,
    continuation_tokens: int,
) -> list[ContinuationSample]:
    need = context_tokens + continuation_tokens
    samples: list[ContinuationSample] = []
    for article, ids in _long_articles(tokenizer, rng, articles, need):
        samples.append(
            ContinuationSample(article.title, tuple(ids[:context_tokens]), tuple(ids[context_tokens:need]))
        )
        if len(samples) == n_samples:
            return samples
    raise ConfigurationError(
        f"Only {len(samples)} articles hold {need} tokens; ask for fewer samples or a shorter context."
    )


def _recall_samples(
    tokenizer: Any,
    rng: random.Random,
    articles: Sequence[Article],
    n_samples: int,
    context_tokens: int,
    n_quotes: int,
) -> list[RecallSample]:
    """Contexts of exactly ``context_tokens`` tokens from the articles' starts, each with ``n_quotes`` of its
    own whole sentences (chosen at random, in context order) to quote back."""
    samples: list[RecallSample] = []
    for article, ids in _long_articles(tokenizer, rng, articles, context_tokens):
        context = tokenizer.decode(ids[:context_tokens])
        quotes = []
        for sentence in _sentences(Article(article.title, context))[:-1]:  # the last may be cut
            words = sentence.split()
            if len(words) <= RECALL_CUE_WORDS or context.count(sentence) != 1:
                continue
            cue_text = " ".join(words[:RECALL_CUE_WORDS])
            whole = tokenizer(sentence, add_special_tokens=False)["input_ids"]
            cue = tokenizer(cue_text, add_special_tokens=False)["input_ids"]
            rest = whole[len(cue) : len(cue) + RECALL_MAX_TOKENS]
            if whole[: len(cue)] != cue or len(rest) < RECALL_MIN_TOKENS:
                continue  # the cue's tokens are not the sentence's first ones, or too little is left
            prompt = tokenizer(RECALL_PROMPT.format(cue=cue_text), add_special_tokens=False)["input_ids"]
            quotes.append((tuple(prompt), tuple(cue), tuple(rest)))
        if len(quotes) < n_quotes:
            continue
        chosen = sorted(rng.sample(range(len(quotes)), n_quotes))
        samples.append(
            RecallSample(article.title, tuple(ids[:context_tokens]), tuple(quotes[i] for i in chosen))
        )
        if len(samples) == n_samples:
            return samples
    raise ConfigurationError(
        f"Only {len(samples)} articles hold {context_tokens} tokens with {n_quotes} whole sentences to quote; ask "
        "for fewer samples, fewer quotes (--needles) or a shorter context."
    )


def make_samples(
    task: str,
    tokenizer: Any,
    n_samples: int,
    context_tokens: int,
    *,
    seed: int = 0,
    n_needles: int = 4,
    continuation_tokens: int = 128,
    articles: Sequence[Article] | None = None,
) -> list[Sample]:
    """Seeded samples of one task, built from real Wikipedia text (or the ``articles`` you pass).

    ``context_tokens`` is the approximate length of the context (retrieval) or the exact number of tokens
    compressed (continuation).

    >>> samples = make_samples("niah_multikey", tokenizer, n_samples=20, context_tokens=1000)  # doctest: +SKIP
    """
    if task not in TASKS:
        raise ConfigurationError(f"Unknown task {task!r}; choose from {', '.join(TASKS)}.")
    check_bench_numbers(n_samples, context_tokens, n_needles, continuation_tokens)
    articles = list(articles) if articles is not None else wikipedia_articles()
    rng = random.Random(f"{task}-{seed}-{context_tokens}")
    if task == "continuation":
        return list(
            _continuation_samples(tokenizer, rng, articles, n_samples, context_tokens, continuation_tokens)
        )
    if task == "recall":
        return list(
            _recall_samples(tokenizer, rng, articles, n_samples, context_tokens, n_needles)
        )  # list[Sample]
    return [
        _retrieval_sample(task, tokenizer, rng, articles, context_tokens, n_needles) for _ in range(n_samples)
    ]


def sample_positions(tokenizer: Any, sample: Sample) -> int:
    """The positions ``sample`` needs: its context and what follows it (the longest question and its answer
    tokens, the continuation, or the longest quote).

    >>> sample_positions(None, ContinuationSample("A", (1, 2, 3), (4, 5)))  # no text: no tokenizer read
    5
    """
    if isinstance(sample, ContinuationSample):
        return len(sample.context_ids) + len(sample.continuation_ids)
    if isinstance(sample, RecallSample):
        return len(sample.context_ids) + max(sum(map(len, quote)) for quote in sample.quotes)
    context = _count_tokens(tokenizer, sample.context)
    return context + max(_count_tokens(tokenizer, q.prompt) + q.max_new_tokens for q in sample.questions)


def check_sample_positions(config: Any, tokenizer: Any, samples: Sequence[Sample]) -> None:
    """Refuse (:class:`ConfigurationError`, as ``lukv check`` does) samples that need more positions than
    the model has (``config``'s ``max_position_embeddings``), before any of them runs."""
    from ...models import check_positions

    for number, sample in enumerate(samples, start=1):
        needed = sample_positions(tokenizer, sample)
        check_positions(
            config,
            needed,
            f"Sample {number} of {sample.task} (its context and what follows it)",
            "pass a smaller --context-tokens (context_tokens=)",
        )
