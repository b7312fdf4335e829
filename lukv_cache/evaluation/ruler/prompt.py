"""A RULER sample as kvpress feeds it: split into context / question / answer prefix
(kvpress's ``create_huggingface_dataset.py`` patterns), then tokenized as kvpress's pipeline does: the
context inside the chat template's user turn (with no template: the BOS token first), the question, the
template's closing part and the answer prefix after it. The context is compressed without the question.

>>> split_input("vt", "Memorize... VAR X = 1\\nQuestion: Find all variables that are assigned the value 1 in the text above. Answer: They are: ")
('Memorize... VAR X = 1\\n', 'Question: Find all variables that are assigned the value 1 in the text above. ', 'Answer: They are: ')
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from ...errors import ConfigurationError
from . import family

QUESTION_PATTERNS = {
    "niah": re.compile(r"What (?:is|are all) the special magic"),
    "vt": re.compile(r"Question: Find all variables that are assigned the value"),
    "cwe": re.compile(r"Question: What are the 10 most common words in the above list\?"),
    "fwe": re.compile(r"Question: Do not provide any explanation\."),
    "qa": re.compile(r"Answer the question based on the given documents\."),
}
ANSWER_PATTERNS = {
    "niah": re.compile(r"The special magic"),
    "vt": re.compile(r"Answer:"),
    "cwe": re.compile(r"Answer:"),
    "fwe": re.compile(r"Answer:"),
    "qa": re.compile(r"Answer:"),
}
MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}


@dataclass(frozen=True)
class Sample:
    """One RULER sample, split: what ``lukv ruler`` reads and writes (``samples/<length>/<task>.jsonl``, in
    the columns of kvpress's RULER dataset: context, question, answer_prefix, answer, task, max_new_tokens)."""

    task: str
    index: int
    context: str
    question: str
    answer_prefix: str
    answer: list[str]
    max_new_tokens: int
    length: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> Sample:
        return cls(**{k: row[k] for k in cls.__dataclass_fields__})


def split_input(task: str, text: str) -> tuple[str, str, str]:
    """``text`` (RULER's ``input``) as (context, question, answer prefix): the question starts at the last
    match of the family's question pattern, the answer prefix at the first answer pattern after it."""
    kind = family(task)
    matches = list(QUESTION_PATTERNS[kind].finditer(text))
    if not matches:
        raise ConfigurationError(f"a {task} input without its question ({QUESTION_PATTERNS[kind].pattern!r})")
    context, rest = text[: matches[-1].start()], text[matches[-1].start() :]
    answer = ANSWER_PATTERNS[kind].search(rest)
    if answer is None:
        raise ConfigurationError(
            f"a {task} input without its answer prefix ({ANSWER_PATTERNS[kind].pattern!r})"
        )
    return context, rest[: answer.start()], rest[answer.start() :]


def from_row(task: str, row: dict[str, Any]) -> Sample:
    """A generator's row (``index``, ``input``, ``outputs``, ``length``) as a :class:`Sample`."""
    context, question, prefix = split_input(task, row["input"])
    return Sample(
        task, int(row["index"]), context, question, prefix, list(row["outputs"]),
        MAX_NEW_TOKENS[family(task)], int(row["length"]),
    )  # fmt: skip


def prompt_ids(tokenizer: Any, sample: Sample) -> tuple[list[int], list[int]]:
    """The context's and the question's token ids, as kvpress's pipeline makes them (its ``preprocess``)."""
    if getattr(tokenizer, "chat_template", None) is None:
        context, suffix = (getattr(tokenizer, "bos_token", None) or "") + sample.context, "\n"
    else:
        separator = "\n" + "#" * len(sample.context)
        templated = tokenizer.apply_chat_template(
            [{"role": "user", "content": sample.context + separator}],
            add_generation_prompt=True,
            tokenize=False,
            enable_thinking=False,
        )
        context, suffix = templated.split(separator)
    question = sample.question + suffix + sample.answer_prefix
    encode = lambda text: list(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    return encode(context), encode(question)
