"""The Megatron-LM weak-scaling study, planned: the planner's choice and prediction for each GPT
configuration of Narayanan et al. 2021 (SC21, Table 1) on A100 80GB nodes of 8 (NVLink inside a
node, HDR InfiniBand across), sequence 2048, vocabulary 51200.

    python benchmarks/weak_scaling.py [--rows 1,2,6] [--pipeline off|auto|N [--microbatches M]]
                                      [--remat full|none|dots|auto] [--time-limit 30] [--memory-budget 59GiB]
                                      [--mesh-dir DIR]

Each row is planned abstractly (``jax.ShapeDtypeStruct`` state and batch, no devices): the
reference GPT decoder (scanned layers, bfloat16 parameters as ``gpt3-175b``, AdamW) with that
row's layers, hidden size and heads (d_ff = 4 x hidden), on a mesh of GPUs/8 nodes with the
``a100-128x8`` preset's device and links and logical axes data = nodes, model = 8: the mesh
``shardplan mesh new --hardware a100-128x8 --nodes N --ici-model 8 --dcn-data -1`` writes
(``--mesh-dir`` keeps those files). Prints one markdown row per configuration as it is planned,
progress on stderr.

Columns: TP is how many devices split the layers' weight matrices over mesh axes that do not
split the batch; PP the pipeline stages (with microbatches, schedule and the row groups whose
weight gradients are summed once a step, ``replicas``); DP how many devices
split the batch; ``x`` what is left of the GPUs (axes that split neither: replicated work, or a
sequence split), so TP x PP x DP x x = GPUs. ZeRO names the axes that also shard the parameters
(``params``, i.e. FSDP / ZeRO-3) or only the optimizer state (``opt``) over batch-splitting axes.
TFLOP/s per GPU uses the model FLOPs as Megatron counts them (Narayanan et al. 2021, eq. 3,
which includes the recomputation's extra forward pass):
``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` per step, divided by the predicted step time and GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import traceback

if not __package__:   # run as a script from a checkout: import the checkout's shardplan
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import shardplan  # noqa: E402
from shardplan.models.train import reference  # noqa: E402

HARDWARE = "a100-128x8"
SEQ, VOCAB = 2048, 51200
A100_PEAK_TFLOPS = 312.0       # dense bf16


@dataclasses.dataclass(frozen=True)
class Row:
    layers: int
    hidden: int
    heads: int
    gpus: int
    batch: int
    seq: int = SEQ
    vocab: int = VOCAB


# (layers, hidden, heads, GPUs, global batch): Narayanan et al. 2021, Table 1 (weak scaling).
ROWS = [Row(*r) for r in [(24, 2304, 24, 32, 512), (30, 3072, 32, 64, 512), (36, 4096, 32, 128, 512),
                          (40, 6144, 48, 256, 1024), (48, 8192, 64, 512, 1536), (60, 10240, 80, 1024, 1792),
                          (80, 12288, 96, 1536, 2304), (96, 16384, 128, 1920, 2160),
                          (105, 20480, 128, 2520, 2520), (128, 25600, 160, 3072, 3072)]]


def megatron_flops(row: Row) -> float:
    """Model FLOPs of one step, Narayanan et al. 2021 eq. 3 (with the recomputed forward pass)."""
    B, s, l, h, V = row.batch, row.seq, row.layers, row.hidden, row.vocab
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def cluster_mesh(gpus: int, *, hardware: str = HARDWARE, mesh_dir: str | None = None):
    """The mesh of ``gpus`` GPUs in nodes of the preset's size, axes data = nodes, model = node
    (:func:`shardplan.devices.cluster.cluster_mesh`, what ``shardplan mesh new --hardware HARDWARE --nodes N
    --ici-model 8 --dcn-data -1`` writes); written into ``mesh_dir`` where given."""
    from shardplan.devices.cluster import cluster_mesh as make
    from shardplan.devices.mesh import write_mesh
    per_node = shardplan.load_mesh(hardware).devices_per_node
    if gpus % per_node:
        raise ValueError(f"{gpus} GPUs is not a whole number of {per_node}-GPU nodes")
    nodes = gpus // per_node
    name = f"{hardware.split('-')[0]}-{nodes}x{per_node}"
    spec = make(hardware, {"model": per_node}, {"data": -1}, nodes=nodes, name=name)
    if mesh_dir:
        write_mesh(spec, os.path.join(mesh_dir, f"{name}.toml"))
    return spec


def _axes(spec) -> set[str]:
    return {a for dim in spec for a in dim}


def parallelism(plan) -> dict:
    """TP / PP / DP / leftover degrees and ZeRO sharding as the plan lays them out (see the module doc)."""
    sizes = dict(zip(plan.axis_names, plan.axis_sizes))
    config = plan.pipeline_config()
    stage = config.axis if config else None
    batch_axes: set[str] = set()
    weight_axes: set[str] = set()
    opt_axes: set[str] = set()
    for r in plan.inputs:
        if r.role == "batch" and r.name.endswith("['inputs']"):
            batch_axes |= set(r.spec[0]) if r.spec else set()
        # the layers' weight matrices (stacked over layers: dim 0 is the layer, split over the stage axis)
        if r.name.endswith("['kernel']") and "['layers']" in r.name:
            if r.role == "params":
                weight_axes |= _axes(r.spec[1:])
            elif r.role == "opt_state":
                opt_axes |= _axes(r.spec[1:])
    batch_axes.discard(stage)
    tp_axes = weight_axes - batch_axes - {stage}
    tp = math.prod(sizes[a] for a in tp_axes)
    dp = math.prod(sizes[a] for a in batch_axes)
    pp = config.stages if config else 1
    other = math.prod(sizes.values()) // (tp * dp * pp)
    zero3 = sorted(weight_axes & batch_axes)
    zero1 = sorted((opt_axes & batch_axes) - set(zero3))
    zero = ", ".join([f"params/{'+'.join(zero3)}"] * bool(zero3) + [f"opt/{'+'.join(zero1)}"] * bool(zero1)) or "-"
    schedule = "-" if config is None else \
        f"{config.microbatches} mb {config.schedule.value}" + (f" x{config.repeats}" if config.repeats > 1 else "") \
        + (f", grads summed over {config.replicas}" if config.replicas > 1 else "")
    return {"tp": tp, "pp": pp, "dp": dp, "other": other, "schedule": schedule, "zero": zero,
            "tp_axes": sorted(tp_axes), "dp_axes": sorted(batch_axes)}


def remat_chosen(plan, remat: str) -> str:
    if plan.remat and plan.remat.get("sites"):
        return ", ".join(sorted({s["policy"] for s in plan.remat["sites"]}))
    return remat


def plan_row(row: Row, *, pipeline="off", remat: str = "full", time_limit: float = 30.0, memory_budget=None,
             mesh_dir: str | None = None, hardware: str = HARDWARE, cache: bool = False) -> dict:
    """Plan one configuration abstractly and return the table's fields."""
    mesh = cluster_mesh(row.gpus, hardware=hardware, mesh_dir=mesh_dir)
    # As `shardplan plan --remat`: "auto" lets the planner choose per layer class, a policy is built in.
    ref = reference("gpt3-175b", scan=True, n_layers=row.layers, d_model=row.hidden, n_heads=row.heads,
                    d_ff=4 * row.hidden, seq_len=row.seq, vocab=row.vocab, remat="none" if remat == "auto" else remat)
    state = jax.eval_shape(ref.init, jax.random.key(0))
    batch = ref.batch(row.batch, abstract=True)
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(state["params"]))
    budget = shardplan.parse_bytes(memory_budget) if memory_budget is not None else mesh.device.budget_bytes
    start = time.perf_counter()
    plan = shardplan.plan(ref.train_step, state, batch, mesh=mesh, memory_budget=budget, donate_argnums=(0,),
                          time_limit=time_limit, pipeline=pipeline, remat="auto" if remat == "auto" else None,
                          cache=cache)
    wall = time.perf_counter() - start
    step = plan.cost.step_s
    return {**dataclasses.asdict(row), "params_b": params / 1e9, **parallelism(plan),
            "remat": remat_chosen(plan, remat), "step_s": step, "memory_gib": plan.cost.memory_bytes / 2**30,
            "budget_gib": budget / 2**30, "tflops": megatron_flops(row) / step / row.gpus / 1e12,
            "wall_s": wall, "status": plan.solver.status, "mesh": mesh.name, "plan": plan}


HEADER = ("| layers | hidden | heads | GPUs | batch | params (B) | TP | PP | DP | x | pipeline | ZeRO | remat | "
          "step (s) | memory / budget (GiB) | TFLOP/s per GPU | % of peak | planner (s) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def format_row(r: dict) -> str:
    return (f"| {r['layers']} | {r['hidden']} | {r['heads']} | {r['gpus']} | {r['batch']} | {r['params_b']:.1f} | "
            f"{r['tp']} | {r['pp']} | {r['dp']} | {r['other']} | {r['schedule']} | {r['zero']} | {r['remat']} | "
            f"{r['step_s']:.3g} | {r['memory_gib']:.1f} / {r['budget_gib']:.1f} | {r['tflops']:.0f} | "
            f"{r['tflops'] / A100_PEAK_TFLOPS:.0%} | {r['wall_s']:.0f} |")


def _pipeline(text: str):
    return text if text in ("off", "auto") else int(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=None, help="1-based rows of the table to plan, e.g. 1,2,6 (default: all 10)")
    ap.add_argument("--pipeline", type=_pipeline, default="auto",
                    help="auto (default: plan each candidate pipeline, up to 16 stages, keep the best), off, or a "
                         "number of stages (rows 9 and 10 need more than 16: Megatron ran 35 and 64)")
    ap.add_argument("--remat", default="full", choices=("none", "dots", "full", "auto"),
                    help="recomputation in every layer (default full, as Megatron's runs), or auto: the planner's "
                         "choice per layer class (slower with --pipeline auto: 278 s instead of 122 s on row 6)")
    ap.add_argument("--time-limit", type=float, default=30.0, help="CP-SAT limit per solve (deterministic seconds)")
    ap.add_argument("--memory-budget", default=None,
                    help="per GPU, e.g. 75GiB (default: the preset's, 0.75 of the A100's 80 GB)")
    ap.add_argument("--mesh-dir", default=None, help="keep the generated mesh files here (default: a temporary folder)")
    ap.add_argument("--microbatches", type=int, default=None,
                    help="with --pipeline N: that many GPipe microbatches (a PipelineConfig) instead of the planner's "
                         "candidates (2N and 8N microbatches, circular)")
    args = ap.parse_args(argv)
    pipeline = args.pipeline
    if args.microbatches is not None:
        if not isinstance(pipeline, int):
            ap.error("--microbatches needs --pipeline N (a number of stages)")
        pipeline = shardplan.PipelineConfig(stages=pipeline, microbatches=args.microbatches)
    picked = [int(i) for i in args.rows.split(",")] if args.rows else list(range(1, len(ROWS) + 1))
    bad = [i for i in picked if not 1 <= i <= len(ROWS)]
    if bad:
        ap.error(f"--rows {args.rows}: rows are numbered 1 to {len(ROWS)}")
    if args.mesh_dir:
        os.makedirs(args.mesh_dir, exist_ok=True)
    print(f"pipeline {pipeline}, remat {args.remat}, time limit {args.time_limit}; {HARDWARE} hardware, "
          f"seq {SEQ}, vocab {VOCAB}\n")
    print(HEADER, flush=True)
    failed = 0
    for i in picked:
        row = ROWS[i - 1]
        print(f"[{i}/{len(ROWS)}] planning {row} ...", file=sys.stderr, flush=True)
        try:
            r = plan_row(row, pipeline=pipeline, remat=args.remat, time_limit=args.time_limit,
                         memory_budget=args.memory_budget, mesh_dir=args.mesh_dir)
        except Exception as e:     # noqa: BLE001 - one row failing (e.g. no plan fits) leaves the others
            traceback.print_exc()
            failed += 1
            why = str(e).splitlines()[0].split(". Largest")[0][:300]     # InfeasibleBudgetError: its first sentence
            print(f"| {row.layers} | {row.hidden} | {row.heads} | {row.gpus} | {row.batch} | "
                  f"{type(e).__name__}: {why} |||||||||||||", flush=True)
            continue
        print(f"[{i}/{len(ROWS)}] {r['mesh']}: {r['status']}, step {r['step_s']:.2f} s, planned in {r['wall_s']:.0f} s",
              file=sys.stderr, flush=True)
        print(format_row(r), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
