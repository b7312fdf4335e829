"""Torch operators the package reads directly (looked up once, None where this torch lacks them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Callable

flash_attention_cpu: Callable[..., Any] | None
try:  # torch's fused CPU flash attention: it also returns the softmax's log-sum-exp
    flash_attention_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
except (AttributeError, RuntimeError):  # pragma: no cover - older torch
    flash_attention_cpu = None
