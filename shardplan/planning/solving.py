"""Solving a built problem for the planner: exactly by elimination where it is narrow enough, by
moves of one or two mesh axes where its tables are too large, with CP-SAT under the memory budget;
and the error, with the smallest budget that works, where no plan fits."""

from __future__ import annotations

import dataclasses
import functools
import math
import re

from shardplan.errors import InfeasibleBudgetError
from shardplan.planning.assemble import plan_memory
from shardplan.sharding.strategies import Enumerator
from shardplan.solve.exact import lagrangian_start, lower_bound, restricted_of, solve_by_axis_blocks, solve_exact
from shardplan.solve.simplify import eliminate_dead_ends, expand, simplify
from shardplan.solve.solver import Solution, SolverStats, greedy, peak_memory, solve, total_cost
from shardplan.solve.tying import tie, untie
from shardplan.util.sizes import format_bytes

# Table cells past which a mesh of three or more axes is searched a few options at a time
# instead of priced whole: pricing costs about 1 us a cell plus 20 us a distinct pair of specs.
WIDE_CELLS = 100_000



def wide(enum: Enumerator) -> bool:
    return sum(n > 1 for n in enum.sizes) >= 3 and enum.table_cells() > WIDE_CELLS


def solve_by_axes(enum, budget_bytes, options, line, graph, unwanted=lambda problem, choice, sol: False,
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
        whole = None if lean is None else \
            plan_memory(graph, enum, nodes, untie(tied, lean.choice) if tied else lean.choice)
        _raise_infeasible(graph, enum, lean_problem, budget_bytes, lean, whole)
    line.say(f"solving under the memory budget {format_bytes(budget_bytes)}, by mesh axes")
    return nodes, search(untie(tied, lean.choice) if tied else lean.choice, budget_bytes=budget_bytes,
                         time_limit=options.time_limit, relative_gap=options.relative_gap), True


def solve_built(problem, budget_bytes, options, line, graph, enum, unwanted=lambda problem, choice, sol: False):
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
                whole = None if lean is None else plan_memory(graph, enum, problem, full_choice(lean, keep))
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



def restated_with_held(e: InfeasibleBudgetError, budget_bytes: int, held: float, least: float = math.inf, graph=None,
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


def with_leanest(e: InfeasibleBudgetError, solve_under, memory_of) -> InfeasibleBudgetError:
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
