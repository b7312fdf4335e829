"""The reconstruction passes of a scorer like KVzip, for a left-padded batch: which tokens each round feeds.

Round ``k`` feeds every row its ``k``-th chunk (rows with fewer chunks feed only padding), right after the
row's own context and padded on the right to one length, at the positions that follow the row's own
context, so each row scores exactly as it would alone (a sliding-window layer sees the same keys too).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..scorers.kvzip import RepeatPrompt


@dataclass(eq=False)
class ReconstructionRound:
    """One forward of reconstruction tokens: ``input_ids``/``mask``/``position_ids`` ``[B, R]``, and per row
    the chunk it scores (positions in the layer's dense tokens, or None) and the sink positions always in
    its softmax. ``scores`` (layer -> ``[B, H_kv, T]``) is filled in while the round runs."""

    input_ids: torch.Tensor
    mask: torch.Tensor
    position_ids: torch.Tensor
    chunks: list[tuple[int, int] | None]
    sinks: list[torch.Tensor]
    scores: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])


def plan_rounds(
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    prompt: RepeatPrompt,
    chunk_size: int,
    overlap: int,
    sink: int,
) -> Iterator[ReconstructionRound]:
    """The rounds that reconstruct every row of the context ``input_ids [B, T]`` (``mask``: left padding)."""
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
