"""Host offload against recomputation, held against the deviceless GPU compiler.

    python benchmarks/offload.py [--model llama3-8b] [--mesh h100-8] [--batch 8] [--budget GiB]

A reference model (scanned layers) planned from ``ShapeDtypeStruct`` arguments once per
recomputation setting (``dots``, ``offload``, ``full`` for every layer class, and ``auto``, the
planner's own choice per class), then compiled for the mesh's GPU by XLA's CUDA compiler with
no GPU present (``pip install 'shardplan[aot]'``). One markdown row each: the policy chosen, the
predicted step (and the host copies' share of it), device memory predicted and
compiled, host memory predicted and compiled, the planner's wall time.
"""

from __future__ import annotations

import argparse
import time

import jax

import shardplan
from shardplan.models.train import reference
from shardplan.util.sizes import format_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--mesh", default="h100-8")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--budget", default=None, help="memory budget per device (default: the device's usable memory)")
    ap.add_argument("--policies", default="dots,offload,full,auto")
    args = ap.parse_args()
    ref = reference(args.model, scan=True)
    state = jax.eval_shape(ref.init, jax.random.key(0))
    batch = ref.batch(args.batch, abstract=True)
    print(f"{args.model}, batch {args.batch}, {args.mesh}, budget {args.budget or 'default'}")
    print("| remat | chosen | predicted step ms | host copies ms | device memory predicted / compiled "
          "| host memory predicted / compiled | planner wall s |")
    print("|---|---|---|---|---|---|---|")
    for policy in args.policies.split(","):
        f = shardplan.auto(ref.train_step, mesh=args.mesh, remat=policy, memory_budget=args.budget,
                           donate_argnums=(0,), cache=False)
        t = time.perf_counter()
        try:
            plan = f.make_plan(state, batch)
        except shardplan.InfeasibleBudgetError as e:
            print(f"| {policy} | no plan fits: {str(e).splitlines()[0][:80]} | | | | | |")
            continue
        wall = time.perf_counter() - t
        audit = f.audit_for("gpu", state, batch)
        chosen = ", ".join(sorted({s["policy"] for s in plan.remat["sites"]})) if plan.remat else "as written"
        c = plan.cost
        host = audit.host
        host_s = (f"{format_bytes(host.predicted_bytes)} / {format_bytes(host.compiled_bytes)}"
                  if host is not None else "0 / 0")
        print(f"| {policy} | {chosen} | {c.step_s * 1e3:.1f} | {c.offload_exposed_s * 1e3:.1f} | "
              f"{format_bytes(c.memory_bytes)} / {format_bytes(audit.memory.compiled_bytes)} "
              f"({audit.memory_error():+.1%}) | {host_s} | {wall:.1f} |", flush=True)


if __name__ == "__main__":
    main()
