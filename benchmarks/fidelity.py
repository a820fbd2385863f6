"""Predictions against the compilers on a seeded random corpus of models nobody tuned on.

    python -m shardplan.benchmarks.fidelity [--compiler cpu|gpu|tpu|all] [--fixed 60] [--fresh 10]
        [--seed YYYYMMDD] [--out benchmarks/results/fidelity.json]

Each model is drawn from a seed (:func:`draw`): a decoder LM (GPT-style, or Llama-style with
grouped-query attention), a mixture-of-experts decoder or a CNN (ResNet); depth, width, heads,
feed-forward width, vocabulary, sequence, batch, dtype, scanned or unrolled layers and
recomputation; a mesh of one to three axes on the compiler's presets (CPU: 8 fake devices; GPU:
8 to 1024 H100s or A100s; TPU: v5e and v5p slices); a loose budget (the device's) or a binding one
(60% of what the loose plan needs). The planner plans it, the compiler compiles the plan (GPU and
TPU with no device present, the ``[aot]`` extra), and the audit (:mod:`shardplan.compiler.audit`) holds
the predicted memory per device and collective bytes against the compiled program's.

The fixed set is seeds ``0 .. fixed-1``, the same every run; the fresh draw is ``fresh`` models
from ``--seed`` (by default today's date, printed so the run can be reproduced). Per compiler the
table gives the median, 90th percentile and worst absolute error of memory and of collective
bytes, how many plans compiled over their budget and how many of those are still over once
planned again with ``fit_compiled`` (what :func:`shardplan.auto` does on the device itself), and
the worst cells with their configs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import random
import sys
import time

# Fake CPU devices for the GPU and TPU presets' meshes (up to 1024 devices), which the deviceless
# compilers lower on; the CPU plugin alone (the CUDA plugin would look for a GPU).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1024")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if not __package__:   # run as a script from a checkout: import the checkout's shardplan
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

# Imported as shardplan.benchmarks.fidelity, jax was imported before the lines above ran: its
# platforms are set here, before its backends start.
jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])

import shardplan  # noqa: E402
from shardplan.compiler import targets  # noqa: E402
from shardplan.errors import InfeasibleBudgetError  # noqa: E402
from shardplan.models.train import reference  # noqa: E402

# Presets and mesh axes per compiler: (preset, {axis: size}), one to three axes.
MESHES = {
    "cpu": [("cpu-8", {"data": 8}), ("cpu-8", {"data": 4, "model": 2}), ("cpu-8", {"data": 2, "model": 4}),
            ("cpu-8", {"model": 8}), ("cpu-8", {"data": 2, "fsdp": 2, "model": 2})],
    "gpu": [("h100-8", {"data": 8}), ("h100-8", {"data": 2, "model": 4}), ("a100-8", {"data": 4, "model": 2}),
            ("h100-8x8", {"data": 8, "model": 8}), ("h100-8x8", {"data": 16, "model": 4}),
            ("h100-8x8", {"data": 4, "fsdp": 2, "model": 8}), ("a100-128x8", {"data": 128, "model": 8}),
            ("a100-128x8", {"data": 32, "fsdp": 4, "model": 8})],
    "tpu": [("tpu-v5e-256", {"data": 16, "model": 16}), ("tpu-v5e-256", {"data": 64, "model": 4}),
            ("tpu-v5e-256", {"data": 8, "fsdp": 4, "model": 8}), ("tpu-v5p-64", {"data": 16, "model": 4}),
            ("tpu-v5p-64", {"data": 64})],
}
BASE = {"gpt": "gpt-tiny", "llama": "llama-tiny", "moe": "mixtral-tiny", "cnn": "resnet-tiny"}


@dataclasses.dataclass(frozen=True)
class Draw:
    """One model of the corpus: what :func:`reference` builds, its batch, mesh and budget."""

    seed: int
    kind: str                     # gpt, llama, moe, cnn
    overrides: tuple              # (config field, value) pairs over the kind's tiny config
    scan: bool
    batch: int
    preset: str
    axes: tuple                   # ((axis, size), ...)
    binding: bool                 # budget: 60% of the loose plan's memory, else the device's

    def describe(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in self.overrides)
        return (f"seed {self.seed}: {self.kind} ({fields}), {'scanned' if self.scan else 'unrolled'}, batch "
                f"{self.batch}, {self.preset} {dict(self.axes)}, {'binding' if self.binding else 'loose'} budget")


def draw(seed: int, compiler: str) -> Draw:
    """The model of ``seed`` for ``compiler``'s presets: the same draw on every machine."""
    rng = random.Random(f"{compiler}:{seed}")
    kind = rng.choice(["gpt", "gpt", "llama", "llama", "moe", "cnn"])
    preset, axes = rng.choice(MESHES[compiler])
    rows = int(np.prod([n for a, n in axes.items() if a != "model"]))
    dtype = rng.choice(["float32", "bfloat16"])
    remat = rng.choice(["none", "none", "full"])
    if kind == "cnn":
        width = rng.choice([16, 32, 64])
        overrides = {"image_size": rng.choice([32, 64]), "widths": (width, 2 * width, 4 * width),
                     "blocks": rng.randint(1, 3), "dtype": dtype, "remat": remat}
        batch = rows * rng.choice([2, 4, 8])
    else:
        d = rng.choice([128, 256, 384, 512, 768, 1024])
        head_dim = rng.choice([32, 64, 128])
        heads = max(1, d // head_dim)
        overrides = {"vocab": rng.choice([1024, 4096, 8192, 32000, 50304]), "seq_len": rng.choice([128, 256, 512,
                                                                                                   1024]),
                     "d_model": d, "n_heads": heads, "n_layers": rng.randint(2, 8),
                     "d_ff": d * rng.choice([2, 3, 4]), "dtype": dtype, "remat": remat}
        if kind in ("llama", "moe"):
            overrides["n_kv_heads"] = rng.choice([h for h in range(1, heads + 1) if heads % h == 0])
        if kind == "moe":
            overrides.update(n_experts=rng.choice([4, 8]), top_k=rng.choice([1, 2]), d_ff=d * 2)
        batch = rows * rng.choice([1, 2, 4])
    return Draw(seed, kind, tuple(overrides.items()), rng.random() < 0.7, batch, preset, tuple(axes.items()),
                rng.random() < 0.3)


def measure(d: Draw, compiler: str, time_limit: float) -> dict:
    """Plan ``d`` and compile it for ``compiler``: the audit's memory and collective-bytes errors."""
    ref = reference(BASE[d.kind], scan=d.scan, **dict(d.overrides))
    state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(d.batch, abstract=True)
    mesh = shardplan.load_mesh(d.preset, axes=dict(d.axes))
    row = {"seed": d.seed, "config": d.describe()}
    start = time.perf_counter()
    budget = None
    if d.binding:
        loose = shardplan.plan(ref.train_step, state, batch, mesh=mesh, donate_argnums=(0,), cache=False,
                               time_limit=time_limit)
        budget = int(0.6 * loose.cost.memory_bytes)
    f = shardplan.auto(ref.train_step, mesh=mesh, memory_budget=budget, donate_argnums=(0,), cache=False,
                       time_limit=time_limit)
    try:
        f.make_plan(state, batch)
    except InfeasibleBudgetError as e:
        return {**row, "status": "infeasible", "least_bytes": e.min_feasible_bytes}
    a = f.audit_for(compiler, state, batch)
    p, c = a.comm_bytes
    budget = budget if budget is not None else mesh.device.budget_bytes
    row = {**row, "status": "ok", "budget_bytes": budget,
           "memory_predicted": a.memory.predicted_bytes, "memory_compiled": a.memory.compiled_bytes,
           "memory_error": a.memory_error(), "comm_predicted": p, "comm_compiled": c,
           "comm_error": a.comm_error() if c else (0.0 if not p else None),
           "remat": f.plan.choice("remat")}
    if a.memory.compiled_bytes > budget:
        # Over its budget: what shardplan.auto does on the device itself (fit_compiled, its default
        # there), with the compiler of the corpus.
        fitted = shardplan.auto(ref.train_step, mesh=mesh, memory_budget=budget, donate_argnums=(0,), cache=False,
                                time_limit=time_limit, fit_compiled=compiler if compiler != "cpu" else True)
        try:
            fitted.make_plan(state, batch)
            row["fitted_compiled"] = fitted.fit_attempts[-1].compiled_bytes if fitted.fit_attempts else None
        except InfeasibleBudgetError as e:
            row["fitted_compiled"] = None
            row["fitted_status"] = f"infeasible: {str(e).splitlines()[0][:200]}"
    return {**row, "seconds": time.perf_counter() - start}


def summary(compiler: str, rows: list[dict]) -> str:
    """The compiler's table: median, 90th percentile and worst absolute error; the worst cells."""
    ok = [r for r in rows if r["status"] == "ok"]

    def stats(key):
        errors = np.array([abs(r[key]) for r in ok if r.get(key) is not None and np.isfinite(r[key])])
        if not len(errors):
            return "n/a"
        return f"{np.median(errors):.1%} / {np.percentile(errors, 90):.1%} / {errors.max():.1%}"
    over = [r for r in ok if r["memory_compiled"] > r["budget_bytes"]]
    # Of those, the ones still over once planned with fit_compiled (a refusal, "infeasible", is
    # not over: the user is told no plan fits).
    fitted_over = [r for r in over if (r.get("fitted_compiled") or 0) > r["budget_bytes"]]
    fitted = "not run" if any("fitted_compiled" not in r for r in over) else str(len(fitted_over))
    lines = [f"| {compiler} | {len(rows)} | {len(ok)} | {stats('memory_error')} | {stats('comm_error')} | "
             f"{len(over)} | {fitted} |"]
    worst = sorted(ok, key=lambda r: -abs(r["memory_error"]))[:3]
    notes = [f"  - {compiler}, memory {r['memory_error']:+.1%}, collectives "
             f"{'n/a' if r['comm_error'] is None else format(r['comm_error'], '+.1%')}: {r['config']}" for r in worst]
    return "\n".join(lines), "\n".join(notes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compiler", default="cpu", choices=("cpu", "gpu", "tpu", "all"))
    ap.add_argument("--fixed", type=int, default=60, help="models of the fixed set (seeds 0 .. N-1)")
    ap.add_argument("--fresh", type=int, default=10, help="models drawn afresh from --seed")
    ap.add_argument("--seed", type=int, default=int(datetime.date.today().strftime("%Y%m%d")))
    ap.add_argument("--time-limit", type=float, default=5.0)
    ap.add_argument("--out", default=None, help="a JSON file for every row")
    args = ap.parse_args(argv)
    compilers = ["cpu", "gpu", "tpu"] if args.compiler == "all" else [args.compiler]
    compilers = [c for c in compilers if c == "cpu" or targets.available(c)]
    if not compilers:
        print(f"the {args.compiler.upper()} compiler is not installed: pip install 'shardplan[aot]'", file=sys.stderr)
        return 2
    print(f"jax {jax.__version__}; fixed set: seeds 0..{args.fixed - 1}; fresh draw: {args.fresh} models from "
          f"--seed {args.seed}")
    every, tables, notes = {}, [], []
    for compiler in compilers:
        seeds = list(range(args.fixed)) + [args.seed * 1000 + k for k in range(args.fresh)]
        rows = []
        for k, seed in enumerate(seeds):
            d = draw(seed, compiler)
            try:
                row = measure(d, compiler, args.time_limit)
            except Exception as e:         # noqa: BLE001 - a model the planner cannot plan is a result too
                row = {"seed": seed, "config": d.describe(), "status": f"error: {type(e).__name__}: "
                                                                        f"{str(e).splitlines()[0][:200]}"}
            rows.append(row)
            shown = row["status"] if row["status"] != "ok" else \
                f"memory {row['memory_error']:+.1%}, collectives " + \
                ("n/a" if row["comm_error"] is None else f"{row['comm_error']:+.1%}")
            print(f"  [{compiler} {k + 1}/{len(seeds)}] {shown}: {d.describe()}", file=sys.stderr, flush=True)
        every[compiler] = rows
        table, worst = summary(compiler, rows)
        tables.append(table)
        notes.append(worst)
    print("\n| compiler | models | planned and compiled | memory error: median / 90th pct / worst | collective bytes "
          "error: median / 90th pct / worst | compiled over the budget | over it with fit_compiled |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(tables))
    print("\nWorst memory cells:\n" + "\n".join(notes))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"jax": jax.__version__, "seed": args.seed, "rows": every}, fh, indent=1)
        os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
