"""The model-family matrix (issue 30) as a markdown table: one row per decoder-only text family of the
installed transformers, each run in its own fresh process, plus the counts per outcome.

    OMP_NUM_THREADS=1 python benchmarks/family_table.py                      # every family, the table
    OMP_NUM_THREADS=1 python benchmarks/family_table.py llama qwen3_next      # some families
    OMP_NUM_THREADS=1 python benchmarks/family_table.py --json tests/families/baseline_outcomes.json

The case and the outcomes are those of ``tests/families/families.py`` (its docstring and README.md).
Each family runs in a child of a ``forkserver`` that has imported torch, transformers and lukv_cache but
never run a model, one child at a time on one torch thread, so a family's failure (today a failed
LUKVCache forward can poison later forwards of the same process) cannot change another's result. A child
that dies or runs past ``--timeout`` seconds is a ``raw_crash`` row.

``--smoke``: the ``llama`` row alone, its JSON written in a temporary folder and its docs' table printed from
it (``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import _smoke

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "families"))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _quiet() -> None:
    import logging
    import warnings

    import torch

    torch.set_num_threads(1)
    logging.disable(logging.WARNING)  # transformers' config chatter about token ids, rope, ...
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _child(model_type: str, queue) -> None:
    _quiet()
    import families

    try:
        queue.put(families.run_family(model_type, diagnose=True).as_dict())
    except BaseException as err:  # noqa: BLE001 - an escape from the harness itself
        queue.put(
            families.Result(
                model_type, "raw_crash", f"harness: {type(err).__name__}: {err}", type(err).__name__
            ).as_dict()
        )


def run_isolated(model_type: str, ctx, timeout: float) -> dict:
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(model_type, queue))
    start = time.perf_counter()
    proc.start()
    result = None
    try:
        result = queue.get(timeout=timeout)
    except Exception:  # noqa: BLE001 - queue.Empty: dead or too slow
        pass
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if result is None:
        why = f"ran past {timeout:.0f} s" if proc.exitcode in (None, -9) else f"exit code {proc.exitcode}"
        result = {"model_type": model_type, "outcome": "raw_crash", "detail": f"process died: {why}"}
        result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def _cell(text: str, limit: int = 160) -> str:
    text = " ".join(str(text or "").split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def markdown(results: list[dict], skipped: dict[str, str]) -> str:
    from families import OUTCOMES

    counts = collections.Counter(r["outcome"] for r in results)
    lines = ["| outcome | families |", "|---|---:|"]
    lines += [f"| {o} | {counts[o]} |" for o in OUTCOMES]
    lines += [f"| **total** | {len(results)} |", ""]
    lines += [
        "| family | outcome | attn | detail | error | deepest frame | transformers frame | lukv frame |"
    ]
    lines += ["|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: r["model_type"]):
        detail = r.get("detail", "")
        if r.get("dynamic_cache"):
            detail = f"{detail} [{r['dynamic_cache']}]"
        lines.append(
            f"| {r['model_type']} | {r['outcome']} | {r.get('attn', '')} | {_cell(detail, 220)} | "
            f"{r.get('error_type', '')} | {_cell(r.get('frame', ''))} | {_cell(r.get('transformers_frame', ''))} | "
            f"{_cell(r.get('lukv_frame', ''))} |"
        )
    lines += ["", f"Not rows of the matrix ({len(skipped)}):", ""]
    lines += [f"* {t}: {why}" for t, why in skipped.items()]
    return "\n".join(lines)


_MEANING = {
    "works": "exact at ratio 0, evicts at 0.5 (a padded row equals the row alone)",
    "typed_error": "a typed lukv error that names the model feature it cannot read (use DynamicCache)",
    "warns_nothing_compressed": "exact; a warning names the layers left alone (sliding, indexed, KV-shared)",
    "refused_by_transformers": "transformers' own cache refuses the case too (or the model takes no cache)",
}


def docs_table(results: dict[str, dict]) -> str:
    """The table docs/usage.md shows (the README gives its counts): one row per outcome, its families."""
    by_outcome = collections.defaultdict(list)
    for name, r in sorted(results.items()):
        by_outcome[r["outcome"]].append(name)
    lines = ["| outcome | what it means | families |", "|---|---|---|"]
    for outcome, names in sorted(by_outcome.items(), key=lambda kv: -len(kv[1])):
        lines.append(
            f"| {outcome} ({len(names)}) | {_MEANING.get(outcome, '')} | {', '.join(f'`{n}`' for n in names)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("families", nargs="*", help="model types (default: every row of the matrix)")
    parser.add_argument("--json", type=Path, help="also write the results (the baseline file) here")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="with --json and families: update those rows of the existing file",
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per family")
    parser.add_argument("--docs", type=Path, help="print the docs' table of a results file, run nothing")
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        out = _smoke.begin(stand_ins=False).out("families.json")
        _smoke.skipped("every family but llama (the whole matrix: tests/families, -m families)")
        main(["llama", "--json", str(out), "--timeout", str(args.timeout)])  # the table and the file
        print(docs_table(json.loads(out.read_text())["results"]))  # what --docs prints
        return 0
    if args.docs:
        print(docs_table(json.loads(args.docs.read_text())["results"]))
        return 0
    _quiet()
    import families
    import transformers

    names = args.families or families.matrix_families()
    skipped = {} if args.families else families.skipped_families()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "transformers", "transformers.modeling_utils", "lukv_cache", "families"]
    )
    start = time.perf_counter()
    results = []
    for i, name in enumerate(names, 1):
        r = run_isolated(name, ctx, args.timeout)
        results.append(r)
        print(
            f"[{i}/{len(names)}] {name}: {r['outcome']} ({r.get('seconds', 0):.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    elapsed = time.perf_counter() - start
    print(markdown(results, skipped))
    print(f"\n{len(results)} families in {elapsed:.0f} s (transformers {transformers.__version__}).")
    if args.json:
        import torch

        command = "OMP_NUM_THREADS=1 python benchmarks/family_table.py" + "".join(
            f" {a}" for a in (argv if argv is not None else sys.argv[1:])
        )
        import subprocess

        def git(*a):
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

        doc = {
            "command": command,
            "git_head": git("rev-parse", "HEAD"),
            "lukv_cache_uncommitted": git("status", "--short", "lukv_cache").splitlines(),
            "date": datetime.date.today().isoformat(),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "seconds": round(elapsed, 1),
            "counts": dict(collections.Counter(r["outcome"] for r in results)),
            "results": {r["model_type"]: r for r in sorted(results, key=lambda r: r["model_type"])},
            "skipped": skipped,
        }
        if args.merge and args.json.exists():
            old = json.loads(args.json.read_text())
            rows = {**old["results"], **doc["results"]}
            old.update(
                results=dict(sorted(rows.items())),
                counts=dict(collections.Counter(r["outcome"] for r in rows.values())),
                merged=[
                    *old.get("merged", []),
                    {"command": command, "date": doc["date"], "git_head": doc["git_head"]},
                ],
            )
            doc = old
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
