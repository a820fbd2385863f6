"""Predicted against measured on one real device: the compute side of the cost model.

    python benchmarks/device_check.py [--out device_check.json] [--models gpt2-small,llama-tiny] [--budget-s 420]

1. Calibrates the device (``shardplan.calibrate``: matmul FLOP/s per dtype at several shapes, and
   memory bandwidth), printing achieved against the preset's peak.
2. For each reference model, plans its train step on a one-device mesh priced with the
   calibrated figures, runs it, and compares the predicted step time with the measured one.

Writes everything to ``--out`` (JSON) as it goes, so a run cut short still leaves its numbers.
Made for a lent GPU (``benchmarks/device_check.sh``); it also runs on CPU, where the numbers only
check that the script works.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

if not __package__:   # run as a script from a checkout: import the checkout's shardplan
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import shardplan  # noqa: E402
from shardplan.models.train import reference  # noqa: E402
from shardplan.calibrate import calibrate  # noqa: E402

DEFAULT_BASE = {"gpu": "h100-8", "tpu": "tpu-v5e-256", "cpu": "cpu-8"}


def _write(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="device_check.json")
    ap.add_argument("--models", default="gpt2-small:8,gpt3-1.3b:4,llama-tiny:8",
                    help="name:batch,... (run in order until --budget-s is spent)")
    ap.add_argument("--base", default=None, help="preset for memory size (default by platform)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new models after this")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    start = time.perf_counter()
    dev = jax.devices()[0]
    base = args.base or DEFAULT_BASE.get(dev.platform, "h100-8")
    result: dict = {"platform": dev.platform, "device": str(getattr(dev, "device_kind", dev.platform)),
                    "jax": jax.__version__, "base": base}
    preset = shardplan.load_mesh(base, axes={"data": shardplan.load_mesh(base).num_devices})
    big = dev.platform != "cpu"
    mesh = calibrate(base=preset, axes={}, matmul_sizes=(1024, 4096, 8192) if big else (256, 512),
                     copy_bytes=(1 << 30) if big else (64 << 20), repeats=10 if big else 3)
    mesh = dataclasses.replace(mesh, axes=(dataclasses.replace(preset.axes[0], size=1),), devices_per_node=1)
    result["calibration"] = {
        "peak_flops_measured": dict(mesh.device.peak_flops), "peak_flops_preset": dict(preset.device.peak_flops),
        "hbm_bandwidth_measured": mesh.device.hbm_bandwidth, "hbm_bandwidth_preset": preset.device.hbm_bandwidth}
    _write(args.out, result)
    print(json.dumps(result["calibration"], indent=1), flush=True)
    rows = result["models"] = []
    for item in args.models.split(","):
        if time.perf_counter() - start > args.budget_s:
            rows.append({"model": item, "skipped": "time budget spent"})
            break
        name, _, batch = item.partition(":")
        ref = reference(name, scan=True)
        state, data = ref.init(jax.random.key(0)), ref.batch(int(batch or 8))
        row = {"model": name, "batch": int(batch or 8)}
        try:
            step = shardplan.auto(ref.train_step, mesh=mesh, donate_argnums=(0,), time_limit=10)
            for _ in range(2):                      # compile, and the recompile of the second call
                state, metrics = step(state, data)
            jax.block_until_ready(metrics)
            t = time.perf_counter()
            for _ in range(args.steps):
                state, metrics = step(state, data)
            jax.block_until_ready(metrics)
            measured = (time.perf_counter() - t) / args.steps
            c = step.plan.cost
            row.update(predicted_s=c.step_s, predicted_compute_s=c.compute_s, measured_s=measured,
                       ratio=measured / c.step_s, memory_predicted_bytes=c.memory_bytes)
        except Exception as e:            # a model that does not fit: record why, go on with the next
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        rows.append(row)
        _write(args.out, result)
        print(json.dumps(row), flush=True)
    result["wall_s"] = time.perf_counter() - start
    _write(args.out, result)


if __name__ == "__main__":
    main()
