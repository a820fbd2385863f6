"""The long-context choice for attention written out, against the same model written with
``shardplan.attention``.

    python benchmarks/written_attention.py [--model llama3-8b-128k] [--mesh h100-8x8] [--axes data=8,seq=8]

Llama-3-8B at 131072 tokens (the harness cell ``llama3-8b-128k``: batch 8, remat full), planned
with ``context="auto"`` twice from ``ShapeDtypeStruct`` arguments: once as the reference model
writes its attention (``shardplan.attention``) and once as its einsum twin writes it
(``models.layers.causal_attention``: ``jnp.repeat`` for the grouped heads, two einsums, a
``jnp.where`` causal mask and an f32 softmax), which the planner recognises
(``shardplan/tracing/einsum_attention.py``). Prints one markdown row each: the split chosen, the
predicted step and memory, the planner's wall time.
"""

from __future__ import annotations

import argparse
import time

import jax

import shardplan
from shardplan.models.train import reference


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b-128k")
    ap.add_argument("--mesh", default="h100-8x8")
    ap.add_argument("--axes", default="data=8,seq=8")
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    axes = {k: int(v) for k, v in (a.split("=") for a in args.axes.split(","))}
    mesh = shardplan.load_mesh(args.mesh, axes=axes)
    print("| attention written as | split chosen | predicted step s | memory/device GiB | planner wall s |")
    print("|---|---|---|---|---|")
    for attention in ("shardplan", "einsum"):
        ref = reference(args.model, scan=True, attention=attention, remat="full")
        state = jax.eval_shape(ref.init, jax.random.key(0))
        batch = ref.batch(args.batch, abstract=True)
        start = time.perf_counter()
        p = shardplan.plan(ref.train_step, state, batch, mesh=mesh, context="auto", cache=False)
        wall = time.perf_counter() - start
        chosen = p.context_config().describe() if p.context is not None else "none"
        print(f"| {'shardplan.attention' if attention == 'shardplan' else 'einsum-softmax-einsum'} | {chosen} | "
              f"{p.cost.step_s:.3f} | {p.cost.memory_bytes / 2**30:.2f} | {wall:.1f} |", flush=True)


if __name__ == "__main__":
    main()
