"""``build_profile``: calibration set -> oracle importance -> solver -> averaged :class:`Profile`.

The method (``docs/design.md``, arXiv 2602.08585): for every calibration question, decode its answer with a full
cache and record the oracle importance of every context token; rank the same tokens with the scorer the
cache will use (on the context alone, so the ranking is question-agnostic); solve the relaxed allocation
for every global ratio of the grid; average each head's local evict ratio over the questions.

Per-question oracle importances and the context's scores are cached on disk, keyed by the model's
fingerprint, the calibration text and the settings that change them, so an interrupted build resumes and
profiles for other scorers or grids reuse the expensive decoding (:mod:`.result_store`). KVzap's surrogate
is trained first, in :mod:`.kvzap_training`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import torch

from ..cache.compression.recorded import shareable
from ..errors import ConfigurationError
from ..scorers import Scorer, get_scorer, kvzap_scorer
from .calibration import load_calibration
from .eta import count, estimate_line, sayer
from .kvzap_options import KVzapTraining
from .kvzap_training import train_kvzap
from .oracle import AGGREGATES, ContextState, oracle_importances, prefill_context
from .result_store import ResultStore, default_cache_dir, model_fingerprint, short_sha
from .scores import replayed_scores
from .solver import DEFAULT_GRID, check_grid, solve_evict_ratios
from .table_dtype import check_table_dtype, model_in, table_dtype

# Plain completion, no chat template (``docs/design.md``: small models answer nothing in chat format).
QUESTION_TEMPLATE = "\n\nQuestion: {question}\nAnswer:"
_CACHE_FORMAT = 1  # bump when what is cached, or how it is computed, changes
SLIDING_BUILDS = ("keep", "compress")  # BuildSettings.sliding
# a question batch's attention over the context (its largest tensors) stays under this
ORACLE_BATCH_BYTES = 1 << 30
# the context's last queries its prefill keeps, so that scorers reading up to as many rank it from that prefill
RECORDED_QUERIES = 128


def _context_scores(
    model, context_ids: torch.Tensor, scorer: Scorer, tokenizer, sliding: str = "keep"
) -> dict[int, np.ndarray]:
    """The scores the cache ranks by at prefill, per compressed layer: ``{layer: [H_kv, T]}`` (a sliding
    layer under ``sliding="compress"``: ``[H_kv, W - 1]``, the context's last tokens, which it holds)."""
    from .scores import prefill_scores

    with torch.inference_mode():
        per_layer = prefill_scores(
            model, context_ids.to(model.device), scorer, tokenizer=tokenizer, sliding=sliding
        )
    return {i: s[0].float().cpu().numpy() for i, s in enumerate(per_layer) if s is not None}


def _scorer_params(scorer: Scorer) -> dict:
    """What a profile records of its scorer: the keyword defaults, and a reconstruction scorer's settings."""
    params = {k: v for k, v in scorer.params.items() if k != "surrogate"}  # kvzap's is stored as tensors
    if scorer.reconstruction is not None:
        params["reconstruction"] = dataclasses.asdict(scorer.reconstruction)
    return params


def _select_questions(questions: list[str], max_questions: int | None, seed: int) -> list[int]:
    if max_questions is None or max_questions >= len(questions):
        return list(range(len(questions)))
    if max_questions < 1:
        raise ConfigurationError(f"max_questions must be at least 1, got {max_questions}.")
    rng = np.random.default_rng(seed)
    return sorted(rng.choice(len(questions), size=max_questions, replace=False).tolist())


@dataclass
class CalibrationRun:
    """A model on a calibration set: the tokenised prompts and the (cached) per-question results.

    Shared by :func:`build_profiles` and the diagnostics, so both read the same oracle importances.
    """

    model: Any
    tokenizer: Any
    context_ids: torch.Tensor
    question_ids: list[torch.Tensor]
    selected: list[int]
    total_questions: int
    description: str
    k_max: int
    store: ResultStore
    context_sha: str
    fingerprint: str
    aggregate: str = "max"
    sliding: str = "keep"  # "compress": sliding-window layers are scored and recorded over their window
    _state: Any = None
    _scores: dict[str, dict[int, np.ndarray]] = dataclasses.field(default_factory=dict)
    prefill_seconds: float = 0.0  # the context's prefill, once a question needed it

    def oracle_key(self, index: int) -> str:
        settings: tuple = (self.k_max,) if self.aggregate == "max" else (self.k_max, self.aggregate)
        if self.sliding != "keep":
            settings += (f"sliding={self.sliding}",)
        return "oracle-" + short_sha(_CACHE_FORMAT, self.question_ids[index].tolist(), *settings)

    @property
    def context_len(self) -> int:
        return int(self.context_ids.shape[1])

    def scores(self, scorer: Scorer) -> dict[int, np.ndarray]:
        """The scorer's prefill scores on the context, ``{layer: [H_kv, T]}`` (compressed layers only)."""
        key = "scores-" + short_sha(
            _CACHE_FORMAT,
            scorer.name,
            scorer.params,
            scorer.n_queries,
            getattr(scorer.fn, "__module__", None),
            getattr(scorer.fn, "__qualname__", None),
            repr(scorer.reconstruction),
            *((f"sliding={self.sliding}",) if self.sliding != "keep" else ()),
        )
        if key in self._scores:  # read once per run (held() and score_array() both ask)
            return self._scores[key]
        cached = self.store.load(key)
        if cached is not None:
            self._scores[key] = {int(k): v for k, v in cached.items() if k != "none"}
            return self._scores[key]
        if self._replays(scorer):  # from the context's one prefill, which the oracle continues
            self.prefill()
            state = cast(ContextState, self._state)
            impl = self.model.config._attn_implementation
            with torch.inference_mode():
                per_layer = replayed_scores(state.recorded(impl), scorer, self.model.config)
            scores = {i: s[0].float().cpu().numpy() for i, s in enumerate(per_layer) if s is not None}
        else:
            scores = _context_scores(self.model, self.context_ids, scorer, self.tokenizer, self.sliding)
        self.store.save(key, {str(layer): v for layer, v in scores.items()} or {"none": np.zeros(1)})
        self._scores[key] = scores
        return scores

    def score_array(self, scorer: Scorer) -> tuple[np.ndarray, list[int]]:
        """:meth:`scores` as one float32 ``[L, H_kv, T]`` array over every decoder layer (zeros where a layer
        is never compressed; a layer that holds only the context's last tokens, a compressed sliding
        window, is zero before them: :meth:`held`), and the compressed layers, sorted."""
        config = self.model.config.get_text_config()
        per_layer = self.scores(scorer)
        full = np.zeros(
            (config.num_hidden_layers, config.num_key_value_heads, self.context_len), dtype=np.float32
        )
        for layer, values in per_layer.items():
            full[layer, :, self.context_len - values.shape[-1] :] = values
        return full, sorted(per_layer)

    def held(self, scorer: Scorer) -> dict[int, int]:
        """The compressed layers that hold fewer than the context's tokens (sliding windows under
        ``sliding="compress"``): layer -> how many of the context's last tokens it holds."""
        return {
            layer: int(v.shape[-1])
            for layer, v in self.scores(scorer).items()
            if v.shape[-1] < self.context_len
        }

    def prefill(self) -> None:
        """Prefill the context that every question continues; once (a second call does nothing).
        :meth:`decode` calls it when a question must be decoded; call it first to measure the prefill
        apart. Sets :attr:`prefill_seconds`."""
        if self._state is not None:
            return
        started = time.perf_counter()
        queries = RECORDED_QUERIES if shareable(self.model) else 0
        self._state = prefill_context(self.model, self.context_ids, queries=queries)
        self.prefill_seconds = time.perf_counter() - started

    def _replays(self, scorer: Scorer) -> bool:
        """Whether ``scorer``'s context scores come from the context's prefill, replayed (every layer full
        attention, no repeat passes, at most :data:`RECORDED_QUERIES` queries read) rather than a prefill
        of their own."""
        return (
            shareable(self.model) and scorer.reconstruction is None and scorer.n_queries <= RECORDED_QUERIES
        )

    def batches(self, indices: Sequence[int]) -> list[list[int]]:
        """``indices`` in the batches :meth:`decode` decodes together: as many questions as keep the
        attention of a batch's question tokens over the context within :data:`ORACLE_BATCH_BYTES`."""
        config = self.model.config.get_text_config()
        width = max((self.question_ids[i].shape[1] for i in indices), default=1)
        per_question = 3 * 4 * config.num_attention_heads * width * (self.context_len + width)
        size = max(1, ORACLE_BATCH_BYTES // per_question)
        return [list(indices[k : k + size]) for k in range(0, len(indices), size)]

    def decode(self, indices: Sequence[int]) -> list[np.ndarray]:
        """Decode the ``indices``-th selected questions as one batch after the context (prefilled once):
        their oracle importances, each also cached with its answer."""
        self.prefill()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        results = oracle_importances(
            self.model,
            self._state,
            [self.question_ids[i] for i in indices],
            k_max=self.k_max,
            eos_token_id=eos,
            aggregate=self.aggregate,
            sliding=self.sliding == "compress",
        )
        for index, (importance, answer) in zip(indices, results, strict=True):
            self.store.save(
                self.oracle_key(index),
                {"importance": importance, "answer": np.asarray(answer, dtype=np.int64)},
            )
        return [importance for importance, _ in results]

    def cached_oracle(self, index: int) -> np.ndarray | None:
        """The ``index``-th question's oracle importance kept by an earlier build, or ``None`` when it is
        missing, torn, foreign or NaN (to decode again)."""
        cached = self.store.load(self.oracle_key(index))
        valid = (
            cached is not None
            and "importance" in cached
            and cached["importance"].ndim == 3
            and cached["importance"].shape[-1] == self.context_len
            and bool(np.isfinite(cached["importance"]).all())
        )
        return cast("dict[str, np.ndarray]", cached)["importance"] if valid else None

    def oracle(self, index: int) -> np.ndarray:
        """Oracle importance ``[L, H_kv, T]`` of the ``index``-th selected question (decoded once, then
        cached; a missing, torn, foreign or NaN entry is decoded again)."""
        importance = self.cached_oracle(index)
        return self.decode([index])[0] if importance is None else importance


def prepare_run(
    model,
    tokenizer,
    calibration: str | os.PathLike = "planted",
    *,
    k_max: int = 64,
    max_questions: int | None = None,
    seed: int = 0,
    cache_dir: str | os.PathLike | None | Literal[False] = None,
    aggregate: str = "max",
    sliding: str = "keep",
) -> CalibrationRun:
    """Tokenise a calibration set for ``model`` and open its result cache (nothing is decoded yet).

    >>> run = prepare_run(model, tokenizer, "default", k_max=64)  # doctest: +SKIP
    >>> importance = run.oracle(0)  # [L, H_kv, T]  # doctest: +SKIP
    """
    if k_max < 1:
        raise ConfigurationError(f"k_max must be at least 1, got {k_max}.")
    if aggregate not in AGGREGATES:
        raise ConfigurationError(f"aggregate must be one of {', '.join(AGGREGATES)}, got {aggregate!r}.")
    if sliding not in SLIDING_BUILDS:
        raise ConfigurationError(f"sliding must be one of {', '.join(SLIDING_BUILDS)}, got {sliding!r}.")
    context, questions, description = load_calibration(calibration)
    selected = _select_questions(questions, max_questions, seed)
    config = model.config.get_text_config()
    context_ids = tokenizer(context, return_tensors="pt").input_ids
    question_ids = [
        tokenizer(
            QUESTION_TEMPLATE.format(question=questions[i]), return_tensors="pt", add_special_tokens=False
        ).input_ids
        for i in selected
    ]
    t = context_ids.shape[1]
    longest = t + max(q.shape[1] for q in question_ids) + k_max
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and longest > limit:
        raise ConfigurationError(
            f"Context ({t} tokens) + longest question + k_max={k_max} needs {longest} positions but the model "
            f"has {limit}; use a shorter calibration file or a smaller k_max."
        )
    fingerprint = model_fingerprint(model)
    context_sha = short_sha(context, context_ids.tolist())
    root = None if cache_dir is False else Path(cache_dir or default_cache_dir()).expanduser()
    store = ResultStore(None if root is None else root / f"{fingerprint}-{context_sha}")
    return CalibrationRun(
        model,
        tokenizer,
        context_ids,
        question_ids,
        selected,
        len(questions),
        description,
        k_max,
        store,
        context_sha,
        fingerprint,
        aggregate,
        sliding,
    )


@dataclass(frozen=True, eq=False)
class BuildSettings:
    """How :func:`build_profiles` and :func:`build_profile` build: every option but the model, its tokenizer,
    the scorers and the calibration set. Pass one (``settings=``), or its fields as keywords of either
    function (``build_profile(model, tokenizer, k_max=32)``); keywords win over ``settings``' fields.

    ``k_max``: answer tokens decoded per question. ``aggregate``: how a token's oracle importance combines
    the decode steps, ``"max"`` (the paper) or ``"mean"``. ``grid``: global ratios (default 0.01 ... 0.99).
    ``sink``/``window``: protected tokens, never counted (``window=None``: the scorer's own window).
    ``min_keep``: fraction of its evictable tokens every head keeps. ``scope``: ``"all"`` (one budget over
    all layers) or ``"layer"``. ``max_questions``: use a seeded random subset. ``seed``: that subset's and
    the build's seed. ``cache_dir``: where per-question results are kept (``False`` disables, default
    :func:`default_cache_dir`). ``show_progress``: a progress bar. ``model_id``: defaults to
    ``model.config.name_or_path``. ``extra``: free JSON metadata stored in the profile (e.g. where the
    weights came from). ``kvzap``: for the ``kvzap`` scorer, how its surrogate is trained
    (:class:`~lukv_cache.profiling.kvzap_options.KVzapTraining`: documents, corpora, family; the profile
    records it). ``memory_table``: after the profile is built, measure its loss at a grid of (kv_bits,
    eviction ratio) on windows of the calibration context and store it in the profile
    (:func:`~lukv_cache.profiling.memory_table.measure_memory_table`, what a memory budget picks its
    precision by; 4 windows of about a quarter of the context, each prefilled once and replayed into every
    cell's cache). ``table_dtype``: the precision of the table's passes (``"auto"``, the default: in bfloat16
    on a CPU that multiplies it natively, over each window's prefill at the model's precision, elsewhere the
    model's own; ``None`` or ``"model"``: the model's own;
    :func:`~lukv_cache.profiling.table_dtype.table_dtype`). ``oracle_dtype``: the precision of the oracle's
    passes (the context's prefill and scores, the questions' decode), picked the same way (``"auto"``, the
    default: a bfloat16 copy of a float32 model on a CPU that multiplies it natively; on Qwen2.5-0.5B its 24
    questions in 30 s instead of 49 s, docs/profiles.md "Cost"); the table and a kvzap surrogate's training
    run on the model itself, as their own settings say.
    ``sliding``: on a model with sliding-window layers, ``"keep"`` optimises the full-attention layers only
    (the sliding rows are the global ratio); ``"compress"`` also scores each sliding layer over the window
    it holds at the end of the context (the oracle reads the decode's attention over it) and hands out one
    budget across both kinds, each head by its own number of tokens: a profile for ``sliding="compress"``
    caches. On a model without sliding layers both build the same profile.

    >>> BuildSettings(k_max=32).scope
    'all'
    """

    k_max: int = 64
    aggregate: str = "max"
    grid: Sequence[float] | np.ndarray | None = None
    sink: int = 4
    window: int | None = None
    min_keep: float = 0.01
    scope: str = "all"
    max_questions: int | None = None
    seed: int = 0
    cache_dir: str | os.PathLike | None | Literal[False] = None
    show_progress: bool = True
    model_id: str | None = None
    extra: dict | None = None
    kvzap: KVzapTraining | None = None
    memory_table: bool = True
    table_dtype: str | None = "auto"
    oracle_dtype: str | None = "auto"
    sliding: str = "keep"

    def __post_init__(self) -> None:
        if self.sliding not in SLIDING_BUILDS:
            raise ConfigurationError(
                f"sliding must be one of {', '.join(SLIDING_BUILDS)}, got {self.sliding!r}."
            )
        if self.scope not in ("all", "layer"):
            raise ConfigurationError(f"scope must be 'all' or 'layer', got {self.scope!r}.")
        for field in ("table_dtype", "oracle_dtype"):
            if getattr(self, field) is not None:
                check_table_dtype(getattr(self, field), field)
        if self.sink < 0 or (self.window is not None and self.window < 0):
            raise ConfigurationError(
                f"sink and window must be >= 0, got sink={self.sink}, window={self.window}."
            )


def _settings(settings: BuildSettings | None, options: dict[str, Any]) -> BuildSettings:
    """``settings`` (default :class:`BuildSettings`'s) with ``options``, its fields by name, in place."""
    names = [f.name for f in dataclasses.fields(BuildSettings)]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ConfigurationError(
            f"build_profile has no option {', '.join(map(repr, unknown))}; its options are BuildSettings' "
            f"fields: {', '.join(names)}."
        )
    return dataclasses.replace(settings or BuildSettings(), **options)


def build_profiles(
    model,
    tokenizer,
    scorers: Sequence[str | Scorer] = ("keydiff",),
    calibration: str | os.PathLike = "planted",
    *,
    settings: BuildSettings | None = None,
    **options: Any,
) -> dict:
    """Build one LU-KV profile per scorer from one oracle pass: ``{scorer_name: Profile}``.

    Same arguments as :func:`build_profile`, with ``scorers`` a list (``settings`` / ``options``:
    :class:`BuildSettings`). The full-cache decoding of each
    question (the expensive part) is shared by all scorers. ``kvzap`` first learns its surrogate as
    ``kvzap`` says (:class:`~lukv_cache.profiling.kvzap_options.KVzapTraining`: KVzip targets on real
    text, then an MLP or ridge regression) and stores it in its profile.

    >>> profiles = build_profiles(model, tokenizer, scorers=["keydiff", "snapkv"])  # doctest: +SKIP
    >>> profiles["snapkv"].window  # doctest: +SKIP
    32
    """
    settings = _settings(settings, options)
    scorer_objs = list({s.name: s for s in map(get_scorer, scorers)}.values())
    if not scorer_objs:
        raise ConfigurationError("build_profiles needs at least one scorer.")
    surrogate = None
    if any(s.name == "kvzap" for s in scorer_objs):  # learn KVzap's surrogate first (unless given one)
        given = next(s for s in scorer_objs if s.name == "kvzap").params.get("surrogate")
        surrogate = given or train_kvzap(
            model,
            tokenizer,
            settings.kvzap or KVzapTraining(),
            settings.seed,
            settings.cache_dir,
            settings.show_progress,
        )
        scorer_objs = [kvzap_scorer(surrogate) if s.name == "kvzap" else s for s in scorer_objs]
    grid_arr = check_grid(DEFAULT_GRID if settings.grid is None else settings.grid)
    model_id = settings.model_id or getattr(model.config, "name_or_path", "") or ""
    if not model_id:
        raise ConfigurationError(
            "The model has no name_or_path; pass model_id='org/name' so the profile says which model it is for."
        )
    # the oracle on its copy of the model; the copy and the context's cache are gone when it returns, before the
    # table, which runs on the user's model
    profiles, t = _oracle_profiles(
        model, tokenizer, calibration, scorer_objs, grid_arr, model_id, surrogate, settings
    )
    if settings.memory_table:
        profiles = {
            name: _with_memory_table(p, model, tokenizer, t, calibration, settings)
            for name, p in profiles.items()
        }
    return profiles


def _oracle_profiles(
    model, tokenizer, calibration, scorer_objs, grid_arr, model_id: str, surrogate, settings: BuildSettings
) -> tuple[dict[str, Any], int]:
    """Each scorer's profile from the oracle (the context's prefill and scores, the questions' decode) run on
    ``model`` in ``settings.oracle_dtype`` (a copy when that is not the model's own, dropped on return), and the
    calibration context's length."""
    from tqdm.auto import tqdm

    from ..profiles.profile import Profile

    # the oracle's passes (the context's prefill, its scores, the questions' decode) in oracle_dtype
    oracle_dtype = table_dtype(model, settings.oracle_dtype)
    with model_in(model, oracle_dtype) as oracle_model:
        run = prepare_run(
            oracle_model,
            tokenizer,
            calibration,
            k_max=settings.k_max,
            max_questions=settings.max_questions,
            seed=settings.seed,
            cache_dir=settings.cache_dir,
            aggregate=settings.aggregate,
            sliding=settings.sliding,
        )
        t = run.context_len
        windows = {s.name: s.window if settings.window is None else settings.window for s in scorer_objs}
        for name, w in windows.items():
            if t - settings.sink - w < 1:
                raise ConfigurationError(
                    f"The calibration context has {t} tokens: nothing left to evict after {settings.sink} sinks and a "
                    f"window of {w} (scorer {name!r}). Use a longer context."
                )
        config = oracle_model.config.get_text_config()
        torch.manual_seed(settings.seed)
        was_training = oracle_model.training
        oracle_model.eval()
        try:
            scores = {s.name: run.score_array(s) for s in scorer_objs}
            held = {s.name: run.held(s) for s in scorer_objs}
            shape = (len(grid_arr), config.num_hidden_layers, config.num_key_value_heads)
            sums = {s.name: np.zeros(shape) for s in scorer_objs}
            say = sayer(settings.show_progress)
            solved: dict[int, dict[str, np.ndarray]] = {}

            def solve(index: int, importance: np.ndarray) -> None:
                solved[index] = {
                    s.name: solve_evict_ratios(
                        importance,
                        scores[s.name][0],
                        grid=grid_arr,
                        sink=settings.sink,
                        window=windows[s.name],
                        min_keep=settings.min_keep,
                        scope=settings.scope,
                        layers=scores[s.name][1],
                        held=held[s.name],
                    )
                    for s in scorer_objs
                }

            pending: list[int] = []
            for index in range(len(run.selected)):  # an earlier build's results: each read once, solved now
                importance = run.cached_oracle(index)
                if importance is None:
                    pending.append(index)
                else:
                    solve(index, importance)
            if say is not None:
                say(
                    f"LU-KV profile: {count(len(run.selected), 'question')}, each decoding up to {settings.k_max} "
                    f"answer tokens after the {t:,}-token context, decoded together in batches of up to "
                    f"{len(run.batches(range(len(run.selected)))[0])}; {len(run.selected) - len(pending)} kept from an "
                    "earlier build"
                )
            progress = tqdm(
                total=len(run.selected),
                initial=len(run.selected) - len(pending),
                desc="LU-KV profile",
                unit="question",
                disable=not settings.show_progress,
            )
            with progress:
                batches = run.batches(pending)
                for number, batch in enumerate(batches):
                    started, prefill = time.perf_counter(), run.prefill_seconds
                    # decoded together, each saved: a stopped build resumes after the last whole batch
                    for index, importance in zip(batch, run.decode(batch), strict=True):
                        solve(index, importance)
                    progress.update(len(batch))
                    # the first batch: the rest's time
                    if say is not None and number == 0 and len(batches) > 1:
                        seconds = time.perf_counter() - started - (run.prefill_seconds - prefill)
                        rest = len(pending) - len(batch)
                        how = f"; the context's prefill took {run.prefill_seconds:.0f} s more, once"
                        say(
                            estimate_line(
                                f"LU-KV profile (a batch of {count(len(batch), 'question')} at a time)",
                                "batch",
                                seconds,
                                seconds * rest / len(batch),
                                f"{count(rest, 'question')} left",
                                how,
                            )
                        )
            for index in range(len(run.selected)):  # summed in one order, whichever were kept
                for name, ratios in solved[index].items():
                    sums[name] += ratios
        finally:
            oracle_model.train(was_training)

        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        selected = run.selected
        provenance = {
            "prompt_format": "context" + QUESTION_TEMPLATE,
            "scope": settings.scope,
            "oracle_aggregate": settings.aggregate,
            "questions": len(selected),
            "question_indices": selected if len(selected) < run.total_questions else "all",
            "seed": settings.seed,
            "context_tokens": t,
            "calibration_sha256": run.context_sha,
            "model_fingerprint": run.fingerprint,
            "ratio_of": "evictable tokens (sinks and window excluded)",
            "sliding": settings.sliding,
            "oracle_dtype": str(oracle_dtype).removeprefix("torch."),
            **(settings.extra or {}),
        }
        profiles = {
            s.name: Profile(
                grid=grid_arr.astype(np.float32),
                evict_ratio=(sums[s.name] / len(selected)).astype(np.float32),
                model_id=model_id,
                scorer=s.name,
                head_dim=int(head_dim),
                scorer_params=_scorer_params(s),
                sink=settings.sink,
                window=windows[s.name],
                min_keep=settings.min_keep,
                k_max=settings.k_max,
                calibration=run.description,
                extra=provenance,
                surrogate=surrogate if s.name == "kvzap" else None,
            )
            for s in scorer_objs
        }
    return profiles, t


def _with_memory_table(profile, model, tokenizer, context_len: int, calibration, settings: BuildSettings):
    """``profile`` with its memory table, measured on ``model`` (the user's) on windows of the calibration
    context of ``context_len`` tokens (a context too short for 128-token continuations gets shorter ones:
    :func:`~.memory_table.continuation_for`)."""
    from .memory_table import calibration_texts, continuation_for, measure_memory_table

    table = measure_memory_table(
        model,
        tokenizer,
        profile,
        calibration_texts(calibration),
        continuation_tokens=continuation_for(context_len),
        seed=settings.seed,
        show_progress=settings.show_progress,
        dtype=settings.table_dtype,
    )
    return dataclasses.replace(profile, memory_table=table)


def build_profile(
    model,
    tokenizer,
    scorer: str | Scorer = "keydiff",
    calibration: str | os.PathLike = "planted",
    *,
    settings: BuildSettings | None = None,
    **options: Any,
):
    """Build the LU-KV profile of ``model`` for ``scorer`` from a calibration set.

    ``calibration``: a shipped set (``"planted"``, the default: a narrative with planted facts asked back;
    ``"default"``, the narrative with questions about its story; ``"expository"``) or a JSONL file (format
    in ``lukv_cache/profiling/calibration/README.md``). Every other option (``k_max``, ``grid``, ``sink``,
    ``window``, ``min_keep``, ``scope``, ``cache_dir``, ``model_id``, ``kvzap``, ...) is a field of
    :class:`BuildSettings`, given as a keyword or in ``settings=``; an unknown one is a
    :class:`~lukv_cache.errors.ConfigurationError` that lists them.

    >>> from lukv_cache import build_profile
    >>> profile = build_profile(model, tokenizer, scorer="keydiff")  # doctest: +SKIP
    >>> profile.at(0.8).shape  # doctest: +SKIP
    (30, 3)
    """
    return next(
        iter(build_profiles(model, tokenizer, [scorer], calibration, settings=settings, **options).values())
    )
