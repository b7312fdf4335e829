"""The score-to-gain table of a profile (format version 2): what a token's score is worth, per head.

LU-KV's insight is that a scorer's magnitudes do not compare across heads: a head whose scores predict
future use poorly should not win tokens on them. The profile's budgets carry that insight as fixed shares;
this table carries it per token, so that each prompt's own scores still decide where its budget goes.

For each compressed (layer, KV head) ``h`` and calibration context, every evictable token ``j`` (sinks and
the scorer's window excluded) gives one pair:

* its score ``s_h(j)`` minus the context's mean score (over every compressed head and evictable token), so
  that a context's overall level, which moves with its length for attention-like scores, cancels out;
* its oracle gain ``I_h(j)``: the oracle importance (``lukv_cache.profiling.oracle``) of each calibration
  question, divided by that question's mean importance over every compressed head and evictable token (so
  every question weighs alike, whatever its length), averaged over the context's questions.

The pairs of all contexts are sorted by score and cut into ``knots`` bins, finest at the top (counted from
the best token, their edges grow geometrically from ``top`` tokens to all of them); a knot is a bin's
mean score and mean gain, and the gains are projected onto non-decreasing sequences (PAVA, as the solver
does for its loss curves): ``E[gain | score]`` on the head's own scale. The ``calibrated`` allocator maps a
prompt's scores through it and lets every token of the model compete on expected gain.

    >>> rng = np.random.default_rng(0)
    >>> scores = rng.normal(size=(2, 3, 40))
    >>> importance = [np.exp(scores + rng.normal(size=scores.shape))]  # one question, faithful scores
    >>> knots, gains = score_gain_table([(scores, importance)], layers=[0, 1], sink=2, window=2, knots=4)
    >>> knots.shape, bool((np.diff(gains, axis=-1) >= 0).all())
    ((2, 3, 4), True)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from ..allocation.builtin import GAIN_CENTRES as CENTRES
from ..errors import ConfigurationError
from .solver import pava

DEFAULT_KNOTS = 32
DEFAULT_TOP = 16  # each head's best tokens in the top bin (of ~15k pooled calibration tokens per head)
DEFAULT_CALIBRATIONS = ("planted", "default", "expository")  # facts asked back, a story, explanations


def _bins(n: int, knots: int, top: int) -> list[np.ndarray]:
    """``knots`` bins over ``n`` positions sorted by ascending score, finest at the top: counted from the
    top, their edges grow geometrically from ``top`` tokens to all ``n`` (a bin holds at least one token)."""
    from_top = np.unique(np.round(np.geomspace(min(top, n), n, knots)).astype(np.int64))
    edges = np.unique(np.concatenate([[0], n - from_top[::-1], [n]]))
    return [np.arange(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def score_gain_table(
    contexts: Sequence[tuple[np.ndarray, Sequence[np.ndarray]]],
    layers: Sequence[int],
    sink: int,
    window: int,
    knots: int = DEFAULT_KNOTS,
    *,
    centre: str = "model",
    top: int = DEFAULT_TOP,
) -> tuple[np.ndarray, np.ndarray]:
    """The table ``(gain_scores, gain_values)``, float32 ``[L, H_kv, knots]``, from calibration contexts.

    ``contexts``: one ``(scores [L, H_kv, T], [importance [L, H_kv, T] per question])`` per context (its
    own ``T``). ``layers``: the compressed layers (the others' rows stay zero, never read). ``centre``:
    scores minus the context's mean over every compressed head (``"model"``) or each head's own mean
    (``"head"``); the allocator centres a prompt's scores the same way. Bins are finest at the top (where
    a budget's last tokens are decided): the top one holds each head's ``top`` best tokens, and bin edges
    counted from the top grow geometrically from there; a table with fewer distinct edges repeats its last
    knot.
    """
    if knots < 2:
        raise ConfigurationError(f"knots must be at least 2, got {knots}.")
    if centre not in CENTRES:
        raise ConfigurationError(f"centre must be one of {', '.join(CENTRES)}, got {centre!r}.")
    if not contexts or not layers:
        raise ConfigurationError("score_gain_table needs at least one context and one compressed layer.")
    rows = sorted(layers)
    pooled_scores: list[np.ndarray] = []
    pooled_gains: list[np.ndarray] = []
    for scores, importances in contexts:
        t = scores.shape[-1]
        if t - sink - window < 1 or not importances:
            raise ConfigurationError(
                f"A calibration context of {t} tokens leaves nothing to evict after {sink} sinks and a window "
                f"of {window}, or has no question."
            )
        s = np.asarray(scores, dtype=np.float64)[rows, :, sink : t - window]  # [L', H, n]
        gains = np.zeros_like(s)
        for importance in importances:
            part = np.asarray(importance, dtype=np.float64)[rows, :, sink : t - window]
            gains += part / max(float(part.mean()), 1e-30)
        pooled_scores.append(s - (s.mean() if centre == "model" else s.mean(-1, keepdims=True)))
        pooled_gains.append(gains / len(importances))
    s = np.concatenate(pooled_scores, axis=-1)  # [L', H, N]
    g = np.concatenate(pooled_gains, axis=-1)
    if s.shape[-1] < knots:
        raise ConfigurationError(f"{s.shape[-1]} calibration tokens per head cannot make {knots} knots.")
    order = np.argsort(s, axis=-1, kind="stable")
    s, g = np.take_along_axis(s, order, -1), np.take_along_axis(g, order, -1)
    bins = _bins(s.shape[-1], knots, top)
    bins += [bins[-1]] * (knots - len(bins))  # repeated knots: a flat last stretch, still non-decreasing
    knot_scores = np.stack([s[..., b].mean(-1) for b in bins], axis=-1)  # [L', H, Q], non-decreasing
    knot_gains = np.stack([g[..., b].mean(-1) for b in bins], axis=-1)
    knot_gains = pava(knot_gains[..., ::-1])[..., ::-1]  # non-negative, non-decreasing in the score
    shape = (contexts[0][0].shape[0], s.shape[1], knots)
    out_scores, out_gains = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    out_scores[rows], out_gains[rows] = knot_scores, knot_gains
    return out_scores, out_gains


def with_score_gains(
    profile: Any,
    model: Any,
    tokenizer: Any,
    calibrations: Sequence[str | os.PathLike] = DEFAULT_CALIBRATIONS,
    *,
    knots: int = DEFAULT_KNOTS,
    centre: str = "model",
    k_max: int | None = None,
    aggregate: str = "max",
    cache_dir: str | os.PathLike | None | Literal[False] = None,
    show_progress: bool = True,
) -> Any:
    """``profile`` (a :class:`~lukv_cache.Profile`) with a score-to-gain table measured on ``model``: its
    scorer (a kvzap profile's own surrogate) scores each calibration set's context, the oracle decodes its
    questions (kept in ``cache_dir``, shared with :func:`~lukv_cache.profiling.build_profiles`), and
    :func:`score_gain_table` pools them. Budgets and surrogate are unchanged; ``extra["gains"]`` records
    how the table was made.

    >>> profile = with_score_gains(Profile.load("kvzap.safetensors"), model, tokenizer)  # doctest: +SKIP
    >>> profile.has_gains  # doctest: +SKIP
    True
    """
    from tqdm.auto import tqdm

    from ..cache.pretrained import profile_scorer
    from ..scorers import get_scorer
    from .build import prepare_run

    profile.validate_for(model.config)
    scorer = get_scorer(profile_scorer(profile, profile.scorer))
    k_max = profile.k_max if k_max is None else k_max
    contexts = []
    layers: list[int] = []
    described = []
    was_training = model.training
    model.eval()
    try:
        for calibration in calibrations:
            run = prepare_run(
                model, tokenizer, calibration, k_max=k_max, cache_dir=cache_dir, aggregate=aggregate
            )
            full, layers = run.score_array(scorer)  # the profile's shape: validate_for checked it
            bar = tqdm(range(len(run.selected)), desc=f"gains ({calibration})", disable=not show_progress)
            contexts.append((full, [run.oracle(i) for i in bar]))
            described.append(f"{run.description.split(':')[0]} ({len(run.selected)} questions)")
    finally:
        model.train(was_training)
    gain_scores, gain_values = score_gain_table(
        contexts, layers, profile.sink, profile.window, knots, centre=centre
    )
    extra = {
        **profile.extra,
        "gains": {
            "calibration": described,
            "knots": knots,
            "top": DEFAULT_TOP,
            "centre": centre,
            "k_max": k_max,
            "oracle_aggregate": aggregate,
            "score": f"minus the context's mean ({centre}: over {'every compressed head' if centre == 'model' else 'the head'})",
            "gain": "oracle importance / the question's mean, averaged over questions; PAVA in the score",
        },
    }
    return dataclasses.replace(profile, gain_scores=gain_scores, gain_values=gain_values, extra=extra)
