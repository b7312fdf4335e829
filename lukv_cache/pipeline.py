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


# generate()'s inputs that the pipeline builds itself for every question: the context's ids and the
# question's, and their mask (one unpadded row)
_BUILT_HERE = ("inputs", "input_ids", "attention_mask")


def _check_max_new_tokens(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(
            f"LUKVPipeline: max_new_tokens is the answer tokens decoded per question and must be a positive "
            f"integer, got {value!r}; e.g. max_new_tokens=64."
        )
    return value


def _check_generate_kwargs(generate_kwargs: dict[str, Any]) -> None:
    """Refuse the ``generate()`` inputs the pipeline builds itself (they would be passed twice)."""
    for name in _BUILT_HERE:
        if name in generate_kwargs:
            raise ConfigurationError(
                f"LUKVPipeline builds each question's input (the context's ids, then the question's) and its "
                f"attention mask itself, one unpadded row, so {name}= cannot be passed: drop it (to batch "
                "prompts of your own, call model.generate with a LUKVCache instead)."
            )


def _own_cache(cache: object, past_key_values: object) -> LUKVCache | None:
    """The user's own cache (``cache=`` or ``past_key_values=``), which the context is compressed into: an
    empty :class:`LUKVCache`; ``None`` when neither is given."""
    if cache is not None and past_key_values is not None:
        raise ConfigurationError("LUKVPipeline: pass your cache as cache= or as past_key_values=, not both.")
    given, name = (cache, "cache") if cache is not None else (past_key_values, "past_key_values")
    if given is None:
        return None
    if not isinstance(given, LUKVCache):
        raise ConfigurationError(
            f"LUKVPipeline: {name}= must be a LUKVCache (the context is compressed into it and every question "
            f"answered from a fork of it), got {type(given).__name__}. Pass LUKVCache(...), or make_cache=."
        )
    if given.get_seq_length() > 0:
        raise ConfigurationError(
            f"LUKVPipeline: the LUKVCache passed as {name}= already holds {given.get_seq_length()} tokens; "
            "the context is compressed into an empty one. Pass a fresh LUKVCache (cache.fork() answers more "
            "questions about a context it holds)."
        )
    return given


class LUKVPipeline:
    """Answer many questions about one context through one compressed cache.

    ``make_cache``: a function returning a fresh :class:`~lukv_cache.LUKVCache` (any scorer: KVzip's
    repeat passes run once, in :meth:`LUKVCache.prefill`), or keyword arguments for ``LUKVCache`` via
    ``cache_kwargs``. ``question_template`` turns a question into the text appended after the context
    (completion format: SmolLM2-class models answer best without a chat template). Greedy decoding
    unless ``generate_kwargs`` say otherwise. After a call, :attr:`cache` is the compressed context.

    A call takes your own empty ``LUKVCache`` as ``cache=`` (or ``past_key_values=``): the context is
    compressed into it instead of a new ``make_cache()`` one, and it holds the compressed context afterwards.
    The pipeline builds each question's input and attention mask itself (``attention_mask=`` is refused), and
    ``max_new_tokens`` must be a positive integer: a :class:`~lukv_cache.errors.ConfigurationError` otherwise,
    before the context is compressed.
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
        cache: LUKVCache | None = None,
        **generate_kwargs: Any,
    ) -> list[str]:
        """The answer to each question (a list, in order), each decoded from a fork of one compressed
        context. A single question string gives a list of one. ``cache`` (or ``past_key_values``): an empty
        LUKVCache to compress the context into (default: ``make_cache()``'s)."""
        questions = _check_questions(questions)
        _check_max_new_tokens(max_new_tokens)
        own = _own_cache(cache, generate_kwargs.pop("past_key_values", None))
        _check_generate_kwargs(generate_kwargs)
        if not isinstance(context, str) or not context.strip():
            raise ConfigurationError(
                f"LUKVPipeline: the context is empty or not text ({type(context).__name__}); pass the text the "
                "questions are about."
            )
        device = getattr(self.model, "device", None)
        context_ids = self.tokenizer(context, return_tensors="pt").input_ids.to(device)
        cache = self.make_cache() if own is None else own
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
