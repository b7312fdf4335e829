#!/usr/bin/env bash
# The equal-bytes grid of the quantized store (docs/benchmarks.md, "Quantized store"): lukv bench on the
# real SmolLM2-135M-Instruct, multikey retrieval and continuation NLL, seed 0, one run per kv_bits with the
# ratios that put it at about 20%, 10%, 5% and 3% of the full fp32 cache's bytes (an fp32 entry is 4 bytes;
# int8 1 + 1/8 for the group's fp16 scale and zero, int4 1/2 + 1/8). Run from the repository root:
#   bash benchmarks/results/quantized/grid.sh 1000 12      # context tokens, samples
set -euo pipefail
tokens=${1:-1000}
samples=${2:-12}
out=benchmarks/results/quantized
common=(--tasks niah_multikey continuation --samples "$samples" --context-tokens "$tokens" --threads 1
        --scorers kvzap keydiff --allocators global profile --out "$out")
lukv bench "${common[@]}" --kv-bits none --ratios 0.8 0.9 0.95 0.97 --name "grid_${tokens}_fp32"
lukv bench "${common[@]}" --kv-bits 8 --ratios 0.3 0.64 0.82 0.89 --name "grid_${tokens}_int8"
lukv bench "${common[@]}" --kv-bits 4 --ratios 0.0 0.36 0.68 0.81 --name "grid_${tokens}_int4"
