"""From a traced step to a :class:`Plan`: graph, candidate strategies, simplification, ILP."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import time
import warnings
from collections.abc import Sequence

from shardplan.compiler.cost import COLLECTIVE_KINDS, Spec, shared_model
from shardplan.compiler.held import held_bytes
from shardplan.compiler.pricing import Analyses, dot_specs
from shardplan.compiler.targets import compiler_kind
from shardplan.devices.mesh import MeshSpec
from shardplan.errors import InfeasibleBudgetError, ShardplanError
from shardplan.ir.graph import Graph
from shardplan.plans.plan import Plan, PredictedCost, TensorPlan, fingerprint, signature
from shardplan.sharding.rules import apply_rule
from shardplan.sharding.strategies import Enumerator
from shardplan.solve.exact import lagrangian_start, lower_bound, restricted_of, solve_by_axis_blocks, solve_exact
from shardplan.solve.simplify import eliminate_dead_ends, expand, simplify
from shardplan.solve.solver import Solution, SolverStats, greedy, peak_memory, point_memory, solve, total_cost
from shardplan.solve.tying import tie, untie
from shardplan.tracing.manual import body_costs
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


def role_of(path: str, fed: bool) -> str:
    """A readable role for an input leaf from its pytree path and whether the hosts feed it every
    step (``fed``: not the first argument, neither returned anew nor donated: the batch)."""
    low = path.lower()
    if "opt_state" in low:
        return "opt_state"
    if "param" in low:
        return "params"
    return "batch" if fed else "state"


def graph_fingerprint(g: Graph) -> str:
    return fingerprint(list(signature(g)))


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
        plan = _make_plan(graph, enum, problem, choice, sol.stats, mesh, in_tree, out_tree, out_names)
        made[tuple(choice)] = plan
        return plan.cost.step_s >= beat

    with Status() as line:       # ended whatever happens: an error never lands on it
        # The ILP's checkpoints leave out the resharded copies and waiting partial sums a plan
        # holds (their bytes depend on pairs of choices: compiler/held.py); where they put the plan
        # over the budget, it is solved again under a lower one, a few times at most.
        def solve_under(ilp_budget):
            # Without the memory constraint first: if that optimum fits, it is the constrained optimum
            # too. Memory plays no part there, so far more options are dead ends than under a budget.
            if _wide(enum):
                problem, sol, bound = _solve_by_axes(enum, ilp_budget, options, line, graph, unwanted, beat)
                return problem, sol, sol.choice, bound
            return _solve_built(enum.build(), ilp_budget, options, line, graph, enum, unwanted)

        least = math.inf           # the leanest plan's memory seen

        def attempt(ilp_budget):
            """The plan solved under ``ilp_budget`` on the ILP's own memory, and whether it is the
            one to return (it fits with what it holds, or is no plan the search wants)."""
            nonlocal least
            problem, sol, choice, bound = solve_under(ilp_budget)
            stats = dataclasses.replace(sol.stats, wall_time=time.perf_counter() - start, memory_bound=bound)
            plan = dataclasses.replace(made[tuple(choice)], solver=stats) if tuple(choice) in made else \
                _make_plan(graph, enum, problem, choice, stats, mesh, in_tree, out_tree, out_names)
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
            raise failed(_leanest(e, solve_under, lambda p, c: _memory(graph, enum, p, c))) from None
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
                    raise failed(_with_held(e, budget_bytes, budget_bytes - ilp_budget, least)) from None
                lean = e.ilp_bytes
                ilp_budget = budget_bytes
        if not done:
            raise failed(_with_held(InfeasibleBudgetError("", budget_bytes=budget_bytes, min_feasible_bytes=None,
                                                          largest_tensors=[], floor_bytes=None),
                                    budget_bytes, 0, least, graph=graph, enum=enum)) from None
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


def _with_held(e: InfeasibleBudgetError, budget_bytes: int, held: float, least: float = math.inf, graph=None,
               enum=None):
    """``e`` (raised under a budget lowered by ``held`` bytes, what a plan held beyond its tensors
    over it: compiler/held.py) restated for the budget the user gave: the smallest budget that
    works gains them, or is the leanest plan's seen (``least``)."""
    need = min(math.inf if e.min_feasible_bytes is None else e.min_feasible_bytes + held, least)
    need = None if need == math.inf else int(need)
    largest = e.largest_tensors
    if graph is not None and not largest:
        largest = sorted(((graph.tensors[t].name, graph.tensors[t].nbytes) for t in graph.inputs),
                         key=lambda x: -x[1])[:5]
    where = "" if enum is None else f" on mesh {enum.m.mesh.name} {dict(zip(enum.axes, enum.sizes))}"
    listing = ", ".join(f"{n} ({format_bytes(b)})" for n, b in largest)
    return InfeasibleBudgetError(
        f"no plan fits memory_budget={format_bytes(budget_bytes)} per device{where} with the resharded matmul "
        f"operands and waiting partial sums it holds; the smallest budget that works is about "
        f"{format_bytes(need or 0)}. Largest inputs: {listing}. Raise the budget, use more devices, or shrink the "
        "batch.",
        budget_bytes=budget_bytes, min_feasible_bytes=need, largest_tensors=largest, floor_bytes=e.floor_bytes)


def _leanest(e: InfeasibleBudgetError, solve_under, memory_of) -> InfeasibleBudgetError:
    """``e``, with the smallest budget that works found again where what the leanest plan of the
    ILP holds beyond its tensors (compiler/held.py) makes it no longer the leanest: the plans
    under a few budgets between the ILP's leanest and that plan's memory are made, and the
    leanest of them gives the figure."""
    ilp, need = getattr(e, "ilp_bytes", None), e.min_feasible_bytes
    if ilp is None or need is None or need <= ilp * 1.01:
        return e
    least = float(need)
    for f in (0.25, 0.5, 0.75):
        try:
            problem, _, choice, _ = solve_under(ilp + f * (need - ilp))
        except InfeasibleBudgetError:
            continue
        least = min(least, memory_of(problem, choice))
    e.min_feasible_bytes = int(least)
    e.args = (re.sub(r"the smallest budget that works is about .+?\. Largest inputs",
                     f"the smallest budget that works is about {format_bytes(least)}. Largest inputs", e.args[0],
                     count=1),)
    return e


# Table cells past which a mesh of three or more axes is searched a few options at a time
# instead of priced whole: pricing costs about 1 us a cell plus 20 us a distinct pair of specs.
_WIDE_CELLS = 100_000


def _check_manual_meshes(graph: Graph, mesh: MeshSpec) -> None:
    """A ``shard_map`` runs over its own mesh: the plan's must be the same (axes of size 1 aside)."""
    planned = {a: n for a, n in zip(mesh.axis_names, mesh.axis_sizes) if n > 1}
    for r in graph.manual:
        region = {a: n for a, n in r.mesh if n > 1}
        if region != planned:
            raise ShardplanError(f"the shard_map at {r.source} runs over mesh axes {region}, but the plan is for "
                                 f"{planned} ({mesh.name}): plan on the mesh the shard_map names, or build the "
                                 "shard_map over the mesh you plan on (a pipeline's stage axis changes the mesh too)")


def _wide(enum: Enumerator) -> bool:
    return sum(n > 1 for n in enum.sizes) >= 3 and enum.table_cells() > _WIDE_CELLS


def _solve_by_axes(enum, budget_bytes, options, line, graph, unwanted=lambda problem, choice, sol: False,
                   beat: float = math.inf):
    """``(problem without tables, solution, whether the budget shaped it)`` for a wide problem
    (tables too large to price whole: meshes of three or more axes): a search that moves one or two
    mesh axes at a time and prices only the options each move may take; under the budget from the
    leanest plan where the
    unconstrained plan does not fit (and is not ``unwanted``: then it is returned as it is). Where
    :meth:`~shardplan.sharding.strategies.Enumerator.step_floor` (a lower bound on the predicted step) is no
    faster than ``beat``, no plan is wanted: the first options are returned unsolved."""
    nodes = enum.build(tables=False)
    floor = float(sum(n.cost.min() for n in nodes.nodes))     # on the ILP's objective
    step_floor = enum.step_floor()
    if step_floor >= beat:
        start = [0] * len(nodes.nodes)
        stats = SolverStats("NOT_SOLVED: no faster than the best so far", total_cost(nodes, start), step_floor,
                            0.0, 0.0, len(start), 0)
        return nodes, Solution(start, stats, peak_memory(nodes, start)), False
    search = functools.partial(solve_by_axis_blocks, enum.node_options(), enum.build,
                               bound=floor, tie_layers=options.tie_layers)
    line.say(f"solving: {len(nodes.nodes)} decisions, by mesh axes")
    sol = search([0] * len(nodes.nodes))
    if peak_memory(nodes, sol.choice) <= budget_bytes or unwanted(nodes, sol.choice, sol):
        return nodes, sol, False
    # The leanest plan needs no tables (memory is per node): CP-SAT on the nodes alone.
    tied = tie(nodes) if options.tie_layers else None
    lean_problem = tied.problem if tied else nodes
    line.say("solving for the leanest plan")
    lean = solve(lean_problem, budget_bytes=None, time_limit=options.time_limit, minimize_memory=True,
                 status_line=line)
    if lean is None or peak_memory(lean_problem, lean.choice) > budget_bytes:
        whole = None if lean is None else _memory(graph, enum, nodes, untie(tied, lean.choice) if tied else lean.choice)
        _raise_infeasible(graph, enum, lean_problem, budget_bytes, lean, whole)
    line.say(f"solving under the memory budget {format_bytes(budget_bytes)}, by mesh axes")
    return nodes, search(untie(tied, lean.choice) if tied else lean.choice, budget_bytes=budget_bytes,
                         time_limit=options.time_limit, relative_gap=options.relative_gap), True


def _solve_built(problem, budget_bytes, options, line, graph, enum, unwanted=lambda problem, choice, sol: False):
    """``(problem, solution, choice, whether the budget shaped it)`` with every table built:
    exactly where elimination can, under the memory budget with CP-SAT where the unconstrained
    optimum does not fit (and is not ``unwanted``: then it is returned as it is)."""
    tied = tie(problem) if options.tie_layers else None
    solved = tied.problem if tied else problem
    reduced = simplify(solved)

    def full_choice(sol, keep) -> list[int]:
        choice = expand(reduced, [int(k[c]) for k, c in zip(keep, sol.choice)], len(solved.nodes))
        return untie(tied, choice) if tied else choice

    # Solved exactly by variable elimination where the problem is narrow enough (most steps).
    line.say(f"solving: {len(reduced.problem.nodes)} decisions, {len(reduced.problem.edges)} pairs")
    free, keep = eliminate_dead_ends(reduced.problem, memory=False)
    sol = solve_exact(free) or _solve_wide(free, options, line)
    choice = full_choice(sol, keep)
    bound = peak_memory(problem, choice) > budget_bytes
    if bound and unwanted(problem, choice, sol):
        return problem, sol, choice, False
    if bound:
        bounded, keep = eliminate_dead_ends(reduced.problem, memory=True)
        line.say(f"solving under the memory budget {format_bytes(budget_bytes)}")
        # Below the sum of every node's leanest option no plan can fit: skip straight to the
        # leanest plan (for the error's smallest budget that works).
        floor = float(_memory_floor(bounded).max())
        sol = None
        if floor <= budget_bytes:
            line.say(f"solving under the memory budget {format_bytes(budget_bytes)}: a plan that fits")
            start = lagrangian_start(bounded, budget_bytes)
            sol = solve(bounded, budget_bytes=budget_bytes, time_limit=options.time_limit,
                        relative_gap=options.relative_gap, hint=start, status_line=line)
            if sol is None and start is not None and peak_memory(bounded, start) <= budget_bytes:
                # CP-SAT found nothing in time (or its memory units, rounded, put the start just
                # over): the start fits, so it is the plan, its bound unknown.
                cost = total_cost(bounded, start)
                sol = Solution(start, SolverStats("FEASIBLE_PRICED", cost, 0.0, 1.0, 0.0, len(bounded.nodes), 0),
                               peak_memory(bounded, start))
        if sol is None:
            line.say("solving for the leanest plan")
            lean = solve(bounded, budget_bytes=None, time_limit=options.time_limit, minimize_memory=True,
                         status_line=line)
            if lean is None or peak_memory(bounded, lean.choice) > budget_bytes:
                whole = None if lean is None else _memory(graph, enum, problem, full_choice(lean, keep))
                _raise_infeasible(graph, enum, bounded, budget_bytes, lean, whole)
            sol = _from_leanest(bounded, lean, budget_bytes, options)
        choice = full_choice(sol, keep)
    return problem, sol, choice, bound


# Edge-table cells past which CP-SAT's polish costs more than it gives: building its model (one
# boolean per cell) takes about 40 us a cell here, and on the reference models it never improved
# a local optimum of that size (resnet-tiny on (2,2,2), 130k cells: 9 s for the same plan).
_CP_SAT_CELLS = 20_000
_POLISH_LIMIT = 2.0


def _solve_wide(problem, options, line):
    """The unconstrained problem, its tables built, where elimination's would be too large: the
    best plan no move of one mesh axis (nor of two, where that step is small) improves, then
    CP-SAT from it where its model is small enough to improve on it or prove it."""
    line.say(f"solving: {len(problem.nodes)} decisions, by mesh axes")
    sol = solve_by_axis_blocks([n.options for n in problem.nodes], restricted_of(problem), greedy(problem),
                               bound=lower_bound(problem))
    if sum(t.size for t in problem.edges.values()) > _CP_SAT_CELLS:
        return sol
    # A short polish (the local optimum is already a good plan): at most 2 units of CP-SAT time.
    polished = solve(problem, budget_bytes=None, time_limit=min(options.time_limit, _POLISH_LIMIT),
                     relative_gap=options.relative_gap, hint=sol.choice, status_line=line)
    if polished is None:
        return sol
    better = polished.stats.objective < sol.stats.objective * (1 - 1e-9)
    proved = polished.stats.status == "OPTIMAL" and polished.stats.objective <= sol.stats.objective
    return polished if better or proved else sol


def _from_leanest(problem, lean, budget_bytes, options):
    """When the constrained solve finds nothing in time but the leanest plan fits: search for a
    cheaper plan that fits, starting from it; the leanest plan itself if none is found."""
    better = solve(problem, budget_bytes=budget_bytes, time_limit=options.time_limit,
                   relative_gap=options.relative_gap, hint=lean.choice)
    if better is not None:
        return better
    cost = total_cost(problem, lean.choice)
    return dataclasses.replace(lean, stats=dataclasses.replace(lean.stats, status="FEASIBLE_LEANEST", objective=cost,
                                                               bound=0.0, gap=1.0))


def _memory_floor(problem):
    """Per checkpoint, the bytes with every node at its leanest option on its own: no plan holds less."""
    return problem.base_memory + sum(n.memory.min(axis=1) for n in problem.nodes)


def _raise_infeasible(graph, enum, problem, budget_bytes, lean, lean_memory=None):
    """``lean``: the least-memory solution of ``problem`` (``None`` if none was found in time);
    ``lean_memory``: its predicted memory, with what it holds beyond its tensors (compiler/held.py)."""
    if lean is not None:
        need, how = int(max(lean.stats.objective, lean_memory or 0.0)), "about"
    else:
        need, how = int(_memory_floor(problem).max()), "at least"
    largest = sorted(((graph.tensors[t].name, graph.tensors[t].nbytes) for t in graph.inputs),
                     key=lambda x: -x[1])[:5]
    listing = ", ".join(f"{n} ({format_bytes(b)})" for n, b in largest)
    e = InfeasibleBudgetError(
        f"no plan fits memory_budget={format_bytes(budget_bytes)} per device on mesh "
        f"{enum.m.mesh.name} {dict(zip(enum.axes, enum.sizes))}; the smallest budget that works is "
        f"{how} {format_bytes(need)}. Largest inputs: {listing}. Raise the "
        f"budget, use more devices, or shrink the batch.",
        budget_bytes=budget_bytes, min_feasible_bytes=need, largest_tensors=largest,
        floor_bytes=int(sum(graph.tensors[t].nbytes for t in graph.inputs) / math.prod(enum.sizes)))
    e.ilp_bytes = None if lean is None else float(lean.stats.objective)   # the ILP's own figure
    raise e


def _short(source: str) -> str:
    """``dir/file.py:12 (fn)`` -> ``file.py:12``: enough to find the line, short enough for a table."""
    where = source.split(" (")[0]
    return where.rsplit("/", 1)[-1] if ":" in where else ""


def _reassociated(graph: Graph, all_reduced: dict[int, list], account) -> None:
    """XLA's AllReduceReassociate: ``add(all-reduce(x), all-reduce(y))`` becomes
    ``all-reduce(add(x, y))`` where both all-reduce the same bytes over the same mesh axes and
    nothing else reads them (through a transpose or reshape on the way), e.g. a tied embedding's
    gradient summed from its lookup and its logits. The bytes and seconds count one all-reduce;
    the ILP's objective keeps both (each reduction is priced on its own edge), as for a repeated
    reshard."""
    readers: dict[int, int] = {}
    for tid in graph.eqn_inputs.values():
        readers[tid] = readers.get(tid, 0) + 1

    def sole(tid):
        items = all_reduced.get(tid, [])
        return items[0] if tid is not None and len(items) == 1 and readers.get(tid) == 1 else None

    for t in graph.tensors:
        here, _, j = t.path.rpartition(":")
        prim = here.rsplit("/", 1)[-1].partition(".")[2]
        if j != "0" or t.id in all_reduced:
            continue
        if prim in ("transpose", "reshape", "copy"):
            moved = sole(graph.eqn_inputs.get((here, 0)))
            if moved is not None:
                all_reduced[t.id] = [moved]
        elif prim in ("add", "add_any"):
            a, b = graph.eqn_inputs.get((here, 0)), graph.eqn_inputs.get((here, 1))
            ra, rb = sole(a), sole(b)
            if a != b and ra is not None and rb is not None and \
                    (ra[0].axes, ra[0].nbytes, ra[1]) == (rb[0].axes, rb[0].nbytes, rb[1]):
                account([], rb[1], t.id, [(rb[0], 0.0)])
                all_reduced[t.id] = [ra]


def _specs(graph: Graph, enum: Enumerator, problem, choice) -> dict[int, Spec]:
    """Every tensor's PartitionSpec under ``choice``."""
    spec_of: dict[int, Spec] = {}
    for node, i in zip(problem.nodes, choice):
        if node.kind == "group":
            for t in enum.groups[node.key]:
                spec_of[t] = enum.tensor_spec_from(graph, t, node.options[i])
    for t in graph.tensors:
        spec_of.setdefault(t.id, ((),) * t.rank)
    return spec_of


def _memory(graph: Graph, enum: Enumerator, problem, choice, spec_of=None) -> float:
    """The predicted memory per device of ``choice``: the ILP's checkpoints, with what the plan
    holds there beyond its tensors (compiler/held.py)."""
    totals = point_memory(problem, choice)
    if not totals.size:
        return 0.0
    spec_of = spec_of if spec_of is not None else _specs(graph, enum, problem, choice)
    node = problem.node_of_dot
    totals = totals + held_bytes(graph, enum.price, spec_of, lambda k: problem.nodes[node[k]].options[choice[node[k]]])
    return float(totals.max())


def _make_plan(graph: Graph, enum: Enumerator, problem, choice, stats: SolverStats, mesh: MeshSpec,
               in_tree, out_tree, out_names=None) -> Plan:
    model = enum.m
    spec_of = _specs(graph, enum, problem, choice)

    cost_of = {t.id: 0.0 for t in graph.tensors}
    by_kind = dict.fromkeys(COLLECTIVE_KINDS, 0.0)
    bytes_by_kind = dict.fromkeys(COLLECTIVE_KINDS, 0.0)
    by_axis = dict.fromkeys(mesh.axis_names, 0.0)
    bytes_by_axis = dict.fromkeys(mesh.axis_names, 0.0)

    all_reduced: dict[int, list] = {}      # tensor -> the all-reduces of its partial sums, (Comm, mult)

    dropped = 0.0       # seconds of collectives XLA runs once that the ILP priced for each reader

    def account(priced, mult, tid, repeated=()):
        nonlocal dropped
        for c, s in priced:
            if c.kind == "all-reduce":
                all_reduced.setdefault(tid, []).append((c, mult))
            by_kind[c.kind] += s
            bytes_by_kind[c.kind] += c.nbytes * mult
            for a in c.axes:
                by_axis[a] += s / len(c.axes)
                bytes_by_axis[a] += c.nbytes * mult / len(c.axes)
            if tid is not None:
                cost_of[tid] += s
        for c, _ in repeated:
            saved = model.collective_time(c) * mult
            dropped += saved
            bytes_by_kind[c.kind] -= c.nbytes * mult
            by_kind[c.kind] -= saved
            for a in c.axes:
                bytes_by_axis[a] -= c.nbytes * mult / len(c.axes)
                by_axis[a] -= saved / len(c.axes)
            if tid is not None:
                cost_of[tid] -= saved

    # XLA's partitioner reshards one tensor to one spec once per computation (its reshard cache,
    # then CSE): ops of one loop body (or of the top level) that need an operand resharded alike
    # share one set of collectives, e.g. the tied embedding gathered for the logits and again for
    # their gradient. Not across a differentiated jax.checkpoint's optimization barrier: its body
    # reads the barrier's copy of the operand, and reshards it again (an unrolled layer's weight,
    # gathered for the forward pass and again for the recomputation). The bytes and seconds count
    # each once; the objective the ILP minimised (searched_s) keeps each reader's, as its pairwise
    # tables price them.
    resharded: set = set()

    def repeats(tid, need, loop, itemsize=None, region=0):
        """The collectives of resharding ``tid`` to ``need`` where an op before did the same
        (``itemsize``: the bytes an element moves as, where not its own: a dot's bfloat16 pass;
        ``region``: the differentiated checkpoint the reading op is in, :attr:`Graph.region_of`)."""
        t = graph.tensors[tid]
        itemsize = itemsize or enum.price.wire(t)
        key = (tid, need, loop, itemsize, region)
        if need is None or key not in resharded:
            resharded.add(key)
            return []
        return model.reshard_items(t.shape, itemsize, spec_of[tid], need)

    # Where the pricing reshards an operand before its op, or makes a result in place and
    # reshards it after: apply.py pins both there, so XLA moves what the plan priced.
    operand_pins, result_pins, rewrites = {}, {}, {}
    indices_of = {e.dst: e for e in graph.edges if e.primitive.startswith("scatter") and e.required is not None}
    reshards = {id(e): enum.price.operand_reshard(e, spec_of[e.src], spec_of[e.dst])
                for e in graph.edges if e.required is not None}
    # An op that makes its result in place (a gather on the table's split) takes its other
    # operands (the indices) as that result needs them, not as the planned result would.
    made_by_op = {e.dst: (e.src, reshards[id(e)][2]) for e in graph.edges
                  if e.required is not None and reshards[id(e)][2] is not None}
    for e in graph.edges:
        if e.required is not None:
            comms, pin, made, rewrite = reshards[id(e)]
            where = made_by_op.get(e.dst)
            if where is not None and where[0] != e.src:
                need = e.need(where[1], model.sizes)
                comms = enum.price.scaled(model.reshard_items(graph.tensors[e.src].shape, enum.price.src_itemsize(e),
                                                        spec_of[e.src], need), e.mult)
                pin = need if comms else None
            if pin is not None:
                operand_pins[(graph.tensors[e.src].path, graph.tensors[e.dst].path)] = pin
            if made is not None:
                result_pins[graph.tensors[e.dst].path] = made
            if rewrite is not None:         # the op emitted another way (shardplan.tracing.rewrites)
                kind, made, partial = rewrite
                rewrites[graph.tensors[e.dst].path] = {"kind": kind, "operand": spec_of[e.src], "made": made,
                                                       "partial": tuple(partial)}
            account(comms, e.mult, e.dst, repeats(e.src, pin, graph.loop_of[e.dst], region=graph.region_of[e.dst]))
        else:
            need = enum.price.scattered_updates(e, spec_of[e.src], spec_of[e.dst])
            if need is not None and need != spec_of[e.src]:
                # Pinned, so that XLA moves the updates in the steps priced (one at a time), and
                # the indices to match them (small; else XLA reshards the updates to suit them).
                operand_pins[(graph.tensors[e.src].path, graph.tensors[e.dst].path)] = need
                ie = indices_of.get(e.src)
                if ie is not None and ie.required(need) != spec_of[ie.src]:
                    operand_pins[(graph.tensors[ie.src].path, graph.tensors[e.dst].path)] = ie.required(need)
            account(enum.price.edge_comms(e, spec_of[e.src], spec_of[e.dst]), e.mult, e.dst)
    for t in graph.shifts:
        account(enum.price.shift_comms(t, spec_of[t]), graph.tensors[t].mult, t)
    # A reduction to a scalar (a loss's mean over a split batch): one all-reduce of a scalar,
    # latency alone. It counts in the plan's collectives; the ILP leaves it out (it would be a
    # cost of the summed tensor's options, as small as one collective's latency).
    unsearched = 0.0
    for e in graph.to_scalar:
        priced = enum.price.edge_comms(e, spec_of[e.src], ())
        unsearched += sum(s for _, s in priced)
        account(priced, e.mult, e.dst)
    compute = 0.0
    dot_operands = {}
    for k, dot in enumerate(graph.dots):
        node = problem.nodes[problem.node_of_dot[k]]
        option = node.options[choice[problem.node_of_dot[k]]]
        req_l, req_r, prod, partial, _ = dot_specs(dot, option)
        repeated = [c for tid, need in ((dot.lhs, req_l), (dot.rhs, req_r))
                    for c in repeats(tid, need if need != spec_of[tid] else None, graph.loop_of[dot.out],
                                     enum.price.moved_itemsize(dot, graph.tensors[tid]), graph.region_of[dot.out])]
        account(enum.price.dot_comms(dot, option, spec_of[dot.lhs], spec_of[dot.rhs], spec_of[dot.out]), dot.mult,
                dot.out, repeated)
        t = enum.price.dot_compute(dot, option) * dot.mult
        compute += t
        cost_of[dot.out] += t
        # The result spec the strategy computes, reduced as priced (before any resharding to the
        # tensor's own spec): pinned, XLA runs the planned reduction instead of choosing its own.
        dot_operands[graph.tensors[dot.out].path] = (req_l, req_r, model.reduced_spec(prod, partial, spec_of[dot.out]))
    seen: dict = {}
    for r in graph.manual:                   # shard_map bodies: what they do whatever the plan
        costs = body_costs(r.body, dict(r.mesh), r.operands, seen, r.results, gpu=model.gpu,
                           cpu=graph.compiler == "cpu")
        for c, runs in costs.comms:
            account([(c, model.collective_time(c) * runs * r.mult)], runs * r.mult, r.out)
        seconds = costs.hbm_bytes / mesh.device.hbm_bandwidth
        seconds += sum(model.compute_time(flops, costs.dot_bytes[dtype], dtype) for dtype, flops in costs.flops.items())
        compute += seconds * r.mult
        if r.out is not None:
            cost_of[r.out] += seconds * r.mult
    if compiler_kind(mesh) != "cpu":         # XLA's CPU pipeline does not reassociate all-reduces
        _reassociated(graph, all_reduced, account)
    searched = compute          # the ILP's pricing: HBM traffic counted its way
    for t in graph.tensors:
        if t.rank and (t.id in enum.price.a.traffic or t.id in enum.price.a.priced_traffic):
            per_device = enum.price.stored_bytes(t.id, spec_of[t.id])      # as the ILP priced it
            searched += enum.price.hbm_seconds(t.id, per_device)
            s = enum.price.hbm_seconds(t.id, per_device, priced=True)     # as XLA fuses it: the prediction
            compute += s
            cost_of[t.id] += s

    def row(tid, role, name=None):
        t = graph.tensors[tid]
        return TensorPlan(t.path, name or t.name, role, t.shape, t.dtype.name, spec_of[tid],
                          enum.price.stored_bytes(tid, spec_of[tid]), cost_of[tid], t.source)

    offload_s = offload_bytes = 0.0
    for t in graph.transfers:
        s = enum.price.offload_seconds(t, spec_of[t])
        offload_s += s
        cost_of[t] += s
    if graph.host_apart:        # the host's share: offloaded residuals at their fullest, and host arguments
        def host_bytes(tids):
            return sum(model.memory_bytes(graph.tensors[t].shape, graph.tensors[t].dtype.itemsize, spec_of[t])
                       for t in tids if graph.tensors[t].rank)
        offload_bytes = max((host_bytes(p) for p in graph.host_points), default=0.0) + \
            host_bytes(t for t in graph.inputs if graph.tensors[t].host)
    loading = 0.0
    for t in enum.fed:
        s = enum.price.input_seconds(t, spec_of[t])
        loading += s
        cost_of[t] += s
    inputs = tuple(row(t, role_of(graph.tensors[t].name, t in enum.fed)) for t in graph.inputs)
    by_role: dict[str, float] = {}
    for r in inputs:
        by_role[r.role] = by_role.get(r.role, 0.0) + r.bytes_per_device
    out_names = list(out_names) if out_names is not None else [f"out{i}" for i in range(len(graph.outputs))]
    outputs = tuple(row(t, "output", out_names[i]) if t is not None else
                    TensorPlan("", out_names[i], "output", (), "float32", (), 0.0, 0.0)
                    for i, t in enumerate(graph.outputs))
    seen = set(graph.inputs) | {t for t in graph.outputs if t is not None}
    acts = tuple(row(t.id, "activation", f"{t.name} @ {_short(t.source)}" if _short(t.source) else t.name)
                 for t in graph.tensors if t.rank and t.id not in seen)
    memory = _memory(graph, enum, problem, choice, spec_of)
    cost = PredictedCost(compute_s=compute, comm_s_by_kind=by_kind, comm_s_by_axis=by_axis,
                         comm_bytes_by_kind=bytes_by_kind, memory_bytes=memory,
                         memory_bytes_by_role=by_role, comm_bytes_by_axis=bytes_by_axis, input_s=loading,
                         offload_s=offload_s, offload_bytes=offload_bytes,
                         tuple_slots=enum.price.a.tuple_slots)
    cost = dataclasses.replace(cost, searched_s=dataclasses.replace(cost, compute_s=searched).step_s + dropped
                               - unsearched)
    return Plan(mesh_name=mesh.name, axis_names=mesh.axis_names, axis_sizes=mesh.axis_sizes, inputs=inputs,
                outputs=outputs, activations=acts, dot_operands=dot_operands, operand_pins=operand_pins,
                result_pins=result_pins, rewrites=rewrites,
                cost=cost, solver=stats,
                fingerprint=graph_fingerprint(graph), signature=signature(graph), warnings=tuple(graph.warnings),
                stage_shifts=bool(graph.shifts),
                in_tree=in_tree, out_tree=out_tree, mesh_spec=mesh)


