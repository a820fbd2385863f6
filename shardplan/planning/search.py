"""The outer search around the ILP: one loop over the parallelism families
(:mod:`shardplan.parallel.families`: a sequence split of attention, :mod:`shardplan.parallel.sequence`;
a pipeline, :mod:`shardplan.parallel.pipeline_search`; recomputation, :mod:`shardplan.parallel.recompute`),
the step traced and planned once per combination of their candidates, each planned to beat the best so
far, the lowest predicted step that fits the budget kept (:class:`Search`); the defaults that decide
which families are searched (:mod:`shardplan.parallel.defaults`); and a plan's step traced again as it
was made."""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import threading
import types
from collections.abc import Callable

from shardplan.compiler.targets import compiler_kind
from shardplan.devices.mesh import MeshSpec
from shardplan.errors import InfeasibleBudgetError, PlanMismatchError, ShardplanError
from shardplan.parallel import defaults, pipeline_search, recompute, sequence
from shardplan.parallel.families import JOIN, Alongside, Family, Outcome, Point
from shardplan.parallel.pipeline import NoLayerStackError
from shardplan.planning.planner import PlannerOptions, plan_jaxpr
from shardplan.plans import cache as plan_cache
from shardplan.plans.plan import Plan
from shardplan.solve.solver import StopToken, stoppable
from shardplan.tracing.trace import TracedStep
from shardplan.util.progress import silenced
from shardplan.util.sizes import parse_bytes


def budget_for(memory_budget, mesh_spec: MeshSpec) -> int:
    """Bytes per device: the given budget, or what a program may allocate on the device
    (:attr:`~shardplan.devices.mesh.Device.budget_bytes`)."""
    return parse_bytes(memory_budget) if memory_budget is not None else mesh_spec.device.budget_bytes


def plan_traced(traced: TracedStep, mesh_spec: MeshSpec, budget: int, options: PlannerOptions, cache=True,
                beat: float = math.inf):
    """Plan a traced step, or read its plan back from the on-disk cache (:mod:`shardplan.plans.cache`).
    ``beat``: :func:`~shardplan.planning.planner.plan_jaxpr`'s (a plan no faster than ``beat`` seconds
    may come back over the budget, or unsolved; it is not cached)."""
    directory = plan_cache.cache_dir(cache)
    key = plan_cache.plan_key(traced, mesh_spec, budget, options) if directory else ""
    cached = plan_cache.load(directory, key)
    p, graph = plan_jaxpr(traced.closed, traced.names, traced.arg_of, mesh_spec, budget, donated=traced.donated,
                          options=options, in_tree=traced.arg_tree, out_tree=traced.out_tree,
                          state_pairs=traced.state_pairs, out_names=traced.out_names, cached=cached, beat=beat)
    if cached is None and p.cost.memory_bytes <= budget and p.cost.step_s < beat:
        plan_cache.store(directory, key, p)
    return p, graph


def remat_setting(remat):
    """``remat=`` checked: ``None`` (the default), ``"off"``, ``"auto"``, a policy name or
    ``{class key: policy}``."""
    if remat is None or remat in ("auto", "off"):
        return remat
    if not isinstance(remat, (str, dict)):
        raise recompute.RecomputeError(f"remat={remat!r}: give 'auto', 'off', None or a policy name "
                                       f"({', '.join(recompute.POLICIES)})")
    with recompute.recomputing(remat):     # checks every name
        pass
    return remat


def host_apart(mesh_spec: MeshSpec) -> bool:
    """Whether the mesh's compiler holds host-offloaded tensors apart from device memory."""
    return compiler_kind(mesh_spec) != "cpu"


def _check_offload(remat, mesh_spec: MeshSpec) -> None:
    named = [remat] if isinstance(remat, str) else list(remat.values()) if isinstance(remat, dict) else []
    if not host_apart(mesh_spec) and any(p in recompute.OFFLOADING for p in named):
        raise recompute.RecomputeError(
            f"remat='offload' holds residuals in host memory, but mesh {mesh_spec.name!r} runs through XLA's CPU "
            "compiler, which keeps host and device memory as one: nothing would be saved. Plan on the GPU or TPU "
            "mesh it will run on (mesh='h100-8', hardware=...), or choose another policy")


def plan_search(trace: Callable[[], TracedStep], mesh_spec: MeshSpec, memory_budget, options: PlannerOptions,
                cache, setting=None, remat=None, context=None, written=None) -> tuple[Plan, tuple]:
    """``(plan, (graph, traced step))``: the step planned with each family as set, a family left
    at its default (``None``) searched where it can help (:func:`shardplan.parallel.defaults.planned`):
    a pipeline on a mesh of several nodes; recomputation, a sequence split and (on one node) a
    pipeline where the step as written does not fit the budget. ``"off"`` keeps the step as
    written. ``written``: the step as written already planned (``(plan, rest)``) or found not to
    fit (its :class:`InfeasibleBudgetError`)."""
    with collector_paused():
        return defaults.planned(
            lambda p, r, c, beat, known: _plan_pinned(trace, mesh_spec, memory_budget, options, cache, p, r, c,
                                                      beat, known),
            mesh_spec, budget_for(memory_budget, mesh_spec), setting, remat, context, written)


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while a search runs, as it was after. A search makes
    millions of small objects that live until it ends (the cost model's memo keys and priced spec
    pairs, the traced programs, every candidate's tables), and each full collection walks all of
    them again: GPT-3 175B's search on 1024 A100s ran 16 full collections of about 0.3 s each and
    8,000 younger ones, 5.9 s of 32.5 s (``gc.callbacks``); paused, its peak memory stayed within
    a few percent (962 against 1,008 MiB). Reference counting still frees what it can; cycles
    made during the search are collected after it, by the collector's own schedule."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _plan_pinned(trace: Callable[[], TracedStep], mesh_spec: MeshSpec, memory_budget, options: PlannerOptions,
                 cache, setting, remat=None, context=None, beat: float = math.inf,
                 written: InfeasibleBudgetError | None = None) -> tuple[Plan, tuple] | None:
    """``(plan, (graph, traced step))``: the step planned for every candidate the families ask for
    with these settings (a sequence split ``context``, a pipeline ``setting``, recomputation
    ``remat``: :class:`Search`), the lowest predicted step that fits the budget kept; ``None`` where
    none could beat ``beat`` seconds (and none failed). ``written``: why the step as written does
    not fit, known already (it is not planned again)."""
    _check_offload(remat, mesh_spec)
    sequence.check_with_pipeline(context, setting)
    search = Search(families_for(setting, remat, context), lambda mesh: budget_for(memory_budget, mesh), options,
                    cache, beat, written)
    return search.run(Point(trace, mesh_spec))


def families_for(pipeline, remat, context) -> list[Family]:
    """The families of one search, outermost first, with their settings (as the planner takes them).
    The order is how their traces nest: the attention is routed inside the pipeline, and the
    recomputation policies apply to the layers wherever they run."""
    return [sequence.ContextFamily(context), pipeline_search.PipelineFamily(pipeline), recompute.RematFamily(remat)]


class Search:
    """One search over the families (:mod:`shardplan.parallel.families`), outermost first: each family's
    candidates, and inside each one every candidate of the families nested in it, down to a plan
    of the step traced with every family's choice applied. Every candidate is planned to beat the
    best plan so far of the whole search (the planner drops one whose step floor, then whose
    unconstrained optimum, cannot: :func:`shardplan.planning.planner.plan_jaxpr`), and the lowest predicted
    step that fits the budget is kept."""

    def __init__(self, families: list[Family], budget: Callable[[MeshSpec], int], options: PlannerOptions, cache,
                 beat: float = math.inf, written: InfeasibleBudgetError | None = None):
        self.families, self.budget, self.options, self.cache = families, budget, options, cache
        self.best = None                 # (plan, (graph, traced step))
        self.completed = []              # every plan that came back: the candidates each family's choice beat
        self._beat = beat
        self._written = written          # why the step as written does not fit, where known

    @property
    def beat(self) -> float:
        """Seconds a plan must beat to be wanted: the best so far's, or what the search was started with."""
        return min(self._beat, self.best[0].cost.step_s if self.best is not None else math.inf)

    def run(self, point: Point) -> tuple[Plan, tuple] | None:
        """The best plan (each family's :meth:`~shardplan.parallel.families.Family.finish` applied); ``None``
        where every candidate was only slower than the ``beat`` it was started with. Raises the error
        of the candidate that needed the least memory where nothing fitted."""
        outcome = self._explore(0, point)
        if self.best is None:
            if outcome.error is None:
                if self._beat == math.inf:
                    raise ShardplanError("no candidate plan was made: a family gave none")
                return None
            error = outcome.error
            for family in self.families:
                error = family.explain(error)
            raise error
        plan, rest = self.best
        for family in self.families:
            plan = family.finish(plan, self.completed)
        return plan, rest

    def _explore(self, k: int, point: Point) -> Outcome:
        """The best plan at ``point`` over the candidates of family ``k`` and those nested in it."""
        if k == len(self.families):
            return self._leaf(point)
        family = self.families[k]
        walk = family.explore(point, self, alone=all(f.pinned() for f in self.families[k + 1:]))
        best, failures, pending, sent = None, [], None, None
        try:
            while True:
                try:
                    choice = walk.send(sent)
                except StopIteration:
                    if pending is None:
                        break
                    choice = JOIN            # a candidate planned alongside joins at the family's end
                if choice is JOIN:
                    sent, pending = self._join(pending), None
                elif isinstance(choice, Alongside):
                    sent, pending = None, self._alongside(k, family.enter(choice.choice, point))
                    continue
                else:
                    try:
                        sent = self._explore(k + 1, family.enter(choice, point))
                    except (InfeasibleBudgetError, *family.errors) as e:
                        sent = Outcome(None, e)
                if sent.error is not None:
                    failures.append(sent.error)
                if sent.plan is not None and (best is None or sent.plan.cost.step_s < best.cost.step_s):
                    best = sent.plan
        except BaseException:            # Ctrl-C, or an error: a plan made alongside is given up
            if pending is not None:
                pending[0].stop()
            raise
        return Outcome(best, None if best is not None else _least(failures))

    def _leaf(self, point: Point) -> Outcome:
        if self._written is not None and all(f.as_written(c) for f, c, _ in point.chosen):
            raise copy.copy(self._written)        # the step as written: planned before, and over the budget
        traced = point.trace()
        beat = self.beat
        plan, graph = plan_traced(traced, point.mesh, self.budget(point.mesh), self.options, self.cache, beat=beat)
        if plan.cost.step_s >= beat:
            return Outcome()             # no faster than the best so far
        plan = self._recorded(plan, point)
        self._keep(plan, (graph, traced))
        return Outcome(plan)

    def _alongside(self, k: int, point: Point):
        """The plan at ``point`` started on a thread (every family inside ``k`` pinned: one plan),
        after its trace on this one (tracing patches jax's functions)."""
        for family in self.families[k + 1:]:
            point = family.enter(next(family.explore(point, self)), point)
        traced = point.trace()
        work = _on_thread(lambda: plan_traced(traced, point.mesh, self.budget(point.mesh), self.options, self.cache))
        return work, point, traced

    def _join(self, pending) -> Outcome:
        work, point, traced = pending
        try:
            plan, graph = work()
        except InfeasibleBudgetError as e:
            return Outcome(None, e)
        plan = self._recorded(plan, point)
        self._keep(plan, (graph, traced), ties=True)        # the same step: no pipeline is the simpler plan
        return Outcome(plan)

    @staticmethod
    def _recorded(plan: Plan, point: Point) -> Plan:
        for family, choice, note in point.chosen:
            plan = family.record(plan, choice, note)
        return plan

    def _keep(self, plan: Plan, rest: tuple, ties: bool = False) -> None:
        self.completed.append(plan)
        best = self.best
        if best is None or plan.cost.step_s < best[0].cost.step_s or ties and plan.cost.step_s == best[0].cost.step_s:
            self.best = (plan, rest)


def _least(failures: list) -> BaseException | None:
    """Of the candidates' errors, the one that needed the least memory, else the first (``None``: none)."""
    infeasible = [e for e in failures if isinstance(e, InfeasibleBudgetError)]
    if infeasible:
        return min(infeasible, key=lambda e: e.min_feasible_bytes or float("inf"))
    return failures[0] if failures else None


def _on_thread(work: Callable[[], object]) -> Callable[[], object]:
    """``work()`` started on a thread, silenced (:func:`shardplan.util.progress.silenced`); the
    returned function waits for its result (or raises its error), and its ``stop()`` stops the
    thread's CP-SAT solves (:class:`shardplan.solve.solver.StopToken`). Waiting on an Event, not
    ``Thread.join``, keeps Ctrl-C working (see :func:`shardplan.solve.solver._solve_interruptibly`)."""
    box, done, token = {}, threading.Event(), StopToken()

    def run():
        try:
            with silenced(), stoppable(token):
                box["value"] = work()
        except BaseException as e:          # handed to the waiting thread
            box["error"] = e
        finally:
            done.set()
    threading.Thread(target=run, name="shardplan-plan", daemon=True).start()

    def result():
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]
    result.stop = token.stop          # given up on: its CP-SAT solve ends at once, the next is not run
    return result


def traced_as_planned(trace: Callable[[], TracedStep], plan: Plan) -> TracedStep:
    """The step traced as ``plan`` was made: each family's recorded choice entered as the search
    entered it (its attention split, inside its pipeline, with its recomputation)."""
    point = Point(trace, types.SimpleNamespace(axis_names=plan.axis_names, axis_sizes=plan.axis_sizes))
    for family in families_for(None, None, None):
        point = family.enter(family.from_plan(plan, point), point)
    try:
        traced = point.trace()
    except NoLayerStackError as e:
        raise PlanMismatchError(f"the plan pipelines a layer stack, but in this step {e}") from None
    sites = point.chosen[-1][2]
    missing = [s["where"] for s in (plan.remat or {}).get("sites", ()) if s["key"] not in sites]
    if missing:
        raise PlanMismatchError(f"the plan recomputes the layer class at {missing[0]}, which this step does not "
                                "have (same code line and layer shapes): plan the step again")
    return traced
