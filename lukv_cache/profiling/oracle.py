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
:func:`~lukv_cache.attention.swap.attention_swapped`) prefills the context with the stock attention, then
decodes the questions as one batch (:func:`oracle_importances`): each step computes the batch's attention
over the shared context (read once for every question) and each question's own tokens, and folds the
softmax row of each newest query into a running max. Nothing larger than one layer's attention rows of the
batch is ever held, and the context is never copied.

Example::

    >>> from lukv_cache.profiling.oracle import prefill_context, oracle_importance
    >>> ctx = prefill_context(model, context_ids)               # doctest: +SKIP
    >>> importance = oracle_importance(model, ctx, question_ids, k_max=64)  # [L, H_kv, T_ctx]  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from .._compat import cache_kwarg
from ..attention.swap import attention_swapped
from ..cache.compression.recorded import RecordedPrefill
from ..errors import ConfigurationError

ATTN_NAME = "lukv_oracle"


@dataclass
class _Recorder:
    """What the oracle attention function writes to during one pass (one per build, never on a module)."""

    context_len: int
    sliding: bool = False  # also record sliding-window layers (over the context tokens in their window)
    value_norms: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [H_q, T_ctx], sums to 1
    importance: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, H_kv, T_ctx] max/sum
    aggregate: str = (
        "max"  # over decode steps: "max" (the paper) or "mean" (a running sum, divided at the end)
    )
    rows: _Rows | None = None  # a question batch's decode; None: the context's prefill
    queries: int = 0  # the context's prefill: also keep each layer's last queries (and its module)
    context_queries: dict[int, torch.Tensor] = field(default_factory=dict)
    modules: dict[int, torch.nn.Module] = field(default_factory=dict)


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


def _observe_context(rec: _Recorder, module, query, value) -> None:
    """The context's prefill: a layer that holds every context token gets its value norms (it is recorded)
    and, when asked, keeps its last queries."""
    if value.shape[-2] == rec.context_len:
        rec.value_norms[module.layer_idx] = _value_norms(module, value, rec.context_len)
    if rec.queries:
        rec.context_queries[module.layer_idx] = query[:, :, -rec.queries :].clone()
        rec.modules[module.layer_idx] = module


def oracle_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Stock attention output; while a recorder is active, also records value norms (the context's prefill)
    or, for a question batch, computes the batch's attention itself and records the oracle maxima."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    rec = _ACTIVE.get()
    if rec is not None and rec.rows is not None:
        with torch.no_grad():
            return _rows_attention(rec, module, query, key, value, scaling, kwargs.get("softcap")), None
    if kwargs.get("softcap") is not None:
        out = _eager_output(module, query, key, value, attention_mask, scaling, kwargs["softcap"])
    else:
        out = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if rec is not None:
        with torch.no_grad():
            _observe_context(rec, module, query, value)
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
    """The context after prefill: its cache (never written again: each question batch keeps its own tokens
    apart from it) and its value-projection norms."""

    cache: DynamicCache
    context_len: int
    value_norms: dict[int, torch.Tensor]
    num_layers: int
    num_kv_heads: int
    queries: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> its last queries, if kept
    modules: dict[int, torch.nn.Module] = field(default_factory=dict)

    def recorded(self, attn_implementation: str) -> RecordedPrefill:
        """The context's prefill as a :class:`~lukv_cache.cache.compression.recorded.RecordedPrefill` (its
        keys, values and kept queries), to replay into compressed caches without another forward; for a
        model whose layers are all full attention, prefilled with ``queries``."""
        if not self.queries or len(self.queries) != len(self.cache.layers):
            raise ConfigurationError("This context was prefilled without keeping its queries (queries=0).")
        layers = cast(list[DynamicLayer], self.cache.layers)
        return RecordedPrefill(
            n_queries=next(iter(self.queries.values())).shape[-2],
            attn_implementation=attn_implementation,
            keys=[cast(torch.Tensor, layer.keys) for layer in layers],
            values=[cast(torch.Tensor, layer.values) for layer in layers],
            prefill_queries=self.queries,
            modules=dict(self.modules),
        )


def _text_config(model):
    return model.config.get_text_config()


def prefill_context(model, context_ids: torch.Tensor, *, queries: int = 0) -> ContextState:
    """Prefill ``context_ids [1, T]`` once; every question batch then continues this cache without writing to
    it (a full-attention layer holds the context's keys and values, a sliding-window layer its last ones).
    ``queries``: also keep each layer's last ``queries`` queries (:meth:`ContextState.recorded`)."""
    if context_ids.ndim != 2 or context_ids.shape[0] != 1:
        raise ConfigurationError(
            f"The calibration context must be one sequence [1, T], got {context_ids.shape}."
        )
    config = _text_config(model)
    rec = _Recorder(context_len=context_ids.shape[1], queries=max(0, int(queries)))
    cache = DynamicCache(config=config)
    unknown = sorted({type(layer).__name__ for layer in cache.layers if not isinstance(layer, DynamicLayer)})
    if unknown:
        raise ConfigurationError(
            f"The oracle decodes over full-attention and sliding-window layers; this model's cache has "
            f"{', '.join(unknown)} layers, which it does not support yet."
        )
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
        queries=rec.context_queries,
        modules=rec.modules,
    )


class _RowsLayer(DynamicLayer):
    """One layer of a question batch's cache: the rows' own tokens ``[B, H_kv, S, D]`` (questions, then
    answers), after a context every row shares and which stays in the context's cache (the batched
    attention reads it there). Its length counts the context, so positions and masks line up."""

    def __init__(self, context_len: int):
        super().__init__()
        self.context_len = context_len

    def get_seq_length(self) -> int:
        return self.context_len + super().get_seq_length()


@dataclass
class _Rows:
    """What the batched attention reads besides its arguments, for the forward under way."""

    # per layer: the context's keys and values [H_kv, n, D], in float32
    context: list[tuple[torch.Tensor, torch.Tensor]]
    context_len: int
    query_pos: torch.Tensor  # [B, q] positions of this forward's queries (-1: a question's padding)
    key_pos: torch.Tensor  # [B, S] positions of the rows' own tokens held, this forward's too (-1: padding)
    before: torch.Tensor  # [B] tokens before this forward's first real query (a sliding layer holds them all
    # while this is at most its window - 1)
    recording: torch.Tensor  # [B] bool: rows whose answer is still being decoded


def _rows_attention(rec: _Recorder, module, query, key, value, scaling, softcap) -> torch.Tensor:
    """Exact attention of a question batch over the shared context and each row's own tokens, reading the
    context once for every row; records each recording row's newest query into ``rec.importance``.
    Returns ``[B, q, H_q, D]`` as transformers' attention functions do."""
    rows = cast(_Rows, rec.rows)
    layer = module.layer_idx
    context_keys, context_values = rows.context[layer]  # float32 [H_kv, n, D]
    n, t = context_keys.shape[-2], rows.context_len
    first = t - n  # a sliding layer holds the context's last tokens
    b, num_q, q, d = query.shape
    num_kv = key.shape[1]
    groups = num_q // num_kv
    # head-major: every row's queries of a KV head are one matrix, [H_kv, B * G * q, D], so the logits over
    # the context are one batched matmul per KV head; the scale goes on the queries (the smaller side)
    queries = (query.float() * scaling).view(b, num_kv, groups, q, d).transpose(0, 1)  # [H_kv, B, G, q, D]
    # the logits over the context and over the row's own tokens, kept apart (no [.., n + S] copy): the
    # context part, [H_kv, B, G, q, n], is the largest tensor of a batch
    over_context = torch.bmm(queries.reshape(num_kv, -1, d), context_keys.transpose(1, 2))
    over_context = over_context.view(num_kv, b, groups, q, n)
    over_own = torch.einsum("hbgqd,bhsd->hbgqs", queries, key.float())
    if softcap is not None:
        for part in (over_context, over_own):
            part.div_(softcap).tanh_().mul_(softcap)
    query_pos = rows.query_pos[None, :, None, :, None]  # [1, B, 1, q, 1]
    padding = query_pos < 0
    key_pos = rows.key_pos[None, :, None, None, :]  # [1, B, 1, 1, S]
    see_own = (key_pos >= 0) & (key_pos <= query_pos) & ~padding
    window = getattr(module, "sliding_window", None)
    if window:  # a full-attention layer's queries all follow the context: every one sees all of it
        context_pos = torch.arange(first, t, device=query.device)
        see_context = (context_pos <= query_pos) & (query_pos - context_pos < window)
        see_context = see_context | padding  # a padding query reads the context: finite, and never read
        over_context.masked_fill_(~see_context, float("-inf"))
        see_own = see_own & (query_pos - key_pos < window)
    over_own.masked_fill_(~see_own, float("-inf"))
    # one softmax over both parts, in place
    peak = torch.maximum(over_context.amax(-1, keepdim=True), over_own.amax(-1, keepdim=True))
    over_context.sub_(peak).exp_()
    over_own.sub_(peak).exp_()
    total = over_context.sum(-1, keepdim=True) + over_own.sum(-1, keepdim=True)
    weights, own_weights = over_context.div_(total), over_own.div_(total)
    out = torch.bmm(weights.view(num_kv, -1, n), context_values).view(num_kv, b, groups, q, d)
    out = out + torch.einsum("hbgqs,bhsd->hbgqd", own_weights, value.float())
    if layer in rec.value_norms:
        recorded = rows.recording & ((not window) or rec.sliding or (rows.before <= window - 1))
        if bool(recorded.any()):
            norms = rec.value_norms[layer][:, first:].view(num_kv, 1, groups, n)
            # the newest query's, [B, H_kv, n]
            step = (weights[:, :, :, -1] * norms).amax(dim=2).transpose(0, 1)
            importance = rec.importance.setdefault(layer, step.new_zeros(b, num_kv, t))
            part = importance[:, :, first:]
            keep = recorded[:, None, None]
            if rec.aggregate == "max":
                part.copy_(torch.where(keep, torch.maximum(part, step), part))
            else:
                part.add_(step * keep)
    # [H_kv, B, G, q, D] -> [B, q, H_q, D]
    return out.permute(1, 3, 0, 2, 4).reshape(b, q, num_q, d).to(query.dtype)


AGGREGATES = ("max", "mean")


def _check_question(question_ids: torch.Tensor) -> None:
    if question_ids.ndim != 2 or question_ids.shape[0] != 1 or question_ids.shape[1] < 1:
        raise ConfigurationError(
            f"A question must be one non-empty sequence [1, n], got {question_ids.shape}."
        )


def oracle_importances(
    model,
    state: ContextState,
    questions: list[torch.Tensor],
    *,
    k_max: int = 64,
    eos_token_id=None,
    aggregate: str = "max",
    sliding: bool = False,
) -> list[tuple[np.ndarray, list[int]]]:
    """:func:`oracle_importance` of several questions after the same context, decoded as one batch: every
    decode step runs the model once for all of them and reads the context's keys and values once (the
    context is shared, each row holds only its question and answer); a question leaves the batch once
    answered (its end-of-sequence token or ``k_max`` tokens). The same importances and answers as one
    question at a time."""
    if aggregate not in AGGREGATES:
        raise ConfigurationError(f"aggregate must be one of {', '.join(AGGREGATES)}, got {aggregate!r}.")
    if k_max < 1:
        raise ConfigurationError(f"k_max must be at least 1, got {k_max}.")
    if not questions:
        return []
    for question_ids in questions:
        _check_question(question_ids)
    device = model.device
    t, b = state.context_len, len(questions)
    lengths = torch.tensor([q.shape[1] for q in questions], device=device)
    width = int(lengths.max())
    slots = torch.arange(width, device=device)
    padding = slots[None, :] < (width - lengths)[:, None]  # questions end together: padded on the left
    ids = torch.zeros((b, width), dtype=torch.long, device=device)
    for row, question_ids in enumerate(questions):
        ids[row, width - question_ids.shape[1] :] = question_ids[0].to(device)
    positions = t + slots[None, :] - (width - lengths)[:, None]
    positions = positions.masked_fill(padding, -1)
    eos = set(np.atleast_1d(eos_token_id).tolist()) if eos_token_id is not None else set()
    rows = _Rows(
        # in float32 once for the batch, not once a step
        context=[
            (cast(torch.Tensor, layer.keys)[0].float(), cast(torch.Tensor, layer.values)[0].float())
            for layer in cast(list[DynamicLayer], state.cache.layers)
        ],
        context_len=t,
        query_pos=positions,
        key_pos=positions,
        before=torch.full((b,), t, device=device),
        recording=torch.ones(b, dtype=torch.bool, device=device),
    )
    rec = _Recorder(
        context_len=t, value_norms=state.value_norms, aggregate=aggregate, sliding=sliding, rows=rows
    )
    cache = DynamicCache()
    cache.layers = [_RowsLayer(t) for _ in state.cache.layers]
    answers: list[list[int]] = [[] for _ in range(b)]
    finished: dict[int, dict[int, torch.Tensor]] = {}  # question -> layer -> its final importance [H_kv, T]
    active = list(range(b))  # the question each row of the batch decodes
    passed = {cache_kwarg(model): cache}
    with _recording(model, rec), torch.inference_mode():
        while active:
            logits = model(
                input_ids=ids,
                position_ids=rows.query_pos.clamp_min(0),
                attention_mask=torch.ones(
                    (len(active), t + rows.key_pos.shape[1]), dtype=torch.long, device=device
                ),
                use_cache=True,
                logits_to_keep=1,
                **passed,
            ).logits
            tokens = logits[:, -1].argmax(dim=-1)
            for row, token in enumerate(tokens.tolist()):
                answers[active[row]].append(token)
                if token in eos or len(answers[active[row]]) == k_max:
                    rows.recording[row] = False
            ids = tokens[:, None]
            rows.before = rows.query_pos[:, -1] + 1
            rows.query_pos = rows.before[:, None]
            rows.key_pos = torch.cat([rows.key_pos, rows.query_pos], dim=1)
            if not bool(rows.recording.all()):  # answered questions leave the batch, their importances final
                for row in (~rows.recording).nonzero()[:, 0].tolist():
                    # (copies: the batch's tensor goes when the rows left are taken out of it)
                    finished[active[row]] = {
                        layer: part[row].clone() for layer, part in rec.importance.items()
                    }
                keep = rows.recording.nonzero()[:, 0]
                active = [active[row] for row in keep.tolist()]
                ids = ids[keep]
                rows.before, rows.query_pos, rows.key_pos = (
                    rows.before[keep],
                    rows.query_pos[keep],
                    rows.key_pos[keep],
                )
                rows.recording = rows.recording[keep]
                rec.importance = {layer: part[keep] for layer, part in rec.importance.items()}
                for held in cast(list[_RowsLayer], cache.layers):
                    if held.keys is not None and held.values is not None:
                        held.keys, held.values = held.keys[keep], held.values[keep]
    results = []
    for question, answer in enumerate(answers):
        out = np.zeros((state.num_layers, state.num_kv_heads, t), dtype=np.float32)
        for layer, importance in finished[question].items():
            values = importance / len(answer) if aggregate == "mean" else importance
            out[layer] = values.cpu().numpy()
        results.append((out, answer))
    return results


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
    and the greedy answer tokens (:func:`oracle_importances` decodes several at once).

    Feeds the question after the context cache (never modified: see :func:`prefill_context`), then decodes
    greedily with a full cache: the query producing each of the ``k_max`` answer tokens is one decode step.
    Stops early at ``eos_token_id``. ``aggregate``: over the decode steps, ``"max"`` (the paper) or
    ``"mean"`` (a token read a little at many steps counts more than under the max; a sum would allocate
    the same, budgets being scale-free). ``sliding``: also record the sliding-window layers, over the
    context tokens their window holds at each step (zero elsewhere; normalised by the same ``Z_l`` over the
    whole context as a full-attention layer); otherwise their rows are zero (unless the layer still holds
    every token, a context shorter than its window).
    """
    return oracle_importances(
        model,
        state,
        [question_ids],
        k_max=k_max,
        eos_token_id=eos_token_id,
        aggregate=aggregate,
        sliding=sliding,
    )[0]
