# As it ran, with the machine's scratch folder made $SCRATCH (default: a new temporary folder); the results
# were copied here from $SCRATCH/dtune.
scratch=${SCRATCH:-$(mktemp -d)}
echo "scratch folder: $scratch"
cd "$(dirname "$0")/../../../.."  # the repository root
for w in 128 256 192 384; do
  echo "== window $w $(date)"
  python benchmarks/decode_nll.py --continuation 4096 --budgets 512 --documents 3 --skip 3 --methods "kvzap / global" --decode-window $w --threads 2 --out "$scratch/dtune" --name kvzap_w$w
done
echo "== done $(date)"
