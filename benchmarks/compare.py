"""Planner against hand-written plans (data parallel, FSDP, Megatron tensor parallel).

    python benchmarks/compare.py [--models gpt2-small,gpt3-1.3b] [--batch gpt2-small=64,gpt3-1.3b=16]

For each model and mesh cell, every plan is lowered and compiled (never run) on fake CPU
devices. Columns:

- predicted: the project's cost model. For a hand plan, its parameter, optimizer-state and batch
  shardings are fixed and the ILP picks the best activation shardings around them (which
  favours the hand plan).
- compiled: the compiled HLO priced on the cell's mesh: dot FLOPs over peak FLOP/s, plus the
  HBM bytes its top-level ops read and write over HBM bandwidth (summed, no overlap), plus every
  collective (trip counts included) over its mesh axes' links. A CPU all-reduce that is only
  sliced afterwards is priced as the reduce-scatter a GPU compile emits.
- memory: ``memory_analysis`` argument + output + temp - alias bytes per device (CPU compile).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=64")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import shardplan  # noqa: E402
from benchmarks.baselines import BASELINES, hand_plan  # noqa: E402
from models.train import reference  # noqa: E402
from shardplan.api import trace_step  # noqa: E402
from shardplan.cost import CostModel, from_partition_spec  # noqa: E402
from shardplan.hlo import collectives, dot_flops, hbm_bytes  # noqa: E402
from shardplan.planner import PlannerOptions, plan_jaxpr  # noqa: E402

CELLS = [("h100-8", {"data": 2, "model": 4}), ("h100-8", {"data": 1, "model": 8}),
         ("h100-8x8", {"data": 8, "model": 8})]


def check_divisible(state_specs, batch_specs, state, batch, axes) -> None:
    specs = jax.tree.leaves((state_specs, batch_specs), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for spec, aval in zip(specs, jax.tree.leaves((state, batch))):
        for size, entry in zip(aval.shape, spec):
            names = (entry,) if isinstance(entry, str) else tuple(entry or ())
            n = 1
            for a in names:
                n *= axes[a]
            if size % n:
                raise ValueError(f"dimension {size} does not split {n} ways over {names}")


def compiled_figures(compiled, mesh_spec, jax_mesh):
    model = CostModel(mesh_spec)
    text = compiled.as_text()
    comms = collectives(text, jax_mesh)
    comm_s = sum(model.collective_time(c.comm()) * c.count for c in comms)
    compute_s = sum(f / mesh_spec.device.flops_for({"bf16": "bfloat16", "f16": "float16"}.get(d, "float32"))
                    for d, f in dot_flops(text).items()) + hbm_bytes(text) / mesh_spec.device.hbm_bandwidth
    m = compiled.memory_analysis()
    memory = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    count = sum(c.count for c in comms)
    nbytes = sum(c.nbytes * c.count for c in comms)
    return compute_s + comm_s, comm_s, memory, count, nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2-small,gpt3-1.3b")
    ap.add_argument("--batch", default="gpt2-small=64,gpt3-1.3b=16",
                    help="global batch per model, name=size,...")
    ap.add_argument("--time-limit", type=float, default=30.0)
    args = ap.parse_args()
    print("| model | mesh | plan | predicted step ms | compiled step ms | compiled comm ms | memory GiB/dev "
          "| collectives (count, GiB) | solve s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        ref = reference(name, scan=True)
        state = jax.eval_shape(ref.init, jax.random.key(0))
        sizes = dict(kv.split("=") for kv in args.batch.split(","))
        batch = ref.batch(int(sizes.get(name, 16)), abstract=True)
        for preset, axes in CELLS:
            mesh_spec = shardplan.load_mesh(preset, axes=axes)
            jax_mesh = mesh_spec.to_jax_mesh()
            label = f"{preset} {tuple(axes.values())}"
            rows = []
            f = shardplan.auto(ref.train_step, mesh=mesh_spec, donate_argnums=(0,), time_limit=args.time_limit)
            try:
                compiled = f.lower(state, batch).compile()
                rows.append(("shardplan", f.plan.cost.step_s, f.plan.solver.wall_time,
                             compiled_figures(compiled, mesh_spec, jax_mesh)))
            except shardplan.InfeasibleBudgetError as e:
                print(f"| {name} | {label} | shardplan | infeasible: needs {e.min_feasible_bytes / 2**30:.0f} GiB "
                      f"| | | | | |", flush=True)
            closed, names, arg_of, donated, _, in_tree, out_tree = trace_step(ref.train_step, (state, batch), (), (0,))
            for kind in BASELINES:
                state_specs, batch_specs = hand_plan(kind, state, batch, axes, stacked=True)
                flat_specs = jax.tree.leaves((state_specs, batch_specs), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
                flat_avals = jax.tree.leaves((state, batch))
                fixed = [from_partition_spec(s, len(a.shape)) for s, a in zip(flat_specs, flat_avals)]
                try:
                    check_divisible(state_specs, batch_specs, state, batch, axes)
                except ValueError as e:
                    print(f"| {name} | {label} | {kind} | n/a: {e} | | | | | |", flush=True)
                    continue
                try:
                    p, _ = plan_jaxpr(closed, names, arg_of, mesh_spec, mesh_spec.device.hbm_bytes, donated=donated,
                                      options=PlannerOptions(time_limit=args.time_limit), fixed_inputs=fixed)
                    predicted = p.cost.step_s
                except shardplan.InfeasibleBudgetError:
                    predicted = float("nan")
                sh = jax.tree.map(lambda s: NamedSharding(jax_mesh, s), (state_specs, batch_specs),
                                  is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
                jitted = jax.jit(ref.train_step, in_shardings=sh, out_shardings=(sh[0], None), donate_argnums=(0,))
                rows.append((kind, predicted, None, compiled_figures(jitted.lower(state, batch).compile(),
                                                                     mesh_spec, jax_mesh)))
            hbm = mesh_spec.device.hbm_bytes
            for kind, predicted, solve_s, (step, comm, memory, count, nbytes) in rows:
                fits = "" if memory <= hbm else " (over HBM)"
                pred = "infeasible" if predicted != predicted else f"{predicted * 1e3:.2f}"
                print(f"| {name} | {label} | {kind} | {pred} | {step * 1e3:.2f} | {comm * 1e3:.2f} | "
                      f"{memory / 2**30:.2f}{fits} | {count:.0f}, {nbytes / 2**30:.3f} | "
                      f"{'' if solve_s is None else f'{solve_s:.1f}'} |", flush=True)


if __name__ == "__main__":
    main()
