"""Measuring a profile's memory table: the loss of each (kv_bits, eviction ratio) on calibration text.

For each of a few windows of the calibration text, the first part (the context) is prefilled into the
profile's cache at one eviction ratio and one precision (``LUKVCache.from_pretrained(profile, ratio,
kv_bits=...)``, as a user would build it), and the next tokens are teacher-forced through it; the table holds
their mean NLL minus the full cache's (``DynamicCache``) on the same tokens, averaged over the windows
(:class:`~lukv_cache.profiles.memory_table.MemoryTable`). :func:`add_memory_table` adds one to a profile
file that has none, without rebuilding it.

>>> table = measure_memory_table(model, tokenizer, profile, calibration_texts("planted"))  # doctest: +SKIP
>>> table.choose({None: 0.95, 8: 0.9, 4: 0.8})  # doctest: +SKIP
8
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from ..errors import ConfigurationError
from ..profiles.memory_table import MemoryTable
from .calibration import SHIPPED_FOLDER, load_calibration
from .continuation import continuation_nll, prefill
from .eta import count, estimate_line, sayer
from .table_dtype import model_in, table_dtype

DEFAULT_BITS: tuple[int | None, ...] = (None, 8, 4)
# 0.25 too: below its first ratio a table holds a quantized precision at that ratio's loss, and where eviction
# itself is costly (Gemma-3-270M: +0.51 nats at 0.5 at every precision) a first ratio of 0.5 made 8 bits
# keeping nearly every token look as lossy as evicting half
DEFAULT_RATIOS: tuple[float, ...] = (0.25, 0.5, 0.7, 0.8, 0.9, 0.95)
DEFAULT_CONTEXTS = 4
DEFAULT_CONTINUATION = 128


def calibration_texts(calibration: str | os.PathLike) -> list[str]:
    """The texts a memory table is measured on: the calibration set's context (the one a profile is built
    from; its questions are not used).

    >>> len(calibration_texts("planted")[0]) > 10_000
    True
    """
    return [load_calibration(calibration)[0]]


def calibration_of(profile: Any) -> str | None:
    """The shipped calibration set a profile was built from, by name, when its ``calibration`` says so
    (``"planted.jsonl: ..."`` -> ``"planted"``); ``None`` for a user's file or an unsaid one.

    >>> calibration_of(type("P", (), {"calibration": "planted.jsonl: The lighthouse keeper"})())
    'planted'
    >>> calibration_of(type("P", (), {"calibration": "mine.jsonl: 3 questions"})()) is None
    True
    """
    name = str(getattr(profile, "calibration", "") or "").partition(":")[0].strip()
    if name.endswith(".jsonl") and (SHIPPED_FOLDER / name).is_file():
        return name.removesuffix(".jsonl")
    return None


def windows_fit(lengths: Sequence[int], contexts: int, continuation_tokens: int, context_tokens: int) -> int:
    """How many non-overlapping windows of ``context_tokens + continuation_tokens`` tokens texts of
    ``lengths`` tokens hold (a window never spans two texts).

    >>> windows_fit([1000, 300], 4, 128, 100)
    5
    """
    need = context_tokens + continuation_tokens
    return sum(length // need for length in lengths)


def window_context_tokens(
    lengths: list[int], contexts: int, continuation_tokens: int, limit: int | None
) -> int:
    """The context a table's windows get when ``context_tokens=None``: the longest that still leaves
    ``contexts`` non-overlapping windows of it + ``continuation_tokens`` in texts of ``lengths`` tokens
    (within ``limit`` positions); 0 when even one token does not fit.

    >>> window_context_tokens([1000, 300], 4, 128, None)  # 3 windows of 300 in the first text, 1 in the second
    172
    """
    longest = max(lengths) - continuation_tokens
    if limit is not None:
        longest = min(longest, limit - continuation_tokens)
    lo, hi = 0, max(longest, 0)
    while lo < hi:  # the largest c with enough windows (fewer fit as c grows)
        mid = (lo + hi + 1) // 2
        if windows_fit(lengths, contexts, continuation_tokens, mid) >= contexts:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _windows(
    token_lists: list[list[int]], contexts: int, need: int, rng: np.random.Generator
) -> list[list[int]]:
    """``contexts`` non-overlapping windows of ``need`` tokens, chosen at random (seeded) among those the
    texts hold; each text's windows sit on a grid shifted by a random offset."""
    slots = []
    for index, ids in enumerate(token_lists):
        count = len(ids) // need
        if count:
            shift = int(rng.integers(0, len(ids) - count * need + 1))
            slots += [(index, shift + k * need) for k in range(count)]
    chosen = sorted(rng.choice(len(slots), size=contexts, replace=False).tolist())
    return [token_lists[slots[i][0]][slots[i][1] : slots[i][1] + need] for i in chosen]


def _check_grid(
    bits: Sequence[int | None], ratios: Sequence[float]
) -> tuple[tuple[int | None, ...], list[float]]:
    from ..cache.storage.quant import check_kv_bits

    bits = tuple(bits)
    if not bits or len(set(bits)) != len(bits):
        raise ConfigurationError(
            f"bits must be distinct kv_bits values, e.g. (None, 8, 4); got {list(bits)}."
        )
    for value in bits:
        check_kv_bits(value)
    values = [float(r) for r in ratios]
    if (
        not values
        or any(not 0.0 < r < 1.0 for r in values)
        or any(b <= a for a, b in zip(values, values[1:]))
    ):
        raise ConfigurationError(
            f"ratios must be strictly increasing inside (0, 1), e.g. (0.5, 0.8, 0.9); got {values}."
        )
    return bits, values


@torch.no_grad()
def measure_memory_table(
    model: Any,
    tokenizer: Any,
    profile: Any,
    texts: str | Sequence[str],
    *,
    bits: Sequence[int | None] = DEFAULT_BITS,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    contexts: int = DEFAULT_CONTEXTS,
    continuation_tokens: int = DEFAULT_CONTINUATION,
    context_tokens: int | None = None,
    seed: int = 0,
    allocator: str | None = None,
    layers: bool = True,
    show_progress: bool = False,
    share_prefill: bool = True,
    dtype: str | torch.dtype | None = None,
    layer_contexts: int | None = None,
    layer_method: str = "gradient",
) -> MemoryTable:
    """The loss of ``profile``'s cache on ``model`` at every (``bits``, ``ratios``): the mean over
    ``contexts`` windows of ``texts`` of the continuation's excess NLL (nats per token) against the full
    cache.

    Each window is ``context_tokens`` tokens prefilled into ``LUKVCache.from_pretrained(profile, ratio,
    allocator=allocator, kv_bits=bits)`` (the profile's scorer, kvzap's surrogate included, its sink and
    window; ``allocator=None``: the one ``from_pretrained`` gives the profile's scorer, ``"profile"`` for
    all but kvzap) with ``cache.prefill`` (so a reconstruction scorer, ``kvzip``, runs its repeat passes
    with ``tokenizer``), then ``continuation_tokens`` tokens teacher-forced. ``texts``: the calibration set's
    context (:func:`calibration_texts`), tokenised without special tokens; the windows do not overlap
    and are chosen with ``seed``. ``context_tokens=None``: the longest that leaves ``contexts`` windows
    (within the model's positions). The same arguments give the same table.

    ``layers`` (with 8 and 4 among ``bits``): also each decoder layer's ``layer_loss``, on the same windows:
    the cache at 8 bits evicting nothing but that layer's keys and values at 4 bits, against the same cache
    with every layer at 8: what a memory budget weighs when it keeps some layers at 8 bits and the others at
    4. ``layer_method="passes"`` measures it, one more pass per window and layer. ``"gradient"`` (the
    default, where the prefill is shared, below, and outside ``torch.inference_mode``; else the passes)
    estimates every layer's at once from one backward pass per window: the continuation's NLL differentiated
    with every layer's keys and values at the midpoint of their 8- and 4-bit values, dotted with their
    difference. For one layer alone the midpoint rule is exact to second order in the difference (it keeps
    the first-order shift of the text's own tokens that a layer's rounding makes, and the second-order
    loss); the other layers' half-steps add their cross terms. On Qwen2.5-Coder-0.5B it keeps the same
    layers at 8 bits as the passes (``docs/profiles.md``) in a fraction of their time.

    ``share_prefill``: each window's context is prefilled once and replayed into every cell's cache
    (:class:`~lukv_cache.cache.compression.recorded.RecordedPrefill`: compression never changes a layer's
    prefill output, so every cell sees the same keys, values and queries); the same table as a prefill per
    cell, for a fraction of the passes. Not on models with sliding-window layers or other attention than
    sdpa / eager, nor with a reconstruction scorer (``kvzip``, whose repeat passes read the context): those
    prefill each cell and measure the layers' losses with passes.

    ``dtype``: the precision of the passes (:func:`~lukv_cache.profiling.table_dtype.table_dtype`): ``None``
    (the model's own), a floating dtype or its name (every pass runs on a copy of the model in it; the model is
    not changed), or ``"auto"``: the cells in bfloat16 for a float32 model on a CPU that multiplies bfloat16
    natively (about 3x faster there, the cells as the float32 ones within their noise) over a prefill in the
    model's own precision: each window's context prefilled once, at the model's precision (the layers'
    losses are small differences: the rounding of a bfloat16 prefill's keys and values moves them), and
    replayed into the cells cast to bfloat16; the layers' backward pass runs in bfloat16 over it too (with
    ``layer_method="passes"``, the layers' passes in the model's precision); ``measure`` names them.
    ``layer_contexts``: the layers' losses on the first this many windows only
    (``None``: all of them).

    >>> table = measure_memory_table(model, tokenizer, profile, calibration_texts("planted"))  # doctest: +SKIP
    >>> table.loss.shape  # doctest: +SKIP
    (3, 5)
    """
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    from ..cache import LUKVCache
    from ..cache.compression.recorded import RecordedPrefill, shareable

    bits, ratio_list = _check_grid(bits, ratios)
    if contexts < 1 or continuation_tokens < 2:
        raise ConfigurationError(
            f"contexts must be >= 1 and continuation_tokens >= 2, got {contexts} and {continuation_tokens}."
        )
    if context_tokens is not None and context_tokens < 1:
        raise ConfigurationError(f"context_tokens must be >= 1 (or None), got {context_tokens}.")
    texts = [texts] if isinstance(texts, str) else list(texts)
    token_lists = [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    lengths = [len(ids) for ids in token_lists] or [0]
    config = model.config.get_text_config()
    limit = getattr(config, "max_position_embeddings", None)
    limit = limit if isinstance(limit, int) else None
    if context_tokens is None:
        context_tokens = window_context_tokens(lengths, contexts, continuation_tokens, limit)
    need = context_tokens + continuation_tokens
    if context_tokens < 1 or windows_fit(lengths, contexts, continuation_tokens, context_tokens) < contexts:
        raise ConfigurationError(
            f"The calibration text ({sum(lengths):,} tokens) does not hold {contexts} windows of "
            f"{max(context_tokens, 1)} context + {continuation_tokens} continuation tokens; ask for fewer "
            "contexts or continuation tokens, or use a longer calibration text."
        )
    if limit is not None and need > limit:
        raise ConfigurationError(
            f"A window of {context_tokens} context + {continuation_tokens} continuation tokens needs {need} "
            f"positions but the model has {limit}; ask for a shorter context_tokens."
        )
    if layer_method not in ("gradient", "passes"):
        raise ConfigurationError(f"layer_method must be 'gradient' or 'passes', got {layer_method!r}.")
    if layer_contexts is not None and not 1 <= layer_contexts <= contexts:
        raise ConfigurationError(
            f"layer_contexts must be between 1 and contexts ({contexts}), or None, got {layer_contexts}."
        )
    profile.validate_for(model.config)
    passes_dtype = table_dtype(model, dtype)
    # "auto": only the cells in the fast dtype; the layers' losses keep the model's precision
    layer_dtype = next(model.parameters()).dtype if dtype == "auto" else passes_dtype
    windows = _windows(token_lists, contexts, need, np.random.default_rng(seed))
    device = next(model.parameters()).device
    excess = np.zeros((len(bits), len(ratio_list), contexts), dtype=np.float64)
    allocator_name = allocator
    num_layers = int(config.num_hidden_layers) if layers and 8 in bits and 4 in bits else 0
    layer_windows = contexts if layer_contexts is None else layer_contexts
    layer_excess = np.zeros((num_layers, layer_windows), dtype=np.float64)

    def quantized(ratio: float, bits: int | None, at_4_bits: int | None = None) -> Any:
        cache = LUKVCache.from_pretrained(
            profile, ratio, allocator=allocator, kv_bits=bits, config=model.config
        )
        if at_4_bits is not None:  # one layer's store in 4 bits, before anything is stored
            cast(Any, cache.layers[at_4_bits]).kv_bits = 4  # a LUKVLayer (every layer of a LUKVCache)
        return cache

    scorer = quantized(ratio_list[0], bits[0]).policy.scorer
    share = share_prefill and shareable(model) and scorer.reconstruction is None
    # the views below read a replayed prefill; under torch.inference_mode nothing can be differentiated
    gradient = share and layer_method == "gradient" and not torch.is_inference_mode_enabled()
    layer_runs = 1 if gradient else num_layers + 1
    users_model, was_training = model, model.training
    model.eval()
    cell_runs = 1 + len(bits) * len(ratio_list)
    bar = tqdm(
        total=contexts * cell_runs + (layer_windows * layer_runs if num_layers else 0),
        desc="memory table",
        unit="run",
        disable=not show_progress,
    )
    # the cells replay the layers' prefill, cast to their precision
    cast_prefill = share and bool(num_layers) and layer_dtype != passes_dtype
    # the prefill's precision is what the layers' losses need: their backward pass runs in the cells' (on
    # Qwen2.5-Coder-0.5B a bfloat16 pass over a float32 prefill orders the layers as a float32 one does)
    gradient_dtype = passes_dtype if gradient and cast_prefill else layer_dtype
    say = sayer(show_progress)
    if say is not None:
        say(
            f"memory table: {count(contexts, 'window')} of {context_tokens:,} + {continuation_tokens} tokens, "
            f"{cell_runs} runs each ({len(bits)} precisions x {len(ratio_list)} ratios) in {_name(passes_dtype)}"
            + (
                f", {'one backward pass' if gradient else f'{layer_runs} more'} on "
                f"{count(layer_windows, 'window')} for the layers' losses in {_name(gradient_dtype)}"
                if num_layers
                else ""
            )
            + (" (on a copy of the model)" if passes_dtype != next(model.parameters()).dtype else "")
            + (f"; each window prefilled once, in {_name(layer_dtype)}" if cast_prefill else "")
        )

    def split(window: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([window], dtype=torch.long, device=device)
        return ids[:, :context_tokens], ids[:, context_tokens:]

    def nll(model: Any, cache: Any, context: torch.Tensor, target: torch.Tensor, recorded: Any) -> float:
        torch.manual_seed(seed)  # a scorer that draws random numbers draws the same ones
        if recorded is not None:  # the window's one prefill, replayed
            if isinstance(cache, LUKVCache):
                recorded.replay_into(cache)
            else:
                cache = recorded.full_cache(model.config)
            last_logits = cast(torch.Tensor, recorded.last_logits)
        elif isinstance(cache, LUKVCache):  # as a user fills one: reconstruction scorers too
            out = cache.prefill(model, context, tokenizer=tokenizer, logits_to_keep=1)
            last_logits = out.logits[:, -1, :]
        else:
            last_logits = prefill(model, context, cache)
        return continuation_nll(model, cache, last_logits, target)

    def estimate(started: float, left: int, what: str) -> None:
        if say is not None and left:
            seconds = time.perf_counter() - started
            say(estimate_line(what, "window", seconds, seconds * left, f"{count(left, 'window')} left"))

    try:
        with (
            bar,
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
            model_in(model, passes_dtype) as cells_model,  # "auto": a bfloat16 copy for the cells
            # the cells' model when the dtypes agree (two copies in one dtype would be the same model twice)
            (
                contextlib.nullcontext(cells_model)
                if layer_dtype == passes_dtype
                else model_in(users_model, layer_dtype)
            ) as layers_model,
        ):
            prefill_model = layers_model if num_layers else cells_model
            for w, window in enumerate(windows):
                started = time.perf_counter()
                context, target = split(window)
                model = cells_model
                # one prefill per window, in the layers' precision (the cells replay it cast to theirs)
                layers_recorded = recorded = None
                if share:
                    layers_recorded = RecordedPrefill.record(prefill_model, context, scorer.n_queries)
                    recorded = layers_recorded.for_copy(cells_model, prefill_model)
                full = nll(model, DynamicCache(config=model.config), context, target, recorded)
                bar.update(1)
                for i, b in enumerate(bits):
                    for j, ratio in enumerate(ratio_list):
                        cache = quantized(ratio, b)
                        allocator_name = cache.allocator_name
                        excess[i, j, w] = nll(model, cache, context, target, recorded) - full
                        bar.update(1)
                if w == 0:
                    estimate(started, contexts - 1, "memory table")
                if not num_layers or w >= layer_windows:
                    continue
                started = time.perf_counter()
                model, recorded = layers_model, layers_recorded
                if gradient and recorded is not None:  # (gradient: the prefill is shared)
                    torch.manual_seed(seed)
                    at_8, at_4 = (recorded.replay_into(quantized(0.0, b)).layers for b in (8, 4))
                    gradient_model = cells_model if gradient_dtype == passes_dtype else layers_model
                    layer_excess[:, w] = _midpoint_layer_losses(gradient_model, at_8, at_4, target)
                    bar.update(1)
                else:
                    at_8_bits = nll(model, quantized(0.0, 8), context, target, recorded)
                    bar.update(1)
                    for layer in range(num_layers):
                        layer_excess[layer, w] = (
                            nll(model, quantized(0.0, 8, layer), context, target, recorded) - at_8_bits
                        )
                        bar.update(1)
                if w == 0:
                    estimate(started, layer_windows - 1, "layers' losses")
    finally:
        users_model.train(was_training)
    return MemoryTable(
        bits=bits,
        ratios=np.asarray(ratio_list, dtype=np.float32),
        loss=excess.mean(axis=-1).astype(np.float32),
        measure=(
            f"continuation excess NLL (nats/token) vs the full cache, {contexts} contexts of {context_tokens} "
            f"tokens x {continuation_tokens} continuation tokens, allocator {allocator_name}, seed {seed}, "
            f"{_name(passes_dtype)} passes"
            + (f" over a {_name(layer_dtype)} prefill" if cast_prefill else "")
            + (
                f" (layers' losses: {_name(gradient_dtype)}, {count(layer_windows, 'context')}"
                + (", midpoint gradient)" if gradient else ")")
                if num_layers and (gradient or layer_dtype != passes_dtype or layer_windows != contexts)
                else ""
            )
        ),
        layer_loss=layer_excess.mean(axis=-1).astype(np.float32) if num_layers else None,
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _midpoint_layer_losses(model: Any, at_8: Sequence[Any], at_4: Sequence[Any], target: torch.Tensor) -> Any:
    """Each layer's loss at 4 bits against every layer at 8, to second order, from one backward pass: the
    continuation's mean NLL (``target`` ``[1, n]``, teacher-forced; its first token, predicted by the
    prefill, does not change) differentiated at the midpoint of the 8-bit (``at_8``) and 4-bit (``at_4``)
    caches' keys and values, dotted with their difference, layer by layer. ``at_8``/``at_4``: the layers of
    two caches holding the same context uncompressed (ratio 0)."""
    from transformers import DynamicCache

    from .._compat import cache_kwarg

    dtype = next(model.parameters()).dtype
    deltas, points = [], []
    for wide, narrow in zip(at_8, at_4):
        for a, b in ((wide.keys, narrow.keys), (wide.values, narrow.values)):
            a, b = a.to(dtype), b.to(dtype)
            deltas.append(b - a)
            points.append(((a + b) / 2).requires_grad_(True))
    with torch.enable_grad():
        cache = DynamicCache(config=model.config)
        for layer in range(len(points) // 2):
            cache.update(points[2 * layer], points[2 * layer + 1], layer)
        logits = model(input_ids=target[:, :-1], use_cache=True, **{cache_kwarg(model): cache}).logits
        loss = torch.nn.functional.cross_entropy(logits[0].float(), target[0, 1:], reduction="sum")
        grads = torch.autograd.grad(loss / target.shape[1], points)
    per_tensor = [float((g.float() * d.float()).sum()) for g, d in zip(grads, deltas)]
    return np.asarray(per_tensor, dtype=np.float64).reshape(-1, 2).sum(axis=1)


def continuation_for(calibration_tokens: int, contexts: int = DEFAULT_CONTEXTS) -> int:
    """The continuation a build measures its table with: :data:`DEFAULT_CONTINUATION` tokens, or for a
    calibration context too short to hold ``contexts`` windows of that, half of each window (so a short
    calibration file still gets a table, measured on fewer tokens; its ``measure`` says how many).

    >>> continuation_for(4500), continuation_for(135)
    (128, 16)
    """
    return max(2, min(DEFAULT_CONTINUATION, calibration_tokens // contexts // 2))


def add_memory_table(
    path: str | os.PathLike,
    model: Any,
    tokenizer: Any,
    calibration: str | os.PathLike | None = None,
    *,
    out: str | os.PathLike | None = None,
    replace: bool = False,
    **options: Any,
) -> Path:
    """Measure the memory table of the profile file at ``path`` and write the profile with it, atomically, to
    ``out`` (default: ``path`` itself); nothing else in the profile changes. Returns the path written.

    ``calibration``: the texts' calibration set (default: the shipped set the profile names in its
    ``calibration``; a profile built from a file of your own needs it). A profile that already holds a
    table raises :class:`~lukv_cache.errors.ConfigurationError` unless ``replace=True``. ``options``:
    :func:`measure_memory_table`'s keywords (``contexts``, ``ratios``, ``bits``, ``seed``, ...).

    >>> add_memory_table("keydiff.safetensors", model, tokenizer)  # doctest: +SKIP
    PosixPath('keydiff.safetensors')
    """
    from ..profiles.profile import Profile

    profile = Profile.load(path)
    if profile.memory_table is not None and not replace:
        raise ConfigurationError(
            f"{path} already holds a memory table ({profile.memory_table.measure}); pass replace=True "
            "(--replace) to measure it again."
        )
    if calibration is None:
        calibration = calibration_of(profile)
        if calibration is None:
            raise ConfigurationError(
                f"{path} was built from calibration {profile.calibration!r}, not a shipped set; pass the "
                "calibration file it was built from (--calibration)."
            )
    table = measure_memory_table(model, tokenizer, profile, calibration_texts(calibration), **options)
    return dataclasses.replace(profile, memory_table=table).save(out if out is not None else path)
