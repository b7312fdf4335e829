"""What the cache reads off the call stack: the model that called into it (to learn its layout when built
without ``config=``), and whether the running forward is a chunk of transformers' chunked prefill.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch


def callers(skip: int, limit: int) -> Iterator[Any]:
    """The frames calling the function that calls this one, innermost first, after ``skip`` of them."""
    frame: FrameType | None = sys._getframe(skip + 2)
    for _ in range(limit):
        if frame is None:
            return
        yield frame
        frame = frame.f_back


def calling_model() -> torch.nn.Module | None:
    """The nearest ``nn.Module`` with a config on the call stack (the model, or the layer, that called into
    the cache), or ``None`` (the cache used outside a model)."""
    for frame in callers(1, 64):
        owner = frame.f_locals.get("self")
        config = getattr(owner, "config", None) if isinstance(owner, torch.nn.Module) else None
        if config is not None and hasattr(config, "get_text_config"):
            return owner
    return None


def generate_prefill_chunk() -> int | None:
    """The chunk size when the running forward is a chunk of transformers' chunked prefill
    (``model.generate(..., prefill_chunk_size=C)``), else ``None``.

    The cache cannot tell such a chunk from a question sent after a context (both are a later multi-token
    forward) by what it receives, so it looks for ``GenerationMixin._prefill``'s chunk loop on the call
    stack (transformers 5.23, the pinned release): cheap, and only asked after a compressed multi-token
    forward.

    >>> generate_prefill_chunk() is None
    True
    """
    # the model's forward, its layers and wrappers lie between _prefill and here
    for frame in callers(0, 128):
        if (
            frame.f_code.co_name == "_prefill"
            and frame.f_globals.get("__name__") == "transformers.generation.utils"
        ):
            config = frame.f_locals.get("generation_config")
            chunk = getattr(config, "prefill_chunk_size", None)
            return int(chunk) if chunk is not None and "chunk_idx" in frame.f_locals else None
    return None
