"""The predicted step of each recomputation policy on one device, as ``remat="auto"`` weighs them.

    python benchmarks/remat_prices.py [--base h200-8] [--calibrated benchmarks/results/h200_calibration.json] \
        [--models gpt2-small:16,llama3-8b:1:n_layers=4] [--policies none,dots_all,dots,full,offload,auto]

Plans each reference model's train step (from abstract arguments: nothing runs) on ``--base``'s
device cut to one, priced with a calibration's measured peaks where given, under each policy,
and prints the predicted step, its compute and what the ILP minimised. Set
``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 CUDA_VISIBLE_DEVICES=-1`` where the aot extra is installed.
The measured steps of the same plans are in ``benchmarks/RESULTS.md`` (sessions 20 and 21).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if not __package__:   # run as a script from a checkout: import the checkout's shardplan
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="h200-8")
    ap.add_argument("--calibrated", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                        "h200_calibration.json"),
                    help="a calibration's JSON (device_check.py's); '' for the preset's peaks")
    ap.add_argument("--models", default="gpt2-small:16,llama3-8b:1:n_layers=4")
    ap.add_argument("--policies", default="none,dots_all,dots,full,offload,auto")
    args = ap.parse_args()
    import jax

    import shardplan
    from benchmarks.device_check import _one_device
    from shardplan.errors import InfeasibleBudgetError
    from shardplan.models.train import MODEL_CONFIGS, reference
    mesh = _one_device(args.base, json.load(open(args.calibrated)) if args.calibrated else None)
    print(f"{'model':<32} {'remat':<9} {'chosen':<9} {'step ms':>9} {'compute ms':>11} {'ILP ms':>9} {'GiB':>7}")
    for item in args.models.split(","):
        name, batch, *fields = item.split(":")
        overrides = {k: type(getattr(MODEL_CONFIGS[name], k))(v) for k, v in (f.split("=") for f in fields)}
        ref = reference(name, scan=True, **overrides)
        state = jax.eval_shape(ref.init, jax.random.key(0))
        data = ref.batch(int(batch), abstract=True)
        for remat in args.policies.split(","):
            try:
                p = shardplan.plan(ref.train_step, state, data, mesh=mesh, remat=remat, time_limit=20, cache=False)
            except InfeasibleBudgetError:
                print(f"{item:<32} {remat:<9} does not fit")
                continue
            chosen = ",".join(s["policy"] for s in (p.remat or {}).get("sites", []))
            c = p.cost
            print(f"{item:<32} {remat:<9} {chosen:<9} {c.step_s * 1e3:>9.1f} {c.compute_s * 1e3:>11.1f} "
                  f"{c.searched_s * 1e3:>9.1f} {c.memory_bytes / 2**30:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
