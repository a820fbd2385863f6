"""Planner wall time against layer count: GPT-3 175B shapes on a100-128x8 (1024 devices), abstract.

    python benchmarks/solve_time.py [--layers 12,24,48,96] [--scan|--no-scan] [--time-limit 10]
    python benchmarks/solve_time.py --layers 96 --batch 1536 --remat full --pipeline auto   # the pipeline search

Prints a markdown table: layers, trace+graph+enumeration seconds, ILP seconds, total, solver
status and gap, predicted step time and memory per device, and the pipeline chosen.
"""

from __future__ import annotations

import argparse
import time

import jax

import shardplan
from shardplan.models.train import reference


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt3-175b")
    ap.add_argument("--mesh", default="a100-128x8")
    ap.add_argument("--layers", default="12,24,48,96")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--scan", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--remat", default=None, help="recomputation policy (full, dots, auto; default: as written)")
    ap.add_argument("--pipeline", default="off", help="off, auto or a stage count (shardplan.plan's pipeline=)")
    ap.add_argument("--memory-budget", default=None, help="per device, e.g. 80GiB (default: the device's HBM)")
    args = ap.parse_args()
    print("| model | layers | layer stack | planner wall s | ILP s | status | gap | predicted step s "
          "| memory/device GiB | pipeline |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    pipeline = int(args.pipeline) if args.pipeline.isdigit() else args.pipeline
    for n in map(int, args.layers.split(",")):
        ref = reference(args.model, scan=args.scan, n_layers=n)
        state = jax.eval_shape(ref.init, jax.random.key(0))
        batch = ref.batch(args.batch, abstract=True)
        start = time.perf_counter()
        p = shardplan.plan(ref.train_step, state, batch, mesh=args.mesh, donate_argnums=(0,),
                           time_limit=args.time_limit, memory_budget=args.memory_budget, cache=False,
                           remat=args.remat, pipeline=pipeline)
        wall = time.perf_counter() - start
        print(f"| {args.model} | {n} | {'scan' if args.scan else 'unrolled'} | {wall:.1f} | {p.solver.wall_time:.1f} | "
              f"{p.solver.status} | {p.solver.gap:.1%} | {p.cost.step_s:.2f} | {p.cost.memory_bytes / 2**30:.1f} | "
              f"{p.pipeline_config().describe() if p.pipeline else 'none'} |",
              flush=True)


if __name__ == "__main__":
    main()
