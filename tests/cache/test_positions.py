"""A store's positions are int16 while they fit (below 32768) and widen to int32 when a later token's
position passes, with the same values: 2 bytes per stored token instead of 4 for any prompt below 32k."""

from __future__ import annotations

import torch

from lukv_cache.cache.storage.merge import absorb, rebuild


def _block(length: int) -> torch.Tensor:
    return torch.arange(length * 4, dtype=torch.float32).view(1, 1, length, 4)


def test_positions_are_int16_below_32768_and_widen_past_it():
    block = _block(10)
    keep = torch.ones(1, 1, 10, dtype=torch.bool)
    store = absorb(None, block, block, keep, start=32_700)  # the last position is 32,709
    assert store.positions.dtype == torch.int16
    store = absorb(store, block, block, keep, start=32_760)  # up to 32,769: past int16
    assert store.positions.dtype == torch.int32
    assert store.positions.tolist() == [*range(32_700, 32_710), *range(32_760, 32_770)]
    far = absorb(None, block, block, keep, start=40_000)
    assert far.positions.dtype == torch.int32 and far.positions.tolist() == list(range(40_000, 40_010))


def test_a_rebuild_past_the_limit_keeps_every_position():
    block = _block(10)
    store = absorb(None, block, block, torch.ones(1, 1, 10, dtype=torch.bool), start=32_750)
    assert store.positions.dtype == torch.int16
    # keep the store's 10 rows and a 30-token suffix's last 5 (positions 32,785 ... 32,789)
    source = torch.cat([torch.arange(10), 10 + torch.arange(25, 30)])
    rebuilt = rebuild(store, _block(30), _block(30), 32_760, source, torch.tensor([15]), None, None)
    assert rebuilt.positions.dtype == torch.int32
    assert rebuilt.positions.tolist() == [*range(32_750, 32_760), *range(32_785, 32_790)]
