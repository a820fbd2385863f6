"""Where a compiled plan's memory peaks: the buffers live at the fullest point of XLA's heap.

    python benchmarks/compiled_peak.py --model llama-tiny --mesh h100-8 --axes data=8,model=1 \\
        [--batch 128] [--target gpu|tpu|cpu] [--top 25] [--remat full] [--pipeline auto]
        [--memory-budget 60GiB] [--xla name=value,...] [--dump DIR]

Plans the reference model (scanned, fp32, AdamW) as ``audit_matrix.py`` does, compiles it for the
target with XLA's dumps on (the TPU with VMEM placement off, as the audit), and reads the
buffer assignment (:func:`shardplan.compiler.footprint.dumped_heap`): the heap, the bytes live at its
fullest point (loop-carried values included), the step where that is, and the buffers live
there, largest first, beside the plan's predicted memory and the memory model's fullest
checkpoint under the plan's specs. A heap over its live peak is layout
(fragmentation, alignment); a prediction under the live peak is liveness the memory model
misses (RESULTS.md, session 27).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1024")
if not __package__:   # run as a script from a checkout: import the checkout's shardplan
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import shardplan  # noqa: E402
from shardplan import api  # noqa: E402
from shardplan.compiler import footprint, layout, targets  # noqa: E402
from shardplan.models.train import reference  # noqa: E402
from shardplan.util.sizes import format_bytes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--mesh", default="h100-8")
    ap.add_argument("--axes", default="data=8,model=1")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--target", default="auto", choices=("auto", "cpu", "gpu", "tpu"))
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--xla", default="", help="extra XLA options, name=value,...")
    ap.add_argument("--remat", default="none", help="as shardplan plan --remat")
    ap.add_argument("--pipeline", default="off", help="auto, off or a number of stages")
    ap.add_argument("--memory-budget", default=None)
    ap.add_argument("--dump", default=None, help="keep XLA's dumps in this folder")
    args = ap.parse_args()
    ref = reference(args.model, scan=True, remat="none")
    state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(args.batch, abstract=True)
    axes = {k: int(v) for k, v in (kv.split("=") for kv in args.axes.split(","))}
    pipeline = None if args.pipeline == "off" else (args.pipeline if args.pipeline == "auto" else int(args.pipeline))
    f = shardplan.auto(ref.train_step, mesh=shardplan.load_mesh(args.mesh, axes=axes), donate_argnums=(0,),
                       time_limit=30, remat=None if args.remat == "none" else args.remat, pipeline=pipeline,
                       memory_budget=args.memory_budget)
    plan = f.make_plan(state, batch)
    c = f._compiled((state, batch), {})
    spec = c.plan.mesh_spec or f.mesh_spec
    target = targets.resolve(args.target, spec)
    jax_mesh = targets.target_mesh(spec, target)[0] if target != "cpu" else c.mesh
    program = api._Compiled(c.traced, c.plan, c.graph, jax_mesh, f.jit_kwargs)
    with tempfile.TemporaryDirectory(prefix="shardplan-peak-") as scratch:
        folder = args.dump or scratch
        extra = dict(kv.split("=", 1) for kv in args.xla.split(",") if kv)
        extra = {k: {"true": True, "false": False}.get(v, int(v) if v.lstrip("-").isdigit() else v)
                 for k, v in extra.items()}
        options = {**targets.HBM_ONLY_OPTIONS.get(target, {}), **extra, "xla_dump_to": folder}
        compiled = program.lower(*f._abstract(c, (state, batch), {})).compile(compiler_options=options)
        heap = footprint.dumped_heap(folder)
    if heap is None:
        sys.exit("no buffer assignment was dumped (a persistent compilation cache hit?)")
    m = compiled.memory_analysis()
    kept = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    print(f"{args.model} on {args.mesh} {axes}, batch {args.batch}, compiled for {target}")
    if plan.pipeline is not None:
        print(f"pipeline: {plan.pipeline_config().describe()}")
    print(f"predicted memory per device {format_bytes(plan.cost.memory_bytes)} "
          f"(heap overhead {spec.device.heap_overhead:.0%} on predicted live temporaries)")
    print(f"compiled: arguments + outputs - aliased {format_bytes(kept)}, heap {format_bytes(heap.heap)}, "
          f"total {format_bytes(kept + heap.heap)}")
    print(f"heap's live peak {format_bytes(heap.live_peak)} at step {heap.peak_step} "
          f"(layout adds {heap.heap / max(heap.live_peak, 1) - 1:+.1%})")
    print(f"\n{'bytes':>10}  {'live':>11}  {'shape':34}  values (aliased)")
    for size, start, end, shape, names in heap.at_peak[:args.top]:
        print(f"{format_bytes(size):>10}  {start:>5}-{end:<5}  {shape[:34]:34}  {', '.join(names[:3])[:70]}")
    rest = heap.at_peak[args.top:]
    if rest:
        print(f"... {len(rest)} more buffers, {format_bytes(sum(b[0] for b in rest))}")
    _model_peak(plan, c.graph, spec, args.top)


def _model_peak(plan, graph, spec, top: int) -> None:
    """The memory model's fullest checkpoint under the plan's specs: its temporaries, largest first
    (on a TPU each rounded to its heap slot), beside the compiled list above."""
    rows = {r.path: r for r in (*plan.activations, *plan.inputs, *plan.outputs)}
    tiled = layout.tiled(spec.device.name)
    best = None
    for k, point in enumerate(graph.points):
        items = [(float(layout.heap_bytes(rows[graph.tensors[t].path].bytes_per_device, tiled)), t)
                 for t in point if graph.tensors[t].rank and graph.tensors[t].path in rows]
        total = sum(b for b, _ in items)
        if best is None or total > best[0]:
            best = (total, k, items)
    if best is None:
        return
    total, k, items = best
    print(f"\nthe model's fullest checkpoint ({k} of {len(graph.points)}): {format_bytes(total)} in "
          f"{len(items)} tensors, before the heap overhead (split-K partial sums apart)")
    print(f"{'bytes':>10}  {'shape':34}  {'PartitionSpec':30}  tensor")
    items.sort(key=lambda x: -x[0])
    for b, t in items[:top]:
        tt, row = graph.tensors[t], rows[graph.tensors[t].path]
        print(f"{format_bytes(b):>10}  {tt.dtype.name + str(list(tt.shape)):34}  {str(row.partition_spec)[:30]:30}  "
              f"{tt.name} @ {tt.source.rsplit('/', 1)[-1][:50]}")
    if items[top:]:
        print(f"... {len(items) - top} more tensors, {format_bytes(sum(b for b, _ in items[top:]))}")


if __name__ == "__main__":
    main()
