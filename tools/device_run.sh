#!/usr/bin/env bash
# Run a command on the GPU machine (the device tool) with flodl_run's missing packages installed.
#
# The machine has torch, rich, scikit-learn, nvidia-ml-py and matplotlib, but not hydra-core,
# omegaconf, antlr4-python3-runtime, pyzmq, msgspec or cryptography (with cffi and pycparser).
# Fetch their wheels here once per checkout
# (`tools/device_run.sh --fetch`), then call the device tool with carry=[".whl"] and the command
#   bash tools/device_run.sh <command...>
# mlflow is imported only when tracking is on, so run GPU jobs with `tracking=off`.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--fetch" ]; then
  grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
  plat="--python-version 3.12 --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64"
  for pkg in hydra-core==1.3.8 omegaconf==2.3.1 pyzmq==27.3.0 msgspec==0.22.0 \
             cryptography==50.0.2 cffi==2.1.1 pycparser==3.12; do
    python3 -m pip download -q --no-deps --only-binary=:all: $plat -d .whl "$pkg"
  done
  python3 -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w .whl  # sdist only: build it
  ls .whl
  exit 0
fi

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$@"
