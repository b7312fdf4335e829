"""Memory and speed on the real model, side by side in one run: KV bytes, prefill time, decode ms/token.

Methods: ``DynamicCache`` (full); ``LUKVCache`` at each ratio (LU-KV profile from ``--profiles`` when there
is one, else the uniform allocator, said in the table); and, per ratio, a plain ``DynamicCache`` holding
the same number of tokens in every head (sinks + window + the scorer's top tokens, gathered dense), the
"uniformly compressed" baseline a dense cache can offer. The context is real Wikipedia text.

    python benchmarks/efficiency.py                       # 8k tokens (SmolLM2's longest), ratios 0.5 0.8 0.9
    python benchmarks/efficiency.py --tokens 2048 --decode-steps 16 --threads 1

``--smoke``: 256 tokens, ratio 0.8, 2 decode steps on the stand-ins of ``benchmarks/_smoke.py``, written in
a temporary folder (``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import _smoke
import torch
from _calls import cache_kw
from _out import default_out
from kvpress_efficiency import decode_ms  # the scripts next to this one: kvpress' rows time decode alike
from prefill_cost import text_ids  # consecutive Wikipedia articles, long ones first
from transformers import DynamicCache  # noqa: E402

from lukv_cache import LUKVCache, ProfileError, get_scorer
from lukv_cache.cache import kv_cache_bytes
from lukv_cache.evaluation.methods import Method, make_cache
from lukv_cache.evaluation.prefill import SharedPrefill
from lukv_cache.models import load_model


def dense_uniform_cache(
    shared: SharedPrefill, scorer_name: str, ratio: float, sink: int, window: int
) -> DynamicCache:
    """A DynamicCache keeping, in every (layer, head), the sinks, the window and the same number of top
    tokens by ``scorer_name`` as the uniform allocator: dense ``[B, H, kept, D]`` tensors."""
    scorer = get_scorer(scorer_name)
    cache = DynamicCache()
    for layer_idx, (keys, values) in enumerate(zip(shared.keys, shared.values)):
        t = keys.shape[-2]
        queries = shared.queries[layer_idx][:, :, -scorer.n_queries :] if scorer.n_queries else None
        scores = scorer(keys, values, queries).float()
        region = torch.arange(t)
        evictable = (region >= sink) & (region < t - window)
        n_keep = round((1.0 - ratio) * int(evictable.sum()))
        scores = scores.masked_fill(~evictable, float("-inf"))
        top = scores.topk(n_keep, dim=-1).indices  # [B, H, n_keep]
        protected = region[~evictable].expand(*top.shape[:2], -1)
        index = torch.cat([protected, top], dim=-1).sort(dim=-1).values
        gather = index.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        cache.update(keys.gather(2, gather).clone(), values.gather(2, gather).clone(), layer_idx)
    return cache


@torch.no_grad()
def timed_prefill(model: Any, ids: torch.Tensor, cache: Any) -> tuple[float, torch.Tensor]:
    started = time.perf_counter()
    out = model(input_ids=ids, **{cache_kw(model): cache}, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - started, out.logits[:, -1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=8192, help="context length (8192)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.8, 0.9])
    parser.add_argument("--scorer", default="keydiff")
    parser.add_argument("--profiles", help="a folder of profiles searched first (default: the shipped ones)")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--out", default=str(default_out("efficiency")), help="where to write efficiency_<tokens>.{md,json}"
    )
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.out = str(_smoke.begin().out("efficiency"))
        args.tokens, args.ratios, args.decode_steps, args.threads = 256, [0.8], 2, 1

    model, tokenizer = load_model(args.model, threads=args.threads)
    ids = text_ids(tokenizer, args.tokens)
    t = ids.shape[1]
    rows: list[dict[str, Any]] = []

    def add(
        name: str, cache: Any, prefill_s: float | None, last_logits: torch.Tensor, note: str = ""
    ) -> None:
        stored = cache.stored_tokens().double().mean().item() if hasattr(cache, "stored_tokens") else None
        if stored is None:
            stored = float(cache.layers[0].keys.shape[-2])
        held = kv_cache_bytes(cache)
        ms = decode_ms(model, cache, int(last_logits.argmax()), t, args.decode_steps)
        rows.append(
            {
                "method": name,
                "tokens_per_head": stored,
                "kv_bytes": held,
                "prefill_s": prefill_s,
                "decode_ms_per_token": ms,
                "note": note,
            }
        )
        shown = f"{prefill_s:7.1f}" if prefill_s is not None else "    n/a"
        print(f"{name:<44} {stored:8.0f} {held / 1e6:9.1f} {shown} {ms:9.1f}  {note}", flush=True)

    print(
        f"{t} tokens of Wikipedia text, {torch.get_num_threads()} thread(s), {args.decode_steps} decode steps"
    )
    print(f"{'method':<44} {'tok/head':>8} {'KV MB':>9} {'prefill s':>7} {'ms/token':>9}")
    full = DynamicCache()
    seconds, last = timed_prefill(model, ids, full)
    add("DynamicCache (full)", full, seconds, last)
    del full

    try:
        make_cache(Method("profile", args.scorer, 0.5), model, args.profiles)
        has_profile = True
    except ProfileError:
        has_profile = False
    for ratio in args.ratios:
        allocator = "profile" if has_profile else "uniform"
        cache = make_cache(Method(allocator, args.scorer, ratio), model, args.profiles)
        seconds, last = timed_prefill(model, ids, cache)
        note = "LU-KV profile" if has_profile else "no profile: uniform allocator"
        add(f"LUKVCache {allocator}/{args.scorer} ratio {ratio:g}", cache, seconds, last, note)
        del cache

    scorer = get_scorer(args.scorer)
    shared = SharedPrefill.record(model, ids, n_queries=max(2, scorer.n_queries))
    sink, window = LUKVCache(0.5, args.scorer).sink, scorer.window
    for ratio in args.ratios:
        cache = dense_uniform_cache(shared, args.scorer, ratio, sink, window)
        add(
            f"DynamicCache dense uniform {args.scorer} ratio {ratio:g}",
            cache,
            None,
            shared.last_logits,
            "built from the full prefill",
        )
        del cache

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python benchmarks/efficiency.py", *(argv if argv is not None else sys.argv[1:])])
    record = {
        "command": command,
        "tokens": t,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "decode_steps": args.decode_steps,
        "rows": rows,
    }
    (out / f"efficiency_{t}.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [
        f"# Efficiency at {t} tokens",
        "",
        f"Command: `{command}`",
        "",
        f"{torch.get_num_threads()} CPU thread(s), torch {torch.__version__}, {args.decode_steps} decode steps "
        "(median after one warm-up), fp32.",
        "",
        "| method | tokens/head | KV MB | prefill s | decode ms/token | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        prefill = f"{r['prefill_s']:.1f}" if r["prefill_s"] is not None else "n/a"
        lines.append(
            f"| {r['method']} | {r['tokens_per_head']:.0f} | {r['kv_bytes'] / 1e6:.1f} | {prefill} | "
            f"{r['decode_ms_per_token']:.1f} | {r['note']} |"
        )
    (out / f"efficiency_{t}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / f'efficiency_{t}.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
