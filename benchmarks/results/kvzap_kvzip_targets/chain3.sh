#!/bin/sh
while ! grep -q ALLDONE /tmp/s26/chain2.log; do sleep 5; done
cd "$(dirname "$0")/../../.."  # the repository root
python /tmp/s26/kvzip_target_surrogate.py /tmp/s26/kvzipt > /tmp/s26/kvzipt.log 2>&1
for p in shipped kvzipt; do
  if [ $p = shipped ]; then P=""; else P="--profiles /tmp/s26/$p"; fi
  lukv bench --tasks niah_multikey continuation --samples 16 --scorers kvzap --allocators global threshold --ratios 0.5 0.8 0.9 $P --seed 1 --threads 2 --out /tmp/s26/tbench --name tune_$p
done
echo ALLDONE
