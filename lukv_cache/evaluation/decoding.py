"""Greedy decoding through a prefilled cache, and the tokens that end an answer (shared by the tasks,
``lukv check`` and ``lukv ruler``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._compat import cache_kwarg


@torch.no_grad()
def greedy_decode(
    model: Any,
    cache: Any,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    done: Callable[[list[int]], bool] | None = None,
) -> list[list[int]]:
    """Forward ``prompt_ids`` ``[B, q]`` through a prefilled ``cache`` (batch ``B``), then decode greedily.

    A row stops after ``max_new_tokens``, at a token in ``stop_ids`` (not kept), or once ``done(tokens)``
    says its answer is complete; decoding ends when every row has stopped. Returns each row's new tokens.

    >>> new_ids = greedy_decode(model, cache, question_ids, max_new_tokens=12)  # doctest: +SKIP
    """
    rows = prompt_ids.shape[0]
    generated: list[list[int]] = [[] for _ in range(rows)]
    active = [True] * rows
    inputs = prompt_ids
    passed = {cache_kwarg(model): cache}
    for _ in range(max_new_tokens):
        logits = model(input_ids=inputs, use_cache=True, logits_to_keep=1, **passed).logits
        tokens = logits[:, -1].argmax(-1).tolist()
        for row, token in enumerate(tokens):
            if not active[row]:
                continue
            if token in stop_ids:
                active[row] = False
                continue
            generated[row].append(token)
            if done is not None and done(generated[row]):
                active[row] = False
        if not any(active):
            break
        inputs = torch.tensor(tokens, device=prompt_ids.device).unsqueeze(-1)
    return generated


def stop_ids(tokenizer: Any) -> list[int]:
    stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    # The answer is one line; a newline means the model moved on.
    for text in ("\n", "\n\n"):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) == 1:
            stops.append(ids[0])
    return stops
