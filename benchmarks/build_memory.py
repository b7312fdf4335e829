"""Peak RSS and time of a LU-KV profile build (``lukv build``), phase by phase.

Runs the same steps as :func:`lukv_cache.profiling.build_profiles`, in the same order, with no result
cache (every oracle pass is really decoded): load the model, tokenise the calibration set, the prefill
scores of each scorer, the context prefill of the oracle, one oracle decode per question (plus the solver
for every scorer), and reports per phase the wall time, the peak RSS reached during it (``VmHWM`` reset
through ``/proc/self/clear_refs`` before each phase, Linux only) and the RSS left after it.

Defaults are small (keydiff, 2 questions, ``k_max`` 16: ~1 min on one CPU thread). The full build of the
shipped profiles (four scorers, 30 questions, ``k_max`` 64)::

    python benchmarks/build_memory.py --full

Results: ``benchmarks/results/build_memory/build_memory.md``.

``--smoke``: keydiff and snapkv, one question, ``k_max`` 4, ``--trim``, on the stand-ins of
``benchmarks/_smoke.py`` (``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import resource
import sys
import time

import _smoke
import numpy as np
import torch

FULL_SCORERS = ("keydiff", "snapkv", "expected_attention", "knorm")


def _status() -> dict[str, int]:
    """``VmHWM`` and ``VmRSS`` in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) // 1024
    return out


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _trimmed_rss() -> int:
    """RSS in MiB after glibc hands its free heap pages back (``malloc_trim``): what objects really hold."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _status()["VmRSS"]


class _Phases:
    def __init__(self, trim: bool) -> None:
        self.rows: list[tuple[str, float, int, int]] = []
        self.trim = trim

    def run(self, name: str, fn):
        gc.collect()
        _reset_peak()
        start = time.perf_counter()
        result = fn()
        elapsed = time.perf_counter() - start
        status = _status()
        self.add(name, elapsed, status["VmHWM"], status["VmRSS"])
        return result

    def add(self, name: str, elapsed: float, peak: int, after: int) -> None:
        trimmed = _trimmed_rss() if self.trim else None
        self.rows.append((name, elapsed, peak, after, trimmed))
        extra = f", after malloc_trim {trimmed} MiB" if self.trim else ""
        print(f"  {name}: {elapsed:.1f} s, peak {peak} MiB, after {after} MiB{extra}", flush=True)

    def table(self) -> str:
        head = "| phase | time (s) | peak RSS (MiB) | RSS after (MiB) |"
        rule = "|---|---:|---:|---:|"
        if self.trim:
            head, rule = head + " after malloc_trim (MiB) |", rule + "---:|"
        lines = [head, rule]
        for name, elapsed, peak, after, trimmed in self.rows:
            lines.append(
                f"| {name} | {elapsed:.1f} | {peak} | {after} |" + (f" {trimmed} |" if self.trim else "")
            )
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--scorer", action="append", help="repeat for several (default keydiff)")
    parser.add_argument("--max-questions", type=int, default=2, help="questions decoded (default 2)")
    parser.add_argument("--all-questions", action="store_true", help="every calibration question")
    parser.add_argument("--k-max", type=int, default=16, help="answer tokens per question (default 16)")
    parser.add_argument("--calibration", default="default")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--full", action="store_true", help="the shipped build: 4 scorers, all questions, k_max 64"
    )
    parser.add_argument(
        "--trim",
        action="store_true",
        help="diagnosis: after each phase call glibc's malloc_trim and report the RSS left (changes the peaks after)",
    )
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        _smoke.begin()
        args.model, args.scorer, args.max_questions, args.all_questions = (
            "smollm2",
            ["keydiff", "snapkv"],
            1,
            False,
        )
        args.k_max, args.calibration, args.threads, args.full, args.trim = 4, "default", 1, False, True
    if args.full:
        args.scorer, args.all_questions, args.k_max = list(FULL_SCORERS), True, 64
    scorers = args.scorer or ["keydiff"]
    max_questions = None if args.all_questions else args.max_questions

    from lukv_cache.models import load_model
    from lukv_cache.profiling.build import prepare_run
    from lukv_cache.profiling.solver import DEFAULT_GRID, solve_evict_ratios
    from lukv_cache.scorers import get_scorer

    torch.set_num_threads(args.threads)
    print(f"command: python benchmarks/build_memory.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"torch {torch.__version__}, {args.threads} thread(s)", flush=True)
    total_start = time.perf_counter()
    phases = _Phases(args.trim)
    model, tokenizer = phases.run("load model", lambda: load_model(args.model))
    model.eval()
    run = phases.run(
        "tokenise calibration",
        lambda: prepare_run(
            model, tokenizer, args.calibration, k_max=args.k_max, max_questions=max_questions, cache_dir=False
        ),
    )
    config = model.config.get_text_config()
    shape = (config.num_hidden_layers, config.num_key_value_heads, run.context_len)
    objs = [get_scorer(s) for s in scorers]
    full_scores = {}
    for s in objs:
        layer_scores = phases.run(f"prefill scores {s.name}", lambda s=s: run.scores(s))
        full = np.zeros(shape, dtype=np.float32)
        for layer, v in layer_scores.items():
            full[layer] = v
        full_scores[s.name] = (full, sorted(layer_scores))
    phases.run("oracle: context prefill", run.prefill)
    sums = {s.name: np.zeros((len(DEFAULT_GRID), *shape[:2])) for s in objs}
    questions = len(run.selected)
    oracle_start = time.perf_counter()
    _reset_peak()
    oracle_peak = 0
    for index in range(questions):
        importance = run.oracle(index)
        for s in objs:
            full, layers = full_scores[s.name]
            sums[s.name] += solve_evict_ratios(
                importance, full, grid=DEFAULT_GRID, window=s.window, layers=layers
            )
        oracle_peak = max(oracle_peak, _status()["VmHWM"])
    phases.add(
        f"oracle decode + solver, {questions} question(s) x k_max {args.k_max}",
        time.perf_counter() - oracle_start,
        oracle_peak,
        _status()["VmRSS"],
    )
    total = time.perf_counter() - total_start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # KiB on Linux
    print()
    print(phases.table())
    print(f"\ntotal: {total:.1f} s, peak RSS of the process (ru_maxrss) {peak} MiB")
    print(f"context {run.context_len} tokens, scorers {', '.join(scorers)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
