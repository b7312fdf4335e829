"""The core tests' tiny models: ``lukv_cache.testing``'s, cached, plus the helpers only tests use.

Every model is seeded, so two calls give identical weights (an assistant model and a main model can
share a vocabulary without sharing weights by passing another seed).
"""

from __future__ import annotations

import functools

import torch

from lukv_cache._compat import cache_kwarg
from lukv_cache.allocation import ALLOCATORS, allocators_reading_profile
from lukv_cache.testing import tiny_model as _fresh_model

# the allocators that read a profile's curves (registered with reads_profile=True); the adaptive one
# (threshold) reads a kvzap profile's score thresholds instead, and takes value= in the tests
PROFILE_FAMILY = tuple(a for a in allocators_reading_profile() if not ALLOCATORS.get(a).adaptive)


@functools.cache
def _cached(arch: str, attn: str, dtype: torch.dtype, seed: int, frozen: tuple):
    return _fresh_model(arch, seed=seed, attn=attn, dtype=dtype, **dict(frozen))


def tiny_model(
    arch: str = "llama", attn: str = "sdpa", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides
):
    """``lukv_cache.testing.tiny_model``, cached per argument set: tests must not change a model they get
    here (``copy.deepcopy`` it first if they do)."""
    return _cached(arch, attn, dtype, seed, tuple(sorted(overrides.items())))


def greedy_with_logits(
    model, ids: torch.Tensor, cache, new_tokens: int = 6, attention_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ``generate`` over ``cache`` (passed by the keyword the installed transformers takes: ``cache``
    from 5.24, ``past_key_values`` before): the sequences and the stacked logits of every new token."""
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=attention_mask,
            **{cache_kwarg(model): cache},
            max_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences, torch.stack(out.logits)


def scorer_for(name: str, model):
    """A registered scorer by name, ready for ``model``: ``kvzap`` gets a seeded random surrogate of the
    model's shape (a trained one needs the real model; the cache's contract does not) that reads every
    input a surrogate can read, the context's length included (so a padded row must see its own length) and
    the last queries' window attention (so a padded row must be scored from its own queries)."""
    if name != "kvzap":
        return name
    from lukv_cache.scorers.kvzap import kvzap_scorer
    from lukv_cache.testing import random_surrogate

    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or 16
    return kvzap_scorer(random_surrogate(text.num_hidden_layers, text.num_key_value_heads, head_dim))


class CharTokenizer:
    """Characters as token ids of the tiny models' vocabulary (``lukv_cache.testing.VOCAB``): enough for
    the pipeline's encode and decode."""

    def __call__(self, text, return_tensors=None, add_special_tokens=True):
        from lukv_cache.testing import VOCAB

        ids = torch.tensor([[3 + ord(c) % (VOCAB - 3) for c in text]])
        return type("Encoded", (), {"input_ids": ids})()

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


def json_leaves(value, path=()):
    """Every ``(path, value)`` of a JSON value, itself first: the fuzzers edit each one."""
    yield path, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from json_leaves(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from json_leaves(item, (*path, i))


def with_question(seq: torch.Tensor, mask: torch.Tensor | None):
    """The tokens so far plus a 3-token question (seeded), and its mask."""
    from lukv_cache.testing import prompt

    ids = torch.cat([seq, prompt(seq.shape[0], 3, seed=9)], 1)
    if mask is None:
        return ids, None
    return ids, torch.cat([mask, torch.ones(ids.shape[0], ids.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
