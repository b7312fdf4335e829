"""How dense tokens enter a layer's ragged store: each function takes the store (or ``None``) and dense
``[B, H, R, D]`` tokens and returns the new :class:`~lukv_cache.cache.storage.ragged.RaggedStore`.

* :func:`absorb`: eviction and plain folds merge the kept tokens of a dense block into the store, segment
  by segment after what it holds (:func:`append`: all of them);
* :func:`rebuild`: eviction at fold time builds a new store from a selection of the old store's rows and
  the suffix's tokens (a quantized store's rows are moved as codes, never quantized again).
"""

from __future__ import annotations

from typing import cast

import torch

from .ragged import RaggedStore, flat_index_from_mask, gather_into_slots, gather_ragged, position_dtype
from .tail import StoreTail


def absorb(
    store: RaggedStore | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    keep: torch.Tensor,
    start: int,
    scores: torch.Tensor | None = None,
    kv_bits: int | None = None,
) -> RaggedStore:
    """``store`` with the kept tokens (``keep [B, H, R]``) of ``keys`` / ``values`` ``[B, H, R, D]``, a dense
    block starting at logical position ``start``, merged segment by segment (``scores [B, H, R]`` with them,
    if given); a new store in ``kv_bits`` when there was none.

    >>> block = torch.arange(8.).view(1, 2, 2, 2)
    >>> store = absorb(None, block, block, torch.tensor([[[True, False], [True, True]]]), start=5)
    >>> store.positions.tolist(), store.counts().tolist()
    ([5, 5, 6], [1, 2])
    """
    b, h, r = keep.shape
    counts = keep.sum(-1).flatten()
    flat = flat_index_from_mask(keep)  # segment-major, positions ascending: the store layout
    # gather straight from [B, H, R, D] (often a strided view): no copy of the whole block
    new_k, new_v = gather_ragged(keys, flat), gather_ragged(values, flat)
    last = start + r - 1  # no kept position is above it
    new_pos = (flat % r + start).to(position_dtype(last))
    new_s = None if scores is None else scores.reshape(-1)[flat.to(scores.device)].to(new_k.device)
    if store is None:
        return RaggedStore.build(
            new_k, new_v, new_pos, counts, num_heads=h, scores=new_s, kv_bits=kv_bits, last=last
        )
    return store.extend(new_k, new_v, new_pos, counts, new_s, last=last)


def append(
    store: RaggedStore | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    kv_bits: int | None = None,
    scores: torch.Tensor | None = None,
) -> RaggedStore:
    """``store`` with every token of ``keys`` / ``values`` ``[B, H, S, D]`` (a dense block starting at logical
    position ``start``) after each segment's rows: :func:`absorb` with nothing left out, without its masks and
    gathers (a fold that evicts nothing, every few decoding steps of every layer). ``scores [B, H, S]``: stored
    with them (or ``None``).

    >>> block = torch.arange(8.).view(1, 2, 2, 2)
    >>> store = append(None, block, block, start=5)
    >>> store.positions.tolist(), store.counts().tolist()
    ([5, 6, 5, 6], [2, 2])
    """
    b, h, s = keys.shape[:3]
    segments = b * h
    last = start + s - 1
    new_k, new_v = keys.reshape(segments * s, -1), values.reshape(segments * s, -1)
    positions = torch.arange(start, start + s, device=new_k.device).to(position_dtype(last)).repeat(segments)
    counts = torch.full((segments,), s, dtype=torch.long, device=new_k.device)
    new_s = None if scores is None else scores.reshape(-1).to(new_k.device)
    if store is None:  # its own rows: a reshape of a whole buffer is a view of it (the suffix reuses it)
        if kv_bits is None:
            new_k, new_v = new_k.clone(), new_v.clone()
        return RaggedStore.build(
            new_k, new_v, positions, counts, num_heads=h, scores=new_s, kv_bits=kv_bits, last=last
        )
    return store.extend(new_k, new_v, positions, counts, new_s, last=last)  # a merge: new tensors


def split_sources(
    source: torch.Tensor, n_base: int, n_store: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Where the tokens of ``source`` come from, numbered as :func:`rebuild` reads them (rows ``< n_base`` of the
    store, ``n_base +`` a slot of its tail below ``n_store``, ``n_store +`` a flat index into the suffix
    ``[B, H, S]``): the positions in ``source`` of the suffix's tokens and their flat indices, then of the tail's
    and their slots (``None`` without a tail, ``n_store == n_base``).

    >>> split_sources(torch.tensor([0, 5, 3, 7]), n_base=3, n_store=6)
    (tensor([3]), tensor([1]), tensor([1, 2]), tensor([2, 0]))
    """
    from_suffix = source >= n_store
    suffix_slots = from_suffix.nonzero().flatten()
    suffix_index = source[suffix_slots] - n_store
    if n_store == n_base:
        return suffix_slots, suffix_index, None, None
    tail_slots = ((source >= n_base) & ~from_suffix).nonzero().flatten()
    return suffix_slots, suffix_index, tail_slots, source[tail_slots] - n_base


def rebuild(
    store: RaggedStore | None,
    suffix_keys: torch.Tensor,
    suffix_values: torch.Tensor,
    start: int,
    source: torch.Tensor,
    counts: torch.Tensor,
    scores: torch.Tensor | None,
    kv_bits: int | None,
    tail: StoreTail | None = None,
) -> RaggedStore:
    """A new store of the tokens ``source`` picks: int64 ``[K]`` in store layout (segment-major, positions
    ascending), each a row of ``store`` (``< N``), a slot of its pending ``tail`` (``N +`` the slot, ``s *
    capacity + j``; never joined first) or a token of the suffix ``[B, H, S, D]`` (``N + tail slots +`` its flat
    index into ``[B, H, S]``), whose first token is at logical position ``start``; ``counts [B * H]``: kept
    tokens per segment; ``scores [K]``: stored with them (or ``None``)."""
    n = 0 if store is None else store.num_tokens
    slots = 0 if tail is None else tail.segments * tail.capacity
    s = suffix_keys.shape[-2]
    suffix_slots, in_suffix, tail_slots, tail_rows = split_sources(source, n, n + slots)
    last = start + max(s, 1) - 1  # no kept position is above it
    suffix_pos = (in_suffix % max(s, 1) + start).to(position_dtype(last))
    store_rows = source.clamp_max(max(n - 1, 0))  # a tail or suffix slot's placeholder: any row

    def pick(
        stored: torch.Tensor | None, from_tail: torch.Tensor | None, from_suffix: torch.Tensor
    ) -> torch.Tensor:
        if stored is None:
            return from_suffix
        if n:
            picked = gather_into_slots(stored, store_rows, from_suffix, suffix_slots)
        else:  # a store of no rows beside its tail: nothing to gather from it
            shape = (source.shape[0], *from_suffix.shape[1:])
            picked = from_suffix.new_empty(shape).index_copy_(0, suffix_slots, from_suffix)
        if tail_slots is not None and tail_rows is not None and from_tail is not None and tail_slots.numel():
            picked.index_copy_(0, tail_slots, from_tail.index_select(0, tail_rows).to(picked.dtype))
        return picked

    held = store if n or slots else None
    new_k, new_v = gather_ragged(suffix_keys, in_suffix), gather_ragged(suffix_values, in_suffix)
    if store is not None and store.kv_bits is not None:
        # the suffix's kept tokens quantized as the store's (each row on its own): the stored rows'
        # codes are moved, never quantized again
        new_k, new_v = store.quantize_like(new_k, new_v)
        if held is None:  # kept as they are: their own tensors, not views of one block
            new_k, new_v = (
                rows.with_tensors(*(t.clone() for t in rows.tensors())) for rows in (new_k, new_v)
            )
        stored_k = None if held is None else held.keys
        stored_v = None if held is None else held.values
        tail_k = _parts(None if tail is None else tail.keys)
        tail_v = _parts(None if tail is None else tail.values)
        keys = new_k.with_tensors(
            *(pick(a, t, b) for a, t, b in zip(_parts(stored_k), tail_k, new_k.tensors()))
        )
        values = new_v.with_tensors(
            *(pick(a, t, b) for a, t, b in zip(_parts(stored_v), tail_v, new_v.tensors()))
        )
    else:  # a full-precision store: its rows are tensors (it never has a tail)
        keys = pick(None if held is None else cast(torch.Tensor, held.keys), None, new_k)
        values = pick(None if held is None else cast(torch.Tensor, held.values), None, new_v)
    tail_positions = None if tail is None else tail.slot_positions()
    positions = pick(None if held is None else held.positions, tail_positions, suffix_pos)
    heads = suffix_keys.shape[1]
    return RaggedStore.build(
        keys,
        values,
        positions,
        counts.to(positions.device),
        num_heads=heads,
        scores=scores,
        kv_bits=kv_bits,
        last=last,
    )


def _parts(rows) -> tuple:
    """A quantized store's codes, scales and zeros (three ``None`` without a store)."""
    return (None, None, None) if rows is None else rows.tensors()
