#!/bin/sh
while ! grep -q "Exit status" /tmp/s26/rebuild.log; do sleep 5; done
cd "$(dirname "$0")/../../.."  # the repository root
python /tmp/s26/decode_prof.py 1 > /tmp/s26/prof_b1.log 2>&1
python benchmarks/decode_nll.py --continuation 4096 --budgets 512 --documents 3 --skip 3 --methods "kvzap / global" "kvzap / profile" "keydiff / profile" --threads 2 --out /tmp/s26/dtune --name kvzap_profile_tune > /tmp/s26/dtune.log 2>&1
for c in default expository; do
  lukv bench --tasks niah_multikey continuation --samples 16 --scorers kvzap --allocators profile --ratios 0.5 0.8 0.9 --profiles /tmp/s26/cal_$c --threads 2 --out /tmp/s26/calbench --name report_$c
done
echo ALLDONE
