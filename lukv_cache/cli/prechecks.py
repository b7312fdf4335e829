"""The arguments of ``lukv`` commands refused before torch is imported: a model folder that is not there,
ratios, counts, files, and each command's combinations, one ``error:`` line each."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

from .._names import refuse_unknown
from ..errors import ConfigurationError
from ..evaluation.methods import (
    MAX_NEEDLES,
    MIN_CONTEXT_TOKENS,
    TASKS,
    check_bench_numbers,
    check_count,
    kv_bits_list,
    memory_list,
)
from ..models import PACKAGED_NAMES

# Scorer and allocator names are checked against the built-in ones (lukv_cache._names, no torch): a `lukv`
# run loads no plugins (no entry points, no user modules), so the registries hold only those names and a
# name that is not built in would be refused by them too, after the torch import.


def _path_like(value: str) -> bool:
    """Whether a model argument names a local folder rather than a Hub id (``org/name``): it starts with
    ``.``, ``/`` or ``~``, ends with a separator, or has more separators than a Hub id's one."""
    separators = value.count(os.sep) + (value.count(os.altsep) if os.altsep else 0)
    return value.startswith((".", "/", "~")) or value.endswith(os.sep) or separators > 1


def model_exists(model: str | None, option: str = "") -> None:
    """A path-like model argument that is not a folder is one ``error:`` line, not huggingface_hub's
    complaint about repo ids."""
    if not model or not _path_like(model):
        return
    path = Path(model).expanduser()
    if path.is_dir():
        return
    what = f"{option} {model}" if option else model
    if path.exists():
        raise ConfigurationError(f"{what}: is a file, not a model folder (one with config.json).")
    raise ConfigurationError(
        f"{what}: no such folder. Give a local model folder, a Hub id (org/name) or a packaged model: "
        f"{PACKAGED_NAMES}."
    )


def ratio_in_range(value: Any) -> float:
    """The check :func:`lukv_cache.cache.check_ratio` makes, without importing torch."""
    try:
        ratio = float(value)
    except (TypeError, ValueError):
        ratio = math.nan
    if math.isnan(ratio) or not 0.0 <= ratio < 1.0:
        raise ConfigurationError(
            f"ratio is the fraction of the prompt's KV entries to remove and must be in [0, 1); got {value!r}. "
            "ratio=0.8 keeps 20% of the tokens."
        )
    return ratio


def _file_exists(option: str, path: str | None) -> None:
    if path is not None and not Path(path).expanduser().is_file():
        why = "is a folder, not a file" if Path(path).expanduser().is_dir() else "no such file"
        raise ConfigurationError(f"{option} {path}: {why}.")


def _folder_exists(option: str, path: str | None) -> None:
    """A folder option (``--profiles``) that names no folder is one ``error:`` line, not a silent search of
    nothing."""
    if path is None or Path(path).expanduser().is_dir():
        return
    why = "is a file, not a folder" if Path(path).expanduser().exists() else "no such folder"
    raise ConfigurationError(
        f"{option} {path}: {why}. Give a folder of profiles (<model id>/<scorer>.safetensors inside), or "
        f"leave {option} out."
    )


def count_in_range(option: str, value: int | None, low: int, what: str, high: int | None = None) -> None:
    """An integer option (``None``: not given) in ``[low, high]``, else one ``error:`` line saying so."""
    if value is not None:
        check_count(option, value, low, what, high)


def precheck_check(args: argparse.Namespace) -> None:
    model_exists(args.model)
    _folder_exists("--profiles", args.profiles)
    for ratio in args.ratios or ():
        ratio_in_range(ratio)
    if args.memory is not None:
        memory_list(args.memory)
        if args.ratios is not None:
            raise ConfigurationError(
                "Give --memory or --ratios, not both: --memory measures each budget (which chooses the ratio "
                "and the bits), --ratios each ratio."
            )
        if args.kv_bits is not None:
            raise ConfigurationError(
                "--memory and --kv-bits do not combine: a memory budget chooses the bits itself (the table "
                "shows what it chose). Drop --kv-bits, or use --ratios with --kv-bits."
            )
    if args.ratios == [] or args.memory == [] or (args.allocators is not None and not args.allocators):
        raise ConfigurationError(
            "Give at least one ratio and one allocator, e.g. --ratios 0.5 --allocators uniform."
        )
    refuse_unknown("scorer", [args.scorer] if args.scorer is not None else [])
    refuse_unknown("allocator", args.allocators or [])
    if not 0.0 < args.tolerance <= 1.0:
        raise ConfigurationError(
            f"tolerance is the agreement a ratio must keep and must be in (0, 1], got {args.tolerance!r}; e.g. 0.9."
        )
    if args.max_new_tokens < 1:
        raise ConfigurationError(
            f"max_new_tokens must be at least 1 (the answers compared are decoded), got {args.max_new_tokens!r}; "
            "e.g. 24."
        )
    if not args.calibration and not args.text:
        raise ConfigurationError(
            "Nothing to check: pass calibration JSONL files, or text files and --questions."
        )
    if args.text and args.questions is None:
        raise ConfigurationError(
            "Plain text files need a questions file (--questions, one question per line)."
        )
    for path in args.text or ():
        _file_exists("--text", path)
    _file_exists("--questions", args.questions)
    _file_exists("--answers", args.answers)
    from ..profiling.calibration import calibration_path  # light: json and paths

    for item in args.calibration or ():
        calibration_path(item)


def precheck_demo(args: argparse.Namespace) -> None:
    model_exists(args.model, "--model")
    _folder_exists("--profiles", args.profiles)
    for ratio in args.ratios:
        ratio_in_range(ratio)
    count_in_range("--contexts", args.contexts, 1, "texts")
    count_in_range(
        "--context-tokens", args.context_tokens, MIN_CONTEXT_TOKENS, "length of each text in tokens"
    )
    count_in_range("--facts", args.facts, 1, "planted facts per text", MAX_NEEDLES)


def _parts(values: list[str] | None) -> list[str]:
    """``--scorers a b`` and ``--scorers a,b`` both work (as ``lukv bench`` reads them)."""
    return [part for value in values or () for part in str(value).split(",") if part]


def precheck_bench(args: argparse.Namespace) -> None:
    model_exists(args.model, "--model")
    _folder_exists("--profiles", args.profiles)
    check_bench_numbers(args.samples, args.context_tokens, args.needles, args.continuation_tokens, flags=True)
    for part in _parts(args.ratios):
        ratio_in_range(part)
    refuse_unknown("scorer", _parts(args.scorers))
    refuse_unknown("allocator", _parts(args.allocators))
    kv_bits_list(_parts(args.kv_bits))
    if memory_list(_parts(args.memory)) and args.kv_bits and not args.ratios:
        raise ConfigurationError(
            "--kv-bits sets the bits of the --ratios' caches, and --memory runs no ratio unless --ratios is "
            "given: a memory budget chooses its own bits. Drop --kv-bits, or add --ratios."
        )
    _split_needs_memory(args)
    for task in _parts(args.tasks):  # the runner's own check, before the model loads
        if task not in TASKS:
            raise ConfigurationError(f"Unknown task {task!r}; choose from {', '.join(TASKS)}.")


def _split_needs_memory(args: argparse.Namespace) -> None:
    """``--split`` shares a memory budget's bytes: without ``--memory`` it would change nothing."""
    if getattr(args, "split", None) is not None and not _parts(args.memory):
        raise ConfigurationError(
            f"--split {args.split} shares the --memory budgets' bytes between layer kinds, and no --memory is "
            "given: add --memory, or drop --split (--ratios evict every layer at the ratio)."
        )


def precheck_ruler(args: argparse.Namespace) -> None:
    from ..evaluation.ruler import MIN_LENGTH
    from ..evaluation.ruler import TASKS as RULER_TASKS

    model_exists(args.model)
    _folder_exists("--profiles", args.profiles)
    count_in_range("--samples", args.samples, 1, "samples per task and length")
    for length in args.lengths:
        count_in_range("--lengths", length, MIN_LENGTH, "RULER lengths in the model's tokens")
    for part in _parts(args.ratios):
        ratio_in_range(part)
    refuse_unknown("scorer", _parts(args.scorers))
    refuse_unknown("allocator", _parts(args.allocators))
    kv_bits_list(_parts(args.kv_bits))
    memory_list(_parts(args.memory))
    _split_needs_memory(args)
    for task in _parts(args.tasks):
        if task not in RULER_TASKS:
            raise ConfigurationError(f"Unknown RULER task {task!r}; choose from {', '.join(RULER_TASKS)}.")


def precheck_build(args: argparse.Namespace) -> None:
    model_exists(args.model)
    refuse_unknown("scorer", args.scorer or ())
    count_in_range("--k-max", args.k_max, 1, "answer tokens decoded per question")
    count_in_range("--max-questions", args.max_questions, 1, "questions used")
    count_in_range("--sink", args.sink, 0, "protected first tokens")
    count_in_range("--window", args.window, 0, "protected last tokens")
    if not 0.0 <= args.min_keep < 1.0:
        raise ConfigurationError(
            f"--min-keep (the fraction every head keeps) must be in [0, 1), got {args.min_keep!r}; e.g. 0.01."
        )


def precheck_memory_table(args: argparse.Namespace) -> None:
    model_exists(args.model)
    _file_exists("PROFILE", str(args.profile))
    if args.contexts < 1 or args.continuation_tokens < 2:
        raise ConfigurationError(
            f"--contexts must be >= 1 and --continuation-tokens >= 2, got {args.contexts} and "
            f"{args.continuation_tokens}."
        )
    if args.context_tokens is not None and args.context_tokens < 1:
        raise ConfigurationError(f"--context-tokens must be >= 1, got {args.context_tokens}.")
    layer_contexts = getattr(args, "layer_contexts", None)
    if layer_contexts is not None and not 1 <= layer_contexts <= args.contexts:
        raise ConfigurationError(
            f"--layer-contexts must be between 1 and --contexts ({args.contexts}), got {layer_contexts}."
        )
    if args.calibration is not None:
        from ..profiling.calibration import calibration_path  # light: json and paths

        calibration_path(args.calibration)
