"""``shardplan mesh list|show|validate|new|calibrate``: the presets and mesh files."""

from __future__ import annotations

import json
import sys

from shardplan.cli.args import fake_cpu_devices, parse_axes


def command(args, extra: list[str]) -> int:
    import shardplan
    from shardplan.compiler.cost import ALL_REDUCE, Comm, CostModel
    if args.mesh_cmd == "list":
        for name in shardplan.preset_names():
            m = shardplan.load_mesh(name)
            print(f"{name:<12} {m.num_devices:>5} x {m.device.name:<26} axes {dict(zip(m.axis_names, m.axis_sizes))}")
        return 0
    if args.mesh_cmd == "validate":
        try:
            m = shardplan.load_mesh(args.path)
        except shardplan.MeshConfigError as e:    # every problem of the file, one line each
            for line in getattr(e, "problems", None) or [str(e)]:
                print(f"shardplan: error: {line}", file=sys.stderr)
            return 2
        print(f"{args.path}: valid: {m.name}, {m.num_devices} x {m.device.name}, "
              f"axes {dict(zip(m.axis_names, m.axis_sizes))}")
        return 0
    if args.mesh_cmd == "new":
        return _mesh_new(args, extra)
    if args.mesh_cmd == "calibrate":
        return _mesh_calibrate(args)
    m = shardplan.load_mesh(args.name)
    model = CostModel(m)
    nodes = m.num_devices // m.devices_per_node
    cut = m.inter_node_link if nodes > 1 else m.intra_node_link
    print(json.dumps({"name": m.name, "device": m.device.name, "peak_flops": dict(m.device.peak_flops),
                      "hbm_bytes": m.device.hbm_bytes, "hbm_bandwidth": m.device.hbm_bandwidth,
                      "heap_overhead": m.device.heap_overhead, "usable_bytes": m.device.usable_bytes,
                      "allocator_fraction": m.device.allocator_fraction,
                      "default_memory_budget": m.device.budget_bytes, "devices": m.num_devices,
                      "devices_per_node": m.devices_per_node, "nodes": nodes,
                      "bisection_bandwidth": m.num_devices / 2 * cut.bandwidth,
                      "axes": [{"name": a.name, "size": a.size, "link": a.link.name, "bandwidth": a.link.bandwidth,
                                "latency": a.link.latency,
                                "all_reduce_1GiB_s": model.collective_time(Comm(ALL_REDUCE, (a.name,), 2**30))}
                               for a in m.axes], "source": m.source}, indent=1))
    return 0


def _mesh_calibrate(args) -> int:
    fake_cpu_devices(args.cpu_devices)      # CPU: fake devices to measure collectives on
    import jax

    from shardplan.devices.calibrate import calibrate
    from shardplan.devices.mesh import write_mesh
    given = [args.coordinator is not None, args.num_processes is not None, args.process_id is not None]
    if any(given) and not all(given):
        raise ValueError("--coordinator, --num-processes and --process-id go together: give all three "
                         "(e.g. --coordinator host0:1234 --num-processes 2 --process-id 0), or none")
    if all(given):
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
    quick = dict(matmul_sizes=(128, 256), copy_bytes=8 * 2**20, collective_bytes=(2**12, 2**16, 2**20), repeats=2) \
        if args.quick else {}
    spec = calibrate(base=args.base, axes=parse_axes(args.axes), name=args.name, **quick)
    if jax.process_index() != 0:       # every process measured; process 0 writes and says so
        return 0
    write_mesh(spec, args.out)
    flops = ", ".join(f"{k} {v / 1e12:.3f} TFLOP/s" for k, v in spec.device.peak_flops.items())
    print(f"wrote {args.out}: {spec.num_devices} x {spec.device.name}; {flops}; memory "
          f"{spec.device.hbm_bandwidth / 1e9:.1f} GB/s; " + "; ".join(
              f"{a.name}: {a.link.bandwidth / 1e9:.2f} GB/s, {a.link.latency * 1e6:.1f} us" for a in spec.axes),
          file=sys.stderr)
    return 0


def _mesh_new(args, extra: list[str]) -> int:
    import re

    from shardplan.devices.cluster import cluster_mesh
    from shardplan.devices.mesh import write_mesh
    ici, dcn = {}, {}
    it = iter(extra)
    for flag in it:
        match = re.fullmatch(r"--(ici|dcn)-(\w+)", flag)
        value = next(it, None)
        if not match or value is None or not re.fullmatch(r"-1|\d+", value):
            raise ValueError(f"unexpected argument {flag!r}{'' if value is None else ' ' + value}: write "
                             "parallelism as --ici-AXIS N and --dcn-AXIS N (N a positive integer or -1)")
        (ici if match.group(1) == "ici" else dcn)[match.group(2)] = int(value)
    if not ici and not dcn:
        raise ValueError("give the logical axes as --ici-AXIS N (inside a node) and --dcn-AXIS N (across nodes), "
                         "e.g. --ici-data 2 --ici-model 4 --dcn-data 2")
    spec = cluster_mesh(args.hardware, ici, dcn, nodes=args.nodes, devices_per_node=args.devices_per_node,
                        name=args.name)
    write_mesh(spec, args.out)
    axes = dict(zip(spec.axis_names, spec.axis_sizes))
    print(f"wrote {args.out}: {spec.num_devices} x {spec.device.name}, axes {axes}, "
          f"links {[a.link.name for a in spec.axes]}", file=sys.stderr)
    return 0
