"""The ``shardplan`` command line: ``shardplan plan`` plans a reference model on a mesh preset;
``shardplan mesh list|show`` inspects presets. Errors print one line and exit 2, no traceback."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _parse_axes(text: str | None) -> dict[str, int] | None:
    if not text:
        return None
    out = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name or not size.isdigit():
            raise ValueError(f"--axes {text!r}: write it as name=size,name=size (e.g. data=2,model=4)")
        out[name.strip()] = int(size)
    return out


def _cmd_plan(args) -> int:
    import jax
    import shardplan
    from models.train import reference

    mesh = shardplan.load_mesh(args.mesh, axes=_parse_axes(args.axes))
    ref = reference(args.model, scan=args.scan)
    print(f"planning {args.model} ({'scanned' if args.scan else 'unrolled'} layers, batch {args.batch}) "
          f"on {mesh.name} {dict(zip(mesh.axis_names, mesh.axis_sizes))} ...", file=sys.stderr, flush=True)
    state = jax.eval_shape(ref.init, jax.random.key(0))
    batch = ref.batch(args.batch, abstract=True)
    plan = shardplan.plan(ref.train_step, state, batch, mesh=mesh, memory_budget=args.memory_budget,
                          donate_argnums=(0,), time_limit=args.time_limit)
    print(plan.explain(max_activations=args.activations))
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            f.write(plan.to_json())
        os.replace(tmp, args.json)     # never leave a half-written plan on disk
        print(f"plan written to {args.json}", file=sys.stderr)
    return 0


def _cmd_mesh(args) -> int:
    import shardplan
    from shardplan.cost import ALL_REDUCE, Comm, CostModel
    if args.mesh_cmd == "list":
        for name in shardplan.preset_names():
            m = shardplan.load_mesh(name)
            print(f"{name:<12} {m.num_devices:>5} x {m.device.name:<26} axes {dict(zip(m.axis_names, m.axis_sizes))}")
        return 0
    m = shardplan.load_mesh(args.name)
    model = CostModel(m)
    print(json.dumps({"name": m.name, "device": m.device.name, "peak_flops": dict(m.device.peak_flops),
                      "hbm_bytes": m.device.hbm_bytes, "hbm_bandwidth": m.device.hbm_bandwidth,
                      "axes": [{"name": a.name, "size": a.size, "link": a.link.name, "bandwidth": a.link.bandwidth,
                                "latency": a.link.latency,
                                "all_reduce_1GiB_s": model.collective_time(Comm(ALL_REDUCE, (a.name,), 2**30))}
                               for a in m.axes], "source": m.source}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardplan", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="plan a reference model's train step on a mesh preset or file")
    p.add_argument("--model", default="gpt2-small", help="reference model config (models/train.py MODEL_CONFIGS)")
    p.add_argument("--mesh", default="h100-8", help="preset name or mesh file path")
    p.add_argument("--axes", default=None, help="override the logical mesh axes, e.g. data=2,model=4")
    p.add_argument("--batch", type=int, default=16, help="global batch size")
    p.add_argument("--scan", action=argparse.BooleanOptionalAction, default=True, help="scan over layers")
    p.add_argument("--memory-budget", default=None, help="per-device budget, e.g. 60GiB (default: device HBM)")
    p.add_argument("--time-limit", type=float, default=30.0, help="ILP limit in CP-SAT deterministic time (about seconds of one core)")
    p.add_argument("--activations", type=int, default=20, help="activation rows to print")
    p.add_argument("--json", default=None, help="also write the plan as JSON to this path")
    m = sub.add_parser("mesh", help="inspect mesh presets")
    msub = m.add_subparsers(dest="mesh_cmd", required=True)
    msub.add_parser("list", help="list the presets")
    show = msub.add_parser("show", help="print a preset or file with derived figures")
    show.add_argument("name")
    args = parser.parse_args(argv)
    from shardplan.errors import ShardplanError
    try:
        return _cmd_plan(args) if args.cmd == "plan" else _cmd_mesh(args)
    except (ShardplanError, ValueError, KeyError) as e:
        print(f"shardplan: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
