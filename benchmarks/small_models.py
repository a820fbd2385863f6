"""Planner wall time for small models (what a user feels on a first call): trace, graph, options,
solve, from a cold start and with the plan cache off.

    python benchmarks/small_models.py [--meshes "8;2,4;2,2,2"] [--models gpt-tiny,llama-tiny,...]

Prints a markdown table: model, parameters, layer stack, mesh axes, planner wall seconds
(trace to plan), of them in the solver, status, predicted step. Bar: at most 2 s for a model of
at most a million parameters on the 2-core development machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
if not __package__:   # run as a script from a checkout: import the checkout's shardplan
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import shardplan  # noqa: E402
from shardplan.models.train import reference  # noqa: E402

MODELS = "gpt-tiny,llama-tiny,mlp-tiny,resnet-tiny,vit-tiny"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--meshes", default="8;2,4;2,2,2", help="';'-separated axis sizes over data,fsdp/model axes")
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args(argv)
    names = {1: ("data",), 2: ("data", "model"), 3: ("data", "fsdp", "model")}
    print("| model | parameters | layer stack | mesh axes | planner wall s | solver s | status | predicted step ms |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for model in args.models.split(","):
        for scan in (False, True):
            ref = reference(model, scan=scan)
            state = jax.eval_shape(ref.init, jax.random.key(0))
            params = sum(x.size for x in jax.tree.leaves(state["params"]))
            batch = ref.batch(args.batch, abstract=True)
            for text in args.meshes.split(";"):
                sizes = [int(x) for x in text.split(",")]
                axes = dict(zip(names[len(sizes)], sizes))
                mesh = shardplan.load_mesh("cpu-8", axes=axes)
                start = time.perf_counter()
                p = shardplan.plan(ref.train_step, state, batch, mesh=mesh, donate_argnums=(0,), cache=False)
                wall = time.perf_counter() - start
                worst = max(worst, wall)
                print(f"| {model} | {params:,} | {'scan' if scan else 'unrolled'} | {axes} | {wall:.2f} | "
                      f"{p.solver.wall_time:.2f} | {p.solver.status} | {p.cost.step_s * 1e3:.3f} |", flush=True)
    print(f"\nslowest: {worst:.2f} s")


if __name__ == "__main__":
    main()
