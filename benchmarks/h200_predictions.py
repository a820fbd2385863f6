"""Today's predictions against steps measured on a device: each model of a ``device_check`` JSON
planned again, abstractly, on the same calibrated one-device mesh, beside the step it measured.

    python benchmarks/h200_predictions.py benchmarks/results/device_check_h200_5.json [--without-slice-copies]

No device is needed: the planner prices the step; the measured figures are the JSON's. Shows
whether a change to the time model moved the predictions toward what the device ran: "then" is
the prediction the JSON recorded when the step ran, "now" today's. ``--without-slice-copies``
adds today's prediction with the GPU's copies of scanned slices left unpriced
(:func:`shardplan.compiler.traffic.copied_slices`, session 24), planned again with that rule off.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a device_check JSON (benchmarks/results/device_check_*.json)")
    ap.add_argument("--calibration", default=None,
                    help="the calibration JSON its steps ran under (default: the JSON's own)")
    ap.add_argument("--without-slice-copies", action="store_true",
                    help="add a column: today's prediction with the GPU's scanned-slice copies unpriced")
    args = ap.parse_args(argv)
    import jax
    from device_check import _one_device

    import shardplan
    from shardplan.compiler import traffic
    from shardplan.models.train import reference
    with open(args.results) as fh:
        data = json.load(fh)
    calibration = data.get("calibration")
    if args.calibration:
        with open(args.calibration) as fh:
            calibration = json.load(fh)

    def predict(m, mesh) -> float:
        ref = reference(m["model"], scan=True, **m.get("overrides", {}))
        state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(m["batch"], abstract=True)
        f = shardplan.auto(ref.train_step, mesh=mesh, donate_argnums=(0,), time_limit=20, remat=m["remat_setting"],
                           cache=False)
        f.make_plan(state, batch)
        return f.plan.cost.step_s

    extra = " predicted now, slice copies unpriced ms |" if args.without_slice_copies else ""
    print(f"| model, batch, remat | predicted then ms |{extra} predicted now ms | measured ms | measured / now |")
    print("|---|---|---|---|---|" + ("---|" if extra else ""))
    for m in data["models"]:
        if "measured_s" not in m:
            continue
        mesh = _one_device(m["mesh"].removesuffix("-1"), calibration)
        now = predict(m, mesh)
        without = ""
        if args.without_slice_copies:
            kept, traffic.copied_slices = traffic.copied_slices, lambda graph: set()
            try:
                without = f" {predict(m, mesh) * 1e3:.1f} |"
            finally:
                traffic.copied_slices = kept
        layers = "".join(f", {k}={v}" for k, v in m.get("overrides", {}).items())
        print(f"| {m['model']}{layers}, {m['batch']}, {m['remat_setting']} | {m['predicted_s'] * 1e3:.1f} |{without} "
              f"{now * 1e3:.1f} | {m['measured_s'] * 1e3:.1f} | {m['measured_s'] / now:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
