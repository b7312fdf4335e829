"""What a fold decides (``LUKVCache(decode_max_tokens=N)``), as pure functions of one layer's held tokens.

Every ``fold_interval`` tokens after the prompt, the cache re-applies its budgets to everything a layer
holds: the ragged store's tokens and the dense suffix's real ones, per segment (batch row, KV head) in
position order (:class:`Held`). The first ``sink`` and the last ``window`` (the cache's ``decode_window``) of them are protected; the rest
are ranked by the scorer and each segment keeps its budget. Scores come from one of two places:

* **rescored** (the default for scorers that read keys, values and queries only: ``keydiff``,
  ``snapkv``, ``tova``, ``expected_attention``, ``knorm``, ``streaming``, ``random``): each segment's held
  tokens are scored again at the fold, on their own (a head's tokens differ from its neighbours' after an
  eviction), with the queries of the last decoding steps (the layer's eviction record keeps them:
  :meth:`~lukv_cache.cache.storage.record.EvictionRecord.record_queries`), so keydiff's anchor and
  snapkv's observation window are those of the current state;
* **kept** (scorers that read every KV head of a token, ``Scorer.context``: ``kvzap``): a token is scored
  once, when it leaves the dense suffix (prefill or fold), where all heads still hold it, and its score
  is stored with it in the store (``RaggedStore.scores``) and reused at every later fold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...scorers import Scorer, check_scores
from ..storage.layer import LUKVLayer
from ..storage.merge import split_sources
from ..storage.quant import PackedRows
from ..storage.ragged import gather_ragged


@dataclass(frozen=True, eq=False)
class Held:
    """What one layer holds at a fold, per segment ``g = b * H + h``, in position order: the store's
    tokens, then its pending tail's, then the suffix's real ones (never padding), in slots ``[G, M]``.

    ``source``: int64 ``[G, M]``, each slot's token as a store row (``< n_base``), a slot of the store's tail
    (``n_base +`` the slot, ``g * capacity + j``; ``< n_store``) or ``n_store +`` its flat index into the suffix
    ``[B, H, S]`` (0 past a segment's end); ``counts``: int64 ``[G]`` tokens held; ``protected``: bool
    ``[G, M]``, the segment's first ``sink`` and last ``window`` tokens; ``evictable``: the other held slots;
    ``n_base``: the store's rows (``n_store`` without a tail).
    """

    source: torch.Tensor
    counts: torch.Tensor
    protected: torch.Tensor
    evictable: torch.Tensor
    n_store: int
    n_base: int

    @property
    def width(self) -> int:
        return int(self.source.shape[1])

    @property
    def slots(self) -> torch.Tensor:
        """bool ``[G, M]``: the slots that hold a token."""
        return self.protected | self.evictable


def held_counts(layer: LUKVLayer, valid: torch.Tensor) -> torch.Tensor:
    """int64 ``[B * H]``: the tokens ``layer`` holds per segment, its store's and the suffix's real ones
    (``valid [B, S]``); :func:`held_tokens` protects ``min(count, sink + window)`` of them."""
    real = valid.sum(-1).repeat_interleave(layer.num_heads)
    stored = layer.store_counts()  # its tail's rows too, without joining them
    return real if stored is None else real + stored.to(real.device)


def held_tokens(layer: LUKVLayer, valid: torch.Tensor, sink: int, window: int) -> Held:
    """The :class:`Held` frame of ``layer`` (``valid``: bool ``[B, S]``, the suffix's real tokens), over its
    store and pending tail as they are (:meth:`~lukv_cache.cache.storage.layer.LUKVLayer.store_parts`: a fold
    never joins them first).

    The first ``sink`` held tokens of a segment are its row's first real tokens (sinks are never evicted and
    every held token is real), so a row of a padded batch protects what it protects alone.
    """
    assert layer.suffix_keys is not None  # the layer holds a forward
    b, h, s, device = layer.batch_size, layer.num_heads, layer.suffix_length, layer.suffix_keys.device
    store, tail = layer.store_parts()
    n_base = 0 if store is None else store.num_tokens
    n_store = n_base + (0 if tail is None else tail.segments * tail.capacity)
    in_base = torch.zeros(b * h, dtype=torch.long, device=device) if store is None else store.counts()
    in_store = in_base + (0 if tail is None else tail.length)
    starts = torch.zeros_like(in_base) if store is None else store.offsets[:-1]
    counts = held_counts(layer, valid)  # [G]
    width = int(counts.max()) if counts.numel() else 0
    slot = torch.arange(width, device=device).unsqueeze(0)
    # the suffix's real tokens of each row in order (padding, at the row's start, sorted after them)
    order = valid.long().argsort(dim=-1, descending=True, stable=True).repeat_interleave(h, dim=0)
    nth = (slot - in_store.unsqueeze(-1)).clamp(0, max(s - 1, 0))
    suffix = order.gather(1, nth) if s else torch.zeros_like(nth)
    segment = torch.arange(b * h, device=device).unsqueeze(-1)
    source = torch.where(
        slot < in_store.unsqueeze(-1), starts.unsqueeze(-1) + slot, n_store + segment * s + suffix
    )
    if tail is not None:  # the tail's slots of each segment, after its store rows
        in_tail = (slot >= in_base.unsqueeze(-1)) & (slot < in_store.unsqueeze(-1))
        source = torch.where(in_tail, n_base + segment * tail.capacity + slot - in_base.unsqueeze(-1), source)
    slots = slot < counts.unsqueeze(-1)
    protected = slots & ((slot < sink) | (slot >= counts.unsqueeze(-1) - window))
    return Held(source.masked_fill(~slots, 0), counts, protected, slots & ~protected, n_store, n_base)


def gather_held(
    held: Held,
    stored: torch.Tensor | PackedRows | None,
    suffix: torch.Tensor,
    tail: torch.Tensor | PackedRows | None = None,
) -> torch.Tensor:
    """``[G, M, ...]``: each slot's row of ``stored [N, ...]`` (the store's tensor, or its quantized rows), of
    ``tail [slots, ...]`` (the same of its pending tail, when ``held`` has one) or of ``suffix [B, H, S, ...]``
    (the suffix's; NaN for store and tail rows when ``stored`` is None); slots past a segment's end hold
    arbitrary values (nothing reads them: :func:`rescore` scores each segment's own tokens, :func:`masked_held`
    masks them)."""
    if held.n_store != held.n_base and stored is not None and tail is None:
        raise RuntimeError("gather_held: the frame holds a store's tail; pass the tail's rows too.")
    source = held.source.flatten()
    suffix_slots, in_suffix, tail_slots, tail_rows = split_sources(source, held.n_base, held.n_store)
    rows = gather_ragged(suffix, in_suffix)
    if not held.n_store:
        return rows.view(*held.source.shape, *suffix.shape[3:])
    shape = (source.shape[0], *rows.shape[1:])
    base_slots = ((source < held.n_base) & held.slots.flatten()).nonzero().flatten()  # held store rows
    if stored is None:  # a store without this tensor (scores never kept): NaN, ranked lowest
        out = rows.new_full(shape, float("nan"))
    elif base_slots.shape[0] == held.n_base:  # every store row, in order (a fold holds its whole store): one
        # dequantized block, each row copied to its slot (the slots past a segment's end are left as they are)
        whole = stored.dequantize() if isinstance(stored, PackedRows) else stored
        out = rows.new_empty(shape).index_copy_(0, base_slots, whole.to(rows.dtype))
    else:  # a quantized store's rows come back dequantized (PackedRows.rows); other slots' placeholder: any
        index = source.clamp_max(held.n_base - 1)
        out = (stored.rows(index) if isinstance(stored, PackedRows) else stored.index_select(0, index)).to(
            rows.dtype
        )
    if stored is not None and tail is not None and tail_slots is not None and tail_rows is not None:
        picked = tail.rows(tail_rows) if isinstance(tail, PackedRows) else tail.index_select(0, tail_rows)
        out.index_copy_(0, tail_slots, picked.to(rows.dtype))
    return out.index_copy_(0, suffix_slots, rows).view(*held.source.shape, *suffix.shape[3:])


def masked_held(scores: torch.Tensor, held: Held) -> torch.Tensor:
    """``scores [G, M]`` with ``-inf`` on every slot that is not evictable; a score that is not finite
    becomes the largest or lowest finite one, as for a prefill (``masked_scores``)."""
    finfo = torch.finfo(torch.float32)
    scores = scores.nan_to_num(nan=finfo.min, posinf=finfo.max, neginf=finfo.min)
    return scores.masked_fill(~held.evictable, float("-inf"))


def rescore(
    scorer: Scorer,
    held: Held,
    keys: torch.Tensor,
    values: torch.Tensor | None,
    queries: torch.Tensor | None,
    num_heads: int,
) -> torch.Tensor:
    """fp32 ``[G, M]``: each segment's held tokens scored on their own (``keys``/``values [G, M, D]`` from
    :func:`gather_held`, ``values`` None for a scorer that does not read them; ``queries [B, H_q, W, D]``, the
    last decoding steps', or ``None``), ``-inf`` past a segment's end. Segments holding as many tokens are
    scored in one call, each as a batch row."""
    g, width = held.source.shape
    if queries is not None and scorer.n_queries:
        queries = queries[:, :, -scorer.n_queries :]
    counts = held.counts.unique().tolist()
    if counts == [width] and width:  # every segment holds as many tokens: one call on views, no copies
        q = None
        if queries is not None and scorer.n_queries:
            q = queries.reshape(g, queries.shape[1] // num_heads, *queries.shape[2:])
        v = None if values is None else values.unsqueeze(1)
        return check_scores(scorer, scorer(keys.unsqueeze(1), v, q), (g, 1, width))[:, 0]
    scores = torch.full(held.source.shape, float("-inf"), dtype=torch.float32, device=keys.device)
    for n in counts:
        if n == 0:
            continue
        segs = (held.counts == n).nonzero().flatten()
        q = None
        if queries is not None and scorer.n_queries:
            group = queries.shape[1] // num_heads
            q = queries.view(queries.shape[0], num_heads, group, *queries.shape[2:])
            q = q[segs // num_heads, segs % num_heads]  # [K, group, W, D]: each segment's query heads
        k = keys[segs, :n].unsqueeze(1)
        v = None if values is None else values[segs, :n].unsqueeze(1)
        part = check_scores(scorer, scorer(k, v, q), (segs.numel(), 1, n))
        scores[segs, :n] = part[:, 0]
    return scores
