"""Memory and speed of LUKVCache vs DynamicCache on a SmolLM2-135M-shaped model (random weights, fp32, CPU).

Decode (the default): for each context, batch and thread count, four caches are timed side by side, each
in its own subprocess (so peak RSS and torch's thread pool belong to that measurement alone):

* ``full``: a DynamicCache holding the whole context;
* ``same``: a DynamicCache holding as many tokens per head as the compressed cache holds on average;
* ``uniform``: LUKVCache(ratio, keydiff, uniform): every head keeps the same number of tokens;
* ``profile``: LUKVCache(ratio, keydiff, profile): the shipped SmolLM2 LU-KV budgets (ragged per head).

The caches are filled without a model forward (a 32k-token prefill of batch 8 would take hours on a CPU):
random keys/values go through ``cache.update`` layer by layer and the LUKVCache compresses them exactly
as after a prefill (keydiff scores, the allocator's budgets), through the same attention contract a model
uses. Decode then runs the real model forward, one token at a time: the median ms/token is reported.

    python benchmarks/cache_bench.py --contexts 8192 32768 --batch 1 8 --threads 1 2 --out benchmarks/results/decode_speed/cache_bench_decode.json
    python benchmarks/cache_bench.py --contexts 512 --decode-steps 3 --small   # seconds, for a smoke run

``--interleave`` times the caches step by step in ONE process instead, a decode step of each in turn,
each step starting at the next cache: LUKVCache uniform with eviction at fold time off (``off``), the same
with ``decode_max_tokens`` = the tokens it kept per head (``on``), ``equal``: ``max_tokens`` = that many
(every head exactly as many: the same budgets as ``off`` now, kept from when uniform's heads differed by
one token), ``ragged(_on)``: the shipped SmolLM2 keydiff profile's per-head budgets at the ratio (the
model's first layers), off and on, and the ``same`` DynamicCache. Machine noise then hits them all alike,
so the ratios are the figure to read. ``--layers`` keeps the model's first layers only (the model's other
work shrinks with it, so the ratio gets stricter):

    python benchmarks/cache_bench.py --interleave --contexts 4096 --batch 1 4 --threads 2 --layers 8 --decode-steps 300

``--layer`` times one layer's decode attention alone (SmolLM2's 3 KV heads, 9 query heads, head_dim 64, a
128-token suffix): the masked product, the tiles (JSON key ``tiles``; ``windows`` in runs recorded before
the rename) and stock sdpa over a DynamicCache of the same tokens, for each context and batch, with
budgets equal per head and ragged (uniform in 0.2-1.8x the mean). It is
where ``AttentionLimits.masked_limit`` (segments x stored rows; ``lukv_cache/attention/limits.py``) comes from:

    python benchmarks/cache_bench.py --layer --contexts 1024 2048 4096 8192 16384 --batch 1 2 4 8 --threads 2

``--prefill`` instead times a real prefill at each context (batch 1; DynamicCache vs LUKVCache): prefill
seconds and peak RSS, the figures of the first version of this benchmark.

``--smoke``: every mode in turn on the tiny model (``--small``), 256 tokens, batch 1, one thread, 2 decode
steps, the measurements in this process, each mode's JSON in a temporary folder (``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import _smoke
from _calls import cache_kw

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's lukv_cache


def _model(small: bool, max_positions: int, layers: int | None = None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if small:
        cfg = LlamaConfig(
            vocab_size=256,
            hidden_size=96,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
        )
    else:  # SmolLM2-135M's shape
        cfg = LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            tie_word_embeddings=True,
        )
    cfg.max_position_embeddings = max_positions
    cfg._attn_implementation = "sdpa"
    if layers is not None:
        cfg.num_hidden_layers = layers
    return LlamaForCausalLM(cfg).eval()


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _decode_ms(model, cache, first_token, steps: int) -> float:
    import torch

    token = first_token
    times = []
    with torch.no_grad():
        for _ in range(steps + 2):
            t0 = time.perf_counter()
            out = model(input_ids=token, **{cache_kw(model): cache}, use_cache=True)
            times.append(time.perf_counter() - t0)
            token = out.logits[:, -1:].argmax(-1)
    times = sorted(times[2:])  # drop warm-up
    return 1000 * times[len(times) // 2]


def _lukv_cache(method: str, ratio: float, small: bool, config):
    import lukv_cache

    if method == "profile" and not small:  # the shipped SmolLM2 keydiff profile (this model's shape)
        return lukv_cache.LUKVCache.from_pretrained(
            "HuggingFaceTB/SmolLM2-135M-Instruct", ratio=ratio, scorer="keydiff", local_files_only=True
        )
    if method == "profile":  # the tiny model has no shipped profile: a fixed ragged table instead
        import torch

        gen = torch.Generator().manual_seed(3)
        table = torch.rand(config.num_hidden_layers, config.num_key_value_heads, generator=gen)
        return lukv_cache.LUKVCache(allocator="profile", evict_ratio=table * 0.2 + ratio - 0.1)  # mean ~ratio
    return lukv_cache.LUKVCache(ratio=ratio, scorer="keydiff", allocator="uniform", config=config)


def _fill(model, cache, batch: int, tokens: int, gen) -> None:
    """Random keys/values through ``cache.update`` for every layer, then the layer's attention contract
    (what lukv_cache's attention does after a prefill): a LUKVCache compresses exactly as after a prefill."""
    import torch

    from lukv_cache.attention import claim_attention

    cfg = model.config
    h, hq, d = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    for idx, block in enumerate(model.model.layers):
        k = torch.randn((batch, h, tokens, d), generator=gen)
        v = torch.randn((batch, h, tokens, d), generator=gen)
        keys, _ = cache.update(k, v, idx)
        call = claim_attention(block.self_attn, keys)
        if call is not None:  # a LUKVCache: hand it the "prefill" queries (keydiff reads none of them)
            query = torch.randn((batch, hq, 1, d), generator=gen).expand(batch, hq, tokens, d)
            call.finish(block.self_attn, query, None)
        del k, v, keys


def child(
    method: str, tokens: int, batch: int, threads: int, ratio: float, steps: int, small: bool, keep: int
):
    """One decode measurement in a fresh process: fill the cache, then median decode ms/token."""
    import torch
    from transformers import DynamicCache

    from lukv_cache.cache.storage.report import kv_cache_bytes

    torch.set_num_threads(threads)
    model = _model(small, max(tokens, 2048) + steps + 8)
    gen = torch.Generator().manual_seed(1)
    result = {"method": method, "tokens": tokens, "batch": batch, "threads": threads}
    t0 = time.perf_counter()
    with torch.no_grad():
        if method in ("full", "same"):
            cache = DynamicCache(config=model.config)
            _fill(model, cache, batch, tokens if method == "full" else keep, gen)
        else:
            cache = _lukv_cache(method, ratio, small, model.config)
            _fill(model, cache, batch, tokens, gen)
    result["fill_s"] = time.perf_counter() - t0
    result["kv_bytes"] = kv_cache_bytes(cache)
    if method in ("uniform", "profile"):
        stored = cache.stored_tokens().double()  # [L, B, H]
        result["kept_per_head"] = float(stored.mean())
        result["kept_min_max"] = [int(stored.min()), int(stored.max())]
    else:
        result["kept_per_head"] = float(tokens if method == "full" else keep)
    first = torch.zeros((batch, 1), dtype=torch.long)
    result["decode_ms"] = _decode_ms(model, cache, first, steps)
    result["peak_rss_mib"] = _rss_mib()
    return result


def _profile_table(ratio: float, config):
    """``[layers, kv_heads]``: the shipped SmolLM2 keydiff profile's evict ratios at ``ratio`` for the
    model's first layers (the tiny ``--small`` model: a seeded random table of mean ~ratio instead)."""
    import torch

    from lukv_cache.profiles import Profile
    from lukv_cache.profiles.location import BUNDLED_DIR

    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    path = BUNDLED_DIR / "HuggingFaceTB" / "SmolLM2-135M-Instruct" / "keydiff.safetensors"
    table = torch.as_tensor(Profile.load(path).at(ratio))
    if table.shape[1] != heads or table.shape[0] < layers:
        gen = torch.Generator().manual_seed(3)
        return torch.rand(layers, heads, generator=gen) * 0.2 + ratio - 0.1
    return table[:layers]


def interleave_child(
    tokens: int, batch: int, threads: int, ratio: float, steps: int, small: bool, layers: int
):
    """``--interleave``: three caches in one process, one decode step of each in turn (see the docstring)."""
    import statistics

    import torch
    from transformers import DynamicCache

    import lukv_cache

    torch.set_num_threads(threads)
    model = _model(small, max(tokens, 2048) + steps + 8, layers or None)
    gen = torch.Generator().manual_seed(1)
    caches = {}
    with torch.no_grad():
        caches["off"] = lukv_cache.LUKVCache(
            ratio=ratio, scorer="keydiff", allocator="uniform", config=model.config
        )
        _fill(model, caches["off"], batch, tokens, gen)
        keep = round(float(caches["off"].stored_tokens().double().mean()))
        caches["on"] = lukv_cache.LUKVCache(
            ratio=ratio, scorer="keydiff", allocator="uniform", config=model.config, decode_max_tokens=keep
        )
        _fill(model, caches["on"], batch, tokens, gen)
        caches["equal"] = (
            lukv_cache.LUKVCache(  # every head exactly `keep` tokens (uniform: give or take one)
                max_tokens=keep, scorer="keydiff", allocator="uniform", config=model.config
            )
        )
        _fill(model, caches["equal"], batch, tokens, gen)
        table = _profile_table(ratio, model.config)
        caches["ragged"] = lukv_cache.LUKVCache(allocator="profile", evict_ratio=table, scorer="keydiff")
        _fill(model, caches["ragged"], batch, tokens, gen)
        caches["ragged_on"] = lukv_cache.LUKVCache(
            allocator="profile", evict_ratio=table, scorer="keydiff", decode_max_tokens=keep
        )
        _fill(model, caches["ragged_on"], batch, tokens, gen)
        caches["same"] = DynamicCache(config=model.config)
        _fill(model, caches["same"], batch, keep, gen)
    times = interleaved_steps(model, caches, batch, steps)
    result = {"tokens": tokens, "batch": batch, "threads": threads, "layers": model.config.num_hidden_layers}
    result["kept_per_head"] = keep
    result["on_kept_per_head_after"] = float(caches["on"].stored_tokens().double().mean())
    ragged = caches["ragged"].stored_tokens()[: model.config.num_hidden_layers].double()
    result["ragged_kept_per_head"] = float(ragged.mean())
    result["ragged_kept_min_max"] = [int(ragged.min()), int(ragged.max())]
    for name, series in times.items():
        result[name] = {
            "median_ms": 1000 * statistics.median(series),
            "mean_ms": 1000 * statistics.fmean(series),
        }
    return result


def interleaved_steps(
    model, caches: dict, batch: int, steps: int, around: dict | None = None
) -> dict[str, list[float]]:
    """Seconds of each cache's ``steps`` decode steps, one step of each cache in turn, each step starting at
    the next cache (no cache always goes first), after 3 warm-up steps of each (``quantized_cost.py`` too).
    ``around``: per cache name, a context manager factory its steps run in (e.g. a setting turned off)."""
    import contextlib

    import torch

    token = torch.zeros((batch, 1), dtype=torch.long)
    times = {name: [] for name in caches}
    with torch.no_grad():
        order = list(caches.items())
        for step in range(steps + 3):
            for name, cache in order[step % len(order) :] + order[: step % len(order)]:
                with (around or {}).get(name, contextlib.nullcontext)():
                    t0 = time.perf_counter()
                    model(input_ids=token, **{cache_kw(model): cache}, use_cache=True)
                    times[name].append(time.perf_counter() - t0)
    return {name: series[3:] for name, series in times.items()}


def _interleave_rows(args) -> list[dict]:
    rows = []
    common = (args.ratio, args.decode_steps, int(args.small), args.layers or 0)
    for tokens in args.contexts:
        for batch in args.batch:
            for threads in args.threads:
                row = _run(args, "interleave", tokens, batch, threads, *common)
                rows.append(row)
                names = ("off", "on", "equal", "ragged", "ragged_on")
                same = row["same"]
                if len(rows) == 1:
                    print(
                        f"\nDecode ms/token, one process, steps alternated ({args.decode_steps} each), ratio {args.ratio}, "
                        "keydiff; off/on = uniform budgets, eviction at fold time off/on; equal = max_tokens "
                        "(every head the same count), off; ragged(_on) = the SmolLM2 profile's budgets; "
                        "same = DynamicCache of the kept size"
                    )
                    print(
                        "context | batch | threads | layers | kept/head | "
                        + " | ".join(names)
                        + " | same | "
                        + " | ".join(f"{n}/same" for n in names)
                        + " (median; mean)"
                    )
                print(
                    f"{tokens} | {batch} | {threads} | {row['layers']} | {row['kept_per_head']} | "
                    + " | ".join(f"{row[n]['median_ms']:.2f}" for n in names)
                    + f" | {same['median_ms']:.2f} | "
                    + " | ".join(
                        f"{row[n]['median_ms'] / same['median_ms']:.3f}; "
                        f"{row[n]['mean_ms'] / same['mean_ms']:.3f}"
                        for n in names
                    ),
                    flush=True,
                )
    return rows


def prefill_child(method: str, tokens: int, ratio: float, small: bool) -> dict:
    """A real prefill at batch 1 (``--prefill``): seconds and peak RSS of DynamicCache vs LUKVCache."""
    import torch
    from transformers import DynamicCache

    import lukv_cache
    from lukv_cache.cache.storage.report import kv_cache_bytes

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    model = _model(small, max(tokens, 2048) + 8)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    if method == "dynamic":
        cache = DynamicCache(config=model.config)
    else:
        cache = lukv_cache.LUKVCache(ratio=ratio, scorer="keydiff", allocator="uniform")
    rss_before = _rss_mib()
    with torch.no_grad():
        t0 = time.perf_counter()
        # logits_to_keep=1 as generate() does: the full [T, vocab] logits would dominate the peak
        model(input_ids=ids, **{cache_kw(model): cache}, use_cache=True, logits_to_keep=1)
        seconds = time.perf_counter() - t0
    return {
        "method": method,
        "tokens": tokens,
        "prefill_s": seconds,
        "prefill_peak_rss_delta_mib": _rss_mib() - rss_before,
        "kv_bytes": kv_cache_bytes(cache),
    }


def _time_layer_paths(store, query, suffix, dense, module, steps: int) -> dict[str, float]:
    """Median ms of one decode attention call per path, the paths timed in turn step by step."""
    import statistics
    from dataclasses import replace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lukv_cache.attention.compressed import compressed_attention
    from lukv_cache.attention.limits import LIMITS

    def ours(limit):  # the limits pick the path: the masked product for every layer, or none
        limits = replace(LIMITS, masked_limit=limit, masked_equal_limit=limit)

        def call():
            return compressed_attention(store, query, *suffix, None, 0.125, limits=limits)

        return call

    paths = {
        "masked": ours(1 << 62),
        "tiles": ours(0),  # runs recorded before the rename call this path "windows"
        "sdpa": lambda: sdpa_attention_forward(module, query, *dense, None, scaling=0.125),
    }
    times = {name: [] for name in paths}
    for step in range(steps + 10):
        for name, fn in paths.items():
            t0 = time.perf_counter()
            fn()
            if step >= 10:  # warm-up
                times[name].append(time.perf_counter() - t0)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def layer_rows(args) -> list[dict]:
    """``--layer``: one layer's decode attention per path (see the module docstring)."""
    import torch

    from lukv_cache.cache.storage.ragged import RaggedStore

    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads[0])
    h, hq, d, suffix = 3, 9, 64, 128
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, hq // h
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(
        f"\nOne layer's decode attention, ms (median of {args.decode_steps}), {args.threads[0]} thread(s), "
        f"ratio {args.ratio}; sdpa = stock sdpa over a DynamicCache of the same tokens per head"
    )
    print("context | batch | budgets | segments x rows | masked | tiles | sdpa | masked/sdpa | tiles/sdpa")
    for tokens in args.contexts:
        for batch in args.batch:
            for budgets in ("equal", "ragged"):
                keep = round(tokens * (1 - args.ratio))
                counts = torch.full((batch * h,), keep)
                if budgets == "ragged":
                    counts = (keep * (0.2 + 1.6 * torch.rand(batch * h, generator=gen))).long()
                n = int(counts.sum())
                keys, values = (torch.randn(n, d, generator=gen) for _ in range(2))
                store = RaggedStore.build(keys, values, torch.arange(n), counts, num_heads=h)
                query = torch.randn(batch, hq, 1, d, generator=gen)
                sfx = tuple(torch.randn(batch, h, suffix, d, generator=gen) for _ in range(2))
                dense = tuple(torch.randn(batch, h, keep + suffix, d, generator=gen) for _ in range(2))
                row = {"tokens": tokens, "batch": batch, "budgets": budgets, "segments_x_rows": batch * h * n}
                row.update(_time_layer_paths(store, query, sfx, dense, module, args.decode_steps))
                rows.append(row)
                print(
                    f"{tokens} | {batch} | {budgets} | {row['segments_x_rows']} | {row['masked']:.3f} | "
                    f"{row['tiles']:.3f} | {row['sdpa']:.3f} | {row['masked'] / row['sdpa']:.2f} | "
                    f"{row['tiles'] / row['sdpa']:.2f}",
                    flush=True,
                )
    return rows


def _run(args, *child_args) -> dict:
    if args.smoke:  # the --child path in this process: seconds, where a process per measurement takes minutes
        return json.loads(json.dumps(_child_result(list(map(str, child_args)))))
    cmd = [sys.executable, __file__, "--child", *map(str, child_args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{child_args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _decode_rows(args) -> list[dict]:
    rows = []
    small = int(args.small)
    for tokens in args.contexts:
        for batch in args.batch:
            for threads in args.threads:
                row = {"tokens": tokens, "batch": batch, "threads": threads}
                common = (tokens, batch, threads, args.ratio, args.decode_steps, small)
                row["uniform"] = _run(args, "uniform", *common, 0)
                row["profile"] = _run(args, "profile", *common, 0)
                keep = round(row["uniform"]["kept_per_head"])
                row["same"] = _run(args, "same", *common, keep)
                if not args.skip_full:
                    row["full"] = _run(args, "full", *common, 0)
                rows.append(row)
                _print_decode([row], args, header=len(rows) == 1)
    return rows


def _print_decode(rows, args, header: bool) -> None:
    if header:
        print(
            f"\nDecode ms/token, ratio {args.ratio}, keydiff; 'same' = DynamicCache holding the compressed "
            "cache's tokens per head"
        )
        cols = ("context", "batch", "threads", "kept/head", "uniform", "profile", "same", "full")
        cols += ("uniform/same", "profile/uniform", "uniform/full", "KV MiB uniform/full")
        print(" | ".join(cols), flush=True)
    for r in rows:
        u, pr, sa, fu = r["uniform"], r["profile"], r["same"], r.get("full")
        full_ms = f"{fu['decode_ms']:.1f}" if fu else "-"
        print(
            " | ".join(
                [
                    str(r["tokens"]),
                    str(r["batch"]),
                    str(r["threads"]),
                    f"{u['kept_per_head']:.0f}",
                    f"{u['decode_ms']:.1f}",
                    f"{pr['decode_ms']:.1f}",
                    f"{sa['decode_ms']:.1f}",
                    full_ms,
                    f"{u['decode_ms'] / sa['decode_ms']:.3f}",
                    f"{pr['decode_ms'] / u['decode_ms']:.3f}",
                    f"{u['decode_ms'] / fu['decode_ms']:.3f}" if fu else "-",
                    f"{u['kv_bytes'] / 2**20:.0f}/{fu['kv_bytes'] / 2**20:.0f}" if fu else "-",
                ]
            ),
            flush=True,
        )


def _child_result(child_args: list[str]) -> dict:
    """One measurement, from the arguments ``--child`` gets (``_run``)."""
    method, *rest = child_args
    if method == "interleave":
        tokens, batch, threads, ratio, steps, small, layers = rest
        return interleave_child(
            int(tokens), int(batch), int(threads), float(ratio), int(steps), bool(int(small)), int(layers)
        )
    if method.startswith("prefill-"):
        tokens, ratio, small = int(rest[0]), float(rest[1]), bool(int(rest[2]))
        return prefill_child(method.removeprefix("prefill-"), tokens, ratio, small)
    tokens, batch, threads, ratio, steps, small, keep = rest
    return child(
        method, int(tokens), int(batch), int(threads), float(ratio), int(steps), bool(int(small)), int(keep)
    )


def _result(args, mode: str) -> dict:
    """The rows of one mode (``decode``, ``interleave``, ``layer`` or ``prefill``), printed as they come."""
    if mode == "prefill":
        rows = []
        for tokens in args.contexts:
            row = {"tokens": tokens}
            for method in ("dynamic", "lukv"):
                row[method] = _run(args, f"prefill-{method}", tokens, args.ratio, int(args.small))
            rows.append(row)
            d, lk = row["dynamic"], row["lukv"]
            print(
                f"{tokens} tokens: prefill s LUKV/Dynamic {lk['prefill_s']:.1f}/{d['prefill_s']:.1f}, "
                f"peak RSS delta MiB {lk['prefill_peak_rss_delta_mib']:.0f}/{d['prefill_peak_rss_delta_mib']:.0f}, "
                f"KV bytes ratio {lk['kv_bytes'] / d['kv_bytes']:.3f}",
                flush=True,
            )
        return {"mode": "prefill", "ratio": args.ratio, "rows": rows}
    if mode == "layer":
        return {"mode": "layer", "ratio": args.ratio, "threads": args.threads[0], "rows": layer_rows(args)}
    if mode == "interleave":
        result = {"mode": "interleave", "ratio": args.ratio, "decode_steps": args.decode_steps}
        result["rows"] = _interleave_rows(args)
        return result
    result = {"mode": "decode", "ratio": args.ratio, "decode_steps": args.decode_steps}
    result["rows"] = _decode_rows(args)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--ratio", type=float, default=0.8)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--skip-full", action="store_true", help="do not time the full DynamicCache")
    p.add_argument("--prefill", action="store_true", help="time a real prefill instead (batch 1)")
    p.add_argument("--small", action="store_true", help="tiny model (for CI / smoke runs)")
    p.add_argument("--interleave", action="store_true", help="alternate the caches' steps in one process")
    p.add_argument("--layers", type=int, default=None, help="keep the model's first LAYERS layers")
    p.add_argument("--layer", action="store_true", help="time one layer's decode attention paths")
    p.add_argument("--out", default=None, help="write the raw numbers as JSON here")
    p.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    p.add_argument("--child", nargs="+", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child_result(args.child)))
        return 0
    if args.smoke:  # every mode, tiny, each written as JSON into the temporary folder
        folder = _smoke.begin(stand_ins=False).folder
        _smoke.skipped(
            "one process per measurement: in a smoke run they run in this one (its RSS, its threads)"
        )
        args.small, args.contexts, args.batch, args.threads, args.decode_steps = True, [256], [1], [1], 2
        args.layers, args.skip_full, args.ratio = None, False, 0.8
        for mode in ("decode", "interleave", "layer", "prefill"):
            (folder / f"cache_bench_{mode}.json").write_text(json.dumps(_result(args, mode), indent=2))
        return 0
    mode = next((m for m in ("prefill", "layer", "interleave") if getattr(args, m)), "decode")
    result = _result(args, mode)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
