#!/usr/bin/env bash
# One short, prepared check for a lent accelerator (under 8 minutes): calibrate the compute side
# of the cost model (matmul FLOP/s per dtype and shape, memory bandwidth) and compare predicted
# with measured train-step time of the reference models on one device.
#
# On the lent H200 jax, flax and optax are installed; ortools is not. Fetch its wheels here
# first (python 3.12, x86-64), into .whl/ (ignored by git), and carry .whl:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 -d .whl ortools==9.15.6755 \
#     absl-py immutabledict protobuf
# then run:  bash benchmarks/device_check.sh   (writes $OUT/device_check.json, or ./device_check.json)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
out="${OUT:-.}/device_check.json"
python3 -c "import jax; print('devices:', jax.devices())"
timeout 450 python3 benchmarks/device_check.py --out "$out" --budget-s 300 || echo "device_check.py exited $?; partial results in $out"
cat "$out"
