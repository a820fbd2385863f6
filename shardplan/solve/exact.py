"""The unconstrained problem solved exactly by variable elimination (dynamic programming).

Without a memory budget the ILP is a sum of per-node and per-edge costs: eliminating one node
at a time (minimising it out of the sum of every table that mentions it, and remembering the
argmin for each choice of its neighbours) gives the exact optimum. Its cost grows with the
product of the option counts of a node and its neighbours at elimination time, which stays small
for train steps once chains are folded and repeated layers tied (the interaction graph of a
decoder layer has width 3). :func:`solve_exact` returns ``None`` when the tables would grow past
``max_entries``; the caller then falls back to CP-SAT.

Where even one table is too large to price (meshes of three or more axes: a few hundred options
a tensor), :func:`solve_by_axis_blocks` searches by mesh axes, each step a small problem of
the options that move one or two axes, priced for those alone and solved exactly.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from shardplan.ir.problem import Problem
from shardplan.solve.simplify import eliminate_dead_ends, expand, simplify
from shardplan.solve.solver import Solution, SolverStats, peak_memory, solve, total_cost
from shardplan.solve.tying import tie, untie


def _order(problem: Problem, max_entries: int) -> list[int] | None:
    """An elimination order whose tables stay within ``max_entries``, or ``None`` if neither
    heuristic finds one: least table first (most steps), else least fill first (the fewest new
    pairs among a node's neighbours: densely coupled steps, a mixture of experts' dispatch and
    combine einsums, where the least table first grows one past the limit)."""
    return _greedy_order(problem, max_entries, fill=False) or _greedy_order(problem, max_entries, fill=True)


def _greedy_order(problem: Problem, max_entries: int, *, fill: bool) -> list[int] | None:
    k = [len(n.options) for n in problem.nodes]
    adj: dict[int, set[int]] = {i: set() for i in range(len(k))}
    for a, b in problem.edges:
        adj[a].add(b)
        adj[b].add(a)

    def entries(v: int) -> float:      # floats: a wide node's product overflows int64
        return math.prod(float(k[u]) for u in adj[v]) * k[v]

    def key(v: int) -> tuple:
        if not fill:
            return (entries(v), v)
        near = sorted(adj[v])
        added = sum(1 for i, a in enumerate(near) for b in near[i + 1:] if b not in adj[a])
        return (added, entries(v), v)

    # A node's key changes only when a neighbour goes (its fill: a neighbour's neighbour too):
    # recount those alone.
    rank = {v: key(v) for v in adj}
    order = []
    while rank:
        n = min(rank, key=rank.__getitem__)
        if rank.pop(n)[-2] > max_entries:
            return None
        around = adj.pop(n)
        for u in around:
            adj[u] |= around - {u}
            adj[u].discard(n)
        changed = set(around)
        if fill:
            for u in around:
                changed |= adj[u]
        for u in changed:
            rank[u] = key(u)
        order.append(n)
    return order


def _expand(scope: tuple[int, ...], table: np.ndarray, full: tuple[int, ...]) -> np.ndarray:
    """``table`` over ``scope`` laid out over ``full`` (a superset, sorted), size-1 where absent."""
    shape = [1] * len(full)
    for s, n in zip(scope, table.shape):
        shape[full.index(s)] = n
    return table.reshape(shape)


def solve_exact(problem: Problem, *, max_entries: int = 25_000_000) -> Solution | None:
    """The optimum of ``problem`` without its memory constraint, or ``None`` if too wide to eliminate."""
    start = time.perf_counter()
    order = _order(problem, max_entries)
    if order is None:
        return None
    factors: list[tuple[tuple[int, ...], np.ndarray]] = [((i,), n.cost.astype(float)) for i, n in
                                                          enumerate(problem.nodes)]
    factors += [((a, b), t.astype(float)) for (a, b), t in problem.edges.items()]     # a < b
    records = []
    for n in order:
        mine = [f for f in factors if n in f[0]]
        factors = [f for f in factors if n not in f[0]]
        full = tuple(sorted({s for scope, _ in mine for s in scope}))
        total = sum(_expand(scope, t, full) for scope, t in mine)
        axis = full.index(n)
        rest = full[:axis] + full[axis + 1:]
        records.append((n, rest, np.argmin(total, axis=axis)))
        factors.append((rest, np.min(total, axis=axis)))
    choice = [0] * len(problem.nodes)
    for n, rest, arg in reversed(records):
        choice[n] = int(arg[tuple(choice[s] for s in rest)]) if rest else int(arg)
    cost = total_cost(problem, choice)
    stats = SolverStats(status="OPTIMAL", objective=cost, bound=cost, gap=0.0,
                        wall_time=time.perf_counter() - start, num_variables=len(problem.nodes),
                        num_constraints=0)
    return Solution(choice, stats, peak_memory(problem, choice))


def lagrangian_start(problem: Problem, budget_bytes: float, *, iters: int = 8,
                     max_entries: int = 25_000_000) -> list[int] | None:
    """A plan of ``problem`` within ``budget_bytes``, found by pricing memory instead of bounding it:
    each step solves the problem exactly (:func:`solve_exact`) with every node's option costing
    ``lam`` seconds a byte more at the checkpoints that have gone over the budget, raising
    ``lam`` until the optimum fits, then bisecting it (the cheapest plan that fitted is kept).
    ``None`` where no step's optimum fits or the problem is too wide to eliminate.

    It starts CP-SAT (:func:`~shardplan.solve.solver.solve`) near the budgeted optimum: CP-SAT's LP
    bound proves such a plan within the gap in seconds, where from an over-budget start its
    local search can take much longer to find one (``benchmarks/user_gpt3.py``, GPT-3 175B
    with einsum attention on 1024 devices: 16.0 s to plan, now 5.4). Tied layers make memory
    move in large steps, so the bound of this relaxation itself is weak (5% there) and is not
    used."""
    if not problem.base_memory.size or _order(problem, max_entries) is None:
        return None
    memory = [n.memory.astype(float) for n in problem.nodes]

    def optimum(lam: np.ndarray) -> list[int]:
        priced = [dataclasses.replace(n, cost=n.cost + lam @ m) for n, m in zip(problem.nodes, memory)]
        return solve_exact(dataclasses.replace(problem, nodes=priced), max_entries=max_entries).choice

    def peaks(choice: list[int]) -> np.ndarray:
        return problem.base_memory + sum(m[:, c] for m, c in zip(memory, choice))

    choice = optimum(np.zeros(len(problem.base_memory)))
    over = peaks(choice) > budget_bytes
    if not over.any():
        return choice
    # Where a second costs as much as the plan's bytes: the right order for lam (a floor where
    # the plan costs nothing).
    lam = max(total_cost(problem, choice), 1e-9) / max(float(peaks(choice).max()), 1.0) / 16
    low, high, best = 0.0, None, None
    for _ in range(iters):
        choice = optimum(lam * over / over.sum())
        fits = peaks(choice) <= budget_bytes
        if fits.all():
            cost = total_cost(problem, choice)
            if best is None or cost < best[0]:
                best = (cost, choice)
            high = lam
        else:
            over |= ~fits
            low = lam
        if high is not None and high <= 1.25 * low:       # close enough: a start, not an optimum
            break
        lam = 4 * lam if high is None else (math.sqrt(low * high) if low else high / 4)
    return best[1] if best else None


def _placement(option) -> dict[str, object]:
    """Where each mesh axis sits in an option: the dimension class (groups) or dot dim it shards."""
    items = option.items() if isinstance(option, dict) else enumerate(option)
    return {a: where for where, axes in items for a in axes}


def _restrict(problem: Problem, allowed: list[list[int]]) -> Problem:
    nodes = [dataclasses.replace(n, options=[n.options[i] for i in ok], cost=n.cost[ok], memory=n.memory[:, ok])
             for n, ok in zip(problem.nodes, allowed)]
    edges = {(a, b): t[np.ix_(allowed[a], allowed[b])] for (a, b), t in problem.edges.items()}
    return Problem(nodes, edges, problem.base_memory, problem.node_of_group, problem.node_of_dot)


def restricted_of(problem: Problem) -> Callable[[list[list[int]]], Problem]:
    """:func:`solve_by_axis_blocks`'s ``restricted`` for a problem whose tables are all built."""
    return lambda allowed: _restrict(problem, allowed)


def lower_bound(problem: Problem) -> float:
    """Every node and every pair at its cheapest, each on its own: no plan costs less."""
    return float(sum(n.cost.min() for n in problem.nodes) + sum(t.min() for t in problem.edges.values()))


def solve_reduced(problem: Problem, *, max_entries: int = 25_000_000, tie_layers: bool = True) -> list[int] | None:
    """The exact optimum of ``problem`` (no memory constraint) after tying repeated layers,
    folding chains and dropping dead ends; ``None`` if still too wide to eliminate."""
    tied = tie(problem) if tie_layers else None
    reduced = simplify(tied.problem if tied else problem)
    free, keep = eliminate_dead_ends(reduced.problem, memory=False)
    sol = solve_exact(free, max_entries=max_entries)
    if sol is None:
        return None
    nodes = len((tied.problem if tied else problem).nodes)
    choice = expand(reduced, [int(k[c]) for k, c in zip(keep, sol.choice)], nodes)
    return untie(tied, choice) if tied else choice


def _solve_budgeted(problem: Problem, hint: list[int], budget_bytes: float, *, time_limit: float,
                    relative_gap: float, tie_layers: bool, max_cells: int,
                    max_entries: int = 25_000_000) -> list[int] | None:
    """A good plan of ``problem`` under the budget: memory priced into the exact solve
    (:func:`lagrangian_start`), or where that finds none, CP-SAT's best from the feasible
    ``hint``; ``None`` if neither applies (CP-SAT's model, over ``max_cells`` table cells, would
    take longer to build than the step is worth). The caller keeps it only if it improves: a
    step of a local search, found in a fraction of CP-SAT's time (GPT-3 175B's 4-stage pipeline
    on 1024 devices: 22.6 s to 4.9 s, the same plan)."""
    tied = tie(problem) if tie_layers else None
    small = tied.problem if tied else problem
    reduced = simplify(small)
    bounded, keep = eliminate_dead_ends(reduced.problem, memory=True)
    priced = lagrangian_start(bounded, budget_bytes, max_entries=max_entries)
    if priced is not None:
        choice = expand(reduced, [int(k[c]) for k, c in zip(keep, priced)], len(small.nodes))
        return untie(tied, choice) if tied else choice
    if sum(t.size for t in small.edges.values()) > max_cells:
        return None
    start = [0] * len(small.nodes)
    for n, c in enumerate(hint):
        start[tied.rep[n] if tied else n] = c
    sol = solve(small, budget_bytes=budget_bytes, time_limit=time_limit, relative_gap=relative_gap, hint=start)
    if sol is None:
        return None
    return untie(tied, sol.choice) if tied else sol.choice


_CRUMB = 1e-4


def solve_by_axis_blocks(options: Sequence[Sequence], restricted: Callable[[list[list[int]]], Problem],
                         start: list[int], *, bound: float, budget_bytes: float | None = None,
                         time_limit: float = 2.0, relative_gap: float = 0.0, pair_entries: int = 2_000_000,
                         max_cells: int = 50_000, tie_layers: bool = True) -> Solution:
    """A plan no move of one mesh axis improves, for problems too wide to solve whole.

    ``options`` are every node's options and ``restricted(allowed)`` the problem with node ``n``
    kept to its options ``allowed[n]``, tables priced for those alone (so a search over a few
    options at a time never prices them all). From ``start``, each step lets every node change
    where one mesh axis goes (the others stay where they are) and solves that problem exactly,
    round the axes until none improves; then the same with two axes at a time where the step
    stays small, back to single axes after any pair that improves. Without a budget a step is
    solved by elimination (pairs while its tables stay under ``pair_entries`` cells); under
    ``budget_bytes`` (``start`` must fit it), where that optimum does not fit, by pricing memory
    into the elimination (:func:`lagrangian_start`: a good plan within the budget, not always
    the step's best), else by CP-SAT within ``time_limit`` while the step's tables stay under
    ``max_cells``. Each step can only lower the cost and keeps the plan within the budget;
    ``bound`` (weak, from the caller) is reported as the lower bound.
    """
    began = time.perf_counter()
    placements = [[_placement(o) for o in node] for node in options]
    axes = sorted({a for p in placements for q in p for a in q})
    singles = [(a,) for a in axes]
    pairs = list(itertools.combinations(axes, 2))

    def fixed(choice: list[int]) -> Problem:
        return restricted([[c] for c in choice])

    # Per node, where each axis sits in each option, as small integers ([axes, options]; 0: the
    # axis is not used). A step keeps each node to the options placing the axes outside its
    # block as its current option does; these sets are found by comparing integer keys, and
    # kept: the same few come back round after round.
    codes = []
    for node in placements:
        where: dict[object, int] = {}
        table = np.zeros((len(axes), len(node)), dtype=np.int64)
        for o, q in enumerate(node):
            for k, a in enumerate(axes):
                if a in q:
                    table[k, o] = where.setdefault(q[a], len(where) + 1)
        codes.append((table, len(where) + 1))
    keys_of: dict[tuple, list[np.ndarray]] = {}
    same: dict[tuple, list[int]] = {}

    def movable(block, n: int, c: int) -> list[int]:
        """The options of node ``n`` placing the axes outside ``block`` as its option ``c`` does
        (what a step may choose among: the ``block`` axes move, the rest stay)."""
        if block not in keys_of:
            keys_of[block] = [(np.array([0 if a in block else base ** k for k, a in enumerate(axes)]) @ table)
                              for table, base in codes]
        keys = keys_of[block][n]
        at = (block, n, int(keys[c]))
        if at not in same:
            same[at] = np.flatnonzero(keys == keys[c]).tolist()
        return same[at]

    def step(block, choice, max_entries):
        allowed = [movable(block, n, c) for n, c in enumerate(choice)]
        if all(len(ok) == 1 for ok in allowed):
            return None
        sub = restricted(allowed)
        sub_choice = solve_reduced(sub, max_entries=max_entries, tie_layers=tie_layers)
        if budget_bytes is not None and (sub_choice is None or peak_memory(sub, sub_choice) > budget_bytes):
            # The step's optimum without the budget, where it fits, is its optimum under it too.
            hint = [ok.index(c) for ok, c in zip(allowed, choice)]
            sub_choice = _solve_budgeted(sub, hint, budget_bytes, time_limit=time_limit, relative_gap=relative_gap,
                                         tie_layers=tie_layers, max_cells=max_cells, max_entries=max_entries)
        if sub_choice is None:
            return None
        return [allowed[n][c] for n, c in enumerate(sub_choice)], total_cost(sub, sub_choice)

    choice, cost = list(start), total_cost(fixed(start), [0] * len(start))
    blocks, max_entries = singles, 25_000_000
    # A move gaining less than 0.01% of the step is not taken: each move taken costs a round of
    # every axis again, and on GPT-3 175B's pipelines such crumbs were a quarter of the moves
    # (0.07% of the step in all). Under a budget, where a step solved by CP-SAT within its time
    # limit may improve by crumbs round after round, only an improvement past its gap counts.
    enough = _CRUMB if budget_bytes is None else max(_CRUMB, relative_gap)
    # A step's problem depends on the plan only through where the other axes sit, so a block
    # tried since the plan last changed (or whose own move made that change) would find the
    # same plan again: it is skipped (176 steps where there were 213 for GPT-3 175B's pipelines).
    changes, tried = 0, {}
    while True:
        improved = False
        for block in blocks:
            if tried.get(block) == changes:
                continue
            found = step(block, choice, max_entries)
            if found is not None and found[1] < cost * (1 - enough):
                (choice, cost), improved = found, True
                changes += 1
            tried[block] = changes
        if improved:
            blocks, max_entries = singles, 25_000_000       # settle single-axis moves again
        elif blocks is singles and pairs:
            blocks, max_entries = pairs, pair_entries
        else:
            break
    bound = min(cost, bound)
    stats = SolverStats(status="LOCAL_OPTIMUM", objective=cost, bound=bound,
                        gap=0.0 if cost <= 0 else (cost - bound) / cost, wall_time=time.perf_counter() - began,
                        num_variables=len(placements), num_constraints=0)
    return Solution(choice, stats, peak_memory(fixed(choice), [0] * len(choice)))
