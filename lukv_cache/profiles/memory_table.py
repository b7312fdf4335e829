"""A profile's measured loss at a grid of (bits, eviction ratio): which mix of fewer tokens and fewer bits
loses least for a model under a memory budget.

A budget of bytes can keep more tokens at fewer bits (``kv_bits=8`` or ``4``) or fewer tokens at the model's
precision; which loses least differs per model, so it is measured (:func:`lukv_cache.profiling.memory_table.
measure_memory_table`) and stored in the profile. :meth:`MemoryTable.choose` picks the precision of least
loss among those a budget allows.

>>> import numpy as np
>>> table = MemoryTable(
...     bits=(None, 8, 4),
...     ratios=np.array([0.5, 0.9], dtype=np.float32),
...     loss=np.array([[0.1, 0.5], [0.12, 0.3], [0.2, 0.25]], dtype=np.float32),
...     measure="continuation excess NLL, 4 contexts x 128 tokens",
... )
>>> round(table.loss_at(None, 0.7), 4), round(table.loss_at(8, 0.25), 4)
(0.3, 0.12)
>>> table.choose({None: 0.9, 8: 0.8, 4: 0.7})
4
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigurationError, ProfileFormatError

METADATA_KEY = "memory_table"  # the profile's __metadata__ entry that holds the table, as JSON
MAX_BITS = 32  # the widest stored precision a table may name (the cache quantizes to 8 or 4)
MAX_ROWS = 64  # bits values in a table
MAX_RATIOS = 1024  # ratios in a table
MAX_LAYERS = 4096  # entries of a table's layer_loss


def _precision(bits: int | None) -> float:
    """How many bits an entry keeps, for ties: ``None`` (the model's precision) beats every number."""
    return math.inf if bits is None else float(bits)


@dataclass(frozen=True, eq=False)
class MemoryTable:
    """Measured loss at each (bits, eviction ratio): ``loss[i, j]`` is the loss of a cache storing
    ``bits[i]`` bits per key/value entry (``None``: the model's precision) that evicts ``ratios[j]`` of the
    prompt.

    ``bits``: distinct values, each ``None`` or an integer in [1, 32], e.g. ``(None, 8, 4)``. ``ratios``:
    float32 ``[R]``, strictly increasing inside (0, 1). ``loss``: float32 ``[len(bits), R]``, finite (the
    excess continuation NLL against the full cache, in nats per token: it may be slightly negative).
    ``measure``: what ``loss`` is, in a few words. ``layer_loss`` (optional): float32 ``[L]``, finite, what
    each decoder layer's keys and values at 4 bits cost when every other layer's are at 8 and nothing is
    evicted (the same loss, against every layer at 8 bits): what a budget weighs when it keeps some layers
    at 8 bits and the rest at 4 (:meth:`mix_loss`); it needs rows for 8 and 4 bits. Anything else raises
    :class:`~lukv_cache.errors.ProfileFormatError`.

    >>> MemoryTable((None,), np.array([0.5], dtype=np.float32), np.zeros((2, 1)), "x")
    Traceback (most recent call last):
    ...
    lukv_cache.errors.ProfileFormatError: memory table: loss must have shape [bits=1, ratios=1], got [2, 1].
    """

    bits: tuple[int | None, ...]
    ratios: np.ndarray
    loss: np.ndarray
    measure: str = ""
    layer_loss: np.ndarray | None = None

    def __post_init__(self) -> None:
        where = "memory table"
        bits = self.bits
        if isinstance(bits, (str, bytes)) or not isinstance(bits, Sequence) or not bits:
            raise ProfileFormatError(
                f"{where}: bits must be a non-empty sequence of None and integers, got {bits!r:.80}."
            )
        if len(bits) > MAX_ROWS:
            raise ProfileFormatError(f"{where}: at most {MAX_ROWS} bits values, got {len(bits)}.")
        for value in bits:
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, (int, np.integer))
                or not 1 <= value <= MAX_BITS
            ):
                raise ProfileFormatError(
                    f"{where}: bits must be None (the model's precision) or integers in [1, {MAX_BITS}], "
                    f"got {value!r:.40}."
                )
        bits = tuple(None if b is None else int(b) for b in bits)
        if len(set(bits)) != len(bits):
            raise ProfileFormatError(f"{where}: bits must be distinct, got {list(bits)}.")
        object.__setattr__(self, "bits", bits)
        ratios, loss = _float32(self.ratios, "ratios", where), _float32(self.loss, "loss", where)
        if ratios.ndim != 1 or not 1 <= ratios.size <= MAX_RATIOS:
            raise ProfileFormatError(
                f"{where}: ratios must be a 1-D array of 1 to {MAX_RATIOS} values, got shape "
                f"{list(ratios.shape)}."
            )
        if (
            not (np.isfinite(ratios).all() and (ratios > 0).all() and (ratios < 1).all())
            or (np.diff(ratios) <= 0).any()
        ):
            shown = np.round(ratios.astype(np.float64), 4).tolist()
            raise ProfileFormatError(
                f"{where}: ratios must be strictly increasing inside (0, 1), got {shown}."
            )
        if loss.shape != (len(bits), ratios.size):
            raise ProfileFormatError(
                f"{where}: loss must have shape [bits={len(bits)}, ratios={ratios.size}], got "
                f"{list(loss.shape)}."
            )
        if not np.isfinite(loss).all():
            raise ProfileFormatError(f"{where}: loss contains NaN or infinite values.")
        if not isinstance(self.measure, str):
            raise ProfileFormatError(f"{where}: measure must be a string, got {type(self.measure).__name__}.")
        ratios.flags.writeable = False  # frozen: the arrays too
        loss.flags.writeable = False
        object.__setattr__(self, "ratios", ratios)
        object.__setattr__(self, "loss", loss)
        if self.layer_loss is not None:
            layer_loss = _float32(self.layer_loss, "layer_loss", where)
            if layer_loss.ndim != 1 or not 1 <= layer_loss.size <= MAX_LAYERS:
                raise ProfileFormatError(
                    f"{where}: layer_loss must be a 1-D array of 1 to {MAX_LAYERS} values (one per decoder "
                    f"layer), got shape {list(layer_loss.shape)}."
                )
            if not np.isfinite(layer_loss).all():
                raise ProfileFormatError(f"{where}: layer_loss contains NaN or infinite values.")
            if 8 not in bits or 4 not in bits:
                raise ProfileFormatError(
                    f"{where}: layer_loss needs rows for 8 and 4 bits (what it mixes), the table has kv_bits "
                    f"{_names(list(bits))}."
                )
            layer_loss.flags.writeable = False
            object.__setattr__(self, "layer_loss", layer_loss)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MemoryTable):
            return NotImplemented
        return (
            self.bits == other.bits
            and self.measure == other.measure
            and np.array_equal(self.ratios, other.ratios)
            and np.array_equal(self.loss, other.loss)
            and _same(self.layer_loss, other.layer_loss)
        )

    __hash__ = None  # type: ignore[assignment]  # equal tables hold equal arrays, which do not hash

    def __repr__(self) -> str:
        return (
            f"MemoryTable(bits={self.bits}, ratios={np.round(self.ratios.astype(np.float64), 4).tolist()}, "
            f"measure={self.measure!r}{'' if self.layer_loss is None else f', layers={self.layer_loss.size}'})"
        )

    # ------------------------------------------------------------------------------------ lookup

    def loss_at(self, bits: int | None, ratio: float) -> float:
        """The loss of ``bits`` at eviction ratio ``ratio`` in [0, 1].

        Linear between the table's ratios. Below the first: towards 0 at ratio 0 for ``bits=None`` (a cache
        that evicts nothing at the model's precision loses nothing), and the first ratio's loss held for a
        quantized precision (quantizing costs something even when nothing is evicted). Beyond the last: the
        last segment's slope, never decreasing (``max(slope, 0)``). A ``bits`` not in the table raises
        :class:`~lukv_cache.errors.ConfigurationError`.

        >>> table = MemoryTable((None, 4), np.array([0.5, 0.75], dtype=np.float32),
        ...                     np.array([[0.2, 0.4], [0.3, 0.2]], dtype=np.float32))
        >>> [round(table.loss_at(None, r), 4) for r in (0.0, 0.25, 0.625, 1.0)]
        [0.0, 0.1, 0.3, 0.6]
        >>> [round(table.loss_at(4, r), 4) for r in (0.0, 0.5, 1.0)]
        [0.3, 0.3, 0.2]
        >>> table.loss_at(8, 0.5)
        Traceback (most recent call last):
        ...
        lukv_cache.errors.ConfigurationError: The memory table has no row for kv_bits=8; it has kv_bits None, 4.
        """
        row = self._row(bits)
        ratio = float(ratio)
        if math.isnan(ratio) or not 0.0 <= ratio <= 1.0:
            raise ConfigurationError(
                f"ratio must be in [0, 1] (the fraction of the prompt's KV entries evicted), got {ratio}."
            )
        loss = self.loss[row].astype(np.float64)
        # the knots: ratio 0 first (loss 0 at the model's precision, the first loss held when quantized)
        xs = np.concatenate([[0.0], self.ratios.astype(np.float64)])
        ys = np.concatenate([[0.0 if bits is None else loss[0]], loss])
        if ratio <= xs[-1]:
            return float(np.interp(ratio, xs, ys))
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
        return float(ys[-1] + slope * (ratio - xs[-1]))

    def choose(self, candidates: Mapping[int | None, float]) -> int | None:
        """Of ``candidates`` (``{bits: the eviction ratio a budget allows at that precision}``), the bits of
        least :meth:`loss_at`; on a tie the more precise (``None`` before 8 before 4). Bits the table has
        no row for are skipped; when none is left, :class:`~lukv_cache.errors.ConfigurationError`.

        >>> table = MemoryTable((None, 8), np.array([0.5], dtype=np.float32),
        ...                     np.array([[0.2], [0.2]], dtype=np.float32))
        >>> table.choose({None: 0.5, 8: 0.5, 2: 0.0})
        >>> table.choose({8: 0.4, None: 0.6})
        8
        """
        known = [bits for bits in candidates if bits in self.bits]
        if not known:
            raise ConfigurationError(
                f"None of the precisions {_names(list(candidates))} is in the memory table (it has kv_bits "
                f"{_names(list(self.bits))}); ask for one of those."
            )
        scored = [(self.loss_at(bits, candidates[bits]), -_precision(bits), bits) for bits in known]
        return min(scored, key=lambda item: (item[0], item[1]))[2]

    def layer_order(self) -> list[int]:
        """The decoder layers, the one whose keys and values lose most at 4 bits first (``layer_loss``
        descending; ties: the lower index): the order a budget keeps layers at 8 bits in. Empty without
        ``layer_loss``.

        >>> table = MemoryTable((8, 4), np.array([0.5], dtype=np.float32), np.zeros((2, 1)),
        ...                     layer_loss=np.array([0.01, 0.2, -0.01, 0.01]))
        >>> table.layer_order()
        [1, 0, 3, 2]
        """
        losses = self.layer_loss
        if losses is None:
            return []
        return sorted(range(losses.size), key=lambda i: (-float(losses[i]), i))

    def mix_loss(self, ratio: float, at_4_bits: Sequence[int]) -> float:
        """The estimated loss of keeping the layers ``at_4_bits`` at 4 bits and every other at 8, evicting
        ``ratio`` of the prompt: the 8-bit row at ``ratio`` plus each of those layers' ``layer_loss``, a
        negative one counted as 0 (4 bits do not help a layer: a negative loss is noise, and summed over
        many layers such noise would pick mixes on models whose layers all lose nothing at 4 bits; counted
        as 0, the noise errs towards the wider width, as :meth:`choose`'s ties do). Needs ``layer_loss``.

        >>> table = MemoryTable((8, 4), np.array([0.5], dtype=np.float32), np.array([[0.1], [0.3]]),
        ...                     layer_loss=np.array([0.05, -0.01, 0.02]))
        >>> round(table.mix_loss(0.5, [1, 2]), 4)
        0.12
        """
        if self.layer_loss is None:
            raise ConfigurationError("This memory table has no layer_loss: it cannot weigh mixed widths.")
        extra = sum(max(float(self.layer_loss[i]), 0.0) for i in at_4_bits)
        return self.loss_at(8, ratio) + extra

    def _row(self, bits: int | None) -> int:
        if isinstance(bits, bool) or bits not in self.bits:
            raise ConfigurationError(
                f"The memory table has no row for kv_bits={bits!r}; it has kv_bits {_names(list(self.bits))}."
            )
        return self.bits.index(bits)

    # ------------------------------------------------------------------------------------ file form

    def to_json(self) -> str:
        """The table as the JSON text a profile stores under ``__metadata__["memory_table"]``: ``bits``
        (``null`` for the model's precision), ``ratios``, ``loss`` (rows of plain numbers, each float32 value
        written so that it reads back exactly), ``measure`` and, when the table has one, ``layer_loss``.

        >>> MemoryTable((None, 4), np.array([0.5], dtype=np.float32), np.array([[0.25], [0.5]])).to_json()
        '{"bits": [null, 4], "loss": [[0.25], [0.5]], "measure": "", "ratios": [0.5]}'
        """
        entry: dict[str, Any] = {
            "bits": list(self.bits),
            "ratios": [float(r) for r in self.ratios],
            "loss": [[float(v) for v in row] for row in self.loss],
            "measure": self.measure,
        }
        if self.layer_loss is not None:  # optional: a table without it reads as before
            entry["layer_loss"] = [float(v) for v in self.layer_loss]
        return json.dumps(entry, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str = "<bytes>") -> MemoryTable:
        """Parse :meth:`to_json`'s text; anything malformed raises
        :class:`~lukv_cache.errors.ProfileFormatError` naming ``source``.

        >>> table = MemoryTable((None, 8), np.array([0.5, 0.9], dtype=np.float32), np.ones((2, 2)), "m")
        >>> MemoryTable.from_json(table.to_json()) == table
        True
        """
        from .jsonfile import parse_json

        try:
            value: Any = parse_json(text)
            if not isinstance(value, dict):
                raise TypeError(f"expected a JSON object, got {type(value).__name__}")
            missing = sorted({"bits", "ratios", "loss", "measure"} - set(value))
            if missing:
                raise KeyError(f"no {', '.join(missing)}")
            rows = value["loss"]
            if not isinstance(value["bits"], list) or not isinstance(rows, list):
                raise TypeError("bits and loss must be lists")
            if not isinstance(value["ratios"], list) or not all(_number(r) for r in value["ratios"]):
                raise TypeError("ratios must be a list of numbers")
            if not all(isinstance(row, list) and all(_number(v) for v in row) for row in rows):
                raise TypeError("loss must be a list of lists of numbers")
            if len({len(row) for row in rows}) > 1:
                raise ValueError("loss rows of different lengths")
            loss = np.asarray(rows, dtype=np.float64).reshape(len(rows), -1 if rows and rows[0] else 0)
            layers = value.get("layer_loss")
            if layers is not None and (not isinstance(layers, list) or not all(_number(v) for v in layers)):
                raise TypeError("layer_loss must be a list of numbers")
            return cls(
                tuple(value["bits"]),
                np.asarray(value["ratios"], dtype=np.float64),
                loss,
                value["measure"],
                None if layers is None else np.asarray(layers, dtype=np.float64),
            )
        except ProfileFormatError as err:
            raise ProfileFormatError(f"{source}: {err}", source=source, field=METADATA_KEY) from None
        except (ValueError, TypeError, KeyError, OverflowError, RecursionError) as err:
            raise ProfileFormatError(
                f"{source}: malformed memory_table metadata ({type(err).__name__}: {err}).",
                source=source,
                field=METADATA_KEY,
            ) from None


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return a is None and b is None or a is not None and b is not None and np.array_equal(a, b)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _names(bits: list) -> str:
    return ", ".join("None" if b is None else repr(b) for b in bits) or "none"


def _float32(value: Any, name: str, where: str) -> np.ndarray:
    try:
        array = np.asarray(value)
        if array.dtype == object or not np.issubdtype(array.dtype, np.number):
            raise TypeError(array.dtype)
        if np.issubdtype(array.dtype, np.floating) and np.isfinite(array).all():
            too_big = bool((np.abs(array.astype(np.float64)) > np.finfo(np.float32).max).any())
            if too_big:
                raise ValueError("a value beyond float32's range")
        return np.array(array, dtype=np.float32)  # a copy: the caller's array stays theirs
    except (TypeError, ValueError, OverflowError) as err:
        raise ProfileFormatError(f"{where}: {name} must be a numeric array, got {err}.") from None
