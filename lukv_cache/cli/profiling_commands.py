"""The profiling commands' flags: ``lukv build``, ``memory-table`` and ``show`` (which prints its legend
under the tables)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError
from ..models import PACKAGED_NAMES, add_threads_argument
from ..profiles.location import DEFAULT_REPO_ID, DEFAULT_SCORER, LOCAL_DIR_ENV, REPO_ID_ENV
from ..profiling.kvzap_options import CORPORA, FAMILIES, LENGTH_INPUTS, TARGETS, KVzapTraining
from ..profiling.table_dtype import TABLE_DTYPES
from .declare import add_command, lazy_command
from .prechecks import (
    count_in_range,
    model_exists,
    precheck_build,
    precheck_memory_table,
    ratio_in_range,
)

DEFAULT_CALIBRATION = "planted"  # `lukv build`'s set, and so `lukv show --model`'s


def _document_group(text: str) -> tuple[int, int]:
    """``"48x1024"`` -> ``(48, 1024)``; ``"48"`` -> ``(48, 1024)``."""
    count, x, tokens = text.lower().partition("x")
    try:
        group = (int(count), int(tokens) if x else 1024)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not COUNTxTOKENS (e.g. 48x1024) or a count") from None
    if min(group) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the count and the tokens must be positive")
    return group


def _groups(groups: tuple[tuple[int, int], ...]) -> str:
    return " ".join(f"{count}x{tokens}" for count, tokens in groups)


def _table_dtype_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--table-dtype",
        choices=TABLE_DTYPES,
        default="auto",
        help="precision of the memory table's passes: auto (on a bfloat16 copy of a float32 model where the CPU "
        "multiplies bfloat16 natively, over each window's prefill at the model's precision, which the layers' "
        "losses need; elsewhere the model's own), model (the model's own), or a dtype (every pass and prefill "
        "in it; docs/profiles.md) (default: %(default)s)",
    )


def profiling_commands(subparsers: Any) -> None:
    run = "lukv_cache.profiling.cli"
    build = add_command(
        subparsers,
        "build",
        "build LU-KV profiles of a model from a calibration set",
        "Decode the calibration questions with a full cache, record the oracle importance, solve the "
        "allocation for every ratio and write one profile per scorer.",
    )
    build.add_argument(
        "model",
        metavar="MODEL_PATH_OR_ID",
        help=f"a local model folder or Hub id, or a packaged model: {PACKAGED_NAMES}",
    )
    build.add_argument(
        "--scorer", action="append", help=f"scorer (repeat for several; default {DEFAULT_SCORER})"
    )
    build.add_argument(
        "--out",
        type=Path,
        help="a .safetensors file (one scorer) or a folder (writes <folder>/<scorer>.safetensors); default: "
        f"the local profile folder ${LOCAL_DIR_ENV} (else ~/.cache/lukv_cache/profiles) at <model id>/<scorer>",
    )
    build.add_argument("--push", action="store_true", help="also publish to the shared profile repository")
    build.add_argument(
        "--repo-id", help=f"shared repository for --push (default: ${REPO_ID_ENV} or {DEFAULT_REPO_ID})"
    )
    build.add_argument("--calibration", default=DEFAULT_CALIBRATION, help="shipped set name or JSONL file")
    build.add_argument("--k-max", type=int, default=64, help="answer tokens decoded per question")
    build.add_argument(
        "--aggregate",
        choices=("max", "mean"),
        default="max",
        help="oracle importance over the decode steps: max (the paper) or mean",
    )
    build.add_argument(
        "--sliding",
        choices=("keep", "compress"),
        default="keep",
        help="models with sliding-window layers: optimise the full-attention layers only (keep), or one "
        "budget across both kinds, each sliding head over its window (compress: for caches with "
        "sliding='compress')",
    )
    build.add_argument(
        "--max-questions", type=int, help="use a seeded random subset of the questions (default: all)"
    )
    build.add_argument("--seed", type=int, default=0, help="seed of --max-questions' subset")
    build.add_argument("--sink", type=int, default=4, help="protected first tokens")
    build.add_argument("--window", type=int, help="protected last tokens (default: the scorer's own)")
    build.add_argument(
        "--kvzap-documents",
        nargs="+",
        type=_document_group,
        default=None,
        metavar="COUNTxTOKENS",
        help="--scorer kvzap: groups of training documents, e.g. 48x1024 8x4096 (a plain count means "
        f"documents of 1,024 tokens; default: {_groups(KVzapTraining().documents)})",
    )
    build.add_argument(
        "--kvzap-corpus",
        nargs="+",
        choices=CORPORA,
        default=None,
        help=f"--scorer kvzap: real text its documents come from, in turn (default: "
        f"{' '.join(KVzapTraining().corpora)})",
    )
    build.add_argument(
        "--kvzap-family",
        choices=FAMILIES,
        default=KVzapTraining().family,
        help="--scorer kvzap: the surrogate, a ridge regression or a 2-layer MLP (default: %(default)s)",
    )
    build.add_argument(
        "--kvzap-hidden",
        type=int,
        default=KVzapTraining().hidden,
        help="--scorer kvzap --kvzap-family mlp: the MLP's hidden units (default: %(default)s)",
    )
    build.add_argument(
        "--kvzap-length",
        choices=LENGTH_INPUTS,
        default=KVzapTraining().length,
        help="--scorer kvzap: whether the surrogate reads the context's length: not at all, log T, or log T "
        "and every feature times it (for documents of several lengths; default: %(default)s)",
    )
    build.add_argument(
        "--kvzap-window-attention",
        action=argparse.BooleanOptionalAction,
        default=KVzapTraining().window_attention,
        help="--scorer kvzap: whether the surrogate also reads how strongly the context's last 32 queries read "
        "each token (needs --kvzap-length interactions; default: %(default)s)",
    )
    build.add_argument(
        "--kvzap-target",
        choices=TARGETS,
        default=KVzapTraining().target,
        help="--scorer kvzap: the scores the surrogate learns (their log): KVzip+ (attention times ||v W_O||, "
        "as KVzap) or KVzip's attention alone (default: %(default)s)",
    )
    build.add_argument("--min-keep", type=float, default=0.01, help="fraction every head keeps")
    build.add_argument(
        "--scope", choices=("all", "layer"), default="all", help="one budget for all layers, or per layer"
    )
    build.add_argument(
        "--cache-dir", help="per-question results, for resuming (default: ~/.cache/lukv_cache/profiling)"
    )
    build.add_argument(
        "--model-id", help="model id recorded in the profile (default: the model's name_or_path)"
    )
    build.add_argument(
        "--no-memory-table",
        action="store_true",
        help="skip measuring the profile's memory table (the loss at each kv_bits x eviction ratio and each "
        "layer's at 4 bits, what a memory budget picks its widths by; default: measured after the build, on "
        "the calibration text)",
    )
    _table_dtype_argument(build)
    build.add_argument(
        "--oracle-dtype",
        choices=TABLE_DTYPES,
        default="auto",
        help="precision of the oracle's passes (the context's prefill and scores, the questions' decode): auto "
        "(a bfloat16 copy of a float32 model where the CPU multiplies bfloat16 natively: Qwen2.5-0.5B's oracle in "
        "30 s instead of 49 s, the same held-apart scores; elsewhere the model's own), model (the model's own), or "
        "a dtype (docs/profiles.md) (default: %(default)s)",
    )
    build.add_argument("--quiet", action="store_true", help="no progress bar")
    add_threads_argument(build)
    build.set_defaults(func=lazy_command(run, "_build", precheck_build))

    table = add_command(
        subparsers,
        "memory-table",
        "measure the memory table of an existing profile file and write it into the file",
        "Measure a profile's loss at each kv_bits x eviction ratio, and each layer's with only its keys and "
        "values at 4 bits (the continuation's excess NLL against the full cache on windows of the calibration "
        "text), and write the profile with it, atomically; the rest of the profile is unchanged. What `lukv "
        "build` does after a build, for a profile built without it.",
    )
    table.add_argument(
        "model",
        metavar="MODEL_PATH_OR_ID",
        help=f"the model the profile is for: a local folder, a Hub id or a packaged model: {PACKAGED_NAMES}",
    )
    table.add_argument("profile", metavar="PROFILE", type=Path, help="a profile (.safetensors)")
    table.add_argument(
        "--calibration",
        help="shipped set name or JSONL file the profile was built from (default: the shipped set its "
        "calibration names)",
    )
    table.add_argument("--out", type=Path, help="write here instead of over PROFILE (default: PROFILE)")
    table.add_argument("--replace", action="store_true", help="measure again a table the profile holds")
    table.add_argument("--contexts", type=int, default=4, help="windows of the calibration text")
    table.add_argument(
        "--continuation-tokens", type=int, default=128, help="teacher-forced tokens after each context"
    )
    table.add_argument(
        "--context-tokens",
        type=int,
        help="tokens prefilled per window (default: the longest that leaves --contexts windows)",
    )
    table.add_argument("--seed", type=int, default=0, help="seed of the windows")
    table.add_argument(
        "--layer-contexts",
        type=int,
        help="measure the layers' losses at 4 bits on the first this many windows (default: all of them)",
    )
    table.add_argument(
        "--no-share-prefill",
        action="store_true",
        help="prefill each cell's context itself instead of replaying the window's one prefill (the same "
        "table, more passes)",
    )
    _table_dtype_argument(table)
    table.add_argument("--quiet", action="store_true", help="no progress bar")
    add_threads_argument(table)
    table.set_defaults(func=lazy_command(run, "_memory_table", precheck_memory_table))

    show = add_command(subparsers, "show", "summarise a profile; optionally plot it")
    show.add_argument("profile", metavar="PROFILE", type=Path, help="a profile (.safetensors)")
    show.add_argument(
        "--ratio",
        type=float,
        nargs="+",
        action="extend",
        help="global ratio(s) to report, e.g. --ratio 0.5 0.8 (default 0.5 0.8 0.9)",
    )
    show.add_argument(
        "--png",
        type=Path,
        help="write heatmaps at the ratios to this image (and curves, as <name>-curves.png); a .png, .pdf, "
        ".svg, ... file, .png added to a name without a suffix (default: no plots)",
    )
    show.add_argument("--json", action="store_true", help="print the metadata as JSON")
    show.add_argument(
        "--model",
        metavar="MODEL_PATH_OR_ID",
        help="also decompose the eviction loss (LU-KV vs uniform, pyramid, AdaKV, global, hybrid) on a "
        "calibration set (default: no decomposition)",
    )
    show.add_argument(
        "--calibration",
        default=DEFAULT_CALIBRATION,
        help="calibration set for --model (the same default as `lukv build`'s)",
    )
    show.add_argument("--max-questions", type=int, help="questions used by --model (default: all)")
    show.add_argument("--cache-dir", help="per-question results shared with `lukv build` (same default)")
    show.set_defaults(func=_show)


SHOW_LEGEND = (
    "loss: the oracle importance each method evicts, summed over heads and averaged over the questions\n"
    "  (lower is better); floor: the part even the oracle's own top tokens lose at that budget (what the\n"
    "  budget split alone decides); gap: what the scorer adds, the importance of the tokens it misses minus\n"
    "  that of those it keeps wrongly; loss = floor + gap. lukv: the profile's per-head budgets; uniform,\n"
    "  pyramid, adakv, global, hybrid, hybrid_global: the other allocators, with the same scorer."
)


# the image formats matplotlib's savefig writes, by the file's suffix
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".webp", ".tif", ".tiff", ".eps", ".ps")


def _plot_path(option: str, path: Path | None) -> Path | None:
    """An image file to write: not a folder, with a suffix matplotlib writes (none: ``.png``, as it would
    add itself, so that what is reported is the file written)."""
    if path is None:
        return None
    if path.is_dir():
        raise ConfigurationError(
            f"{option} {path} is a folder; give a file name, e.g. {path / 'heatmap.png'}."
        )
    if not path.suffix:
        return path.with_suffix(".png")
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise ConfigurationError(
            f"{option} {path}: matplotlib cannot write a {path.suffix!r} image; end the name in .png (or "
            f"{', '.join(PLOT_SUFFIXES[1:])})."
        )
    return path


def _show(args: argparse.Namespace) -> int:
    """``lukv show``; with ``--model``, a progress line on stderr first and a legend under the tables."""
    model_exists(args.model, "--model")
    for ratio in args.ratio or ():
        ratio_in_range(ratio)
    count_in_range("--max-questions", args.max_questions, 1, "questions used by --model")
    args.png = _plot_path("--png", args.png)
    if args.model:
        ratios = " ".join(f"{r:g}" for r in (args.ratio or [0.5, 0.8, 0.9]))
        print(
            f"lukv show: loading {args.model} and decomposing the eviction loss on the calibration set "
            f"{args.calibration!r} at ratio(s) {ratios} (about a minute on SmolLM2-135M; the per-question "
            "results are cached for the next run)...",
            file=sys.stderr,
            flush=True,
        )
    code = lazy_command("lukv_cache.profiling.cli", "_show")(args)
    if args.model and not args.json:
        print("\n" + SHOW_LEGEND)
    return code
