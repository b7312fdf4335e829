"""One long context, many questions: compress the context once, answer every question from its own fork of
the compressed cache (the stores shared, only what a question appends is its own).

>>> from lukv_cache.pipeline import LUKVPipeline                                   # doctest: +SKIP
>>> ask = LUKVPipeline(model, tokenizer, lambda: LUKVCache(0.8, scorer="kvzip", allocator="global"))  # doctest: +SKIP
>>> ask(context, ["Who wrote it?", "When?"], max_new_tokens=32)                    # doctest: +SKIP
['...', '...']

transformers' own ``pipeline("text-generation", model=model, tokenizer=tokenizer)`` takes a cache too
(``pipe(text, past_key_values=LUKVCache(0.8))``); it compresses each call's prompt as ``generate`` does.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._compat import cache_kwarg
from .cache import LUKVCache
from .errors import ConfigurationError


def _check_template(template: object) -> None:
    """A question template is a string whose only field is ``{question}`` (other braces doubled)."""
    try:
        fields = (
            {name for _, name, _, _ in string.Formatter().parse(template)}
            if isinstance(template, str)
            else None
        )
    except ValueError:  # a lone brace
        fields = None
    if fields is None or "question" not in fields or fields - {"question", None}:
        raise ConfigurationError(
            f"LUKVPipeline: question_template must be a string with the field '{{question}}' and no other "
            f"(write a literal brace twice: '{{{{' or '}}}}'), got {template!r}."
        )


def _check_questions(questions: object) -> list[str]:
    """One question (a string) or a list or tuple of them, as a list."""
    if isinstance(questions, str):
        return [questions]
    if isinstance(questions, list | tuple) and all(isinstance(q, str) for q in questions):
        return list(questions)
    raise ConfigurationError(
        "LUKVPipeline: questions must be a string or a list of strings, got "
        f"{type(questions).__name__}{' holding ' + repr(questions)[:80] if isinstance(questions, list | tuple) else ''}."
    )


class LUKVPipeline:
    """Answer many questions about one context through one compressed cache.

    ``make_cache``: a function returning a fresh :class:`~lukv_cache.LUKVCache` (any scorer: KVzip's
    repeat passes run once, in :meth:`LUKVCache.prefill`), or keyword arguments for ``LUKVCache`` via
    ``cache_kwargs``. ``question_template`` turns a question into the text appended after the context
    (completion format: SmolLM2-class models answer best without a chat template). Greedy decoding
    unless ``generate_kwargs`` say otherwise. After a call, :attr:`cache` is the compressed context.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        make_cache: Callable[[], LUKVCache] | None = None,
        *,
        question_template: str = "\n\nQuestion: {question}\nAnswer:",
        **cache_kwargs: Any,
    ):
        if make_cache is not None and cache_kwargs:
            raise ConfigurationError(
                "LUKVPipeline: pass make_cache= or LUKVCache keyword arguments, not both."
            )
        _check_template(question_template)
        self.model, self.tokenizer = model, tokenizer
        self.make_cache = make_cache or (lambda: LUKVCache(**cache_kwargs))
        self.question_template = question_template
        self.cache: LUKVCache | None = None

    @torch.no_grad()
    def __call__(
        self,
        context: str,
        questions: str | Sequence[str],
        *,
        max_new_tokens: int = 64,
        **generate_kwargs: Any,
    ) -> list[str]:
        """The answer to each question (a list, in order), each decoded from a fork of one compressed
        context. A single question string gives a list of one."""
        questions = _check_questions(questions)
        if not isinstance(context, str) or not context.strip():
            raise ConfigurationError(
                f"LUKVPipeline: the context is empty or not text ({type(context).__name__}); pass the text the "
                "questions are about."
            )
        device = getattr(self.model, "device", None)
        context_ids = self.tokenizer(context, return_tensors="pt").input_ids.to(device)
        cache = self.make_cache()
        if not isinstance(cache, LUKVCache):
            raise ConfigurationError(
                f"LUKVPipeline: make_cache must return a LUKVCache, got {type(cache).__name__}."
            )
        cache.prefill(self.model, context_ids, tokenizer=self.tokenizer)
        self.cache = cache
        generate_kwargs.setdefault("do_sample", False)
        answers = []
        for question in questions:
            text = self.question_template.format(question=question)
            question_ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids.to(
                device
            )
            ids = torch.cat([context_ids, question_ids], dim=1)
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                **{cache_kwarg(self.model): cache.fork()},
                **generate_kwargs,
            )
            answers.append(self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
        return answers
