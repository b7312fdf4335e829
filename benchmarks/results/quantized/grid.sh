#!/usr/bin/env bash
# The equal-bytes grid of the quantized store (docs/benchmarks.md, "Quantized store"): lukv bench on the
# real SmolLM2-135M-Instruct, multikey retrieval and continuation NLL, seed 0 (the same samples in every
# run; each run has its own full-cache row). The ratios put each precision at about 10%, 5% and 3% of the
# full fp32 cache's bytes (an fp32 entry is 4 bytes; int8 1 + 1/8 for its group's fp16 scale and zero,
# int4 1/2 + 1/8), before the dense 32-token window and the sinks that every kvzap head keeps in fp32.
# These are the runs whose results lie here (python benchmarks/quantized_grid_table.py 1000 | 4000 makes
# the equal-bytes tables). Run from the repository root; 1 thread each.
set -euo pipefail
out=benchmarks/results/quantized
one_k=(--tasks niah_multikey continuation --samples 12 --context-tokens 1000 --threads 1 --out "$out")
lukv bench "${one_k[@]}" --scorers kvzap keydiff --allocators global profile --kv-bits none \
    --ratios 0.8 0.9 0.95 0.97 --name grid_1000_fp32
lukv bench "${one_k[@]}" --scorers kvzap --allocators global --kv-bits 8 4 --ratios 0.68 0.82 \
    --name grid_1000_quantized_kvzap_global
lukv bench "${one_k[@]}" --scorers keydiff --allocators profile --kv-bits 8 4 --ratios 0.68 0.82 \
    --name grid_1000_quantized_keydiff_profile
four_k=(--tasks niah_multikey continuation --samples 8 --context-tokens 4000 --threads 1 --out "$out"
        --scorers kvzap --allocators global)
lukv bench "${four_k[@]}" --kv-bits none --ratios 0.8 0.9 0.95 0.97 --name grid_4000_fp32
lukv bench "${four_k[@]}" --kv-bits 8 4 --ratios 0.68 0.82 --name grid_4000_quantized
# (grid_1000_quantized_keydiff_profile was run as `python -m lukv_cache.cli bench ...` from a git worktree of
# this repository's HEAD at the time, with --out pointing at this folder; its recorded command is written
# here as the equivalent `lukv bench` from the repository root.)
