"""KVzip (Kim et al., arXiv 2505.23416): score the context by how much the model reads each token while it
is asked to repeat the context.

After the context's prefill, the model is fed, chunk by chunk, "Repeat the previous context exactly."
(later chunks: "Repeat the part of the previous context exactly, starting with" + the previous chunk's last
8 tokens), then the chat template's assistant turn (or a newline without one), then the chunk itself,
teacher-forced, through the full context cache. A context token's score is the largest attention any
reconstruction query of its GQA group pays it. As in the authors' code and kvpress, the softmax runs over
the sinks, the chunk's own context tokens and the reconstruction tokens (causal among themselves).

This module owns the method: the prompt (:class:`RepeatPrompt`), and :class:`Reconstruction`, the strategy a
reconstruction scorer carries (``Scorer.reconstruction``): which tokens each round of passes feeds
(:meth:`Reconstruction.rounds`) and how a round's attention scores the context (:meth:`Reconstruction.score`).
:meth:`lukv_cache.LUKVCache.prefill` runs the model through the rounds, holding the context meanwhile, and
evicts by the scores; it knows nothing of chunks, prompts or value norms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from .._ops import flash_attention_cpu as _flash_cpu
from ..errors import ConfigurationError

REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
PLAIN_SUFFIX = "\n"
TEMPLATES = ("auto", "chat", "plain")


@dataclass(frozen=True)
class RepeatPrompt:
    """Token ids around each reconstruction chunk: ``first`` before the first chunk, ``next`` (then the
    previous chunk's last ``overlap`` tokens) before later ones, ``suffix`` right before the chunk.

    >>> prompt = RepeatPrompt((5, 6), (7,), (8,))
    >>> [ids for _, ids in prompt.chunks([1, 2, 3, 4, 5], chunk_size=3, overlap=1)]
    [[5, 6, 8, 1, 2, 3], [7, 3, 8, 4, 5]]
    """

    first: tuple[int, ...]
    next: tuple[int, ...]
    suffix: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("first", "next", "suffix"):
            ids = getattr(self, name)
            try:
                ids = tuple(ids)
            except TypeError:
                ids = (ids,)
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise ConfigurationError(
                    f"RepeatPrompt.{name} must be token ids (non-negative integers), got {getattr(self, name)!r:.80}; "
                    "build it with RepeatPrompt.from_tokenizer(tokenizer)."
                )
            object.__setattr__(self, name, ids)

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raise :class:`ConfigurationError` when an id is outside the model's vocabulary ``[0, vocab_size)``
        (a prompt written with another model's tokenizer): the embedding lookup would fail mid-prefill."""
        outside = sorted({i for i in (*self.first, *self.next, *self.suffix) if i >= vocab_size})
        if outside:
            raise ConfigurationError(
                f"The repeat prompt has token ids {outside[:5]} outside the model's vocabulary of {vocab_size}: "
                "build it with the model's own tokenizer (RepeatPrompt.from_tokenizer), or pass tokenizer=."
            )

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, template: str = "auto") -> RepeatPrompt:
        """The prompt in ``tokenizer``'s words. ``template``: ``"auto"`` (the chat template's assistant turn
        when the tokenizer has a chat template, else a newline, as KVzip does), ``"chat"`` or ``"plain"``."""
        if template not in TEMPLATES:
            raise ConfigurationError(f"template must be one of {', '.join(TEMPLATES)}, got {template!r}.")
        if not callable(getattr(tokenizer, "encode", None)):
            raise ConfigurationError(
                f"KVzip needs a tokenizer with encode() to write its repeat prompt, got {type(tokenizer).__name__}."
            )

        def encode(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        has_chat = bool(getattr(tokenizer, "chat_template", None))
        if template == "chat" and not has_chat:
            raise ConfigurationError(
                "template='chat' but the tokenizer has no chat template; use 'plain' or 'auto'."
            )
        suffix = PLAIN_SUFFIX
        if template == "chat" or (template == "auto" and has_chat):
            suffix = _assistant_turn(tokenizer)
        return cls(encode(REPEAT_FIRST), encode(REPEAT_NEXT), encode(suffix))

    def chunks(
        self, context_ids: Sequence[int], chunk_size: int = 2048, overlap: int = 8
    ) -> list[tuple[tuple[int, int], list[int]]]:
        """``[((start, end), reconstruction ids), ...]``: each chunk of ``context_ids`` and its prompt."""
        if chunk_size < 1:
            raise ConfigurationError(f"chunk_size must be a positive number of tokens, got {chunk_size}.")
        ids = list(context_ids)
        out = []
        for start in range(0, len(ids), chunk_size):
            end = min(start + chunk_size, len(ids))
            head = list(self.first) if start == 0 else list(self.next) + ids[max(0, start - overlap) : start]
            out.append(((start, end), head + list(self.suffix) + ids[start:end]))
        return out


def _assistant_turn(tokenizer: Any) -> str:
    """The chat template's text between the end of a user message and the assistant's answer."""
    marker = "\n" + "#" * 16
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "lukv" + marker}], add_generation_prompt=True, tokenize=False
        )
    except Exception as err:  # the template is the model's code (jinja): any failure means it cannot be used
        raise ConfigurationError(
            f"The tokenizer's chat template failed to render the repeat prompt ({type(err).__name__}: {err}); "
            "use template='plain' (kvzip_scorer(template='plain')) or pass repeat_prompt=RepeatPrompt(...)."
        ) from err
    if marker not in rendered:
        raise ConfigurationError(
            "The tokenizer's chat template does not keep the user's message; use template='plain' or pass "
            "repeat_prompt=RepeatPrompt(...)."
        )
    return rendered.split(marker, 1)[1]


def chunk_scores(
    query: torch.Tensor,
    keys: torch.Tensor,
    chunk: tuple[int, int],
    sinks: torch.Tensor,
    recon_valid: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    value_weight: torch.Tensor | None = None,
    block: int = 256,
) -> torch.Tensor:
    """One row's KVzip scores for one chunk: fp32 ``[H_kv, end - start]``.

    ``query``: ``[H_q, R, D]``, the reconstruction queries (the last ``R`` positions of ``keys``);
    ``keys``: ``[H_kv, S, D]``, the layer's keys (context, then the ``R`` reconstruction tokens);
    ``chunk``: the chunk's positions in ``keys``; ``sinks``: int64 positions always in the softmax;
    ``recon_valid``: bool ``[R]``, False on padding; ``value_weight``: optional ``[H_q, end - start]``
    multiplying each attention weight (KVzip+'s ``||v W_O||``). Query rows go in blocks (exact: the
    softmax runs over keys), so no ``[H_q, R, S]`` tensor is ever built.
    """
    hq, r, d = query.shape
    h = keys.shape[0]
    g = hq // h
    start, end = chunk
    s = keys.shape[1]
    index = torch.cat([sinks.to(keys.device), torch.arange(start, end, device=keys.device)])
    index = torch.cat([index, torch.arange(s - r, s, device=keys.device)])
    sub = keys.index_select(1, index).float()  # [H, n_sink + C + R, D]
    n_before = index.numel() - r
    recon_pos = torch.arange(r, device=keys.device)
    best = torch.zeros(h, end - start, dtype=torch.float32, device=keys.device)
    q = query.float().view(h, g, r, d)
    chunk_keys = sub[:, sinks.numel() : n_before]  # [H, C, D]
    fused = _flash_cpu is not None and softcap is None and keys.device.type == "cpu"
    for lo in range(0, r, block):
        hi = min(lo + block, r)
        rows = recon_valid[lo:hi]
        if not bool(rows.any()):
            continue
        # causal among the reconstruction tokens, padding never read
        allowed = (recon_pos[None, :] <= recon_pos[lo:hi, None]) & recon_valid[None, :]
        mask = torch.cat(
            [torch.ones(hi - lo, n_before, dtype=torch.bool, device=keys.device), allowed], dim=1
        )
        qb = q[:, :, lo:hi]
        if fused:
            # the softmax's normaliser from the fused kernel (no [q, keys] tensor); probabilities only
            # for the chunk's own tokens: exp(logit - logsumexp)
            bias = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf"))
            rows_q = qb.reshape(1, h, g * (hi - lo), d)
            lse = cast("Callable[..., Any]", _flash_cpu)(  # fused: the operator exists
                rows_q,
                sub[None],
                sub[None],
                0.0,
                False,
                attn_mask=bias.repeat(g, 1)[None, None],
                scale=scaling,
            )[1]
            logits = torch.einsum("hgqd,hkd->hgqk", qb, chunk_keys) * scaling
            part = (logits - lse.view(h, g, hi - lo, 1)).exp_()
        else:
            logits = torch.einsum("hgqd,hkd->hgqk", qb, sub) * scaling
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            probs = logits.masked_fill(~mask, float("-inf")).softmax(-1)
            part = probs[..., sinks.numel() : n_before]  # [H, G, q, C]: the chunk's context tokens
        if value_weight is not None:
            part = part * value_weight.view(h, g, 1, -1)
        part = part.masked_fill(~rows.view(1, 1, -1, 1), 0.0)
        best = torch.maximum(best, part.amax(dim=(1, 2)))
    return best


def value_norms(module: torch.nn.Module, values: torch.Tensor) -> torch.Tensor | None:
    """``||v_j W_O[q]||`` for every query head ``q`` and token ``j`` of ``values [H_kv, T, D]``, divided by
    its mean over the tokens (so layers and heads compare): ``[H_q, T]``, or None without ``o_proj``."""
    o_proj = getattr(module, "o_proj", None)
    if o_proj is None or not hasattr(o_proj, "weight"):
        return None
    v = values.float()
    h, _, d = v.shape
    w = o_proj.weight
    if hasattr(w, "to_local"):  # tensor parallelism: o_proj is rowwise, its local columns are our heads
        w = w.to_local()
    w = w.float()  # [hidden, H_q * D]
    hq = w.shape[1] // d
    w = w.view(w.shape[0], hq, d).transpose(0, 1)  # [H_q, hidden, D]
    gram = w.transpose(1, 2) @ w  # ||W v||^2 = v^T (W^T W) v
    v = v.repeat_interleave(hq // h, dim=0)  # [H_q, T, D]
    norms = ((v @ gram) * v).sum(-1).clamp_min(0).sqrt()
    return norms / norms.mean(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


@dataclass(eq=False)
class ReconstructionRound:
    """One forward of reconstruction tokens: ``input_ids``/``mask``/``position_ids`` ``[B, R]``, and per row
    the chunk it scores (positions in the layer's dense tokens, or None) and the sink positions always in
    its softmax. ``scores`` (layer -> ``[B, H_kv, T]``): where the cache collects the round's scores."""

    input_ids: torch.Tensor
    mask: torch.Tensor
    position_ids: torch.Tensor
    chunks: list[tuple[int, int] | None]
    sinks: list[torch.Tensor]
    scores: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])


def _plan_rounds(
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    prompt: RepeatPrompt,
    chunk_size: int,
    overlap: int,
    sink: int,
) -> Iterator[ReconstructionRound]:
    """The rounds that reconstruct every row of the context ``input_ids [B, T]`` (``mask``: left padding).

    Round ``k`` feeds every row its ``k``-th chunk (rows with fewer chunks feed only padding), right after the
    row's own context and padded on the right to one length, at the positions that follow the row's own
    context, so each row scores exactly as it would alone (a sliding-window layer sees the same keys too).
    """
    b, t = input_ids.shape
    device = input_ids.device
    lengths = mask.long().sum(-1).tolist()
    pads = [t - n for n in lengths]
    per_row = [prompt.chunks(input_ids[row, pads[row] :].tolist(), chunk_size, overlap) for row in range(b)]
    for k in range(max((len(chunks) for chunks in per_row), default=0)):
        seqs = [chunks[k][1] if k < len(chunks) else [] for chunks in per_row]
        r = max(len(seq) for seq in seqs)
        ids = torch.zeros(b, r, dtype=input_ids.dtype, device=device)
        valid = torch.zeros(b, r, dtype=torch.bool, device=device)
        bounds: list[tuple[int, int] | None] = []
        sinks = []
        for row, seq in enumerate(seqs):
            if seq:
                ids[row, : len(seq)] = torch.tensor(seq, dtype=input_ids.dtype, device=device)
                valid[row, : len(seq)] = True
                start, end = per_row[row][k][0]
                bounds.append((pads[row] + start, pads[row] + end))
            else:
                bounds.append(None)
                start = 0
            # sinks: the row's first real tokens, when the chunk does not already hold them
            n_sinks = min(sink, start)
            sinks.append(torch.arange(pads[row], pads[row] + n_sinks, device=device))
        positions = torch.tensor(lengths, device=device).view(b, 1) + (valid.long().cumsum(-1) - 1).clamp_min(
            0
        )
        yield ReconstructionRound(ids, valid, positions, bounds, sinks)


@dataclass(frozen=True)
class Reconstruction:
    """How a reconstruction scorer runs (KVzip): chunks of at most ``chunk_size`` context tokens, each
    prompted with the previous chunk's last ``overlap`` tokens; ``template``: ``"auto"`` (the chat template
    when the tokenizer has one), ``"chat"`` or ``"plain"``; ``weighted``: multiply each attention weight by
    ``||v W_O||`` (KVzip+).

    The cache calls three methods, and a second reconstruction method is a class with the same three:
    :meth:`repeat_prompt` (the prompt from a tokenizer), :meth:`rounds` (the passes to run) and
    :meth:`score` (called by each compressed layer's attention during a pass).
    """

    chunk_size: int = 2048
    overlap: int = 8
    template: str = "auto"
    weighted: bool = False

    def repeat_prompt(self, tokenizer: Any) -> RepeatPrompt:
        """The prompt around each chunk, in the words of ``tokenizer`` (its chat template per ``template``)."""
        return RepeatPrompt.from_tokenizer(tokenizer, self.template)

    def rounds(
        self, input_ids: torch.Tensor, mask: torch.Tensor, prompt: RepeatPrompt, sink: int
    ) -> Iterator[ReconstructionRound]:
        """The passes that score every row of the context ``input_ids [B, T]`` (``mask``: left padding), the
        first ``sink`` tokens of each row always in the softmax; each round's ``scores`` is the cache's."""
        return _plan_rounds(input_ids, mask, prompt, self.chunk_size, self.overlap, sink)

    def score(
        self,
        round_: ReconstructionRound,
        scores: torch.Tensor,
        module: torch.nn.Module,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        scaling: float,
        softcap: float | None,
    ) -> None:
        """Write one layer's scores of this round into ``scores`` ``[B, H_kv, T]``: ``query`` ``[B, H_q, R, D]``
        (the round's tokens), ``keys`` / ``values`` ``[B, H_kv, S, D]`` (the layer's tokens: the context, then
        the round's ``R``), ``module`` the attention (its ``o_proj`` weighs values when ``weighted``)."""
        for row, bounds in enumerate(round_.chunks):
            if bounds is None:
                continue
            start, end = bounds
            weight = value_norms(module, values[row, :, start:end]) if self.weighted else None
            scores[row, :, start:end] = chunk_scores(
                query[row],
                keys[row],
                bounds,
                round_.sinks[row],
                round_.mask[row],
                scaling=scaling,
                softcap=softcap,
                value_weight=weight,
            )
