"""The checks of a prefill's inputs (``LUKVCache.prefill``): ids, the padding mask and, for a reconstruction
scorer, left padding; a bad batch is a :class:`~lukv_cache.errors.ConfigurationError` before any forward."""

from __future__ import annotations

import torch

from ...errors import ConfigurationError


def check_prefill_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    left_padding_only: bool,
    vocab_size: int | None,
) -> torch.Tensor:
    """The prefill's mask (``[B, T]`` int64 on the ids' device; ones when ``attention_mask`` is None) after
    checking the inputs, so a bad batch is a :class:`ConfigurationError` instead of silently wrong scores.

    ``input_ids`` must be a non-empty 2-D integer tensor with ids in ``[0, vocab_size)`` (when known); the
    mask must have its shape and hold only 0 and 1, every row at least one 1; with ``left_padding_only``
    (KVzip scores each row's context as one block) every row must read ``0 ... 0 1 ... 1``.

    >>> check_prefill_inputs(torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]]), left_padding_only=True,
    ...                      vocab_size=8)
    tensor([[0, 1, 1]])
    """
    _check_ids(input_ids, vocab_size)
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.long)
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(input_ids.shape):
        got = (
            list(attention_mask.shape)
            if isinstance(attention_mask, torch.Tensor)
            else type(attention_mask).__name__
        )
        raise ConfigurationError(
            f"attention_mask must have the shape of input_ids {list(input_ids.shape)}, got {got}: one 0/1 "
            "entry per token (0 = padding), as the tokenizer returns it."
        )
    mask = attention_mask.to(device=input_ids.device)
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ConfigurationError(
            "attention_mask must hold only 0 (padding) and 1 (token); pass the tokenizer's mask."
        )
    mask = mask.long()
    empty = (mask.sum(-1) == 0).nonzero()
    if empty.numel():
        raise ConfigurationError(
            f"Row {int(empty[0, 0])} of attention_mask is all padding: every row needs at least one token."
        )
    if left_padding_only:
        bad = (mask[:, 1:] < mask[:, :-1]).any(-1).nonzero()
        if bad.numel():
            raise ConfigurationError(
                f"Row {int(bad[0, 0])} of attention_mask is right-padded or has holes; a reconstruction scorer "
                "(KVzip) needs left padding, every row 0 ... 0 1 ... 1: set tokenizer.padding_side = 'left'."
            )
    return mask


def _check_ids(input_ids: torch.Tensor, vocab_size: int | None) -> None:
    """Raise ConfigurationError unless ``input_ids`` is a non-empty ``[B, T]`` integer tensor in the vocabulary."""
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.ndim != 2
        or input_ids.numel() == 0
        or input_ids.is_floating_point()
        or input_ids.is_complex()
        or input_ids.dtype == torch.bool
    ):
        got = (
            f"a {input_ids.dtype} tensor of shape {list(input_ids.shape)}"
            if isinstance(input_ids, torch.Tensor)
            else type(input_ids).__name__
        )
        raise ConfigurationError(
            f"input_ids must be a non-empty [batch, tokens] integer tensor, got {got}; for one sequence pass "
            "ids[None] (or the tokenizer's return_tensors='pt' output)."
        )
    if vocab_size is not None:
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= vocab_size:
            raise ConfigurationError(
                f"input_ids must lie in [0, {vocab_size}) (the model's vocabulary), found ids in [{low}, {high}]; "
                "tokenize with the model's own tokenizer."
            )
