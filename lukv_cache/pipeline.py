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

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .cache import LUKVCache
from .errors import ConfigurationError


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
        if "{question}" not in question_template:
            raise ConfigurationError("LUKVPipeline: question_template must contain '{question}'.")
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
        if isinstance(questions, str):
            questions = [questions]
        if not context or not context.strip():
            raise ConfigurationError(
                "LUKVPipeline: the context is empty; pass the text the questions are about."
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
                past_key_values=cache.fork(),
                max_new_tokens=max_new_tokens,
                **generate_kwargs,
            )
            answers.append(self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
        return answers
