#!/bin/sh
# The tuning benches of README.md, as they ran (after build_cal.py had built the default and expository
# profiles into $SCRATCH/cal_<set>: SCRATCH must be that scratch folder).
set -e
scratch=${SCRATCH:?set SCRATCH to the scratch folder build_cal.py wrote to}
cd "$(dirname "$0")/../../.."  # the repository root
for c in planted default expository; do
  if [ $c = planted ]; then P=""; else P="--profiles $scratch/cal_$c"; fi
  lukv bench --tasks niah_multikey continuation --samples 16 --scorers kvzap --allocators profile --ratios 0.5 0.8 0.9 $P --seed 1 --threads 2 --out "$scratch/calbench" --name tune_$c
done
echo ALLDONE
