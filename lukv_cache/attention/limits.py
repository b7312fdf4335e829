"""The tuning limits of the attention paths: one frozen :class:`AttentionLimits`, today's defaults in
:data:`LIMITS`.

Every function that reads a limit takes ``limits=`` (``None``: :data:`LIMITS`, read at call time), so a
caller that wants others passes them (``compressed_attention(..., limits=replace(LIMITS, tile_rows=128))``)
and a test or benchmark that wants them for a whole model patches :data:`LIMITS` for a while
(``monkeypatch.setattr(limits, "LIMITS", replace(limits.LIMITS, masked_limit=0))``).

>>> from dataclasses import replace
>>> LIMITS.tile_rows, replace(LIMITS, tile_rows=128).tile_rows
(256, 128)
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import ConfigurationError


@dataclass(frozen=True)
class AttentionLimits:
    """Where one attention path hands over to another, and the block sizes of the kernels.

    * ``masked_limit``: the masked product of :mod:`.masked` serves ragged segments while ``segments x
      stored rows`` stays at most this (``benchmarks/cache_bench.py --layer``);
    * ``masked_equal_limit``: ... and equal segments while the stored rows stay at most this (measured up
      to 157k, all faster than the tiles);
    * ``tile_rows``: rows per tile of :mod:`.tiles` (``benchmarks/cache_bench.py``; 128-512 measure alike);
    * ``block_rows``: rows of a quantized store dequantized at a time (8 MiB per tensor at fp32, head_dim
      64), :mod:`.compressed`; each block more costs a decode step more than its rows: 16384 decoded a 4k
      batch of 4 at ratio 0.8 (9,876 rows) in one block, 1.19x the fp32 store's ms/token at 8 bits where
      4096 took 1.62x, and ``memory=0.1``'s 16,860 rows of the same prompts (8 bits) in two, 121 ms/token,
      where 32768 takes one, 97 ms (``benchmarks/quantized_cost.py``; a quick timing of 16 steps, not committed);
    * ``triton_block_n``: keys per inner step of the Triton kernel (:mod:`._triton_ragged`);
    * ``triton_min_chunk``: the fewest keys a split is given (below that, launch overhead dominates);
    * ``triton_max_splits``: the most splits per segment.
    """

    masked_limit: int = 16384
    masked_equal_limit: int = 262144
    tile_rows: int = 256
    block_rows: int = 32768
    triton_block_n: int = 64
    triton_min_chunk: int = 4 * 64
    triton_max_splits: int = 128

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            least = 0 if field.name.startswith("masked") else 1  # 0: the masked product serves nothing
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigurationError(
                    f"AttentionLimits.{field.name} must be an integer >= {least}, got {value!r}."
                )


LIMITS = AttentionLimits()


def resolve_limits(limits: AttentionLimits | None) -> AttentionLimits:
    """``limits``, or :data:`LIMITS` as it is now (so a patched default is seen)."""
    return LIMITS if limits is None else limits
