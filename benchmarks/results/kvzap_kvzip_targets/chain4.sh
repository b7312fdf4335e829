#!/bin/sh
cd "$(dirname "$0")/../../.."  # the repository root
lukv bench --tasks niah_multikey continuation --samples 16 --scorers kvzap --allocators global threshold --ratios 0.5 0.8 0.9 --profiles /tmp/s26/kvzipt --threads 2 --out /tmp/s26/rbench --name kvzap_1k_kvzip_targets
lukv bench --tasks niah_multikey continuation --samples 6 --context-tokens 4000 --scorers kvzap --allocators global threshold --ratios 0.5 0.8 0.9 --profiles /tmp/s26/kvzipt --threads 2 --out /tmp/s26/rbench --name kvzap_4k_kvzip_targets
echo ALLDONE
