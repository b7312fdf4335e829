cd "$(dirname "$0")/../../../.."  # the repository root
for w in 128 256 192 384; do
  echo "== window $w $(date)"
  python benchmarks/decode_nll.py --continuation 4096 --budgets 512 --documents 3 --skip 3 --methods "kvzap / global" --decode-window $w --threads 2 --out /tmp/s27/dtune --name kvzap_w$w
done
echo "== done $(date)"
