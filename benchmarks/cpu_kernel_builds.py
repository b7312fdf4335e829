"""The CPU decode kernel over a quantized store's codes as other CPUs get it: one layer's decode attention
per build of ``lukv_cache/attention/cpu_codes.c``, against the fp32 store's own path over the same rows.

The kernel is compiled on first use with ``-march=native``, so what a CPU runs depends on its vector units:
16-float vectors where the compiler targets AVX-512, 8-float ones with AVX2 and FMA (most laptops and desktops,
AMD before Zen 4), the scalar loop elsewhere. This script builds each of them here (``cpu_codes.TARGETS``, ``load_target``):

* ``native``: this machine's own build (what ``kernel()`` serves);
* ``avx2``: ``-march=haswell`` (the AVX2 vectors), and ``avx2 scalar``: the same target with ``-DLUKV_SCALAR``,
  the scalar loop an AVX2 CPU ran before it had vectors of its own;
* ``x86-64``: the baseline target (no vectors: the scalar loop).

and times, for each shape (SmolLM2-135M: 3 KV heads, 3 query rows per KV head, head_dim 64; Qwen2.5-0.5B: 2 and
7, 64; Llama-3.1-8B: 8 and 4, 128; Gemma-3-270M: 1 and 4, 256), batch and rows per (row, KV head), one call of ``codes_attention`` on an
8-bit and a 4-bit store and of ``compressed_attention`` on the fp32 store of the same rows (what a full-precision
store runs at decode), each with an 8-token dense suffix; the calls go round-robin, the median of ``--repeats``
rounds is reported, and each build's figure also as a ratio to the fp32 store's. Run it alone (timings). A
target this CPU cannot run is left out.

    python benchmarks/cpu_kernel_builds.py --threads 2 --out benchmarks/results/quantized/kernel_builds.md

``--smoke``: one small shape, a few rounds (``benchmarks/smoke.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import _smoke  # noqa: E402

# name: (KV heads, query rows per KV head, head_dim)
SHAPES = {
    "smollm2": (3, 3, 64),
    "qwen2.5-0.5b": (2, 7, 64),
    "llama-3.1-8b": (8, 4, 128),
    "gemma-3-270m": (1, 4, 256),
}
SUFFIX = 8


def builds() -> dict:
    """name -> the kernel library of this machine's build and of each of ``cpu_codes.TARGETS`` this CPU runs."""
    from lukv_cache.attention import cpu_codes

    libs = {"native": cpu_codes.kernel(), **{name: cpu_codes.load_target(name) for name in cpu_codes.TARGETS}}
    return {name: lib for name, lib in libs.items() if lib is not None}


def run(shape: str, batch: int, rows: int, repeats: int, libs: dict) -> dict:
    """Median microseconds per call of each build at 8 and 4 bits and of the fp32 store's path."""
    from lukv_cache.attention import compressed, cpu_codes
    from lukv_cache.cache.storage.ragged import RaggedStore

    heads, group, dim = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    n = batch * heads * rows
    keys, values = torch.randn(n, dim, generator=gen), torch.randn(n, dim, generator=gen)
    positions = torch.arange(rows).repeat(batch * heads)
    counts = torch.full((batch * heads,), rows)
    stores = {
        bits: RaggedStore.build(keys, values, positions, counts, num_heads=heads, kv_bits=bits)
        for bits in (8, 4)
    }
    dense = RaggedStore.build(*stores[8].dense(), positions, counts, num_heads=heads)
    query = torch.randn(batch, heads, group, dim, generator=gen)
    suffix_k, suffix_v = (torch.randn(batch, heads, SUFFIX, dim, generator=gen) for _ in range(2))
    scaling = dim**-0.5
    calls = {
        "fp32 store": lambda: compressed.compressed_attention(
            dense, query.view(batch, heads * group, 1, dim), suffix_k, suffix_v, None, scaling=scaling
        )
    }
    for name, lib in libs.items():
        for bits, store in stores.items():
            calls[f"{name} int{bits}"] = lambda lib=lib, store=store: cpu_codes.codes_attention(
                query, store, suffix_k, suffix_v, scaling=scaling, lib=lib
            )
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(repeats + 2):  # two warm-up rounds
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            if round_ >= 2:
                times[name].append(time.perf_counter() - started)
    return {name: 1e6 * statistics.median(series) for name, series in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[823, 1405, 3277], help="rows per (row, KV head)"
    )
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", default=None, help="write the table here too")
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.shapes, args.batch, args.rows, args.repeats = ["smollm2"], [1], [100], 3
        args.out = _smoke.begin().out("kernel_builds.md")
    torch.set_num_threads(args.threads)
    libs = builds()
    from lukv_cache.attention import cpu_codes

    command = "python benchmarks/cpu_kernel_builds.py " + " ".join(sys.argv[1:] if argv is None else argv)
    names = [f"{name} int{bits}" for name in libs for bits in (8, 4)]
    lines = [
        f"Command: {command}",
        "",
        f"Builds here: {', '.join(f'{name} ({cpu_codes.vector_lanes(lib)} lanes)' for name, lib in libs.items())}; "
        f"{args.threads} threads; microseconds per call (median of {args.repeats} rounds), and / the fp32 store's.",
        "",
        "| shape | batch | rows | fp32 store | " + " | ".join(names) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(names),
    ]
    for shape in args.shapes:
        for batch in args.batch:
            for rows in args.rows:
                got = run(shape, batch, rows, args.repeats, libs)
                base = got["fp32 store"]
                cells = [f"{got[name]:.0f} ({got[name] / base:.2f})" for name in names]
                lines.append(f"| {shape} | {batch} | {rows} | {base:.0f} | " + " | ".join(cells) + " |")
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    if args.smoke:
        print("smoke: cpu_kernel_builds ran")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
