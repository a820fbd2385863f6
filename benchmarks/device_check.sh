#!/usr/bin/env bash
# One short, prepared check for a lent accelerator (about 6 minutes on an H200): what the device
# reports against the preset and the deviceless target config, the compute side of the cost model
# (matmul FLOP/s, memory and host-copy bandwidth), and per reference model on one device: predicted
# against measured step time, predicted memory against the device's compile, the deviceless compile
# and the allocator's peak, and losses against jax.jit (benchmarks/device_check.py).
#
# On the lent H200 jax, flax and optax are installed; ortools is not. Fetch its wheels here
# first (python 3.12, x86-64), into .whl/ (ignored by git), and carry .whl:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl ortools==9.15.6755 immutabledict==4.3.1 protobuf==6.33.6
# then run:  bash benchmarks/device_check.sh [device_check.py options]
# The seeded corpus's small models instead of the reference ones (predicted against measured step
# time and memory for models nobody tuned on; report.py's device table reads them):
#            bash benchmarks/device_check.sh --models '' --corpus 8
# (writes $OUT/device_check.json, or ./device_check.json)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
out="${OUT:-.}/device_check.json"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null || true
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
timeout 450 python3 benchmarks/device_check.py --out "$out" "$@" || echo "device_check.py exited $?; partial results in $out"
