"""From a traced step to a :class:`Plan`: graph, candidate strategies, the solve
(:mod:`shardplan.planning.solving`), again under a lower budget where what the plan holds beyond
its tensors puts it over, and the plan made of the choice (:mod:`shardplan.planning.assemble`)."""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Sequence

from shardplan.compiler.cost import Spec, shared_model
from shardplan.compiler.pricing import Analyses
from shardplan.compiler.targets import compiler_kind
from shardplan.devices.mesh import MeshSpec
from shardplan.errors import InfeasibleBudgetError, ShardplanError
from shardplan.ir.graph import Graph
from shardplan.planning.assemble import graph_fingerprint, make_plan, plan_memory
from shardplan.planning.solving import restated_with_held, solve_built, solve_by_axes, wide, with_leanest
from shardplan.plans.plan import Plan
from shardplan.sharding.rules import apply_rule
from shardplan.sharding.strategies import Enumerator
from shardplan.tracing.walk import build_graph
from shardplan.util.progress import Status
from shardplan.util.sizes import format_bytes


@dataclasses.dataclass(frozen=True)
class PlannerOptions:
    time_limit: float = 30.0          # CP-SAT deterministic time per solve (~seconds of one core); wall cap 10x
    relative_gap: float = 0.005       # stop once within this fraction of the best bound
    num_points: int = 12              # memory checkpoints taken from the liveness schedule
    tie_layers: bool = True           # repeated layers share one choice (solved once)

    def __post_init__(self):
        t = self.time_limit
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
            raise ValueError(f"time_limit={t!r} is not a positive number; give CP-SAT deterministic seconds, "
                             "e.g. time_limit=30")



def plan_jaxpr(closed_jaxpr, input_names: Sequence[str], input_args: Sequence[int], mesh: MeshSpec,
               budget_bytes: int, *, donated: Sequence[bool] = (), options: PlannerOptions = PlannerOptions(),
               in_tree=None, out_tree=None, fixed_inputs: Sequence[Spec | None] | None = None,
               state_pairs: Sequence[tuple[int, int]] = (), out_names: Sequence[str] | None = None,
               cached: Plan | None = None, beat: float = math.inf) -> tuple[Plan, Graph]:
    """Plan a whole-step jaxpr whose flat inputs are named ``input_names`` (the argument of each in ``input_args``).

    ``fixed_inputs`` pins the spec of some inputs (``None``: free), e.g. to price a hand-written
    plan's parameter and batch shardings with the best activation shardings around them.
    ``state_pairs`` lists (flat input, flat output) pairs where the step returns a state leaf in
    place of an input: each pair gets one sharding, so the next call takes the output as it is.
    ``out_names`` names the flat outputs (pytree paths of the result). ``cached`` is a plan made
    before for this very problem (:mod:`shardplan.plans.cache`): it is used as it is if its tensors
    are the graph's. ``beat``: seconds a plan must beat to be wanted (an outer search's best so
    far); where the optimum without the budget does not fit and is no faster, that plan is
    returned as it is, over the budget, with no budgeted solve (under the budget the ILP's objective
    only grows; the predicted step, which counts HBM traffic its own way, all but always with it);
    on a mesh searched by axes, where a lower bound on every plan's step is no faster, an
    unsolved plan (status ``NOT_SOLVED``). Either way its step is at least ``beat``.
    """
    graph = build_graph(closed_jaxpr, input_names, apply_rule, num_points=options.num_points, ties=state_pairs,
                        device=mesh.device.name, compiler=compiler_kind(mesh), donated=donated)
    if cached is not None:
        if cached.fingerprint == graph_fingerprint(graph):
            with Status() as line:
                line.done(f"plan read from the cache: predicted step {cached.cost.step_s * 1e3:.3f} ms")
            return dataclasses.replace(cached, in_tree=in_tree, out_tree=out_tree, mesh_spec=mesh), graph
        warnings.warn("shardplan: a cached plan does not match the traced step's tensors; planning again",
                      stacklevel=3)
    _check_manual_meshes(graph, mesh)
    donated_outputs = graph.donated_outputs
    model = shared_model(mesh)
    fixed = {t: s for t, s in zip(graph.inputs, fixed_inputs or []) if s is not None}
    # Inputs the hosts load every step: beyond the first argument (the state), neither returned
    # anew nor donated (the batch).
    state_in = {i for i, _ in state_pairs}
    fed = frozenset(t for k, t in enumerate(graph.inputs)
                    if k not in state_in and not (k < len(donated) and donated[k]) and input_args[k] not in (0, "0"))
    # What the compiler makes of the graph (HBM traffic, combined reductions, TPU tiles), once.
    enum = Enumerator(graph, model, donated_outputs, fixed, fed, analyses=Analyses.of(graph, model.tiled))
    start = time.perf_counter()

    made: dict[tuple, Plan] = {}        # the plan ``unwanted`` made, by its choice: returned as it is

    def unwanted(problem, choice, sol) -> bool:
        """Whether the unconstrained optimum ``choice`` is no faster than ``beat``."""
        if beat == math.inf:
            return False
        plan = make_plan(graph, enum, problem, choice, sol.stats, mesh, in_tree, out_tree, out_names)
        made[tuple(choice)] = plan
        return plan.cost.step_s >= beat

    with Status() as line:       # ended whatever happens: an error never lands on it
        # The ILP's checkpoints leave out the resharded copies and waiting partial sums a plan
        # holds (their bytes depend on pairs of choices: compiler/held.py); where they put the plan
        # over the budget, it is solved again under a lower one, a few times at most.
        def solve_under(ilp_budget, options=options):
            # Without the memory constraint first: if that optimum fits, it is the constrained optimum
            # too. Memory plays no part there, so far more options are dead ends than under a budget.
            if wide(enum):
                problem, sol, bound = solve_by_axes(enum, ilp_budget, options, line, graph, unwanted, beat)
                return problem, sol, sol.choice, bound
            return solve_built(enum.build(), ilp_budget, options, line, graph, enum, unwanted)

        # The error's smallest budget that works is a figure, not a plan: its solves near the
        # leanest plan, where CP-SAT works longest to find one that fits, are cut short.
        quick = dataclasses.replace(options, time_limit=min(options.time_limit, _LEANEST_TIME_LIMIT))

        least = math.inf           # the leanest plan's memory seen

        def attempt(ilp_budget):
            """The plan solved under ``ilp_budget`` on the ILP's own memory, and whether it is the
            one to return (it fits with what it holds, or is no plan the search wants)."""
            nonlocal least
            problem, sol, choice, bound = solve_under(ilp_budget)
            stats = dataclasses.replace(sol.stats, wall_time=time.perf_counter() - start, memory_bound=bound)
            plan = dataclasses.replace(made[tuple(choice)], solver=stats) if tuple(choice) in made else \
                make_plan(graph, enum, problem, choice, stats, mesh, in_tree, out_tree, out_names)
            least = min(least, plan.cost.memory_bytes)
            return plan, (plan.cost.memory_bytes <= budget_bytes or stats.status.startswith("NOT_SOLVED")
                          or plan.cost.step_s >= beat)

        def failed(e: InfeasibleBudgetError):
            need = ("" if e.min_feasible_bytes is None
                    else f": needs about {e.min_feasible_bytes / 2**30:.2f} GiB a device")
            line.done(f"no plan fits the budget of {e.budget_bytes / 2**30:.2f} GiB{need}")
            return e

        try:
            plan, done = attempt(budget_bytes)
        except InfeasibleBudgetError as e:
            raise failed(with_leanest(e, lambda b: solve_under(b, quick),
                                      lambda p, c: plan_memory(graph, enum, p, c))) from None
        ilp_budget, lean = budget_bytes, None
        for _ in range(_HELD_ROUNDS):
            if done:
                break
            over = plan.cost.memory_bytes - budget_bytes
            # A leaner ILP optimum may hold more than the one before (no monotone path): lower by
            # the excess and at least by a third, then, from the ILP's leanest, a few steps down.
            if lean is None:
                ilp_budget = min(ilp_budget - over, 0.7 * ilp_budget)
            else:
                ilp_budget = lean + 0.5 * (ilp_budget - lean)
            line.say(f"what the plan holds beyond its tensors (resharded copies, waiting partial sums) puts it "
                     f"{format_bytes(over)} over the budget: solving again under {format_bytes(ilp_budget)}")
            try:
                plan, done = attempt(ilp_budget)
            except InfeasibleBudgetError as e:
                if lean is not None or getattr(e, "ilp_bytes", None) is None:
                    raise failed(restated_with_held(e, budget_bytes, budget_bytes - ilp_budget, least)) from None
                lean = e.ilp_bytes
                ilp_budget = budget_bytes
        if not done:
            none = InfeasibleBudgetError("", budget_bytes=budget_bytes, min_feasible_bytes=None, largest_tensors=[],
                                         floor_bytes=None)
            raise failed(restated_with_held(none, budget_bytes, 0, least, graph=graph, enum=enum)) from None
        stats = plan.solver
        # The plan's step: the objective and what no choice changes (shard_map bodies).
        if stats.status.startswith("NOT_SOLVED"):
            line.done(f"not planned: every plan takes at least {stats.bound * 1e3:.3f} ms, no faster than the best so "
                      f"far ({beat * 1e3:.3f} ms)")
        else:
            line.done(f"planned: {stats.status}, predicted step {plan.cost.step_s * 1e3:.3f} ms, gap {stats.gap:.2%}, "
                      f"{stats.wall_time:.1f} s")
    return plan, graph


# Solves at most, where what a plan holds beyond its tensors (compiler/held.py) puts it over the budget.
_HELD_ROUNDS = 6
# CP-SAT's deterministic seconds for each solve that only refines an InfeasibleBudgetError's
# smallest budget that works (with the default 30 s, three of them took 70 s each on one MoE).
_LEANEST_TIME_LIMIT = 2.0


def _check_manual_meshes(graph: Graph, mesh: MeshSpec) -> None:
    """A ``shard_map`` runs over its own mesh: the plan's must be the same (axes of size 1 aside)."""
    planned = {a: n for a, n in zip(mesh.axis_names, mesh.axis_sizes) if n > 1}
    for r in graph.manual:
        region = {a: n for a, n in r.mesh if n > 1}
        if region != planned:
            raise ShardplanError(f"the shard_map at {r.source} runs over mesh axes {region}, but the plan is for "
                                 f"{planned} ({mesh.name}): plan on the mesh the shard_map names, or build the "
                                 "shard_map over the mesh you plan on (a pipeline's stage axis changes the mesh too)")
