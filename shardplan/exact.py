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


def solve_exact(problem: Problem, *, max_entries: int = 4_000_000) -> Solution | None:
    """The optimum of ``problem`` without its memory constraint, or ``None`` if too wide to eliminate."""
    start = time.perf_counter()
    order = _order(problem, max_entries)
    if order is None:
        return None
    factors: list[tuple[tuple[int, ...], np.ndarray]] = [((i,), n.cost.astype(float)) for i, n in
                                                          enumerate(problem.nodes)]
    factors += [((a, b), t.astype(float)) if a < b else ((b, a), t.T.astype(float))
                for (a, b), t in problem.edges.items()]
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
