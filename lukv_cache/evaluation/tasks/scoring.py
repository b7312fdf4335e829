"""A sample run through a cache and scored: the context prefilled, then its questions answered (or its
continuation teacher-forced) through that same cache."""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..._compat import cache_kwarg
from ...cache import kv_cache_bytes
from ...profiling.continuation import continuation_nll, prefill
from ..decoding import greedy_decode, stop_ids
from .samples import ContinuationSample, RecallSample, Sample

CacheFactory = Callable[[], Any]

_ANSWER_END = re.compile(r"\d\.")


@dataclass
class SampleResult:
    """What one cache did on one sample.

    ``score``: accuracy in [0, 1] for retrieval and recall (mean over questions), mean NLL per token
    (nats) for continuation. ``kv_bytes``/``context_tokens`` are measured right after the context prefill.

    >>> SampleResult(score=1.0, kv_bytes=10, context_tokens=5).score
    1.0
    """

    score: float
    kv_bytes: int
    context_tokens: int
    outputs: list[str] = field(default_factory=list)
    question_scores: list[float] = field(default_factory=list)
    prefill_seconds: float = 0.0


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


def _encode(tokenizer: Any, text: str, device: torch.device) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor([ids], dtype=torch.long, device=device)


def _answer_score(output: str, answers: Sequence[str]) -> float:
    return sum(answer in output for answer in answers) / len(answers)


def context_ids(tokenizer: Any, sample: Sample, device: torch.device | str = "cpu") -> torch.Tensor:
    """The sample's context as ``[1, T]`` token ids (no special tokens).

    >>> ids = context_ids(tokenizer, sample)  # doctest: +SKIP
    """
    if isinstance(sample, ContinuationSample | RecallSample):
        return torch.tensor([sample.context_ids], dtype=torch.long, device=device)
    return _encode(tokenizer, sample.context, torch.device(device))


@torch.no_grad()
def score_prefilled(
    model: Any, tokenizer: Any, sample: Sample, cache: Any, last_logits: torch.Tensor
) -> tuple[float, list[str], list[float]]:
    """Answer ``sample``'s questions (or teacher-force its continuation) through a cache that already holds
    the context. ``last_logits``: the prefill's last-position logits ``[1, V]``.

    Returns ``(score, outputs, question_scores)``. Every question sees the same prefilled context: they
    decode as one batch (the cache's rows repeated) when they have the same length, else one by one on
    copies. The cache itself is consumed.

    >>> score, outputs, _ = score_prefilled(model, tokenizer, sample, cache, last_logits)  # doctest: +SKIP
    """
    device = _device(model)
    if isinstance(sample, ContinuationSample):
        target = torch.tensor([sample.continuation_ids], dtype=torch.long, device=device)
        return continuation_nll(model, cache, last_logits, target), [], []
    if isinstance(sample, RecallSample):
        return _score_recall(model, tokenizer, sample, cache)

    stops = stop_ids(tokenizer)

    def done(tokens: list[int]) -> bool:
        # A 7-digit answer ends with a period; stopping there saves the decode steps of the next sentence.
        return _ANSWER_END.search(tokenizer.decode(tokens, skip_special_tokens=True)) is not None

    prompts = [_encode(tokenizer, q.prompt, device) for q in sample.questions]
    max_new = max(q.max_new_tokens for q in sample.questions)
    single = all(len(q.answers) == 1 for q in sample.questions)  # a list of values has periods inside
    if len({p.shape[1] for p in prompts}) == 1:
        # Questions of equal length (make_samples picks keys so) decode as one batch on copies of the rows.
        if len(prompts) > 1:
            cache.batch_repeat_interleave(len(prompts))
        new_ids = greedy_decode(model, cache, torch.cat(prompts), max_new, stops, done if single else None)
    else:
        new_ids = []
        for index, prompt in enumerate(prompts):
            working = cache if index == len(prompts) - 1 else copy.deepcopy(cache)
            new_ids += greedy_decode(model, working, prompt, max_new, stops, done if single else None)
    outputs = [tokenizer.decode(ids, skip_special_tokens=True) for ids in new_ids]
    scores = [_answer_score(text, q.answers) for text, q in zip(outputs, sample.questions)]
    return sum(scores) / len(scores), outputs, scores


@torch.no_grad()
def _score_recall(
    model: Any, tokenizer: Any, sample: RecallSample, cache: Any
) -> tuple[float, list[str], list[float]]:
    """Each quote on its own copy of the prefilled cache: prompt + cue + rest forwarded at once, the rest's
    tokens scored by whether the greedy prediction is the true token."""
    device = _device(model)
    outputs, scores = [], []
    for index, (prompt_ids, cue, rest) in enumerate(sample.quotes):
        working = cache if index == len(sample.quotes) - 1 else copy.deepcopy(cache)
        ids = torch.tensor([prompt_ids + cue + rest[:-1]], dtype=torch.long, device=device)
        logits = model(input_ids=ids, use_cache=True, **{cache_kwarg(model): working}).logits  # [1, q, V]
        predicted = logits[0, len(prompt_ids) + len(cue) - 1 :].argmax(-1)  # predicts rest[0 ...]
        target = torch.tensor(rest, device=device)
        scores.append(float((predicted == target).double().mean()))
        outputs.append(tokenizer.decode(predicted.tolist(), skip_special_tokens=True))
    return sum(scores) / len(scores), outputs, scores


@torch.no_grad()
def evaluate_sample(model: Any, tokenizer: Any, sample: Sample, make_cache: CacheFactory) -> SampleResult:
    """Prefill ``sample``'s context into ``make_cache()``, then answer its questions (or teacher-force its
    continuation) through that same cache.

    >>> from transformers import DynamicCache
    >>> result = evaluate_sample(model, tokenizer, sample, DynamicCache)  # doctest: +SKIP
    """
    ids = context_ids(tokenizer, sample, _device(model))
    cache = make_cache()
    started = time.perf_counter()
    last_logits = prefill(model, ids, cache)
    prefill_seconds = time.perf_counter() - started
    held = kv_cache_bytes(cache)
    score, outputs, question_scores = score_prefilled(model, tokenizer, sample, cache, last_logits)
    return SampleResult(score, held, ids.shape[1], outputs, question_scores, prefill_seconds)
