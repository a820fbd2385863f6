"""What the defaults cost and what they buy: each step planned with every family at its default
(shardplan.parallel.defaults) and with each family off, side by side in one run.

    python -m shardplan.benchmarks.defaults [--steps tests] [--large]

Prints markdown tables:

* per step (the reference models, and with ``--steps DIR`` the user-step corpora of the
  repository's ``tests/``: ``user_steps.py`` and ``scan_steps.py``): planning wall seconds and
  predicted step with the defaults, with ``remat``, ``context`` and ``pipeline`` each ``"off"``,
  and with all three off; the families the default plan uses;
* the decorator's first call (trace, plan, lower, compile), cold (plan cache off) and warm (the
  plan read from the disk cache, as by a second process), against a plain ``jax.jit`` lower and
  compile of the same step and against that step jitted with the plan's input shardings, as
  ratios measured in the same run;
* ``--large``: GPT-3 175B written as a plain ``jax.lax.scan`` of checkpointed layers
  (:mod:`shardplan.benchmarks.user_gpt3`; no shardplan call in the model), batch 1536, on
  ``a100-128x8`` with its nodes on InfiniBand and on 10 Gb Ethernet: planning time and
  predicted step with the defaults (a pipeline searched: several nodes) and with
  ``pipeline="off"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import shardplan  # noqa: E402
from shardplan.models.train import reference  # noqa: E402

SETTINGS = {"defaults": {}, "remat off": {"remat": "off"}, "context off": {"context": "off"},
            "pipeline off": {"pipeline": "off"},
            "all off": {"remat": "off", "context": "off", "pipeline": "off"}}


def _families(p) -> str:
    used = [name for name, on in (("pipeline", p.pipeline), ("remat", (p.remat or {}).get("sites")),
                                  ("context", p.context)) if on]
    return ", ".join(used) or "as written"


def _row(name, mesh, fn, args, jit: dict, budget=None, kwargs=None) -> str:
    cells, chosen = [], ""
    for label, kw in SETTINGS.items():
        start = time.perf_counter()
        try:
            p = shardplan.plan(fn, *args, mesh=mesh, memory_budget=budget, cache=False, time_limit=10, **jit, **kw,
                               **(kwargs or {}))
            shown = f"{time.perf_counter() - start:.1f} s, {p.cost.step_s * 1e3:.2f} ms"
            chosen = chosen or _families(p)
        except shardplan.InfeasibleBudgetError as e:
            shown = f"{time.perf_counter() - start:.1f} s, over budget (needs {e.min_feasible_bytes / 2**20:.0f} MiB)"
        cells.append(shown)
        print(f"  {name} {label}: {shown}", file=sys.stderr, flush=True)
    mesh_name = mesh if isinstance(mesh, str) else mesh.name
    return f"| {name} | {mesh_name} | {budget or 'default'} | " + " | ".join(cells) + f" | {chosen} |"


def _reference_steps():
    for model, mesh, batch, budget in (("gpt-tiny", "cpu-8", 16, None), ("llama-tiny", "cpu-8", 16, None),
                                       ("gpt2-small", "h100-8", 16, None), ("gpt2-small", "h100-8", 64, "6GiB")):
        ref = reference(model, scan=True, remat="none")
        state = jax.eval_shape(ref.init, jax.random.key(0))
        yield f"{model} (batch {batch})", mesh, ref.train_step, (state, ref.batch(batch, abstract=True)), \
            {"donate_argnums": (0,)}, budget, None


def _corpus_steps(folder: str):
    sys.path.insert(0, os.path.abspath(folder))
    import scan_steps
    import user_steps
    for module in (user_steps, scan_steps):
        for name, build in module.BUILDERS.items():
            us = build()
            yield name, "cpu-8", us.fn, us.args, dict(us.jit), None, us.kwargs
    for written, build in (("plain-scan", scan_steps.abstract_gpt), ("unrolled", scan_steps.abstract_unrolled_gpt)):
        step, args = build(12, 1024, 16, 1024, 50304, 64)
        yield f"{written} GPT, 12 x d1024, batch 64, bf16", "h100-8", step, args, {"donate_argnums": (0,)}, "6GiB", None


def _decorator_ratio() -> str:
    """The decorator's first call, cold (plan cache off) and warm (its plan read from the disk
    cache by a fresh decorator, as a second process reads it), against ``jax.jit(step).lower(...)
    .compile()`` and against the same step jitted with the plan's input shardings, in one run."""
    ref = reference("gpt-tiny", scan=True)
    mesh = shardplan.load_mesh("cpu-8")
    state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(16, abstract=True)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        shardplan.auto(lambda s, b: ref.train_step(s, b), mesh=mesh, donate_argnums=(0,), cache=cache).lower(
            state, batch).compile()                     # fills the cache, and warms up jax's own caches
        for k in range(4):
            # A new function object each time: jax caches traces and executables per function.
            times = {}
            for name, make in (
                    ("plain", lambda: jax.jit(lambda s, b: ref.train_step(s, b), donate_argnums=(0,))),
                    ("cold", lambda: shardplan.auto(lambda s, b: ref.train_step(s, b), mesh=mesh, donate_argnums=(0,),
                                                    cache=False)),
                    ("sharded", lambda: jax.jit(lambda s, b: ref.train_step(s, b), donate_argnums=(0,),
                                                in_shardings=planned.in_shardings(jax_mesh))),
                    ("warm", lambda: shardplan.auto(lambda s, b: ref.train_step(s, b), mesh=mesh, donate_argnums=(0,),
                                                    cache=cache))):
                if name == "sharded":
                    planned, jax_mesh = times["cold_f"].plan, mesh.to_jax_mesh()
                start = time.perf_counter()
                f = make()
                f.lower(state, batch).compile()
                times[name] = time.perf_counter() - start
                times[name + "_f"] = f
            if k:
                plain = times["plain"]
                rows.append(f"| gpt-tiny on cpu-8 | {plain:.2f} s | {times['sharded']:.2f} s | {times['cold']:.2f} s "
                            f"({times['cold'] / plain:.2f}x) | {times['warm']:.2f} s ({times['warm'] / plain:.2f}x, "
                            f"{times['warm'] / times['sharded']:.2f}x the sharded jit) |")
    return "\n".join(rows)


def _large() -> list[str]:
    from shardplan.benchmarks import user_gpt3
    params = user_gpt3.abstract_params("einsum")
    args = (params, jax.eval_shape(user_gpt3.OPT.init, params), jax.ShapeDtypeStruct((1536, user_gpt3.S + 1), "int32"))
    a100 = shardplan.load_mesh("a100-128x8")
    ethernet = dataclasses.replace(a100.inter_node_link, name="ethernet", bandwidth=1.25e9, latency=30e-6)
    meshes = {"a100-128x8 (InfiniBand)": a100,
              "a100-128x8 (10 Gb Ethernet)": dataclasses.replace(a100, inter_node_link=ethernet).with_axes(
                  dict(zip(a100.axis_names, a100.axis_sizes)))}
    rows = []
    for name, mesh in meshes.items():
        for label, kw in (("defaults", {}), ("pipeline off", {"pipeline": "off"})):
            start = time.perf_counter()
            p = shardplan.plan(user_gpt3.train_step, *args, mesh=mesh, donate_argnums=(0, 1), cache=False, **kw)
            wall = time.perf_counter() - start
            rows.append(f"| {name} | {label} | {wall:.1f} s | {p.cost.step_s:.2f} s | "
                        f"{p.pipeline_config().describe() if p.pipeline else 'none'} | {_families(p)} |")
            print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default=None, help="a folder with user_steps.py and scan_steps.py (the repository's "
                                                  "tests/) to plan its corpora too")
    ap.add_argument("--large", action="store_true", help="also GPT-3 175B on a100-128x8 (minutes)")
    args = ap.parse_args()
    print(f"jax {jax.__version__}; planning wall time on this machine ({os.cpu_count()} cores), predicted step\n")
    print("| step | mesh | budget | " + " | ".join(SETTINGS) + " | families the default plan uses |")
    print("|---|---|---|" + "---|" * len(SETTINGS) + "---|")
    steps = list(_reference_steps()) + (list(_corpus_steps(args.steps)) if args.steps else [])
    for name, mesh, fn, a, jit, budget, kwargs in steps:
        print(_row(name, mesh, fn, a, jit, budget, kwargs), flush=True)
    print("\n| step | plain jax.jit lower + compile | jax.jit with the plan's shardings | shardplan.auto first call, "
          "cold | warm (plan cache filled) |\n|---|---|---|---|---|")
    print(_decorator_ratio(), flush=True)
    if args.large:
        print("\n| GPT-3 175B, plain jax.lax.scan, batch 1536 | settings | planning | predicted step | pipeline "
              "| families |\n|---|---|---|---|---|---|")
        print("\n".join(_large()))


if __name__ == "__main__":
    main()
