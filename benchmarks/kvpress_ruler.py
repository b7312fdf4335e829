"""RULER through kvpress 0.5.5's own pipeline and presses, on the very samples `lukv ruler` ran (issue 55,
"kvpress side by side"): same samples, same model weights, same greedy decode and scoring, in kvpress's own
environment, appended to a results file in the format of ours, and one table of both libraries.

Environment (kvpress 0.5.5 needs transformers < 5.3, lukv_cache >= 5.23, so this runs in a venv of its own;
the exact lines and ``pip freeze`` are in ``benchmarks/results/ruler/kvpress_env.txt``)::

    python -m venv /tmp/kvp
    /tmp/kvp/bin/pip install "torch==2.13.0" "kvpress==0.5.5" "transformers==4.57.3"

Command, from the repository root (lukv_cache is read from ``PYTHONPATH=.`` for three modules that import
neither torch nor transformers: ``lukv_cache.evaluation.ruler.scoring``, RULER's metrics,
``lukv_cache.evaluation.ruler.store``, the resumable JSONL ``Store``, and ``...ruler.prompt``, whose
``prompt_ids`` each sample's kvpress tokenization is checked against: a difference is a ``warning:`` line)::

    OMP_NUM_THREADS=1 PYTHONPATH=. /tmp/kvp/bin/python benchmarks/kvpress_ruler.py \\
        --presses full snapkv adakv kvzip lukv keydiff --ratios 0.8 --samples 5 --threads 1 \\
        --check benchmarks/results/ruler/qwen_4k.jsonl --out benchmarks/results/ruler/kvpress_qwen_4k.jsonl
    PYTHONPATH=. /tmp/kvp/bin/python benchmarks/kvpress_ruler.py --table --out benchmarks/results/ruler/kvpress_qwen_4k.jsonl \\
        --check benchmarks/results/ruler/qwen_4k.jsonl      # the table only (no torch, no model)

Inputs: the samples ``lukv ruler`` saved (``--samples-dir``, default
``benchmarks/results/ruler/qwen_4k.samples/seed42/4096``: RULER's own generators, seed 42, 4096 tokens, in the
columns of kvpress's RULER dataset: context, question, answer_prefix, answer, task, max_new_tokens), the first
``--samples`` of each task; the model folder ``lukv`` converted from the packaged GGUF (``--model``, default
``~/.cache/lukv_cache/qwen2.5-coder-0.5b-instruct``: Qwen2.5-Coder-0.5B-Instruct, float32, sdpa, as ours).
Output: ``--out`` (default ``benchmarks/results/ruler/kvpress_qwen_4k.jsonl``), one JSON line per finished
(length, task, index, method) after the run header ``{"model": "Qwen/Qwen2.5-Coder-0.5B-Instruct", "seed":
42}``; a rerun runs only what is missing. Fields as ours: length, task, index, method, score, prediction,
answer, kv_bytes, full_kv_bytes, context_tokens, question_tokens, seconds, prefill_seconds; plus
masked_kv_bytes and kept_kv_bytes (below).

Protocol: kvpress's ``KVPressTextGenerationPipeline`` itself (``pipeline("kv-press-text-generation")``),
called once per (sample, press) as ``pipe(context, question=..., answer_prefix=..., press=...,
max_new_tokens=...)``: the context in the chat template's user turn is prefilled through ``model.model`` with
the press's hooks (each press prefills on its own: no prefill is shared), the question, the template's
closing part and the answer prefix forwarded through the compressed cache, greedy decoding up to
max_new_tokens (niah 128, vt 30, cwe 120, fwe 50, qa 32) or the generation config's end token. Scored by
lukv_cache's ``scoring.score`` (RULER's string_match_all for niah/vt/cwe/fwe, string_match_part for qa).

Presses (``--presses``; method names ``kvpress:<press>@<ratio>``, ``kvpress:full``), kvpress's defaults:

* ``full``: no press (kvpress's pipeline with ``press=None``); must predict exactly what our ``full`` does.
* ``snapkv``: ``SnapKVPress(ratio)`` (window 64, pooling kernel 5; the last 64 context tokens' attention
  scores the rest, the window is always kept); removes the same share from every (layer, head).
* ``adakv``: ``AdaKVPress(SnapKVPress(ratio))`` (alpha_safeguard 0.2): SnapKV's scores ranked across the
  heads of a layer (each head keeps at least 0.2 of its uniform share). Masks.
* ``kvzip``: ``KVzipPress(ratio)`` (layerwise False, n_sink 4, chunk 2048): the context's reconstruction
  ("Repeat the previous context exactly.") scores each KV pair; ranked across all layers and heads. Masks.
* ``keydiff``: ``KeyDiffPress(ratio)``: minus the cosine of each key to its head's mean normalised key;
  uniform share per (layer, head). (Our ``keydiff`` scorer computes the same score.)
* ``lukv``: ``LUKVPress(KeyDiffPress(), ratio, sink, window)`` fed OUR budget curve: LUKVPress downloads
  its curve at run time from a table keyed by (model id, scorer press), which has only Llama-3.1-8B with
  ExpectedAttention; we set its ``_budget_curves`` to the ``evict_ratio`` tensor of our keydiff profile
  (``--profile``, default ``profiles_hub/Qwen/Qwen2.5-Coder-0.5B-Instruct/keydiff.safetensors``). Both are
  ``[99, layers, KV heads]`` arrays of each head's eviction share at the global ratios 0.01 ... 0.99 (the
  shipped profiles' ``grid``; another grid is interpolated as lukv reads it), which LUKVPress indexes at
  ``round(100 * ratio) - 1``, so the mapping is one to one;
  sink and window are the profile's (4 and 1, LUKVPress's defaults). One difference: our profile's shares
  are of the evictable tokens (sinks and window excluded), LUKVPress applies them to all the context's
  tokens while protecting sink and window (5 tokens of ~3,700 here). Masks. The kvzip profile cannot be fed:
  LUKVPress needs a ``ScorerPress`` and ``KVzipPress`` is not one.
* ``kvzap`` is not run: kvpress's ``KVzapPress`` loads ``nvidia/KVzap-{mlp,linear}-<model>`` from the Hub at
  run time (no such model for Qwen2.5-Coder-0.5B, and no Hub here); our kvzap profile's surrogate reads other
  features (pre-RoPE keys, values, window attention, 517 inputs) than kvpress's (the 896 hidden states), so
  it cannot stand in.

Memory: ``kv_bytes`` is what the cache really holds after the context (the DynamicCache passed to the
pipeline, which the pipeline cuts back to the context after each answer): the sum of ``nbytes`` of every
layer's keys and values. SnapKV and KeyDiff remove pairs (``kv_bytes`` = the kept share). AdaKV, KVzip and
LU-KV only MASK: every pair stays in the cache and decoding swaps the masked keys for a fake key that no
query attends to (kvpress's ``attention_patch``), so they hold the full cache (``kv_bytes`` =
``full_kv_bytes``); ``masked_kv_bytes`` is the bytes of the masked pairs (read from each attention module's
``masked_key_indices``) and ``kept_kv_bytes`` = ``kv_bytes - masked_kv_bytes``, what an implementation
that removed them would hold. ``full_kv_bytes``: the whole context's keys and values (float32).

Time: ``seconds`` is the pipeline call (prefill with the press, compression, question and decode);
``prefill_seconds`` the part before the first answer's forward (prefill and compression, KVzip's
reconstruction passes included). Ours records the methods' own time after one shared prefill instead.

``--smoke`` (in the main interpreter, ``benchmarks/smoke.py``): what runs without kvpress, on the stand-ins
of ``benchmarks/_smoke.py``: the budget curve read from a profile (a stand-in on another grid, interpolated),
the results file through lukv's ``Store``, the consistency check and the table on made-up records; it says
what it skipped: kvpress's pipeline and presses (kvpress pins transformers < 5.3: run it in its venv), the
real model and samples.

Two things this script does to run kvpress faithfully on this model folder:

* the folder was written by transformers 5 (``rope_parameters: {rope_theta: 1e6}``), which transformers
  4.57 does not read (it would use rope_theta 10,000): the config's ``rope_theta`` is set from it;
* importing ``lukv_cache`` registers lukv's attention routing in transformers' registry. kvpress is imported
  first, so its own patch (set in the registry's local mapping, which wins over the global ``register``
  lukv uses) stays in front of transformers' stock functions; :func:`check_attention` asserts this before
  any model runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from _out import default_out

MODEL_ID = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
SEED = 42
TASKS = (
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
    "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2",
)  # fmt: skip
PRESSES = ("full", "snapkv", "adakv", "kvzip", "lukv", "keydiff")
RESULTS = Path("benchmarks/results/ruler")
DEFAULTS = {
    "samples_dir": RESULTS / "qwen_4k.samples" / "seed42" / "4096",
    "model": Path("~/.cache/lukv_cache/qwen2.5-coder-0.5b-instruct").expanduser(),
    "profile": Path("profiles_hub/Qwen/Qwen2.5-Coder-0.5B-Instruct/keydiff.safetensors"),
}
PRESS_NAMES = {"adakv": "adakv-snapkv", "lukv": "lukv-keydiff"}


def method_name(press: str, ratio: float | None) -> str:
    """``kvpress:full`` or ``kvpress:<press>@<ratio>`` (``adakv`` -> ``adakv-snapkv``, ``lukv`` ->
    ``lukv-keydiff``: the scorer press each wraps)."""
    return "kvpress:full" if press == "full" else f"kvpress:{PRESS_NAMES.get(press, press)}@{ratio:g}"


def read_samples(folder: Path, task: str, n: int) -> list[dict[str, Any]]:
    path = folder / f"{task}.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(rows) < n:
        sys.exit(f"error: {path} holds {len(rows)} samples, fewer than --samples {n}")
    return rows[:n]


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    return [r for r in rows if r.get("kind") == "sample"]


# ---------------------------------------------------------------------------------------------- kvpress


def load_curve(path: Path) -> tuple[Any, dict[str, str]]:
    """Our profile's ``evict_ratio`` as LUKVPress's ``[99, L, H]`` curve at 0.01 ... 0.99, and the profile's
    metadata. On that grid (the shipped profiles') it is the tensor itself; on another grid it is interpolated
    as lukv_cache's ``Profile`` reads it (linear between grid points, scaled from 0 below the first, the
    last's above it)."""
    import numpy as np
    from safetensors import safe_open

    with safe_open(str(path), "np") as handle:
        grid, curve, meta = handle.get_tensor("grid"), handle.get_tensor("evict_ratio"), handle.metadata()
    target = np.arange(1, 100) / 100
    if grid.shape == (99,) and np.allclose(grid, target, atol=1e-6):
        return curve.astype(np.float32), meta
    grid, curve = grid.astype(np.float64), curve.astype(np.float64)
    flat = curve.reshape(len(grid), -1)
    out = np.stack([np.interp(target, grid, flat[:, i]) for i in range(flat.shape[1])], axis=1)
    low = target < grid[0]
    out[low] = flat[0] * (target[low] / grid[0])[:, None]
    return np.clip(out, 0, 1).reshape(99, *curve.shape[1:]).astype(np.float32), meta


def make_press(name: str, ratio: float, curve: Any, meta: dict[str, str]) -> Any:
    from kvpress import AdaKVPress, KeyDiffPress, KVzipPress, LUKVPress, SnapKVPress

    if name == "full":
        return None
    if name == "snapkv":
        return SnapKVPress(compression_ratio=ratio)
    if name == "adakv":
        return AdaKVPress(SnapKVPress(compression_ratio=ratio))
    if name == "kvzip":
        return KVzipPress(compression_ratio=ratio)
    if name == "keydiff":
        return KeyDiffPress(compression_ratio=ratio)
    if name == "lukv":
        press = LUKVPress(
            press=KeyDiffPress(), compression_ratio=ratio, sink=int(meta["sink"]), window=int(meta["window"])
        )
        press._budget_curves = curve  # what post_init_from_model would fetch from its URL table
        return press
    raise ValueError(name)


def check_attention() -> None:
    """Every attention function transformers will call is kvpress's ``attention_patch`` wrapper around
    transformers' own function (no lukv routing in between)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    fn = ALL_ATTENTION_FUNCTIONS["sdpa"]
    inner = [c.cell_contents for c in (fn.__closure__ or ())]
    if fn.__module__ != "kvpress.attention_patch" or inner != [sdpa_attention_forward]:
        sys.exit(
            f"error: transformers' sdpa attention is {fn.__module__}.{fn.__qualname__}, not kvpress's patch "
            "around transformers' own: import kvpress before lukv_cache"
        )


def load_model(folder: Path, threads: int) -> tuple[Any, Any]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    config = AutoConfig.from_pretrained(folder)
    rope = getattr(config, "rope_parameters", None)  # written by transformers 5; 4.57 reads rope_theta
    if isinstance(rope, dict) and "rope_theta" in rope:
        if rope.get("rope_type", "default") != "default":
            sys.exit(f"error: {folder}'s rope_parameters {rope} need a rope_scaling this script does not map")
        config.rope_theta = float(rope["rope_theta"])
    model = AutoModelForCausalLM.from_pretrained(
        folder, config=config, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def cache_bytes(cache: Any, model: Any) -> tuple[int, int]:
    """The bytes of keys and values ``cache`` holds, and those of them the attention modules mask."""
    held = sum(int(layer.keys.nbytes + layer.values.nbytes) for layer in cache.layers)
    masked = 0
    for layer, decoder in zip(cache.layers, model.model.layers):
        indices = getattr(decoder.self_attn, "masked_key_indices", None)
        if indices is not None:
            pair = layer.keys.shape[-1] * (layer.keys.element_size() + layer.values.element_size())
            masked += int(indices[0].numel()) * pair
    return held, masked


def run(args: argparse.Namespace) -> None:
    from importlib.metadata import version

    import kvpress  # noqa: F401  (first: see check_attention)
    import torch
    from transformers import DynamicCache, pipeline

    from lukv_cache.evaluation.ruler.prompt import Sample, prompt_ids
    from lukv_cache.evaluation.ruler.scoring import score
    from lukv_cache.evaluation.ruler.store import Store

    check_attention()
    store = Store(args.out, {"model": MODEL_ID, "seed": SEED})
    curve, meta = load_curve(args.profile) if "lukv" in args.presses else (None, {})
    methods = [
        (p, None if p == "full" else r)
        for p in args.presses
        for r in ([None] if p == "full" else args.ratios)
    ]
    methods = list(dict.fromkeys(methods))
    units = [
        (task, row, press, ratio)
        for task in args.tasks
        for row in read_samples(args.samples_dir, task, args.samples)
        for press, ratio in methods
        if (args.length, task, int(row["index"]), method_name(press, ratio)) not in store.done
    ]
    print(
        f"kvpress {version('kvpress')}, transformers {version('transformers')}: {len(units)} runs to do "
        f"({len(store.done)} in {args.out})",
        flush=True,
    )
    if not units:
        return
    model, tokenizer = load_model(args.model, args.threads)
    check_attention()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    stamps: list[float] = []
    answer = pipe.generate_answer

    def timed_answer(*a: Any, **k: Any) -> Any:  # the time the prefill (and compression) ended
        stamps.append(time.perf_counter())
        return answer(*a, **k)

    pipe.generate_answer = timed_answer
    cfg = model.config
    pair_bytes = (
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    )
    pair_bytes *= torch.finfo(model.dtype).bits // 8
    per_method: dict[str, list[float]] = defaultdict(list)
    started_all = time.perf_counter()
    for n, (task, row, press_name, ratio) in enumerate(units, 1):
        name = method_name(press_name, ratio)
        sample = Sample.from_json({**row, "length": row.get("length", args.length)})
        inputs = pipe.preprocess(
            row["context"], questions=[row["question"]], answer_prefix=row["answer_prefix"],
            max_context_length=int(1e10),
        )  # fmt: skip
        context_tokens, question_tokens = inputs["context_ids"].shape[1], inputs["questions_ids"][0].shape[1]
        ours = prompt_ids(tokenizer, sample)  # lukv's tokenization of the same sample: must be kvpress's
        if ours != (inputs["context_ids"][0].tolist(), inputs["questions_ids"][0][0].tolist()):
            print(
                f"warning: {task} #{row['index']}: lukv_cache's prompt_ids differ from kvpress's", flush=True
            )
        press = make_press(press_name, ratio or 0.0, curve, meta)
        cache = DynamicCache()
        stamps.clear()
        started = time.perf_counter()
        with torch.no_grad():
            prediction = pipe(
                row["context"], question=row["question"], answer_prefix=row["answer_prefix"], press=press,
                max_new_tokens=int(row["max_new_tokens"]), cache=cache,
            )["answer"]  # fmt: skip
        seconds = time.perf_counter() - started
        held, masked = cache_bytes(cache, model)
        store.append(
            {
                "length": args.length, "task": task, "index": int(row["index"]), "method": name,
                "score": score(task, prediction, row["answer"]), "prediction": prediction,
                "answer": row["answer"], "kv_bytes": held, "full_kv_bytes": context_tokens * pair_bytes,
                "masked_kv_bytes": masked, "kept_kv_bytes": held - masked,
                "context_tokens": context_tokens, "question_tokens": question_tokens,
                "seconds": seconds, "prefill_seconds": (stamps[0] - started) if stamps else None,
            }
        )  # fmt: skip
        per_method[name].append(seconds)
        done = time.perf_counter() - started_all
        print(
            f"[{n}/{len(units)}] {task} #{row['index']} {name}: score {store.records[-1]['score']:.0f} "
            f"{seconds:.1f}s (kv {held / 2**20:.1f} MiB, masked {masked / 2**20:.1f}) "
            f"eta {done / n * (len(units) - n) / 3600:.2f} h | {prediction[:60]!r}",
            flush=True,
        )
    for name, times in per_method.items():
        print(f"{name}: {sum(times) / len(times):.1f} s per sample over {len(times)}", flush=True)


# ---------------------------------------------------------------------------------------- check, table


def check(ours_path: Path, kvpress_path: Path) -> int:
    """kvpress:full's predictions against our full's on the samples both hold; returns the differences."""
    ours = {(r["length"], r["task"], r["index"]): r for r in read_records(ours_path) if r["method"] == "full"}
    theirs = [r for r in read_records(kvpress_path) if r["method"] == "kvpress:full"]
    same = differ = 0
    for r in theirs:
        o = ours.get((r["length"], r["task"], r["index"]))
        if o is None:
            continue
        tokens = (o.get("context_tokens"), o.get("question_tokens")) == (
            r["context_tokens"],
            r["question_tokens"],
        )
        if o["prediction"] == r["prediction"] and tokens:
            same += 1
        else:
            differ += 1
            print(
                f"DIFFERENT {r['task']} #{r['index']}: tokens ours {o.get('context_tokens')}+"
                f"{o.get('question_tokens')} kvpress {r['context_tokens']}+{r['question_tokens']}\n"
                f"  ours    {o['prediction']!r}\n  kvpress {r['prediction']!r}"
            )
    print(f"check: kvpress:full vs our full: {same} equal, {differ} different "
          f"({len(theirs) - same - differ} of kvpress's not in ours yet)")  # fmt: skip
    return differ


def table(ours_path: Path, kvpress_path: Path, samples: int) -> str:
    """Markdown: each method's mean score per task on the first ``samples`` of each task (both libraries;
    a task a method has not finished is blank, the average over the tasks it has), the KV bytes it holds
    after the context as a share of the full cache's, and (masks) what it would hold without them."""
    rows: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for path, lib in ((ours_path, "lukv_cache"), (kvpress_path, "kvpress 0.5.5")):
        for r in read_records(path):
            if r["index"] < samples:
                rows[(lib, r["method"])][r["task"]].append(r)
    head = ["library", "method", *TASKS, "avg", "n", "KV held", "KV unmasked"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (lib, method), by_task in sorted(rows.items()):
        means = {t: sum(r["score"] for r in rs) / len(rs) for t, rs in by_task.items()}
        flat = [r for rs in by_task.values() for r in rs]
        held = sum(r["kv_bytes"] for r in flat) / sum(r["full_kv_bytes"] for r in flat)
        kept = sum(r.get("kept_kv_bytes", r["kv_bytes"]) for r in flat) / sum(
            r["full_kv_bytes"] for r in flat
        )
        cells = [f"{means[t]:.0f}" if t in means else "" for t in TASKS]
        avg = sum(means.values()) / len(means)
        lines.append(
            f"| {lib} | {method} | " + " | ".join(cells)
            + f" | {avg:.1f} | {len(flat)} | {100 * held:.1f}% | {100 * kept:.1f}% |"
        )  # fmt: skip
    return "\n".join(lines)


def smoke() -> int:
    """``--smoke``: the parts that need no kvpress, on the stand-ins (see the module docstring)."""
    import _smoke

    from lukv_cache.evaluation.ruler.scoring import score
    from lukv_cache.evaluation.ruler.store import Store

    run = _smoke.begin()
    curve, meta = load_curve(run.profile("keydiff"))
    assert curve.shape[0] == 99 and 0 <= curve.min() and curve.max() <= 1, curve.shape
    print(f"LUKVPress curve from the stand-in keydiff profile: {curve.shape}, sink {meta['sink']}, "
          f"window {meta['window']}, at 0.8: {curve[79].ravel().round(3)}")  # fmt: skip
    ours, theirs = run.out("ours.jsonl"), run.out("kvpress.jsonl")
    full, answer = 1000, ["1234567"]
    for path, records in (
        (ours, [("full", " 1234567.", full, full), ("global/keydiff@0.8", " 12.", 210, 210)]),
        (
            theirs,
            [("kvpress:full", " 1234567.", full, full), ("kvpress:lukv-keydiff@0.8", " 1234567.", full, 200)],
        ),
    ):
        store = Store(path, {"model": MODEL_ID, "seed": SEED})
        for method, prediction, held, kept in records:
            store.append(
                {
                    "length": 4096, "task": "niah_single_1", "index": 0, "method": method,
                    "score": score("niah_single_1", prediction, answer), "prediction": prediction,
                    "answer": answer, "kv_bytes": held, "full_kv_bytes": full, "masked_kv_bytes": held - kept,
                    "kept_kv_bytes": kept, "context_tokens": 10, "question_tokens": 3, "seconds": 0.0,
                }
            )  # fmt: skip
    assert check(ours, theirs) == 0
    print(table(ours, theirs, 5))
    _smoke.skipped(
        "kvpress's pipeline and presses (kvpress pins transformers<5.3: run this script in its venv)"
    )
    _smoke.skipped("the real model folder and RULER samples")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presses", nargs="+", default=list(PRESSES), choices=PRESSES)
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.8])
    parser.add_argument("--samples", type=int, default=5, help="the first N samples of each task")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--length", type=int, default=4096, help="the samples' RULER length (the record key)")
    parser.add_argument("--samples-dir", type=Path, default=DEFAULTS["samples_dir"])
    parser.add_argument("--model", type=Path, default=DEFAULTS["model"], help="the model folder")
    parser.add_argument("--profile", type=Path, default=DEFAULTS["profile"], help="lukv's budget curve")
    parser.add_argument(
        "--out",
        type=Path,
        default=default_out("kvpress_ruler") / "kvpress_qwen_4k.jsonl",
        help="results file (default: under the lukv cache; the committed run wrote benchmarks/results/ruler/)",
    )
    parser.add_argument("--check", type=Path, metavar="OURS.jsonl", help="compare kvpress:full with our full")
    parser.add_argument("--table", action="store_true", help="only print the table (and --check)")
    parser.add_argument("--table-out", type=Path, help="also write the table (markdown) here")
    parser.add_argument(
        "--smoke", action="store_true", help="run in seconds on tiny stand-ins (benchmarks/_smoke.py)"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        return smoke()
    for r in args.ratios:
        if not 0 < r < 1:
            parser.error(f"--ratios {r}: must be in (0, 1)")
    if not args.table:
        run(args)
    if args.check:
        check(args.check, args.out)
        text = table(args.check, args.out, args.samples)
        print(text)
        if args.table_out:
            args.table_out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    sys.exit(main())
