"""Run every maintained benchmark script's ``--smoke`` run, one after another, each in its own process: CI
runs this, so a script that no longer runs fails CI.

Every ``benchmarks/*.py`` but this one and the shared helper modules (``_*.py``) is run as
``python benchmarks/<script> --smoke`` on one thread (``OMP_NUM_THREADS=1``), from a temporary working
folder. A smoke run uses tiny stand-ins for the model, the text and the profiles (``benchmarks/_smoke.py``)
and checks that the code runs, not its figures. One line per script: its name, seconds and ``ok`` or
``FAILED`` (then the end of its output), and the parts it left out (``smoke: skipped ...``). A script fails
when it exits non-zero, runs past ``--timeout`` or never says ``smoke:`` (it ignored the flag). Exits 1 if
any failed.

    python benchmarks/smoke.py                     # every script
    python benchmarks/smoke.py cache_bench run     # some of them
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def scripts() -> list[Path]:
    """The maintained benchmark scripts: every ``benchmarks/*.py`` but this one and the helpers (``_*.py``);
    the experiments, kept beside their results under ``benchmarks/results/``, are not run."""
    return sorted(
        p for p in HERE.glob("*.py") if p.name != Path(__file__).name and not p.name.startswith("_")
    )


def run_one(script: Path, timeout: float) -> tuple[bool, float, str]:
    """``(ok, seconds, output)`` of ``python <script> --smoke``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lukv-smoke-cwd-") as cwd:  # a relative path lands here
        try:
            proc = subprocess.run(
                [sys.executable, str(script), "--smoke"],
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as err:
            out = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else err.stdout or ""
            return False, time.perf_counter() - started, f"{out}\nran past {timeout:.0f} s"
    seconds = time.perf_counter() - started
    output = proc.stdout
    if proc.returncode != 0:
        return False, seconds, f"{output}\nexit code {proc.returncode}"
    if not any(line.startswith("smoke:") for line in output.splitlines()):
        return False, seconds, f"{output}\nno 'smoke:' line: the script did not run in smoke mode"
    return True, seconds, output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="scripts to run (default: all), with or without .py")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per script (300)")
    parser.add_argument("--tail", type=int, default=40, help="lines of a failed script's output shown (40)")
    args = parser.parse_args(argv)
    found = scripts()
    if args.names:
        wanted = {name.removesuffix(".py") for name in args.names}
        unknown = wanted - {p.stem for p in found}
        if unknown:
            parser.error(f"no such benchmark script: {', '.join(sorted(unknown))}")
        found = [p for p in found if p.stem in wanted]
    width = max(len(p.name) for p in found)
    failed = []
    started = time.perf_counter()
    for script in found:
        ok, seconds, output = run_one(script, args.timeout)
        print(f"{script.name:<{width}} {seconds:6.1f} s  {'ok' if ok else 'FAILED'}", flush=True)
        for line in output.splitlines():
            if line.startswith("smoke: skipped"):
                print(f"    {line}", flush=True)
        if not ok:
            failed.append(script.name)
            print("\n".join(f"    | {line}" for line in output.splitlines()[-args.tail :]), flush=True)
    total = time.perf_counter() - started
    print(f"{len(found) - len(failed)} of {len(found)} smoke runs ok in {total:.0f} s", flush=True)
    if failed:
        print(f"FAILED: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
