"""The benchmark harness: the planner against expert hand plans over models, meshes and budgets.

    python -m shardplan.benchmarks.bench [--quick] [--cells "SUBSTR;SUBSTR"] [--list]
                                         [--out benchmarks/results] [--plots]
    shardplan bench ...                      (the same)

For each cell (model x mesh x memory budget) it plans, lowers and compiles the planner's plan and
each baseline (:mod:`shardplan.benchmarks.baselines`) on fake devices of the cell's size, never executing
at large sizes. Per plan it reports the predicted step time, the step time the compiled HLO
implies priced on the cell's mesh (dot FLOPs over peak + HBM bytes of the top-level ops over
bandwidth + every collective over its links, as :mod:`shardplan.compiler.audit` reads them), memory per
device (argument + output + temp - alias; on a TPU, libtpu's heap: :mod:`shardplan.compiler.footprint`),
collective count and bytes, and the planner's solve time; per cell the ratio planner / best
baseline that fits the budget, and the same ratio with each compiled program priced op by op
(each top-level op the longer of its FLOPs over peak and its bytes over bandwidth,
:func:`shardplan.compiler.hlo.roofline_seconds`, as the planner prices ops). Tiny cells also execute on 8
fake CPU devices and report the measured step time (labelled CPU).

Budgets: ``hbm`` is what a program may allocate on the device (``Device.budget_bytes``);
``tight`` is 85% of the memory per device of the data-parallel plan's compiled program (the usual
starting point no longer fits; where DP cannot run, halfway between the planner's leanest plan and
its plan under ``hbm``); ``infeasible`` is 1% of the planner's peak (the planner must say so and
name the smallest budget that works). Output: a markdown table (stdout and ``OUT/matrix.md``),
``OUT/results.csv`` and ``OUT/results.json``, and with ``--plots`` PNG figures (matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):   # fake devices for the cells
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1024").strip()
if not __package__:   # run as a script from a checkout: import the checkout's shardplan
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import shardplan  # noqa: E402
from shardplan.benchmarks.baselines import (  # noqa: E402
    BASELINES,
    CP_BASELINES,
    MOE_BASELINES,
    activation_rules,
    context_config,
    hand_plan,
    megatron_3d,
)
from shardplan.benchmarks.bench_output import commit, markdown, plots, write_outputs  # noqa: E402
from shardplan.compiler import footprint, targets  # noqa: E402
from shardplan.compiler.audit import price_collectives  # noqa: E402
from shardplan.compiler.cost import CostModel, from_partition_spec  # noqa: E402
from shardplan.compiler.fit import compile_oom_bytes  # noqa: E402
from shardplan.compiler.footprint import compiled_memory  # noqa: E402
from shardplan.compiler.hlo import collectives, dot_flops, hbm_bytes, roofline_seconds  # noqa: E402
from shardplan.models.layers import activation_sharding  # noqa: E402
from shardplan.models.train import reference  # noqa: E402
from shardplan.parallel.pipeline import PipelineConfig, Schedule, pipelined  # noqa: E402
from shardplan.parallel.pipeline_search import with_stage_axis  # noqa: E402
from shardplan.parallel.sequence import context_parallel, traced_in  # noqa: E402
from shardplan.planning.planner import PlannerOptions, plan_jaxpr  # noqa: E402
from shardplan.tracing.trace import CallSpec, trace_step  # noqa: E402
from shardplan.util.progress import Progress  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Cell:
    model: str
    batch: int
    preset: str
    axes: tuple[tuple[str, int], ...]
    budget: str = "hbm"             # "hbm" | "tight" | "infeasible"
    execute: bool = False           # also run it on 8 fake CPU devices
    remat: str = "none"             # activation recomputation per layer (shardplan.models.layers.REMAT_POLICIES),
                                    # all plans
    context: bool = False           # the planner chooses how attention splits over the sequence (context="auto")
    attention: str | None = None    # the model's attention as written ("einsum": einsum-softmax-einsum),
                                    # else its default

    @property
    def id(self) -> str:
        remat = "" if self.remat == "none" else f"/remat-{self.remat}"
        attention = "" if self.attention is None else f"/attention-{self.attention}"
        return (f"{self.model}/{self.preset}{tuple(n for _, n in self.axes)}/{self.budget}"
                f"{remat}{attention}").replace(" ", "")

    @property
    def devices(self) -> int:
        return math.prod(n for _, n in self.axes)


def _cells() -> list[Cell]:
    out = []
    tiny = [("gpt-tiny", 8), ("llama-tiny", 8)]
    for model, batch in tiny:
        for axes in ((("data", 2), ("model", 4)), (("data", 8), ("model", 1))):
            out.append(Cell(model, batch, "cpu-8", axes, "hbm", execute=True))
    single = (("data", 2), ("model", 4)), (("data", 1), ("model", 8))
    for model, batch in (("gpt2-small", 64), ("gpt3-1.3b", 16)):
        for axes in single:
            for budget in ("hbm", "tight"):
                out.append(Cell(model, batch, "h100-8", axes, budget))
        # At least one sequence per device, so that data parallelism and FSDP can run.
        out.append(Cell(model, max(batch, 64), "h100-8x8", (("data", 8), ("model", 8))))
    # Keeping every activation, gpt2-small under the tight budget and the models below fit no plan
    # (Llama-3 8B at seq 8192 needs about 486 GiB per device): the cells without recomputation
    # show the planner saying so; with each layer recomputed in the backward pass
    # (jax.checkpoint, nothing saved but the layer's input; every plan of the cell, baselines
    # included, runs the same recomputed step) they fit.
    out.append(Cell("gpt2-small", 64, "h100-8", (("data", 2), ("model", 4)), "tight", remat="full"))
    out.append(Cell("llama3-8b", 8, "h100-8", (("data", 2), ("model", 4))))
    for remat in ("dots", "full"):
        out.append(Cell("llama3-8b", 8, "h100-8", (("data", 2), ("model", 4)), remat=remat))
    out.append(Cell("llama3-8b", 64, "h100-8x8", (("data", 8), ("model", 8)), remat="full"))
    out.append(Cell("gpt3-1.3b", 16, "h100-8", (("data", 2), ("model", 4)), "infeasible"))
    out.append(Cell("llama3-8b", 16, "h200-8", (("data", 2), ("model", 4)), remat="full"))
    out.append(Cell("gpt3-1.3b", 256, "tpu-v5e-256", (("data", 16), ("model", 16)), remat="full"))
    # Global batches of one sequence per device: what a user of these clusters runs at the least.
    out.append(Cell("gpt3-175b", 1024, "a100-128x8", (("data", 128), ("model", 8)), remat="full"))
    out.append(Cell("llama3-70b", 1024, "a100-128x8", (("data", 128), ("model", 8)), remat="full"))
    out.append(Cell("llama3-70b", 64, "h100-8x8", (("data", 8), ("model", 8)), remat="full"))
    # Mixture of experts: 8 experts, an axis of 8 to split them over (issue 14).
    out.append(Cell("mixtral-8x7b", 64, "h100-8x8", (("data", 8), ("expert", 8)), remat="full"))
    out.append(Cell("mixtral-8x7b", 64, "tpu-v5p-64", (("data", 8), ("expert", 8)), remat="full"))
    out.append(Cell("gpt3-175b", 1024, "tpu-v5p-2x512", (("replica", 2), ("data", 64), ("model", 8)), remat="full"))
    # Long context (issue 14): Llama-3-8B at 131072 tokens, one sequence per node of 8 (the point
    # of the cell: nothing without a sequence split fits), against MaxText's three strategies.
    out.append(Cell("llama3-8b-128k", 8, "h100-8x8", (("data", 8), ("seq", 8)), remat="full", context=True))
    # The same with its attention written out (einsum-softmax-einsum, jnp.repeat for the grouped
    # heads): the planner recognises it and the hand strategies are applied to it the same way.
    out.append(Cell("llama3-8b-128k", 8, "h100-8x8", (("data", 8), ("seq", 8)), remat="full", context=True,
                    attention="einsum"))
    return out


CELLS = _cells()
QUICK = ("gpt-tiny/cpu-8(2,4)/hbm", "gpt-tiny/cpu-8(8,1)/hbm", "gpt2-small/h100-8(2,4)/hbm")


@dataclasses.dataclass
class Row:
    cell: str
    plan: str
    status: str = "ok"                    # ok | n/a: ... | infeasible: ... | over budget
    predicted_ms: float = float("nan")
    compiled_ms: float = float("nan")
    compute_ms: float = float("nan")
    roofline_ms: float = float("nan")     # compiled, each op the longer of its FLOPs and its bytes, + collectives
    comm_ms_by_kind: dict = dataclasses.field(default_factory=dict)
    memory_gib: float = float("nan")
    collectives: float = float("nan")
    collective_gib: float = float("nan")
    solve_s: float = float("nan")
    cpu_step_ms: float = float("nan")     # measured on 8 fake CPU devices (tiny cells)
    budget_gib: float = float("nan")      # the cell's memory budget per device
    compiler: str = ""                    # which compiler compiled the cell's plans
    choice: str = ""                      # the planner's pipeline; what Megatron 3D needed where it fits nowhere

    @property
    def comm_ms(self) -> float:
        return sum(self.comm_ms_by_kind.values())


def _platform(jax_mesh) -> str:
    """The platform a mesh's devices compile for (a deviceless GPU or TPU target's too)."""
    return jax_mesh.devices.flat[0].platform


def price_compiled(compiled, mesh_spec, jax_mesh) -> dict:
    """The compiled program's step time priced on ``mesh_spec``, with its parts."""
    model = CostModel(mesh_spec)
    text = compiled.as_text()
    nbytes, comm, runs = price_collectives(collectives(text, jax_mesh), model)
    dtype = {"bf16": "bfloat16", "f16": "float16"}
    compute = sum(f / mesh_spec.device.flops_for(dtype.get(d, "float32")) for d, f in dot_flops(text).items())
    compute += hbm_bytes(text) / mesh_spec.device.hbm_bandwidth
    # The same program priced op by op (the longer of each op's FLOPs and bytes), as the planner
    # prices ops: adding FLOP time and byte time counts a compute-bound matmul's operands on top.
    roofline = roofline_seconds(text, lambda d: mesh_spec.device.flops_for(dtype.get(d, "float32")),
                                mesh_spec.device.hbm_bandwidth)
    return dict(compute_ms=compute * 1e3, comm_ms_by_kind={k: v * 1e3 for k, v in comm.items()},
                roofline_ms=(roofline + sum(comm.values())) * 1e3,
                compiled_ms=(compute + sum(comm.values())) * 1e3, memory_gib=compiled_memory(compiled) / 2**30,
                collectives=sum(runs.values()), collective_gib=sum(nbytes.values()) / 2**30)


def _divisible(specs, avals, axes) -> str | None:
    for spec, aval in zip(specs, avals):
        for size, entry in zip(aval.shape, spec):
            names = (entry,) if isinstance(entry, str) else tuple(entry or ())
            n = math.prod(axes[a] for a in names)
            if size % n:
                return f"dimension {size} does not split {n} ways over {names}"
    return None


def _measure_cpu(fn, state, batch, steps: int = 3) -> float:
    for _ in range(2):      # the second call may compile again: the first step's outputs lose weak types
        state, _ = fn(state, batch)
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = fn(state, batch)
    jax.block_until_ready(metrics)
    return (time.perf_counter() - start) / steps * 1e3


def run_cell(cell: Cell, time_limit: float, bar: Progress | None = None, target: str = "cpu") -> list[Row]:
    """The cell's rows, every plan compiled by ``target``'s compiler (:mod:`shardplan.compiler.targets`:
    ``"auto"``, the preset's own GPU or TPU compiler where installed, with no device present)."""
    if cell.devices > len(jax.devices()):
        return [Row(cell.id, "all", f"n/a: needs {cell.devices} devices, jax.devices() has {len(jax.devices())}")]
    axes = dict(cell.axes)
    ref = reference(cell.model, scan=True, remat=cell.remat,
                    **({"attention": cell.attention} if cell.attention else {}))
    state = jax.eval_shape(ref.init, jax.random.key(0))
    batch = ref.batch(cell.batch, abstract=True)
    mesh_spec = shardplan.load_mesh(cell.preset, axes=axes)
    target = targets.resolve(target, mesh_spec)
    compiler = "XLA CPU (fake devices)"
    if target == "cpu":
        jax_mesh = mesh_spec.to_jax_mesh()
    else:
        jax_mesh, compiler = targets.target_mesh(mesh_spec, target)    # compile only, never run
    traced = trace_step(ref.train_step, (state, batch), {}, CallSpec(donate_argnums=(0,)))
    closed, names, arg_of, donated = traced.closed, traced.names, traced.arg_of, traced.donated
    pairs = traced.state_pairs    # state leaves leave as they came: the plan a user's loop runs
    hbm = mesh_spec.device.budget_bytes
    options = PlannerOptions(time_limit=time_limit)
    flat_avals = jax.tree.leaves((state, batch))

    compiled_baselines: dict[str, tuple] = {}

    def baseline(kind):
        """(figures, shardings) of a hand plan's compiled program, or (reason it cannot run, None)."""
        if kind not in compiled_baselines:
            state_specs, batch_specs = hand_plan(kind, state, batch, axes, stacked=True)
            flat = jax.tree.leaves((state_specs, batch_specs), is_leaf=lambda x: isinstance(x, PartitionSpec))
            reason = _divisible(flat, flat_avals, axes)
            if reason:
                compiled_baselines[kind] = (f"n/a: {reason}", None, None)
            else:
                sh = jax.tree.map(lambda s: NamedSharding(jax_mesh, s), (state_specs, batch_specs),
                                  is_leaf=lambda x: isinstance(x, PartitionSpec))
                # A fresh function per plan: JAX's trace cache must not hand one plan's traced
                # step (with or without activation constraints) to another.
                jitted = jax.jit(lambda s, b: ref.train_step(s, b), in_shardings=sh, out_shardings=(sh[0], None),
                                 donate_argnums=(0,))
                rules = activation_rules(kind, axes)
                context = activation_sharding(jax_mesh, rules) if rules else contextlib.nullcontext()
                try:
                    with context, context_parallel(context_config(kind), jax_mesh):
                        lowered = jitted.lower(state, batch)
                    compiled = footprint.compile(lowered, platform=_platform(jax_mesh))
                    figures = price_compiled(compiled, mesh_spec, jax_mesh)
                    compiled_baselines[kind] = (figures, (jitted, sh, rules), flat)
                except Exception as e:       # a baseline XLA cannot compile: say so, keep going
                    used = compile_oom_bytes(e)
                    why = f"over budget: the compiler refused it, {used / 2**30:.2f} GiB per device" if used else \
                        f"n/a: compile failed: {str(e).splitlines()[0][:120]}"
                    compiled_baselines[kind] = (why, None, None)
        return compiled_baselines[kind]

    budget = hbm
    if cell.budget == "tight":
        # The usual starting point no longer fits: 85% of what the data-parallel plan's compiled
        # program needs per device (or, where DP cannot run, halfway between the planner's
        # leanest plan and its plan under the device's memory).
        figures, _, _ = baseline("dp")
        if isinstance(figures, dict):
            budget = int(0.85 * figures["memory_gib"] * 2**30)
        else:
            budget = _halfway_budget(closed, names, arg_of, mesh_spec, hbm, donated, options, pairs)
    elif cell.budget == "infeasible":
        try:
            loose, _ = plan_jaxpr(closed, names, arg_of, mesh_spec, hbm, donated=donated, options=options,
                                  state_pairs=pairs)
            budget = int(loose.cost.memory_bytes * 0.01)
        except shardplan.InfeasibleBudgetError:
            budget = int(hbm * 0.01)

    def concrete():      # a fresh state per run: the steps donate it
        return ref.init(jax.random.key(0)), ref.batch(cell.batch)
    rows = []

    # On a GPU or TPU target the budget is held on that compiler's program (planned again while over).
    # Across nodes the planner searches pipelines too, as `shardplan plan` does by default.
    f = shardplan.auto(ref.train_step, mesh=mesh_spec, memory_budget=budget, donate_argnums=(0,),
                       time_limit=time_limit, cache=False, fit_compiled=None if target == "cpu" else target,
                       pipeline="auto" if mesh_spec.nodes > 1 and not cell.context else None,
                       context="auto" if cell.context else None)
    try:
        start = time.perf_counter()
        f.make_plan(state, batch)     # trace, build the graph, solve (and on a target, the compiled-budget loop)
        solve_s = time.perf_counter() - start
        # Compiled (on a target: the loop's last compile) and priced on the mesh the plan was made
        # for and laid out on: with a pipeline, the cell's mesh with a stage axis split off.
        compiled, laid, _ = f.compile_for(target, state, batch)
        row = Row(cell.id, "shardplan", predicted_ms=f.plan.cost.step_s * 1e3,
                  solve_s=solve_s, **price_compiled(compiled, f.plan.mesh_spec or mesh_spec, laid))
        if f.plan.pipeline is not None:
            row.choice = f.plan.pipeline_config().describe()
        if f.plan.context is not None:
            row.choice = f.plan.context_config().describe()
        if row.memory_gib * 2**30 > budget:
            row.status = "over budget"       # predicted to fit, compiled bigger: shown, never hidden
        if cell.execute:
            row.cpu_step_ms = _measure_cpu(f, *concrete())
        rows.append(row)
    except shardplan.InfeasibleBudgetError as e:
        need = e.min_feasible_bytes
        rows.append(Row(cell.id, "shardplan", "infeasible: needs " +
                        (f"{need / 2**30:.2f} GiB" if need else "more memory")))
    if bar:
        bar.step(f"{cell.id} shardplan")

    # Expert parallelism by hand where there are experts to split and an axis to split them over.
    moe = "expert" in axes and any("moe" in jax.tree_util.keystr(p)
                                   for p, _ in jax.tree_util.tree_leaves_with_path(state))
    for kind in BASELINES + (MOE_BASELINES if moe else ()) + (CP_BASELINES if cell.context else ()):
        figures, run, flat = baseline(kind)
        if not isinstance(figures, dict):
            rows.append(Row(cell.id, kind, figures))
        else:
            fixed = [from_partition_spec(s, len(a.shape)) for s, a in zip(flat, flat_avals)]
            hand = closed if context_config(kind) is None else traced_in(
                lambda: trace_step(ref.train_step, (state, batch), {}, CallSpec(donate_argnums=(0,))),
                context_config(kind), mesh_spec.axis_names, mesh_spec.axis_sizes)().closed
            try:
                p, _ = plan_jaxpr(hand, names, arg_of, mesh_spec, hbm, donated=donated, state_pairs=pairs,
                                  options=options, fixed_inputs=fixed)
                predicted = p.cost.step_s * 1e3
            except shardplan.InfeasibleBudgetError:
                predicted = float("nan")
            row = Row(cell.id, kind, predicted_ms=predicted, **figures)
            if row.memory_gib * 2**30 > budget:
                row.status = "over budget"
            if cell.execute:
                jitted, sh, rules = run
                c_state, c_batch = concrete()
                with activation_sharding(jax_mesh, rules) if rules else contextlib.nullcontext():
                    row.cpu_step_ms = _measure_cpu(jitted, jax.device_put(c_state, sh[0]),
                                                   jax.device_put(c_batch, sh[1]))
            rows.append(row)
        if bar:
            bar.step(f"{cell.id} {kind}")
    if not cell.context:           # the long-context cell compares sequence splits, not pipelines
        rows.append(_megatron_3d(cell, ref, state, batch, mesh_spec, target, budget))
        if bar:
            bar.step(f"{cell.id} megatron-3d")
    for r in rows:
        r.budget_gib = budget / 2**30
        r.compiler = compiler
    return rows


def _megatron_3d(cell: Cell, ref, state, batch, mesh_spec, target: str, budget: int) -> Row:
    """Megatron 3D (:func:`~shardplan.benchmarks.baselines.megatron_3d`): the fastest compiled
    stage count and schedule that fit, each stage count dividing the nodes (up to 16) and the
    layers, each run as GPipe and (where each stage's layers split in two) the circular schedule
    of 2 repeats; where none fits, the leanest, its status listing what each needed."""
    if mesh_spec.nodes == 1:
        return Row(cell.id, "megatron-3d", "n/a: one node: Megatron 3D is its tensor x data parallel (megatron-tp)")
    axes = dict(cell.axes)
    layers = ref.config.n_layers
    best, why = None, "no stage count divides the nodes, the data axis and the layers"
    tried = []
    for stages in [s for s in range(2, 17) if mesh_spec.nodes % s == 0 and axes["data"] % s == 0 and layers % s == 0]:
        staged = with_stage_axis(mesh_spec, stages)
        inner = {a: n for a, n in zip(staged.axis_names, staged.axis_sizes) if a != "stage"}
        micro = cell.batch // inner.get("data", 1)         # one sequence per data-parallel rank
        if micro < stages:
            why = f"{micro} microbatches of one sequence per data rank is fewer than {stages} stages"
            continue
        # The circular schedule where each stage's layers split in two, and GPipe: the circular
        # one's bubble is half GPipe's, but it moves activations between stages twice as often
        # and keeps the weights its round changes select (llama3-70b, 4 stages: 65.85 GiB a
        # device against GPipe's 56.69), so either may be the faster that fits.
        schedules = ([Schedule.CIRCULAR] if (layers // stages) % 2 == 0 else []) + [Schedule.GPIPE]
        for schedule in schedules:
            row = _megatron_3d_one(cell, ref, state, batch, staged, stages, micro, schedule, target)
            if isinstance(row, tuple):        # the compiler refused it
                why, short = row
                tried.append(f"PP {stages} {schedule.value} {short}")
                continue
            tried.append(f"PP {stages} {schedule.value} {row.memory_gib:.0f} GiB")
            if row.memory_gib * 2**30 > budget:
                row.status = "over budget"
            rank = lambda r: (r.status != "ok", r.compiled_ms if r.status == "ok" else r.memory_gib)   # noqa: E731
            if best is None or rank(row) < rank(best):
                best = row
    if best is not None and best.status != "ok":
        best.choice = "needs " + ", ".join(tried)
    return best if best is not None else Row(cell.id, "megatron-3d", f"n/a: {why}")


def _megatron_3d_one(cell: Cell, ref, state, batch, staged, stages: int, micro: int, schedule: Schedule,
                     target: str) -> Row | tuple[str, str]:
    """One Megatron 3D pipeline compiled: its row, or why the compiler refused it (in full, and
    in short for the list of what each pipeline needed)."""
    inner = {a: n for a, n in zip(staged.axis_names, staged.axis_sizes) if a != "stage"}
    circular = schedule is Schedule.CIRCULAR
    # Megatron-LM's data parallelism: each data rank keeps its own copy of the stage's
    # weights and their gradients are summed once a step (replicas), not every microbatch.
    data = inner.get("data", 1)
    config = PipelineConfig(stages, micro, schedule, repeats=2 if circular else 1,
                            batch_axes=("data",) if data > 1 else (), replicas=data)
    mesh = staged.to_jax_mesh() if target == "cpu" else targets.target_mesh(staged, target)[0]
    state_specs, batch_specs = megatron_3d(state, batch, inner, stages)
    sh = jax.tree.map(lambda s: NamedSharding(mesh, s), (state_specs, batch_specs),
                      is_leaf=lambda x: isinstance(x, PartitionSpec))
    jitted = jax.jit(lambda s, b: ref.train_step(s, b), in_shardings=sh, out_shardings=(sh[0], None),
                     donate_argnums=(0,))
    label = f"megatron-3d (PP {stages}, {micro} microbatches, {config.schedule.value})"
    # Megatron's sequence parallelism (Korthikanti et al. 2022): the residual stream split
    # over the sequence on the tensor-parallel axis (the layers' own constraints), so each
    # layer input the pipeline stashes is a 1/TP slice.
    rules = activation_sharding(mesh, {"seq": "model", "embed": None}) if inner.get("model", 1) > 1 else \
        contextlib.nullcontext()
    try:
        with pipelined(config, mesh), rules:
            lowered = jitted.lower(state, batch)
        compiled = footprint.compile(lowered, platform=_platform(mesh))
        row = Row(cell.id, label, **price_compiled(compiled, staged, mesh))
    except Exception as e:       # noqa: BLE001 - a pipeline XLA cannot compile: say so, try the next
        used = compile_oom_bytes(e)
        if used:
            return (f"over budget: the compiler refused PP {stages} {schedule.value}, {used / 2**30:.2f} GiB per "
                    "device", f"{used / 2**30:.0f} GiB")
        return f"compile failed at PP {stages} {schedule.value}: {str(e).splitlines()[0][:100]}", "compile failed"
    return row


def _halfway_budget(closed, names, arg_of, mesh_spec, hbm, donated, options, pairs) -> int:
    """Halfway between the planner's leanest plan and its plan under the device's memory."""
    try:
        loose, _ = plan_jaxpr(closed, names, arg_of, mesh_spec, hbm, donated=donated, options=options,
                              state_pairs=pairs)
        peak = loose.cost.memory_bytes
    except shardplan.InfeasibleBudgetError:
        peak = hbm
    try:
        plan_jaxpr(closed, names, arg_of, mesh_spec, 1, donated=donated, options=options, state_pairs=pairs)
        lean = 0
    except shardplan.InfeasibleBudgetError as e:
        lean = e.min_feasible_bytes or 0
    return int(lean + 0.5 * (peak - lean)) if 0 < lean < peak else int(0.6 * peak)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="shardplan bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"only the cells {', '.join(QUICK)}")
    ap.add_argument("--cells", default=None,
                    help="substrings of cell ids to run, separated by ';' (ids contain commas: 'h100-8(2,4)')")
    ap.add_argument("--list", action="store_true", help="list the cells and exit")
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"),
                    help="folder for the tables and figures (default: benchmarks/results under the current directory)")
    ap.add_argument("--plots", action="store_true", help="also draw PNG plots (needs matplotlib)")
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--target", default="auto", choices=("auto", "cpu"),
                    help="the compiler of every plan: auto (default), each cell's GPU or TPU compiler with no device "
                         "present where installed (pip install 'shardplan[aot]'), else the CPU's; cpu: XLA CPU on "
                         "fake devices (bf16 computed in f32: about twice a GPU's memory)")
    args = ap.parse_args(argv)
    cells = [c for c in CELLS if c.id in QUICK] if args.quick else CELLS
    if args.cells:
        wanted = [w.strip() for w in args.cells.split(";") if w.strip()]
        cells = [c for c in cells if any(w in c.id for w in wanted)]
    if args.list or not cells:
        print("\n".join(c.id for c in (cells or CELLS)))
        return 0 if cells else 2
    steps = sum(2 + len(BASELINES) + (len(CP_BASELINES) - 1 if c.context else 0) for c in cells)
    bar = Progress(steps, "bench")
    all_rows: list[Row] = []
    os.makedirs(args.out, exist_ok=True)
    header = (f"Command: `python -m shardplan.benchmarks.bench "
              f"{' '.join(argv if argv is not None else sys.argv[1:])}`; {time.strftime('%Y-%m-%d')}, "
              f"commit {commit()}, jax {jax.__version__}, {len(jax.devices())} x {jax.devices()[0].platform} "
              "devices.\n\n")
    for cell in cells:
        all_rows += run_cell(cell, args.time_limit, bar, args.target)
        write_outputs(all_rows, args.out, header)      # after every cell: a cut-short run keeps its rows
    table = markdown(all_rows)
    print(header + table)
    if args.plots:
        for path in plots(all_rows, args.out):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
