"""Figures that are not per-cell: planner solve time against layer and device count, and a
per-layer picture of the chosen strategy.

    python -m shardplan.benchmarks.figures [--out benchmarks/results]     # needs matplotlib

* ``solve_time.png``: planner wall time for GPT-3 175B shapes on a100-128x8 against the number of
  layers (12..96, scanned, 1 TiB budget), and for gpt3-1.3b (batch 1024, no binding budget)
  against the device count (8, 64, 256, 1024);
* ``strategy.png``: for an unrolled gpt2-small on h100-8x8, which mesh axes shard each
  parameter of each layer (the PartitionSpec, colour-coded).
Both are planned abstractly (nothing is compiled); numbers also go to ``figures.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

if not __package__:   # run as a script from a checkout: import the checkout's shardplan
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import shardplan  # noqa: E402
from shardplan.models.train import reference  # noqa: E402


def _time_plan(ref, batch, mesh, budget=None) -> float:
    state = jax.eval_shape(ref.init, jax.random.key(0))
    start = time.perf_counter()
    shardplan.plan(ref.train_step, state, ref.batch(batch, abstract=True), mesh=mesh, memory_budget=budget,
                   donate_argnums=(0,), cache=False)
    return time.perf_counter() - start


def solve_times() -> dict:
    layers = {n: _time_plan(reference("gpt3-175b", scan=True, n_layers=n), 256, "a100-128x8", "1TiB")
              for n in (12, 24, 48, 96)}
    meshes = {8: "h100-8", 64: "h100-8x8", 256: "tpu-v5e-256", 1024: "a100-128x8"}
    devices = {n: _time_plan(reference("gpt3-1.3b", scan=True), 1024, m, "64TiB") for n, m in meshes.items()}
    return {"layers": layers, "devices": devices}


def strategy_rows(model: str = "gpt2-small", mesh: str = "h100-8x8", batch: int = 64):
    ref = reference(model, scan=False)
    state = jax.eval_shape(ref.init, jax.random.key(0))
    p = shardplan.plan(ref.train_step, state, ref.batch(batch, abstract=True), mesh=mesh, donate_argnums=(0,))
    rows: dict[str, dict[str, str]] = {}
    for r in p.inputs:
        m = re.match(r"\[0\]\['params'\]\['layers'\]\['blocks'\]\[(\d+)\]\['(\w+)'\]\['(\w+)'\]", r.name)
        if m:
            rows.setdefault(f"layer {int(m.group(1)):02d}", {})[f"{m.group(2)}.{m.group(3)}"] = \
                str(r.partition_spec).replace("PartitionSpec", "")
    return rows, f"{model} unrolled on {mesh} {dict(zip(p.axis_names, p.axis_sizes))}, batch {batch}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"),
                    help="folder for the tables and figures (default: benchmarks/results under the current directory)")
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(args.out, exist_ok=True)
    times = solve_times()
    rows, title = strategy_rows()
    with open(os.path.join(args.out, "figures.json"), "w") as f:
        json.dump({"solve_times": times, "strategy": rows, "strategy_title": title}, f, indent=1)

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    a.plot(list(times["layers"]), list(times["layers"].values()), "o-")
    a.set_xlabel("layers (GPT-3 175B shapes, scanned)")
    a.set_ylabel("planner wall time (s)")
    a.set_ylim(bottom=0)
    a.set_title("a100-128x8 (1024 devices)", fontsize=9)
    b.plot(list(times["devices"]), list(times["devices"].values()), "o-")
    b.set_xscale("log", base=2)
    b.set_xlabel("devices (gpt3-1.3b)")
    b.set_ylim(bottom=0)
    b.set_title("h100-8, h100-8x8, tpu-v5e-256, a100-128x8", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "solve_time.png"), dpi=90)
    plt.close(fig)

    layers = sorted(rows)
    cols = sorted({c for r in rows.values() for c in r})
    specs = sorted({rows[l].get(c, "") for l in layers for c in cols})
    code = {s: i for i, s in enumerate(specs)}
    grid = [[code[rows[l].get(c, "")] for c in cols] for l in layers]
    fig, ax = plt.subplots(figsize=(1.0 * len(cols) + 2, 0.35 * len(layers) + 1.5))
    ax.imshow(grid, cmap="tab20", aspect="auto")
    ax.set_xticks(range(len(cols)), cols, rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(len(layers)), layers, fontsize=7)
    for i, l in enumerate(layers):
        for j, c in enumerate(cols):
            ax.text(j, i, rows[l].get(c, ""), ha="center", va="center", fontsize=5)
    ax.set_title(f"chosen PartitionSpec per parameter and layer\n{title}", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "strategy.png"), dpi=90)
    plt.close(fig)
    print(json.dumps(times, indent=1))


if __name__ == "__main__":
    main()
