#!/bin/sh
# The reported runs of README.md, as they ran (after the profiles were rebuilt into $SCRATCH/cal_<set>:
# SCRATCH must be that scratch folder). A one-off decode profiling probe that ran first, not committed,
# is left out; it wrote nothing these results read.
set -e
scratch=${SCRATCH:?set SCRATCH to the scratch folder the profiles were built in}
cd "$(dirname "$0")/../../.."  # the repository root
python benchmarks/decode_nll.py --continuation 4096 --budgets 512 --documents 3 --skip 3 --methods "kvzap / global" "kvzap / profile" "keydiff / profile" --threads 2 --out "$scratch/dtune" --name kvzap_profile_tune > "$scratch/dtune.log" 2>&1
for c in default expository; do
  lukv bench --tasks niah_multikey continuation --samples 16 --scorers kvzap --allocators profile --ratios 0.5 0.8 0.9 --profiles "$scratch/cal_$c" --threads 2 --out "$scratch/calbench" --name report_$c
done
echo ALLDONE
