"""The unconstrained problem solved exactly by variable elimination (dynamic programming).

Without a memory budget the ILP is a sum of per-node and per-edge costs: eliminating one node
at a time (minimising it out of the sum of every table that mentions it, and remembering the
argmin for each choice of its neighbours) gives the exact optimum. Its cost grows with the
product of the option counts of a node and its neighbours at elimination time, which stays small
for train steps once chains are folded and repeated layers tied (the interaction graph of a
decoder layer has width 3). :func:`solve_exact` returns ``None`` when the tables would grow past
``max_entries``; the caller then falls back to CP-SAT.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

import numpy as np

from shardplan.solver import Solution, SolverStats, peak_memory, total_cost
from shardplan.strategies import Problem


def _order(problem: Problem, max_entries: int) -> list[int] | None:
    """An elimination order (least table first), or ``None`` if a table would exceed ``max_entries``."""
    k = [len(n.options) for n in problem.nodes]
    adj: dict[int, set[int]] = {i: set() for i in range(len(k))}
    for a, b in problem.edges:
        adj[a].add(b)
        adj[b].add(a)
    def entries(v: int) -> float:      # floats: a wide node's product overflows int64
        return math.prod(float(k[u]) for u in adj[v]) * k[v]

    order = []
    alive = set(adj)
    while alive:
        n = min(alive, key=lambda v: (entries(v), v))
        if entries(n) > max_entries:
            return None
        for u in adj[n]:
            adj[u] |= adj[n] - {u}
            adj[u].discard(n)
        alive.discard(n)
        order.append(n)
    return order
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


def _placement(option) -> dict[str, object]:
    """Where each mesh axis sits in an option: the dimension class (groups) or dot dim it shards."""
    items = option.items() if isinstance(option, dict) else enumerate(option)
    return {a: where for where, axes in items for a in axes}


def _restrict(problem: Problem, allowed: list[list[int]]) -> Problem:
    nodes = [dataclasses.replace(n, options=[n.options[i] for i in ok], cost=n.cost[ok], memory=n.memory[:, ok])
             for n, ok in zip(problem.nodes, allowed)]
    edges = {(a, b): t[np.ix_(allowed[a], allowed[b])] for (a, b), t in problem.edges.items()}
    return Problem(nodes, edges, problem.base_memory, problem.node_of_group, problem.node_of_dot)


def lower_bound(problem: Problem) -> float:
    """Every node and every pair at its cheapest, each on its own: no plan costs less."""
    return float(sum(n.cost.min() for n in problem.nodes) + sum(t.min() for t in problem.edges.values()))


def solve_by_axis_blocks(problem: Problem, start: list[int], *, max_entries: int = 25_000_000) -> Solution:
    """A plan no move of any two mesh axes improves, for problems too wide to eliminate whole.

    From ``start``, each step lets every node change where two of the mesh axes go (the others
    stay where they are) and solves that smaller problem exactly by elimination; the steps go
    round the pairs of axes until none improves. Each step can only lower the cost. The bound
    reported is :func:`lower_bound` (weak): the optimum lies between it and the plan's cost.
    """
    began = time.perf_counter()
    placements = [[_placement(o) for o in n.options] for n in problem.nodes]
    axes = sorted({a for p in placements for q in p for a in q})
    blocks = list(itertools.combinations(axes, 2)) or [(a,) for a in axes]
    choice, cost = list(start), total_cost(problem, start)
    improved = True
    while improved:
        improved = False
        for block in blocks:
            allowed = []
            for n, p in enumerate(placements):
                keep = {a: w for a, w in p[choice[n]].items() if a not in block}
                allowed.append([i for i, q in enumerate(p) if {a: w for a, w in q.items() if a not in block} == keep])
            sub = _restrict(problem, allowed)
            sol = solve_exact(sub, max_entries=max_entries)
            if sol is None:
                continue
            new = [allowed[n][c] for n, c in enumerate(sol.choice)]
            new_cost = total_cost(problem, new)
            if new_cost < cost * (1 - 1e-9):
                choice, cost, improved = new, new_cost, True
    bound = min(cost, lower_bound(problem))
    stats = SolverStats(status="LOCAL_OPTIMUM", objective=cost, bound=bound,
                        gap=0.0 if cost <= 0 else (cost - bound) / cost, wall_time=time.perf_counter() - began,
                        num_variables=len(problem.nodes), num_constraints=0)
    return Solution(choice, stats, peak_memory(problem, choice))
