"""The collectives of each loop body of a Megatron 3D pipeline, as compiled on fake CPU devices.

    python benchmarks/pipeline_collectives.py [--model gpt2-small] [--stages 4] [--schedule gpipe]
        [--repeats 1] [--microbatches 8] [--batch 16]

Megatron 3D (:func:`benchmarks.baselines.megatron_3d`) on 8 fake CPU devices as (stage, data,
model=2): the reference model scanned, its layer stack run by shardplan's SPMD pipeline. Prints,
per computation of the compiled program (the forward and backward pipeline loops are while
bodies), how many of each collective it issues and their shapes: what moves per iteration.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if not __package__:   # run as a script from a checkout: import the checkout's shardplan
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from benchmarks.baselines import megatron_3d  # noqa: E402
from shardplan.models.train import reference  # noqa: E402
from shardplan.parallel.pipeline import PipelineConfig, Schedule, pipelined  # noqa: E402

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_COLLECTIVE = re.compile(r"= (\w+\[[^\]]*\]|\([^)]*\))\S* (all-gather|all-reduce|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\(")


def collectives_per_computation(hlo: str) -> dict[str, collections.Counter]:
    """``{computation: Counter((kind, shape))}`` of an HLO module's text."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    computation = None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line.startswith(" "):
            computation = m.group(1)
        m = _COLLECTIVE.search(line)
        if m:
            out[computation][(m.group(2), m.group(1))] += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-small")
    ap.add_argument("--stages", type=int, default=4, choices=(2, 4))
    ap.add_argument("--schedule", default="gpipe", choices=[s.value for s in Schedule])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--replicas", type=int, default=1, help="PipelineConfig.replicas (row groups over 'data')")
    args = ap.parse_args()
    ref = reference(args.model, scan=True)
    state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(args.batch, abstract=True)
    inner = {"data": 8 // args.stages // 2, "model": 2}
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(args.stages, inner["data"], 2),
                             ("stage", "data", "model"))
    state_specs, batch_specs = megatron_3d(state, batch, inner, args.stages)
    sh = jax.tree.map(lambda s: NamedSharding(mesh, s), (state_specs, batch_specs),
                      is_leaf=lambda x: isinstance(x, PartitionSpec))
    step = jax.jit(ref.train_step, in_shardings=sh, out_shardings=(sh[0], None), donate_argnums=(0,))
    config = PipelineConfig(args.stages, args.microbatches, Schedule(args.schedule), repeats=args.repeats,
                            batch_axes=("data",), replicas=args.replicas)
    with pipelined(config, mesh):
        hlo = step.lower(state, batch).compile().as_text()
    print(f"{args.model}, Megatron 3D on cpu-8 (stage={args.stages}, data={inner['data']}, model=2), "
          f"{config.describe()}")
    for computation, counts in collectives_per_computation(hlo).items():
        print(computation)
        for (kind, shape), n in sorted(counts.items()):
            print(f"    {n} x {kind} {shape}")


if __name__ == "__main__":
    main()
