#!/usr/bin/env bash
# The calibrated allocator against global, hybrid_global and profile with kvzap (issue 34): lukv bench on the
# real SmolLM2-135M-Instruct, Wikipedia texts, seed 0 (the reported samples; settings were chosen on news
# texts with benchmarks/tuning.py, see benchmarks/results/tuning/calibrated_*), multikey retrieval,
# continuation NLL and natural-text recall, at 0.8 and 0.9, 1k and 4k tokens. Run from the repository root;
# 1 thread each (the two ran side by side, each on one core).
set -euo pipefail
out=benchmarks/results/calibrated
grid=(--tasks niah_multikey continuation recall --scorers kvzap --allocators global hybrid_global profile calibrated
      --ratios 0.8 0.9 --threads 1 --out "$out")
lukv bench "${grid[@]}" --samples 12 --context-tokens 1000 --name grid_1000
lukv bench "${grid[@]}" --samples 8 --context-tokens 4000 --name grid_4000
# keydiff (no kvzap profile: the one line's scorer for other models), after the two above
lukv bench --tasks niah_multikey continuation recall --scorers keydiff --allocators global profile calibrated \
    --ratios 0.8 0.9 --threads 1 --out "$out" --samples 12 --context-tokens 1000 --name grid_1000_keydiff
# (both were run as `python -m lukv_cache.cli bench ...` from a git worktree of this repository's HEAD at the
# time, side by side, with --out pointing at this folder; their recorded command is written here and in the
# result files as the equivalent `lukv bench` from the repository root.)
# paired.md: python benchmarks/paired_table.py benchmarks/results/calibrated/grid_1000.json \
#   benchmarks/results/calibrated/grid_4000.json; and --reference profile for grid_1000_keydiff.json
