"""Reading a layer's tokens back from its ragged store and dense suffix: the logical ``[B, H, T, D]``
content a ``DynamicLayer`` would hold (:func:`logical_content`, when the layer has one) and one (row, KV
head)'s tokens (:func:`head_tokens`, always). Never on the forward path: attention reads the store and
the suffix as they are."""

from __future__ import annotations

import torch

from ...errors import RaggedCacheError
from .ragged import RaggedStore


def logical_content(
    store: RaggedStore | None, suffix: torch.Tensor, length: int, *, values: bool
) -> torch.Tensor:
    """The logical ``[B, H, T, D]`` keys (or ``values``) of a layer of ``length`` (T) tokens: store tokens
    at their positions, the suffix ``[B, H, S, D]`` in the last S columns, zeros before each row's first
    held token (left padding); :class:`~lukv_cache.errors.RaggedCacheError` when the heads of a row hold
    different tokens or some were evicted after the row's first.

    >>> logical_content(None, torch.ones(1, 1, 2, 1), 3, values=False).flatten().tolist()
    [0.0, 1.0, 1.0]
    """
    b, h, s, d = suffix.shape
    t = length
    if store is None and s == t:
        return suffix
    out = suffix.new_zeros((b, h, t, d))
    out[:, :, t - s :] = suffix
    if store is None or store.num_tokens == 0:
        return out
    counts = store.counts().view(b, h).cpu()
    flat = store.dense()[1 if values else 0].to(out.device)
    for row in range(b):
        held = counts[row]
        a, n = store.offsets_list[row * h], int(held[0])
        if bool((held != n).any()):
            _ragged(f"KV heads hold different numbers of tokens (row {row}: {held.tolist()} per head)")
        if n == 0:
            continue
        pos = store.positions[a : a + n * h].view(h, n).long()
        if not bool((pos == pos[:1]).all()):
            _ragged(f"KV heads hold different tokens (row {row})")
        first = int(pos[0, 0])
        if first + n != t - s or int(pos[0, -1]) != t - s - 1:
            _ragged(
                f"row {row} holds {n + s} of its tokens from position {first} on, out of {t - first}: the "
                "others were evicted"
            )
        out[row, :, first : t - s] = flat[a : a + n * h].view(h, n, d)
    return out


def head_tokens(
    store: RaggedStore | None,
    suffix_keys: torch.Tensor,
    suffix_values: torch.Tensor,
    length: int,
    row: int,
    head: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What KV head ``head`` of batch row ``row`` holds, oldest first: int64 positions ``[n]``, keys
    ``[n, D]`` and values ``[n, D]`` (store, then the suffix ``[B, H, S, D]``, the last S of ``length``)."""
    s, device = suffix_keys.shape[-2], suffix_keys.device
    suffix_pos = torch.arange(length - s, length, device=device)
    if store is None:
        return suffix_pos, suffix_keys[row, head], suffix_values[row, head]
    seg = row * suffix_keys.shape[1] + head
    a, b = store.offsets_list[seg], store.offsets_list[seg + 1]
    positions = torch.cat([store.positions[a:b].long().to(device), suffix_pos])
    stored_k, stored_v = store.dense(a, b)
    keys = torch.cat([stored_k.to(device), suffix_keys[row, head]])
    values = torch.cat([stored_v.to(device), suffix_values[row, head]])
    return positions, keys, values


def _ragged(why: str) -> None:
    raise RaggedCacheError(
        f"This LUKVCache layer has no dense [batch, kv_heads, tokens, head_dim] keys/values: {why}. "
        "layer.keys / layer.values and iterating the cache (what DynamicCache readers do) give the logical "
        "content only while every KV head of a row holds the same tokens, with none missing after the "
        "row's first (e.g. at ratio 0). Read a compressed layer as it is stored: "
        "layer.head_tokens(row, head) gives one (row, KV head)'s positions, keys and values; layer.store is "
        "the ragged store (store.keys / store.values [N, head_dim], every kept token of every (row, KV head) "
        "back to back, segment row * kv_heads + head at store.offsets[s]:store.offsets[s + 1], "
        "store.positions their original positions) and layer.suffix_keys / layer.suffix_values "
        "[batch, kv_heads, S, head_dim] the dense suffix, the layer's last S positions in every head; "
        "cache.stored_tokens() counts the tokens per (layer, row, KV head)."
    )
