"""The documents a KVzap surrogate trains on, by corpus name (:data:`CORPORA`, the names
:data:`lukv_cache.profiling.kvzap_options.CORPORA` lists): what ``KVzapTraining.corpus`` reads. A leaf of
its own, so that the options import it without importing the training (:mod:`lukv_cache.profiling.kvzap`,
which imports the options and re-exports these names)."""

from __future__ import annotations

import random
from typing import Any

import torch

from ..errors import ConfigurationError
from ..texts import news_articles, python_docs


def news_documents(tokenizer: Any, count: int, tokens: int = 1024, seed: int = 0) -> list[torch.Tensor]:
    """``count`` documents ``[1, tokens]`` of news articles (shuffled with ``seed``) joined by blank lines.

    >>> docs = news_documents(tokenizer, 4)  # doctest: +SKIP
    """
    return _documents([a.text for a in news_articles()], "news", tokenizer, count, tokens, seed)


def python_docs_documents(
    tokenizer: Any, count: int, tokens: int = 1024, seed: int = 0
) -> list[torch.Tensor]:
    """``count`` documents ``[1, tokens]`` of Python's reference documentation (topics shuffled with
    ``seed``, long ones cut into several documents).

    >>> docs = python_docs_documents(tokenizer, 4)  # doctest: +SKIP
    """
    return _documents([a.text for a in python_docs()], "Python docs", tokenizer, count, tokens, seed)


def _documents(articles: list[str], corpus: str, tokenizer: Any, count: int, tokens: int, seed: int):
    random.Random(seed).shuffle(articles)
    docs, current = [], []
    for text in articles:
        current.extend(tokenizer.encode(text + "\n\n", add_special_tokens=False))
        if len(current) >= tokens:
            docs.append(torch.tensor([current[:tokens]]))
            current = []
            if len(docs) == count:
                return docs
    raise ConfigurationError(
        f"The {corpus} corpus holds {len(docs)} documents of {tokens} tokens, not {count}."
    )


CORPORA = {"news": news_documents, "python_docs": python_docs_documents}
