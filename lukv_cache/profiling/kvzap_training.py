"""KVzap's surrogate trained for a build: each document's KVzip targets kept on disk (a stopped build
resumes), then the surrogate learnt as :class:`~lukv_cache.profiling.kvzap_options.KVzapTraining` says."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..errors import ConfigurationError
from .eta import DocumentClock, sayer
from .kvzap_options import KVzapTraining
from .result_store import ResultStore, default_cache_dir, model_fingerprint, short_sha
from .solver import DEFAULT_GRID
from .spills import spill_folder


def targets_root(cache_dir) -> Path | None:
    """Where a kvzap build keeps its targets and spills its MLP rows (``False``: nowhere)."""
    return default_cache_dir() if cache_dir is None else (Path(cache_dir) if cache_dir is not False else None)


def cached_kvzip_targets(
    model, tokenizer, cache_dir=None, target: str = "kvzip_plus"
) -> Callable[[torch.Tensor], dict]:
    """``targets(ids)``: :func:`~lukv_cache.profiling.kvzap.kvzip_targets` of a document ``[1, T]``
    (``{layer: [1, T, H]}``; ``target``: ``"kvzip_plus"`` or ``"kvzip"``), kept in ``cache_dir`` (default
    :func:`default_cache_dir`, ``False``: not kept) under the model's fingerprint, the target and the
    tokens, so a build that stops resumes without the repeat passes it ran, and benchmarks share them."""
    from .kvzap import kvzip_targets

    store = _targets_store(cache_dir)
    fingerprint = model_fingerprint(model)

    def targets(ids: torch.Tensor) -> dict[int, torch.Tensor]:
        key = short_sha(f"{target}_targets", fingerprint, ids.tolist())
        saved = store.load(key)
        if saved is None:
            computed = {layer: t.numpy() for layer, t in kvzip_targets(model, tokenizer, ids, target).items()}
            store.save(key, {str(layer): t for layer, t in computed.items()})
            return {layer: torch.from_numpy(t) for layer, t in computed.items()}
        return {int(layer): torch.from_numpy(t) for layer, t in saved.items()}

    return targets


def _targets_store(cache_dir) -> ResultStore:
    root = targets_root(cache_dir)
    return ResultStore(None if root is None else root / "kvzap")


def kvzip_targets_kept(
    model, documents: Sequence[torch.Tensor], cache_dir=None, target: str = "kvzip"
) -> list[bool]:
    """Whether :func:`cached_kvzip_targets` keeps each document's targets from an earlier build."""
    store, fingerprint = _targets_store(cache_dir), model_fingerprint(model)
    return [store.has(short_sha(f"{target}_targets", fingerprint, ids.tolist())) for ids in documents]


def train_kvzap(model, tokenizer, training: KVzapTraining, seed: int, cache_dir, show_progress: bool):
    """KVzap's surrogate for ``model``, trained as ``training`` says; each document's KVzip targets (the
    repeat passes, most of the time) are kept in ``cache_dir`` so an interrupted build resumes."""
    from tqdm.auto import tqdm

    from ..models import max_positions
    from ..scorers.kvzap import KVZAP_WINDOW
    from .kvzap import score_thresholds, train_surrogate

    if not isinstance(training, KVzapTraining):
        raise ConfigurationError(f"kvzap must be a KVzapTraining, got {type(training).__name__}.")
    docs = training.corpus(tokenizer, seed, max_positions(model.config))
    targets = cached_kvzip_targets(model, tokenizer, cache_dir, training.target)

    # the MLP's rows wait on disk, next to the cached targets, one file per layer (memory: one layer's rows);
    # the folder goes when training ends, fails or is stopped by SIGTERM, and a killed build's at the next
    root = targets_root(cache_dir)
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
    spill = spill_folder(root) if training.family == "mlp" else contextlib.nullcontext()
    clock = DocumentClock(  # says what it runs, then (once) an estimate measured on the first document
        sayer(show_progress), docs, kvzip_targets_kept(model, docs, cache_dir, training.target)
    )
    bar = tqdm(total=len(docs), desc="KVzap surrogate", unit="document", disable=not show_progress)
    with bar, spill as folder:
        surrogate = train_surrogate(
            model,
            tokenizer,
            docs,
            family=training.family,
            features=training.features,
            alpha=training.alpha,
            samples=training.samples,
            hidden=training.hidden,
            seed=seed,
            progress=lambda done: clock.done(done, bar),
            targets_of=targets,
            meta={"corpus": f"{training.describe()} ({len(docs)} documents)", "target": training.target},
            spill=folder,
        )
    spread = docs[:: max(1, len(docs) // 8)][:8]  # 8 documents across the groups, lengths and corpora
    surrogate.meta["thresholds"] = score_thresholds(model, surrogate, spread, DEFAULT_GRID, KVZAP_WINDOW)
    return surrogate
