"""Predicted against compiled, per plan: collective bytes per device and memory per device.

    python benchmarks/audit_matrix.py [--models gpt-tiny,llama-tiny,mlp-tiny]
        [--cells "h100-8:data=2,model=4;h100-8:data=8,model=1;h100-8x8:data=8,model=8;a100-128x8:data=128,model=8"]
        [--batch 128] [--target auto|cpu|gpu|tpu] [--pipeline "2x4,4x8,2x8c"]

Each cell plans the reference model (scanned, fp32, AdamW), compiles it and audits it
(:mod:`shardplan.compiler.audit`). ``--target auto`` (default) compiles on the cell's own GPU or TPU compiler
with no device present where installed (``[aot]``), else on fake CPU devices; ``--target cpu``
always on the CPU. The bar: collective bytes within 5%, memory within 10% (issue 12).

``--pipeline`` plans each model (8 scanned layers) inside each of these pipelines instead
(``SxM``: S stages, M microbatches, GPipe; a ``c`` suffix: circular with 2 rounds), the stage
axis split off each cell's mesh, and adds the collective-permute bytes (the stage shifts) to
the table. The bar there (issue 13): collective-permute bytes exact, memory within 15%.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1024")
if not __package__:   # run as a script from a checkout: import the checkout's shardplan
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import shardplan  # noqa: E402
from shardplan.compiler import targets  # noqa: E402
from shardplan.models.train import reference  # noqa: E402
from shardplan.util.sizes import format_bytes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt-tiny,llama-tiny,mlp-tiny")
    ap.add_argument("--cells", default="h100-8:data=2,model=4;h100-8:data=8,model=1;h100-8x8:data=8,model=8;"
                                       "a100-128x8:data=128,model=8", help="preset:axes;... (issue 3's shapes)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--target", default="auto", choices=("auto", "cpu", "gpu", "tpu"))
    ap.add_argument("--pipeline", default="", help="SxM[c],...: plan inside these pipelines (c: circular, 2 rounds)")
    args = ap.parse_args()
    pipelines = [_pipeline(text) for text in args.pipeline.split(",") if text] or [None]
    piped = pipelines != [None]
    print("| model | mesh | " + ("pipeline | " if piped else "") + "compiler | predicted collectives | compiled "
          "collectives | error | " + ("collective-permute predicted / compiled | " if piped else "") +
          "predicted memory | compiled memory | error | within 5% / " + ("15%" if piped else "10%") + " |")
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if piped else ""))
    for name in args.models.split(","):
        ref = reference(name, scan=True, **({"n_layers": 8} if piped else {}))
        state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(args.batch, abstract=True)
        for cell in args.cells.split(";"):
            preset, _, text = cell.partition(":")
            axes = {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}
            mesh = shardplan.load_mesh(preset, axes=axes)
            for config in pipelines:
                f = shardplan.auto(ref.train_step, mesh=mesh, donate_argnums=(0,), time_limit=args.time_limit,
                                   pipeline=config)
                f.make_plan(state, batch)
                target = targets.resolve(args.target, mesh)
                a = f.audit_for(target, state, batch)
                p, c = a.comm_bytes
                ok = abs(a.comm_error()) <= 0.05 and abs(a.memory_error()) <= (0.15 if piped else 0.10)
                shape = tuple(zip(f.plan.axis_names, f.plan.axis_sizes)) if piped else tuple(axes.values())
                row = f"| {name} | {preset} {shape} | "
                if piped:
                    row += f"{config.stages} x {config.microbatches} {config.schedule.value} | "
                row += f"{target} | {format_bytes(p)} | {format_bytes(c)} | {a.comm_error():+.1%} | "
                if piped:
                    permute = next((r for r in a.by_kind if r.name == "collective-permute"), None)
                    row += "none | " if permute is None else \
                        f"{format_bytes(permute.predicted_bytes)} / {format_bytes(permute.compiled_bytes)} | "
                row += (f"{format_bytes(a.memory.predicted_bytes)} | {format_bytes(a.memory.compiled_bytes)} | "
                        f"{a.memory_error():+.1%} | {'yes' if ok else 'no'} |")
                print(row, flush=True)


def _pipeline(text: str):
    from shardplan.parallel.pipeline import PipelineConfig
    circular = text.endswith("c")
    stages, microbatches = (int(n) for n in text.rstrip("c").split("x"))
    return PipelineConfig(stages, microbatches, schedule="circular" if circular else "gpipe",
                          repeats=2 if circular else 1)


if __name__ == "__main__":
    main()
