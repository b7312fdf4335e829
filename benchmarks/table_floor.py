"""How fast a memory table could be on this machine: its passes counted, each timed as the model's own forward.

A profile build's memory table (``lukv_cache.profiling.memory_table.measure_memory_table``, the defaults a
``lukv build`` uses) is a fixed list of forward passes: per window of the calibration text, one context
prefill and ``1 + bits x ratios`` teacher-forced continuations for the cells (in bfloat16 under ``auto`` on a
CPU that multiplies it natively), and for the layers' losses a prefill of their own in the model's precision,
one 8-bit continuation and one per decoder layer, each running only that layer, the ones above it and the
first (the layers below reuse the 8-bit pass's outputs) plus the LM head. This script counts those passes for
``--model`` and the shipped calibration text, times one context prefill and one continuation of the same
sizes as plain forwards of the model (a ``DynamicCache``; no scorer, no eviction, no quantization), and
prints the sum: the time the table's passes take with nothing else, a floor for any table that measures the
same thing. ``--measure`` then measures the real table with the model's ``--scorer`` profile (the shipped
one, or ``$LUKV_PROFILE_DIR``'s), in the same process, for the side by side.

    python benchmarks/table_floor.py --model qwen2.5-coder-0.5b --threads 2 --measure

Results: ``benchmarks/results/table_dtype/table_floor_*.md``. ``--smoke``: the stand-ins of
``benchmarks/_smoke.py``, one repeat, ``--measure`` (``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import _smoke  # noqa: E402
from _calls import cache_kw  # noqa: E402


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _seconds(fn, repeats: int) -> float:
    """The median of ``repeats`` timed calls, after one untimed one."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def pass_seconds(
    model, context: torch.Tensor, continuation: torch.Tensor, repeats: int
) -> tuple[float, float]:
    """``(prefill, continuation)``: seconds for one forward of ``context`` into an empty ``DynamicCache``
    (the last position's logits only, as the table's prefill) and for one forward of ``continuation`` over
    that cache (every position's logits, as a teacher-forced pass)."""
    from transformers import DynamicCache

    def prefill() -> DynamicCache:
        cache = DynamicCache(config=model.config)
        model(input_ids=context, **{cache_kw(model): cache}, use_cache=True, logits_to_keep=1)
        return cache

    with torch.no_grad():
        prefill_s = _seconds(prefill, repeats)
        cache = prefill()

        def continue_() -> None:
            model(input_ids=continuation, **{cache_kw(model): cache}, use_cache=True)
            cache.crop(-continuation.shape[1])  # back to the context alone

        return prefill_s, _seconds(continue_, repeats)


def layer_pass_share(config) -> list[float]:
    """Each layer-loss pass's cost as a share of a whole continuation pass, by weights multiplied per token:
    pass ``l`` runs layer 0 and layers ``l..L-1`` (all of them for ``l`` = 0), then the LM head."""
    text = config.get_text_config()
    hidden, layers = int(text.hidden_size), int(text.num_hidden_layers)
    heads, kv_heads = int(text.num_attention_heads), int(text.num_key_value_heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * int(text.intermediate_size)
    head = hidden * int(text.vocab_size)
    whole = layers * per_layer + head
    return [((layers if i == 0 else 1 + layers - i) * per_layer + head) / whole for i in range(layers)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="a packaged model name")
    parser.add_argument("--scorer", default="keydiff", help="the profile --measure uses")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--measure", action="store_true", help="also measure the real table (minutes)")
    parser.add_argument("--out", type=Path, help="write the lines printed to this markdown file too")
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.out = _smoke.begin().out("table_floor.md")
        args.model, args.threads, args.repeats, args.measure = "smollm2", 1, 1, True
    torch.set_num_threads(args.threads)

    from lukv_cache.models import load_packaged
    from lukv_cache.profiling import memory_table as mt
    from lukv_cache.profiling.table_dtype import model_in, table_dtype

    model, tokenizer = load_packaged(args.model)
    texts = mt.calibration_texts("planted")
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    contexts, continuation = mt.DEFAULT_CONTEXTS, mt.DEFAULT_CONTINUATION
    context_tokens = mt.window_context_tokens(lengths, contexts, continuation, limit)
    cells = 1 + len(mt.DEFAULT_BITS) * len(mt.DEFAULT_RATIOS)
    shares = layer_pass_share(model.config)
    own = next(model.parameters()).dtype
    cells_dtype = table_dtype(model, "auto")
    ids = tokenizer(texts[0], add_special_tokens=False, return_tensors="pt")["input_ids"]
    context, target = ids[:, :context_tokens], ids[:, context_tokens : context_tokens + continuation]

    lines = [
        f"# The memory table's floor: {model.config.name_or_path}, {args.threads} threads",
        "",
        f"Command: `python benchmarks/table_floor.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
        "",
        f"{contexts} windows of {context_tokens:,} context + {continuation} continuation tokens; "
        f"cells: {cells} continuations per window in {_dtype_name(cells_dtype)}; layers' losses: "
        f"1 + {len(shares)} continuations per window in {_dtype_name(own)} ({sum(shares):.2f} whole passes' weights, "
        "the layers below each reused)",
        "",
        "| passes | dtype | prefill s | continuation s | per window s | table s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    total = 0.0
    with model_in(model, cells_dtype) as cells_model:
        pre, cont = pass_seconds(cells_model, context, target, args.repeats)
    per_window = pre + cells * cont
    total += contexts * per_window
    lines.append(
        f"| cells | {_dtype_name(cells_dtype)} | {pre:.2f} | {cont:.3f} | {per_window:.1f} | {contexts * per_window:.1f} |"
    )
    if cells_dtype == own:  # one model for both: the cells' passes, their prefill serving the layers too
        pre32, cont32 = 0.0, cont
    else:
        pre32, cont32 = pass_seconds(model, context, target, args.repeats)
    per_window = pre32 + cont32 * (1 + sum(shares))
    total += contexts * per_window
    lines.append(
        f"| layers' losses | {_dtype_name(own)} | {pre32:.2f} | {cont32:.3f} | {per_window:.1f} | {contexts * per_window:.1f} |"
    )
    lines += ["", f"**Floor: {total:.0f} s** (the passes alone, as plain forwards)."]
    print("\n".join(lines), flush=True)

    if args.measure:
        from lukv_cache.profiles import resolve_profile

        profile = resolve_profile(model.config.name_or_path, args.scorer)
        started = time.perf_counter()
        mt.measure_memory_table(model, tokenizer, profile, texts, dtype="auto")
        seconds = time.perf_counter() - started
        more = [
            f'Measured: `measure_memory_table` with the model\'s {args.scorer} profile, `dtype="auto"`: '
            f"**{seconds:.0f} s** ({seconds / total:.2f}x the floor)."
        ]
        print("\n" + "\n".join(more))
        lines += [""] + more
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}")
    if args.smoke:
        print("smoke: table_floor ran")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
