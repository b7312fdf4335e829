#!/bin/sh
# Step 3 of README.md, as it ran, reading the profile chain3.sh wrote: SCRATCH must be its scratch folder.
set -e
scratch=${SCRATCH:?set SCRATCH to the scratch folder chain3.sh used}
cd "$(dirname "$0")/../../.."  # the repository root
lukv bench --tasks niah_multikey continuation --samples 16 --scorers kvzap --allocators global threshold --ratios 0.5 0.8 0.9 --profiles "$scratch/kvzipt" --threads 2 --out "$scratch/rbench" --name kvzap_1k_kvzip_targets
lukv bench --tasks niah_multikey continuation --samples 6 --context-tokens 4000 --scorers kvzap --allocators global threshold --ratios 0.5 0.8 0.9 --profiles "$scratch/kvzipt" --threads 2 --out "$scratch/rbench" --name kvzap_4k_kvzip_targets
echo ALLDONE
