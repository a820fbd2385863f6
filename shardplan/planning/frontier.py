"""Which cluster, how many devices, at what cost: one train step planned across hardware kinds and
cluster sizes, and the Pareto frontier of time to train against cost.

The step is traced once. For each hardware kind (a preset name or a mesh file: its device, its
links, its devices per node) and each cluster size (whole nodes), the cluster's mesh is laid out
as :meth:`~shardplan.devices.mesh.MeshSpec.with_axes` lays it, its shape chosen among the
candidate ``(data, model)`` shapes, and the step is planned with every parallelism family searched
as :func:`shardplan.auto` searches them (:mod:`shardplan.parallel.defaults`); plans come from the
plan cache where they were made before (:mod:`shardplan.plans.cache`).

A size is skipped, and listed as skipped, where a lower bound shows it cannot reach the frontier:
its arguments alone, split evenly, overflow the memory budget (it does not fit; the least memory
it would need is at least that share), or its ideal step (every matmul at the device's peak on
every device) already takes longer and costs more than a point planned before. Sizes planned but
over the budget are listed with the least memory a device would need
(:class:`~shardplan.errors.InfeasibleBudgetError`'s ``min_feasible_bytes``).

Every time and cost carries the time model's measured band (:mod:`shardplan.devices.time_band`);
a point on hardware never calibrated on a device says so.

>>> result = shardplan.frontier(step, state, batch, hardware=["h100-8", "tpu-v5p-64"],   # doctest: +SKIP
...                             devices=[64, 128, 256], tokens=300e9, prices="meshes/prices/example.toml")
>>> print(result.table())                                                                  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from shardplan.devices.mesh import Axis, MeshSpec, load_mesh
from shardplan.devices.prices import Price, Prices, load_prices
from shardplan.devices.time_band import TimeBand, calibrated, step_time_band
from shardplan.errors import InfeasibleBudgetError, ShardplanError
from shardplan.parallel import defaults, sequence
from shardplan.planning.frontier_report import duration, money
from shardplan.planning.planner import PlannerOptions
from shardplan.planning.search import budget_for, plan_search, plan_traced, remat_setting
from shardplan.plans.plan import Plan
from shardplan.sharding.rules import apply_rule
from shardplan.tracing.trace import CallSpec, TracedStep, trace_step
from shardplan.tracing.walk import build_graph
from shardplan.util.progress import Status, silenced
from shardplan.util.sizes import format_bytes

PLANNED, NO_FIT, SKIPPED = "planned", "does not fit", "skipped"


@dataclasses.dataclass(frozen=True)
class Point:
    """One (hardware, cluster size): planned, over the memory budget, or skipped, and why."""

    hardware: str                       # as the user named it: a preset name or a mesh file
    devices: int
    status: str                         # PLANNED, NO_FIT or SKIPPED
    reason: str = ""                    # why it does not fit or was skipped
    nodes: int = 0
    axes: dict[str, int] | None = None  # the mesh shape chosen
    plan: str = ""                      # the plan in a few words: its families
    step_s: float | None = None         # predicted step seconds
    tokens_per_s: float | None = None
    mfu: float | None = None            # model FLOPs utilisation: the step's matmuls at peak / the step
    memory_bytes: float | None = None   # predicted peak per device
    budget_bytes: int = 0
    least_bytes: float | None = None    # NO_FIT: the least memory per device it would need
    least_is_floor: bool = False        # least_bytes is the arguments' even share (a lower bound)
    train_s: float | None = None        # seconds to train the given tokens
    cost: float | None = None           # in the prices file's currency
    per_device_hour: float = 0.0
    calibrated: bool = False            # its device was measured (else: datasheet figures)
    planning_s: float = 0.0
    frontier: bool = False              # on the Pareto frontier of time against cost

    @property
    def label(self) -> str:
        """``h100-8 x 64`` (the hardware as named, the devices)."""
        return f"{_short(self.hardware)} x {self.devices}"


@dataclasses.dataclass(frozen=True)
class Frontier:
    """Every point of a :func:`frontier` search, those on the Pareto frontier marked, with what
    they were priced on. :meth:`table`, :meth:`to_json` and :meth:`plot` report it."""

    points: tuple[Point, ...]
    tokens: float
    tokens_per_step: int
    model_flops: float                  # per step: the traced step's matmuls
    currency: str
    prices_path: str
    prices: dict[str, Price]            # hardware as named -> its price
    band: TimeBand | None
    wall_s: float

    @property
    def pareto(self) -> list[Point]:
        """The frontier, cheapest first."""
        return sorted((p for p in self.points if p.frontier), key=lambda p: p.cost)

    def table(self, every: bool = False) -> str:
        from shardplan.planning.frontier_report import table
        return table(self, every=every)

    def to_json(self) -> str:
        from shardplan.planning.frontier_report import to_json
        return to_json(self)

    def plot(self, path: str | os.PathLike) -> None:
        """Time against cost, each point labelled by hardware, devices and plan (matplotlib,
        the ``bench`` extra)."""
        from shardplan.planning.frontier_report import plot
        plot(self, path)


def frontier(fn: Callable, *args, hardware: Sequence[str], devices: Sequence[int], tokens: float,
             prices: str | os.PathLike | Prices, tokens_per_step: int | None = None, memory_budget=None,
             shapes: str = "preset", pipeline=None, remat=None, context=None, static_argnums: Sequence[int] = (),
             donate_argnums: Sequence[int] = (), time_limit: float = 30.0, cache=True, **kwargs) -> Frontier:
    """Plan ``fn(*args, **kwargs)`` on every hardware kind x cluster size and find the frontier.

    ``hardware``: preset names or mesh files (their device, links and devices per node; their
    axes give the default mesh shape). ``devices``: cluster sizes; each is whole nodes (a size
    below one node is one smaller node, as a smaller TPU slice is; others are skipped).
    ``tokens``: tokens to train; ``tokens_per_step``: tokens of one step (default: the element
    count of the first integer argument of two or more dimensions, the token ids of a batch).
    ``prices``: a prices file (:mod:`shardplan.devices.prices`) with every hardware's price per
    device-hour. ``shapes``: ``"preset"`` lays each cluster as its preset's axes, the model axis
    kept and the data axis grown; ``"search"`` also tries every other power-of-two model axis
    within a node, the fastest plan kept. ``memory_budget``: per device (default: the device's).
    ``pipeline``, ``remat``, ``context``: as :func:`shardplan.plan`'s; left at ``None``, each family
    is searched where it can help, as the decorator searches it (a pinned family plans faster).

    >>> r = shardplan.frontier(step, state, batch, hardware=["h100-8"], devices=[8, 16],   # doctest: +SKIP
    ...                        tokens=1e9, prices="meshes/prices/example.toml")
    """
    remat, context = remat_setting(remat), sequence.check_setting(context)
    if shapes not in ("preset", "search"):
        raise ValueError(f"shapes={shapes!r}: give 'preset' (the preset's model axis) or 'search' (every "
                         "power-of-two model axis within a node)")
    start = time.perf_counter()
    table = prices if isinstance(prices, Prices) else load_prices(prices)
    kinds = [(str(h), load_mesh(h)) for h in hardware]             # an unknown name fails here, before tracing
    price_of = {h: table.for_mesh(h, spec) for h, spec in kinds}
    sizes = _sizes(devices)
    if not (isinstance(tokens, (int, float)) and math.isfinite(tokens) and tokens > 0):
        raise ValueError(f"tokens={tokens!r}: give the number of tokens to train, e.g. tokens=300e9")
    call = CallSpec.make(fn, static_argnums, (), donate_argnums, ())
    trace = functools.partial(trace_step, fn, args, kwargs, call)
    traced = trace()
    per_step = _tokens_per_step(traced, tokens_per_step)
    flops = _dot_flops(traced)
    arg_bytes = sum(math.prod(a.shape) * a.dtype.itemsize for a in traced.closed.in_avals)
    options = PlannerOptions(time_limit=time_limit)
    steps = tokens / per_step

    def ideal_cost(kind):
        _, spec = kind
        seconds = sum(f / spec.device.flops_for(d) for d, f in flops.items())     # on one device
        return seconds * steps * price_of[kind[0]].per_device_hour / 3600
    searched = "every family searched" if (pipeline, remat, context) == (None, None, None) else "the families as set"
    points: list[Point] = []
    planned: list[Point] = []
    todo = [(k, n) for k in sorted(kinds, key=ideal_cost) for n in sizes]
    for i, ((name, base), n) in enumerate(todo):
        price = price_of[name]
        work_s = sum(f / base.device.flops_for(d) for d, f in flops.items())
        common = dict(hardware=name, devices=n, per_device_hour=price.per_device_hour, calibrated=calibrated(base))
        cluster = _cluster(base, n)
        if cluster is None:
            points.append(Point(status=SKIPPED, reason=f"not whole nodes of {base.devices_per_node} devices", **common))
            continue
        budget = budget_for(memory_budget, cluster)
        common.update(nodes=cluster.nodes if n >= cluster.devices_per_node else 1, budget_bytes=budget)
        if arg_bytes / n > budget:
            points.append(Point(status=NO_FIT, least_bytes=arg_bytes / n, least_is_floor=True, reason=(
                f"its arguments alone, split evenly over {n} devices, overflow the budget: not planned"), **common))
            continue
        floor_s = work_s / n * steps
        floor_cost = floor_s / 3600 * n * price.per_device_hour
        better = next((q for q in planned if q.train_s <= floor_s and q.cost <= floor_cost), None)
        if better is not None:
            points.append(Point(status=SKIPPED, reason=(
                f"cannot reach the frontier: at its ideal step (every matmul at peak) it would take "
                f"{duration(floor_s)} for {money(floor_cost)} {table.currency}; {better.label} takes "
                f"{duration(better.train_s)} for {money(better.cost)} {table.currency}"), **common))
            continue
        with Status() as line:
            line.say(f"frontier: planning {name} x {n} ({i + 1}/{len(todo)})")
        t0 = time.perf_counter()
        with silenced():
            best, least = _plan_cluster(traced, trace, cluster, memory_budget, budget, options, cache, shapes,
                                        (pipeline, remat, context))
        took = time.perf_counter() - t0
        if best is None:
            least_bytes = least.min_feasible_bytes if least is not None else None
            shown = format_bytes(least_bytes) if least_bytes is not None else "an unknown amount"
            points.append(Point(status=NO_FIT, least_bytes=least_bytes, planning_s=took,
                                reason=f"planned with {searched}: no plan fits", **common))
            with Status() as line:
                line.done(f"frontier: {name} x {n} does not fit ({shown} a device needed; {took:.1f} s)")
            continue
        p = best
        train_s = p.cost.step_s * steps
        point = Point(status=PLANNED, axes=dict(zip(p.axis_names, p.axis_sizes)), plan=_describe(p),
                      step_s=p.cost.step_s, tokens_per_s=per_step / p.cost.step_s,
                      mfu=work_s / n / p.cost.step_s, memory_bytes=p.cost.memory_bytes, train_s=train_s,
                      cost=train_s / 3600 * n * price.per_device_hour, planning_s=took, **common)
        planned.append(point)
        points.append(point)
        with Status() as line:
            line.done(f"frontier: {name} x {n}: step {p.cost.step_s:.3f} s, {duration(train_s)}, "
                      f"{money(point.cost)} {table.currency} ({took:.1f} s)")
    on = _pareto(planned)
    order = {name: k for k, (name, _) in enumerate(kinds)}
    points = sorted((dataclasses.replace(p, frontier=True) if id(p) in on else p for p in points),
                    key=lambda p: (order[p.hardware], p.devices))
    return Frontier(points=tuple(points), tokens=float(tokens), tokens_per_step=per_step,
                    model_flops=float(sum(flops.values())), currency=table.currency, prices_path=table.path,
                    prices=price_of, band=step_time_band(), wall_s=time.perf_counter() - start)


def _sizes(devices: Sequence[int]) -> list[int]:
    sizes = []
    for n in devices:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"devices={list(devices)!r}: each cluster size must be a positive number of devices, "
                             f"not {n!r}")
        sizes.append(int(n))
    if not sizes:
        raise ValueError("devices=[]: give the cluster sizes to try, e.g. devices=[8, 64, 512]")
    return sorted(set(sizes))


def _cluster(base: MeshSpec, n: int) -> MeshSpec | None:
    """``base``'s hardware as a cluster of ``n`` devices in whole nodes, laid as ``base``'s axes
    lay them (its minor axes kept, its major axis grown); a size below one node that divides it
    is one smaller node (a smaller TPU slice); ``None``: not whole nodes."""
    per_node = base.devices_per_node
    if n % per_node and per_node % n:
        return None
    per_node = min(per_node, n)
    flat = (Axis("_nodes", n // per_node, base.inter_node_link), Axis("_local", per_node, base.intra_node_link))
    spec = dataclasses.replace(base, name=f"{base.name}@{n}", devices_per_node=per_node, axes=flat)
    return spec.with_axes(_preset_axes(base, n))


def _preset_axes(base: MeshSpec, n: int) -> dict[str, int]:
    """``base``'s axes over ``n`` devices: the minor ones kept while they fit, the major one grown."""
    names, sizes = list(base.axis_names), list(base.axis_sizes)
    rest, minor = n, {}
    for name, size in zip(reversed(names[1:]), reversed(sizes[1:])):
        size = math.gcd(size, rest)
        minor[name] = size
        rest //= size
    return {names[0]: rest, **dict(reversed(minor.items()))}


def _shapes(cluster: MeshSpec, shapes: str) -> list[dict[str, int]]:
    """The mesh shapes to plan the cluster on: its own, and with ``"search"`` every power-of-two
    model axis within a node (a data axis over the rest)."""
    own = dict(zip(cluster.axis_names, cluster.axis_sizes))
    if shapes == "preset":
        return [own]
    n, out = cluster.num_devices, [own]
    model = 1
    while model <= cluster.devices_per_node and n % model == 0:
        shape = {"data": n // model, "model": model}
        if shape not in out:
            out.append(shape)
        model *= 2
    return out


def _plan_cluster(traced: TracedStep, trace, cluster: MeshSpec, memory_budget, budget: int, options, cache,
                  shapes: str, families: tuple) -> tuple[Plan | None, InfeasibleBudgetError | None]:
    """The fastest plan over the cluster's shapes, each planned as the decorator plans: the step
    as written from the one trace where no family is searched first, then the families where it
    does not fit (or a pipeline, on several nodes). ``families``: ``(pipeline, remat, context)``
    as set. ``(None, the error needing least memory)`` where none fits."""
    best, least = None, None
    pipeline, remat, context = families
    for shape in _shapes(cluster, shapes):
        spec = cluster.with_axes(shape)
        try:
            written = None
            if defaults.pipeline_default(spec, pipeline, context) is None and remat in (None, "off") \
                    and context in (None, "off"):
                try:
                    plan, _ = plan_traced(traced, spec, budget, options, cache)
                except InfeasibleBudgetError as e:
                    written = e
                else:
                    if best is None or plan.cost.step_s < best.cost.step_s:
                        best = plan
                    continue
            plan, _ = plan_search(trace, spec, memory_budget, options, cache, pipeline, remat, context,
                                  written=written)
        except InfeasibleBudgetError as e:
            if least is None or (e.min_feasible_bytes or math.inf) < (least.min_feasible_bytes or math.inf):
                least = e
            continue
        if best is None or plan.cost.step_s < best.cost.step_s:
            best = plan
    return best, least


def _tokens_per_step(traced: TracedStep, given: int | None) -> int:
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, (int, np.integer)) or given < 1:
            raise ValueError(f"tokens_per_step={given!r}: give the tokens one step trains on (batch x sequence)")
        return int(given)
    for name, aval in zip(traced.names, traced.closed.in_avals):
        if np.issubdtype(aval.dtype, np.integer) and len(aval.shape) >= 2:
            return math.prod(aval.shape)
    raise ShardplanError("no argument of the step looks like token ids (an integer array of [batch, sequence]): "
                         "pass tokens_per_step=, the tokens one step trains on")


def _dot_flops(traced: TracedStep) -> dict[str, float]:
    """FLOPs per step of the traced step's matmuls (and convolutions), by operand dtype: the
    model FLOPs of model FLOPs utilisation (recomputation a plan adds is not counted)."""
    graph = build_graph(traced.closed, traced.names, apply_rule, ties=traced.state_pairs)
    out: dict[str, float] = {}
    for dot in graph.dots:
        lhs, rhs = graph.tensors[dot.lhs], graph.tensors[dot.rhs]
        sizes = dot.sizes or tuple(lhs.shape[a] if a is not None else rhs.shape[b] for a, b, _ in dot.dims)
        out[lhs.dtype.name] = out.get(lhs.dtype.name, 0.0) + 2.0 * math.prod(sizes) * dot.mult
    return out


def _pareto(points: list[Point]) -> set[int]:
    """The ids of the points no other is both as fast and as cheap as (one of them strictly)."""
    on, fastest = set(), math.inf
    for p in sorted(points, key=lambda p: (p.cost, p.train_s)):
        if p.train_s < fastest:
            on.add(id(p))
            fastest = p.train_s
    return on


def _describe(plan: Plan) -> str:
    """The plan's families in a few words: ``pipeline 8x48 gpipe; remat dots``."""
    parts = []
    config = plan.pipeline_config()
    if config is not None:
        parts.append(f"pipeline {config.stages} stages x {config.microbatches} microbatches {config.schedule.value}")
    policies = sorted({s["policy"] for s in (plan.remat or {}).get("sites", ()) if s["policy"] != "none"})
    if policies:
        parts.append("remat " + "/".join(policies))
    context = plan.context_config()
    if context is not None:
        parts.append(f"context {context.describe()}")
    return "; ".join(parts) or "as written"


def _short(hardware: str) -> str:
    return os.path.splitext(os.path.basename(hardware))[0] if hardware.endswith(".toml") else hardware
