"""LUKVCache's quantized store against transformers' QuantizedCache (optimum-quanto backend), same texts.

On the real SmolLM2-135M-Instruct (fp32, CPU), the bench's own samples (``lukv bench``'s multikey retrieval
and continuation NLL, seed 0, ~1k context tokens), side by side in one run, each cache prefilled and scored
the way ``lukv bench`` does it:

* ``full``: DynamicCache (the reference);
* ``QuantizedCache int4``: transformers' ``QuantizedCache(backend="quanto", nbits=4)`` with its defaults
  (groups of 64, the last 128 tokens kept at full precision as its residual); it evicts nothing;
* ``LUKVCache int4 @0``: ``kv_bits=4`` at ratio 0 (nothing evicted: the quantizers alone);
* the one line ``from_pretrained(model_id, 0.8)`` (kvzap scores, global budgets) at full precision, and
  ``kv_bits=4`` at ratio 0.6 (about the same bytes).

Bytes: every tensor a cache holds after the prefill (QuantizedCache: its quantized tensors' data, scales and
shifts plus the residual; LUKVCache: ``memory_bytes``). Needs ``optimum-quanto`` (a benchmark-only
dependency; install it in a separate environment):

    python -m venv --system-site-packages <venv> && <venv>/bin/pip install optimum-quanto
    PYTHONPATH=. <venv>/bin/python benchmarks/quantized_cache_compare.py --samples 12 --threads 1

``--smoke``: two samples of 200 tokens per task on the stand-ins of ``benchmarks/_smoke.py``, the table
written in a temporary folder; without ``optimum-quanto``, every cache but the QuantizedCache
(``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import _smoke
import torch
from _calls import cache_kw

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _tensor_bytes(obj, seen: set[int]) -> int:
    """Bytes of every tensor reachable from ``obj``'s attributes (quanto's tensors flatten to their parts)."""
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            return sum(_tensor_bytes(getattr(obj, name), seen) for name in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(item, seen) for item in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(item, seen) for item in obj.values())
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return sum(_tensor_bytes(value, seen) for value in vars(obj).values())
    return 0


def cache_bytes(cache) -> int:
    from lukv_cache.cache.storage.report import kv_cache_bytes

    if type(cache).__name__ == "QuantizedCache":
        return sum(_tensor_bytes(layer, set()) for layer in cache.layers)
    return kv_cache_bytes(cache)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--context-tokens", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="write the table here too")
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args(argv)
    quanto = True
    if args.smoke:
        args.out = str(_smoke.begin().out("quantized_cache_compare.md"))
        args.samples, args.context_tokens, args.threads = 2, 200, 1
        quanto = bool(importlib.util.find_spec("optimum")) and bool(
            importlib.util.find_spec("optimum.quanto")
        )
        if not quanto:
            _smoke.skipped(
                "transformers' QuantizedCache: optimum-quanto is not installed (a benchmark-only dependency)"
            )
    torch.set_num_threads(args.threads)

    from transformers import DynamicCache, QuantizedCache

    from lukv_cache import LUKVCache
    from lukv_cache.evaluation.tasks import RetrievalSample, context_ids, make_samples, score_prefilled
    from lukv_cache.models import load_model

    model, tokenizer = load_model("smollm2")
    model_id = model.config.name_or_path

    def methods():
        yield "full (DynamicCache)", lambda: DynamicCache()
        if quanto:
            yield (
                "QuantizedCache int4 (quanto)",
                lambda: QuantizedCache(backend="quanto", config=model.config, nbits=4),
            )
        yield "LUKVCache int4 @0", lambda: LUKVCache(0.0, kv_bits=4, config=model.config)
        yield "one line @0.8 (fp32)", lambda: LUKVCache.from_pretrained(model_id, 0.8, local_files_only=True)
        yield (
            "one line @0.6 int4",
            lambda: LUKVCache.from_pretrained(model_id, 0.6, local_files_only=True, kv_bits=4),
        )

    rows = {}
    started = time.perf_counter()
    for task in ("niah_multikey", "continuation"):
        samples = make_samples(task, tokenizer, args.samples, args.context_tokens, seed=0)
        for name, make in methods():
            scores, held = [], []
            for sample in samples:
                ids = context_ids(tokenizer, sample, "cpu")
                cache = make()
                with torch.no_grad():
                    if isinstance(cache, LUKVCache):
                        out = cache.prefill(model, ids, tokenizer=tokenizer, logits_to_keep=1)
                    else:
                        out = model(
                            input_ids=ids, **{cache_kw(model): cache}, use_cache=True, logits_to_keep=1
                        )
                    held.append(cache_bytes(cache))
                    last = out.logits[:, -1, :]
                    if isinstance(sample, RetrievalSample) and isinstance(cache, QuantizedCache):
                        # QuantizedCache can neither repeat its rows for a batch of questions (its quantized
                        # part keeps batch 1) nor be copied: each question on a fresh prefill of its own
                        parts = []
                        for question in sample.questions:
                            fresh = make()
                            last = model(input_ids=ids, **{cache_kw(model): fresh}, logits_to_keep=1).logits[
                                :, -1, :
                            ]
                            one = replace(sample, questions=(question,))
                            parts.append(score_prefilled(model, tokenizer, one, fresh, last)[0])
                        score = statistics.fmean(parts)
                    else:
                        score, _, _ = score_prefilled(model, tokenizer, sample, cache, last)
                scores.append(score)
            rows[(task, name)] = (scores, held)
            print(
                f"{task} {name}: {statistics.fmean(scores):.4f} ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )

    full_bytes = statistics.fmean(rows[("niah_multikey", "full (DynamicCache)")][1])
    lines = [
        f"SmolLM2-135M-Instruct fp32, {args.samples} samples per task, ~{args.context_tokens} context tokens, seed 0, "
        f"{args.threads} thread(s), {time.perf_counter() - started:.0f} s. Command: PYTHONPATH=. <venv>/bin/python "
        f"benchmarks/quantized_cache_compare.py --samples {args.samples} --threads {args.threads}",
        "",
        "| cache | multikey retrieval | excess NLL (nats/token) ± SE | bytes of the full cache |",
        "|---|---:|---:|---:|",
    ]
    full_nll = rows[("continuation", "full (DynamicCache)")][0]
    for name, _ in methods():
        keys, held = rows[("niah_multikey", name)]
        nll = rows[("continuation", name)][0]
        excess = [a - b for a, b in zip(nll, full_nll)]
        sem = statistics.stdev(excess) / len(excess) ** 0.5 if len(excess) > 1 else 0.0
        lines.append(
            f"| {name} | {100 * statistics.fmean(keys):.1f}% | {statistics.fmean(excess):+.4f} ± {sem:.4f} | "
            f"{100 * statistics.fmean(held) / full_bytes:.1f}% |"
        )
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
