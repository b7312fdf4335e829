"""RULER (Hsieh et al., 2024) on any model ``lukv bench`` takes, under kvpress's question-agnostic protocol:
``lukv ruler``.

One job per module: :mod:`.deps` (the optional packages, checked before anything loads), :mod:`.generate`
(RULER's own generator scripts, driven in process for a tokenizer, length and seed), :mod:`.prompt` (a
sample split into context / question / answer prefix and tokenized as kvpress does), :mod:`.scoring`
(RULER's string-match metrics), :mod:`.store` (the resumable JSONL of finished samples), :mod:`.run` (every
method on every sample, one shared prefill per sample), :mod:`.report` (tables, JSON, markdown) and
:mod:`.command` (the command itself). Light on import: nothing here imports torch until it runs.
"""

from __future__ import annotations

# RULER's 13 tasks (synthetic.yaml), in its order; the five essay tasks split sentences (see .generate)
TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)
ESSAY_TASKS = ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery")
MIN_LENGTH = 256  # shorter and RULER's templates and answers leave no haystack
DEFAULT_SEED = 42  # RULER's prepare.py always seeds its generators with 42


def family(task: str) -> str:
    """The kvpress family of a RULER task (its prompt patterns, scoring and answer length).

    >>> family("niah_multikey_2"), family("qa_1"), family("vt")
    ('niah', 'qa', 'vt')
    """
    return task.split("_")[0]
