#!/bin/sh
# Step 2 of README.md, as it ran (after the job before it had finished), with the machine's scratch folder
# made $SCRATCH (default: a new temporary folder): the KVzip-target surrogate, then the tuning benches.
set -e
scratch=${SCRATCH:-$(mktemp -d)}
echo "scratch folder: $scratch"
cd "$(dirname "$0")/../../.."  # the repository root
python benchmarks/results/kvzap_kvzip_targets/kvzip_target_surrogate.py "$scratch/kvzipt" > "$scratch/kvzipt.log" 2>&1
for p in shipped kvzipt; do
  if [ $p = shipped ]; then P=""; else P="--profiles $scratch/$p"; fi
  lukv bench --tasks niah_multikey continuation --samples 16 --scorers kvzap --allocators global threshold --ratios 0.5 0.8 0.9 $P --seed 1 --threads 2 --out "$scratch/tbench" --name tune_$p
done
echo ALLDONE
