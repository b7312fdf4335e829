"""Question-agnostic long-context tasks on real text: RULER-style retrieval and continuation loss.

Every task runs the same way, as in the paper: the context is prefilled into a fresh cache (which
compresses it), and only then does the question arrive; it is forwarded and greedy-decoded through that
same cache. Several questions about one context share one prefill (each question decodes on a copy).

* ``niah_single``: one "special magic number" needle in a real-text haystack, asked back.
* ``niah_multikey``: several needles with different keys (default 4); every key is asked, one per question.
* ``niah_multivalue``: several values for one key; the answer must list them all (score = fraction found).
* ``continuation``: the first ``context_tokens`` of a Wikipedia article are compressed, the next 128
  tokens are teacher-forced; the score is their mean negative log-likelihood (lower is better).
* ``recall``: natural-text recall, nothing planted. The first ``context_tokens`` of an article are
  compressed; then whole sentences of that context (default 4, chosen at random) are asked back, each cued by
  its first five words, and the rest of the sentence (up to 48 tokens) is teacher-forced; the score is the
  fraction of those tokens the model predicts exactly (greedy copy accuracy, higher is better).

Prompts are plain completions (context, then question, no chat template, no special tokens): SmolLM2-135M
answers ~75% of multikey questions at ~1k tokens that way and ~0% with its chat template.

One job per module: :mod:`.samples` (the tasks and their seeded samples, built from real text),
:mod:`.scoring` (a sample run through a cache and scored) and :mod:`.statistics` (a mean and its standard
error over the samples); the greedy decoding they share with ``lukv check`` is
:mod:`lukv_cache.evaluation.decoding`. This package's face gives their public names.

    >>> from lukv_cache.evaluation.tasks import make_samples, evaluate_sample
    >>> samples = make_samples("niah_multikey", tokenizer, n_samples=2, context_tokens=1000)  # doctest: +SKIP
    >>> evaluate_sample(model, tokenizer, samples[0], make_cache=DynamicCache).score  # doctest: +SKIP
    0.75
"""

from __future__ import annotations

from .samples import (
    ACCURACY_TASKS,
    RETRIEVAL_TASKS,
    ContinuationSample,
    Question,
    RecallSample,
    RetrievalSample,
    Sample,
    check_sample_positions,
    make_samples,
    sample_positions,
)
from .scoring import CacheFactory, SampleResult, context_ids, evaluate_sample, score_prefilled
from .statistics import mean_and_sem

__all__ = [
    "ACCURACY_TASKS",
    "RETRIEVAL_TASKS",
    "CacheFactory",
    "ContinuationSample",
    "Question",
    "RecallSample",
    "RetrievalSample",
    "Sample",
    "SampleResult",
    "check_sample_positions",
    "context_ids",
    "evaluate_sample",
    "make_samples",
    "mean_and_sem",
    "sample_positions",
    "score_prefilled",
]
