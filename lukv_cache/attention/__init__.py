"""Attention over the ragged store, and the routing that makes stock sdpa/eager use it."""

from .dispatch import install
from .ragged import merge_partials, partial_attention, ragged_attention, ragged_attention_reference

__all__ = ["install", "merge_partials", "partial_attention", "ragged_attention", "ragged_attention_reference"]
