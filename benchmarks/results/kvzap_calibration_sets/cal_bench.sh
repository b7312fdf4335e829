#!/bin/sh
while ! grep -q "expository built" /tmp/s26/build_cal.log; do sleep 5; done
sleep 3
cd "$(dirname "$0")/../../.."  # the repository root
for c in planted default expository; do
  if [ $c = planted ]; then P=""; else P="--profiles /tmp/s26/cal_$c"; fi
  lukv bench --tasks niah_multikey continuation --samples 16 --scorers kvzap --allocators profile --ratios 0.5 0.8 0.9 $P --seed 1 --threads 2 --out /tmp/s26/calbench --name tune_$c
done
echo ALLDONE
