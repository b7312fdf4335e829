"""Oracle importance (``docs/design.md``): what each context token really contributes to the answer.

For layer ``l``, KV head ``h`` and context position ``j``::

    I[l, h, j] = max over decode steps k, over the query heads q of h's GQA group of
                 A[l, q, k, j] * ||v_j @ W_O[q]|| / Z_l

(``aggregate="mean"``: the mean over decode steps instead of the max; the max over the group stays.)

``A[l, q, k, :]`` is the softmax attention of the query that produces answer token ``k`` (the last
question token for ``k = 0``, then each generated token), ``W_O[q]`` is query head ``q``'s slice of
``o_proj`` and ``Z_l`` is the sum of ``||v_j @ W_O[q]||`` over the layer's query heads and context positions,
so that layers compare.

It is streamed: a custom attention function (swapped in for the pass with
:func:`~lukv_cache.attention.swap.attention_swapped`) returns the stock output and, during decoding, also
reads the softmax row of the newest query and folds it into a running max.
Nothing larger than one layer's ``[H_q, T]`` attention row is ever held.

Example::

    >>> from lukv_cache.profiling.oracle import prefill_context, oracle_importance
    >>> ctx = prefill_context(model, context_ids)               # doctest: +SKIP
    >>> importance = oracle_importance(model, ctx, question_ids, k_max=64)  # [L, H_kv, T_ctx]  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from .._compat import cache_kwarg
from ..attention.swap import attention_swapped
from ..errors import ConfigurationError

ATTN_NAME = "lukv_oracle"


@dataclass
class _Recorder:
    """What the oracle attention function writes to during one pass (one per build, never on a module)."""

    context_len: int
    mode: str = "context"  # "context": prefill of the context; "decode": question + answer tokens
    kv_len: int = 0  # keys a full-attention layer holds in the current forward
    sliding: bool = False  # also record sliding-window layers (over the context tokens in their window)
    value_norms: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [H_q, T_ctx], sums to 1
    importance: dict[int, torch.Tensor] = field(
        default_factory=dict
    )  # layer -> [H_kv, T_ctx] running max/sum
    aggregate: str = (
        "max"  # over decode steps: "max" (the paper) or "mean" (a running sum, divided at the end)
    )


_ACTIVE: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar("lukv_oracle", default=None)


def _eager_output(module, query, key, value, attention_mask, scaling, softcap):
    """Stock eager attention, only for models with logit softcapping (sdpa refuses them).

    It reads the sdpa masks the oracle is paired with as ``sdpa_attention_forward`` does: ``None`` with
    several queries is causal (the sdpa mask function leaves a plainly causal prompt to ``is_causal``).
    """
    groups = query.shape[1] // key.shape[1]
    logits = query @ repeat_kv(key, groups).transpose(2, 3) * scaling
    logits = torch.tanh(logits / softcap) * softcap
    if attention_mask is None and query.shape[2] > 1:
        attention_mask = torch.ones(
            query.shape[2], key.shape[2], dtype=torch.bool, device=query.device
        ).tril()
    if attention_mask is not None:
        logits = _apply_mask(logits, attention_mask[..., : key.shape[-2]])
    weights = logits.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    return (weights @ repeat_kv(value, groups)).transpose(1, 2).contiguous(), None


def _apply_mask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return logits.masked_fill(~mask, float("-inf"))
    return logits + mask


def _value_norms(module: torch.nn.Module, value: torch.Tensor, context_len: int) -> torch.Tensor:
    """``||v_j @ W_O[q]||`` for every query head q and context position j, normalised over the layer."""
    o_proj = getattr(module, "o_proj", None)
    if o_proj is None or not hasattr(o_proj, "weight"):
        raise ConfigurationError(
            f"Oracle importance needs the attention output projection `o_proj` of {type(module).__name__}; "
            "this architecture names it differently and is not supported yet."
        )
    v = value[0, :, :context_len].float()  # [H_kv, T, D]
    d = v.shape[-1]
    w = o_proj.weight.float()  # [hidden, H_q * D]
    num_q = w.shape[1] // d
    w = w.view(w.shape[0], num_q, d).transpose(0, 1)  # [H_q, hidden, D]
    gram = w.transpose(1, 2) @ w  # [H_q, D, D]: ||W v||^2 = v^T (W^T W) v, no [T, hidden] tensor
    v = repeat_kv(v[None], num_q // v.shape[0])[0]  # [H_q, T, D]
    norms = ((v @ gram) * v).sum(-1).clamp_min(0).sqrt()
    return norms / norms.sum().clamp_min(torch.finfo(torch.float32).tiny)


def _observe(rec: _Recorder, module, query, key, value, attention_mask, scaling, kwargs) -> None:
    layer = module.layer_idx
    t = rec.context_len
    if rec.mode == "context":
        if key.shape[-2] != t:
            return
        rec.value_norms[layer] = _value_norms(module, value, t)
        return
    if layer not in rec.value_norms:
        return
    s = key.shape[-2]
    if s != rec.kv_len and not (rec.sliding and getattr(module, "sliding_window", None) and s < rec.kv_len):
        return  # a sliding-window layer (unless asked for) holds only its window: not part of the optimisation
    # the keys are the last `s` positions: a sliding layer's window starts at `first`; its context part is
    # positions [first, t) (none once the decode has slid past the context)
    first = rec.kv_len - s
    if first >= t:
        return
    q = query[0, :, -1].float()  # the newest query: [H_q, D]
    k = key[0].float()  # [H_kv, S, D]
    groups = q.shape[0] // k.shape[0]
    logits = torch.einsum("hgd,hsd->hgs", q.view(k.shape[0], groups, -1), k).flatten(0, 1) * scaling
    if kwargs.get("softcap") is not None:
        logits = torch.tanh(logits / kwargs["softcap"]) * kwargs["softcap"]
    if isinstance(attention_mask, torch.Tensor):
        logits = _apply_mask(logits, attention_mask[0, :, -1, -k.shape[1] :])
    weights = logits.softmax(dim=-1)[:, : t - first] * rec.value_norms[layer][:, first:]
    if first:  # a sliding window: [H_q, T_ctx], zero before it
        contribution = weights.new_zeros(rec.value_norms[layer].shape)
        contribution[:, first:] = weights
    else:
        contribution = weights
    step_max = contribution.view(k.shape[0], groups, t).amax(dim=1)
    if layer in rec.importance:
        if rec.aggregate == "max":
            torch.maximum(rec.importance[layer], step_max, out=rec.importance[layer])
        else:
            rec.importance[layer] += step_max
    else:
        rec.importance[layer] = step_max


def oracle_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Stock attention output; while a recorder is active, also records value norms and oracle maxima."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if kwargs.get("softcap") is not None:
        out = _eager_output(module, query, key, value, attention_mask, scaling, kwargs["softcap"])
    else:
        out = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rec = _ACTIVE.get()
    if rec is not None:
        with torch.no_grad():
            _observe(rec, module, query, key, value, attention_mask, scaling, kwargs)
    return out


@contextlib.contextmanager
def _recording(model, rec: _Recorder) -> Iterator[_Recorder]:
    """Route the model's attention through :func:`oracle_attention` (with sdpa's masks, which both of its
    paths read) and activate ``rec``; restore after."""
    token = _ACTIVE.set(rec)
    try:
        with attention_swapped(model, ATTN_NAME, oracle_attention, mask="sdpa"):
            yield rec
    finally:
        _ACTIVE.reset(token)


@dataclass
class ContextState:
    """The context after prefill: its cache (copied for each question) and its value-projection norms."""

    cache: DynamicCache
    context_len: int
    value_norms: dict[int, torch.Tensor]
    num_layers: int
    num_kv_heads: int


def _text_config(model):
    return model.config.get_text_config()


class _Reserve:
    """One allocation for the KV of every full-attention layer of the context, with room after it.

    ``[n_layers, 2, B, H_kv, T + reserve, D]``, made at the first layer's first update; a layer of another
    shape gets its own. One block (not a tensor per layer, each step) keeps the context out of the small
    allocations between which freed temporaries would otherwise pile up.
    """

    def __init__(self, num_layers: int, reserve: int):
        self.num_layers, self.reserve = num_layers, reserve
        self.block: torch.Tensor | None = None
        self.next = 0

    def take(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, t, d = like.shape
        shape = (2, b, h, t + self.reserve, d)
        if self.block is None:
            self.block = like.new_empty((max(1, self.num_layers), *shape))
        if self.block.shape[1:] != shape or self.next >= self.block.shape[0]:
            own = like.new_empty(shape)  # a layer of another shape (or more layers than counted)
            return own[0], own[1]
        self.next += 1
        return self.block[self.next - 1, 0], self.block[self.next - 1, 1]


class _ContextLayer(DynamicLayer):
    """A full-attention layer that writes into a buffer ``[B, H, T + reserve, D]`` instead of concatenating.

    The context fills ``[:T]`` and is never written again; each question's tokens go after it, in place,
    and the layer hands attention views of the buffer (no copy of the context per question and per step).
    The context's own forward attends over the tensors it computed, exactly as with a ``DynamicLayer``.
    A question that does not fit moves its copy of the layer to a larger buffer of its own.
    """

    def __init__(self, reserve: _Reserve):
        super().__init__()
        self._reserve: _Reserve | None = reserve
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:  # the context
            self.lazy_initialization(key_states, value_states)
            self._keys, self._values = cast(_Reserve, self._reserve).take(key_states)
            self._reserve = None
            self.keys, self.values = self._keys[..., :0, :], self._values[..., :0, :]
        # tensors from the context's update on (above)
        keys, values = cast(torch.Tensor, self.keys), cast(torch.Tensor, self.values)
        buffer_keys, buffer_values = cast(torch.Tensor, self._keys), cast(torch.Tensor, self._values)
        start = keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > buffer_keys.shape[-2]:
            grown = buffer_keys.new_empty((2, *buffer_keys.shape[:2], 2 * end, buffer_keys.shape[-1]))
            grown[0, ..., :start, :] = keys
            grown[1, ..., :start, :] = values
            self._keys, self._values = buffer_keys, buffer_values = grown[0], grown[1]
        buffer_keys[..., start:end, :] = key_states
        buffer_values[..., start:end, :] = value_states
        self.keys, self.values = buffer_keys[..., :end, :], buffer_values[..., :end, :]
        if start == 0:
            return key_states, value_states
        return self.keys, self.values

    def __deepcopy__(self, memo):
        new = copy.copy(self)
        if self._keys is not None:  # a private buffer, not the whole shared block
            n = cast(torch.Tensor, self.keys).shape[-2]
            new._keys, new._values = self._keys.clone(), cast(torch.Tensor, self._values).clone()
            new.keys, new.values = new._keys[..., :n, :], new._values[..., :n, :]
        return new


# never write into their tensors (``update`` concatenates into new ones): a shallow copy is a private copy
_SHARED_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, _ContextLayer)


def _question_cache(context: DynamicCache) -> DynamicCache:
    """A cache that starts where ``context`` ends, without copying the context's tensors.

    A :class:`_ContextLayer` writes a question's tokens after the context in the shared buffer (questions run
    one at a time); ``DynamicLayer`` and ``DynamicSlidingWindowLayer`` only ever replace their tensors. Other
    layer types are deep-copied.
    """
    cache = copy.copy(context)
    cache.layers = [
        copy.copy(layer) if type(layer) in _SHARED_LAYERS else copy.deepcopy(layer)
        for layer in context.layers
    ]
    return cache


def prefill_context(model, context_ids: torch.Tensor, *, reserve: int = 256) -> ContextState:
    """Prefill ``context_ids [1, T]`` once; every question then continues this cache.

    Full-attention layers keep the context in one buffer with ``reserve`` free positions after it for a
    question and its answer (a longer one costs a copy of the layer for that question).
    """
    if context_ids.ndim != 2 or context_ids.shape[0] != 1:
        raise ConfigurationError(
            f"The calibration context must be one sequence [1, T], got {context_ids.shape}."
        )
    config = _text_config(model)
    rec = _Recorder(context_len=context_ids.shape[1])
    cache = DynamicCache(config=config)
    pool = _Reserve(sum(type(layer) is DynamicLayer for layer in cache.layers), max(0, int(reserve)))
    cache.layers = [_ContextLayer(pool) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    with _recording(model, rec), torch.inference_mode():
        # logits_to_keep=1: the context's logits are never read; all of them would be [T, vocab] fp32
        # (0.8 GB for SmolLM2 at 4.3k tokens, more than its KV cache)
        model(
            input_ids=context_ids.to(model.device),
            use_cache=True,
            logits_to_keep=1,
            **{cache_kwarg(model): cache},
        )
    return ContextState(
        cache=cache,
        context_len=rec.context_len,
        value_norms=rec.value_norms,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
    )


AGGREGATES = ("max", "mean")


def oracle_importance(
    model,
    state: ContextState,
    question_ids: torch.Tensor,
    *,
    k_max: int = 64,
    eos_token_id=None,
    aggregate: str = "max",
    sliding: bool = False,
) -> tuple[np.ndarray, list[int]]:
    """Oracle importance ``[L, H_kv, T_ctx]`` (float32; zero for layers not recorded) for one question,
    and the greedy answer tokens.

    Feeds the question after the context cache (never modified: see :func:`prefill_context`; one
    question at a time per ``state``), then decodes greedily with a full cache: the
    query producing each of the ``k_max`` answer tokens is one decode step. Stops early at ``eos_token_id``.
    ``aggregate``: over the decode steps, ``"max"`` (the paper) or ``"mean"`` (a token read a little at
    many steps counts more than under the max; a sum would allocate the same, budgets being scale-free).
    ``sliding``: also record the sliding-window layers, over the context tokens their window holds at each
    step (zero elsewhere; normalised by the same ``Z_l`` over the whole context as a full-attention layer);
    otherwise their rows are zero.
    """
    if aggregate not in AGGREGATES:
        raise ConfigurationError(f"aggregate must be one of {', '.join(AGGREGATES)}, got {aggregate!r}.")
    if k_max < 1:
        raise ConfigurationError(f"k_max must be at least 1, got {k_max}.")
    if question_ids.ndim != 2 or question_ids.shape[0] != 1 or question_ids.shape[1] < 1:
        raise ConfigurationError(
            f"A question must be one non-empty sequence [1, n], got {question_ids.shape}."
        )
    eos = set(np.atleast_1d(eos_token_id).tolist()) if eos_token_id is not None else set()
    rec = _Recorder(
        context_len=state.context_len,
        mode="decode",
        value_norms=state.value_norms,
        aggregate=aggregate,
        sliding=sliding,
    )
    cache = _question_cache(state.cache)
    answer: list[int] = []
    ids = question_ids.to(model.device)
    rec.kv_len = state.context_len + ids.shape[1]
    passed = {cache_kwarg(model): cache}
    with _recording(model, rec), torch.inference_mode():
        for _ in range(k_max):
            logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **passed).logits
            token = int(logits[0, -1].argmax())
            answer.append(token)
            if token in eos or len(answer) == k_max:
                break
            ids = torch.tensor([[token]], device=model.device)
            rec.kv_len += 1
    out = np.zeros((state.num_layers, state.num_kv_heads, state.context_len), dtype=np.float32)
    for layer, imp in rec.importance.items():
        out[layer] = (imp / len(answer) if aggregate == "mean" else imp).cpu().numpy()
    return out, answer
