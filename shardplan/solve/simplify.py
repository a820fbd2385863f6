"""Exact simplification of a :class:`~shardplan.ir.problem.Problem` before the ILP.

A node that holds no memory at any checkpoint and touches at most two other nodes can be
eliminated without changing the optimum (variable elimination, as in dynamic programming over
a chain): with one neighbour its best option per neighbour option folds into that neighbour's
cost; with two, into the table between them. Nodes with a single option fold into their
neighbours. :func:`expand` restores the eliminated choices from the recorded argmins.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from shardplan.ir.problem import EdgeTables, Problem


@dataclasses.dataclass
class Reduced:
    problem: Problem                 # the smaller problem (nodes renumbered)
    kept: list[int]                  # original index of each kept node
    steps: list[tuple]               # elimination records, in order


def simplify(problem: Problem, *, max_table: int = 4096) -> Reduced:
    nodes = [dataclasses.replace(n, cost=n.cost.astype(float).copy()) for n in problem.nodes]
    edges = EdgeTables({k: v.astype(float) for k, v in problem.edges.items()})
    adj = {n: set(ms) for n, ms in edges.neighbours(len(nodes)).items()}
    alive = set(range(len(nodes)))
    steps: list[tuple] = []
    memless = [not n.memory.any() for n in nodes]

    def set_edge(a, b, table):
        edges.add(a, b, table)
        adj[a].add(b)
        adj[b].add(a)

    def drop(n):
        for m in list(adj[n]):
            edges.drop(n, m)
            adj[m].discard(n)
        adj[n].clear()
        alive.discard(n)

    changed = True
    while changed:
        changed = False
        for n in sorted(alive):
            if n not in alive:
                continue
            nbrs = sorted(adj[n])
            k = len(nodes[n].options)
            if k == 1 and memless[n] is False:
                # A fixed choice still counts its memory; fold only its edges.
                for m in nbrs:
                    nodes[m].cost += edges.drop(m, n)[:, 0]
                    adj[m].discard(n)
                adj[n].clear()
                continue
            if not memless[n] or len(nbrs) > 2:
                continue
            cost = nodes[n].cost
            if not nbrs:
                steps.append(("free", n, int(np.argmin(cost))))
                drop(n)
                changed = True
            elif len(nbrs) == 1:
                m = nbrs[0]
                total = cost[:, None] + edges.table(n, m)          # [k, |m|]
                steps.append(("leaf", n, m, np.argmin(total, axis=0)))
                nodes[m].cost += total.min(axis=0)
                drop(n)
                changed = True
            else:
                a, c = nbrs
                ka, kc = len(nodes[a].options), len(nodes[c].options)
                if ka * kc > max(max_table, k * (ka + kc)):
                    continue
                t1, t2 = edges.table(n, a), edges.table(n, c)
                total = cost[:, None, None] + t1[:, :, None] + t2[:, None, :]   # [k, ka, kc]
                steps.append(("chain", n, a, c, np.argmin(total, axis=0)))
                drop(n)
                set_edge(a, c, total.min(axis=0))
                changed = True
    kept = sorted(alive)
    index = {old: new for new, old in enumerate(kept)}
    new_nodes = [nodes[i] for i in kept]
    new_edges = EdgeTables()
    for (a, b), t in edges.items():
        if a in index and b in index:
            new_edges[(index[a], index[b])] = t
    reduced = Problem(new_nodes, new_edges, problem.base_memory, {}, {})
    return Reduced(reduced, kept, steps)


def eliminate_dead_ends(problem: Problem, *, memory: bool, rounds: int = 6) -> tuple[Problem, list[np.ndarray]]:
    """Drop options that can never be needed for an optimum (Goldstein's dead-end elimination).

    Option ``i`` of a node goes when some other live option ``j`` costs no more whatever the
    neighbours choose: ``cost[i] - cost[j] + sum over neighbours of min_k (T[i, k] - T[j, k]) >= 0``
    (and, with ``memory``, ``j`` holds no more bytes at any checkpoint, so the swap fits whatever
    budget ``i`` fits). Swapping ``i`` for ``j`` in any plan never costs more, so an optimum
    survives. Returns the smaller problem and, per node, the original indices of its options.
    """
    nodes = list(problem.nodes)
    edges = EdgeTables(problem.edges)
    adj = edges.neighbours(len(nodes))
    keep = [np.arange(len(n.options)) for n in nodes]
    dirty = set(range(len(nodes)))       # nodes whose own or a neighbour's options changed
    for _ in range(rounds):
        changed = False
        check, dirty = dirty, set()
        for n, node in enumerate(nodes):
            k = len(node.options)
            if k < 2 or n not in check:
                continue
            margin = node.cost[:, None] - node.cost[None, :]
            for m in adj[n]:
                t = edges.table(n, m)
                margin = margin + (t[:, None, :] - t[None, :, :]).min(axis=2)
            ok = margin >= 0                      # ok[i, j]: j is never worse than i
            if memory:
                ok &= (node.memory[:, None, :] >= node.memory[:, :, None]).all(axis=0).T
            np.fill_diagonal(ok, False)
            alive = np.ones(k, bool)
            for i in np.flatnonzero(ok.any(axis=1)):      # only an option something beats can go
                if ok[i, alive].any():
                    alive[i] = False
            if alive.all():
                continue
            changed = True
            dirty.add(n)
            dirty.update(adj[n])
            idx = np.nonzero(alive)[0]
            keep[n] = keep[n][idx]
            nodes[n] = dataclasses.replace(node, options=[node.options[i] for i in idx], cost=node.cost[idx],
                                           memory=node.memory[:, idx])
            edges.keep_options(n, idx, adj[n])
        if not changed:
            break
    return Problem(nodes, edges, problem.base_memory, problem.node_of_group, problem.node_of_dot), keep


def expand(reduced: Reduced, choice: list[int], num_nodes: int) -> list[int]:
    """Full per-node choice from the reduced problem's choice."""
    full: list[int | None] = [None] * num_nodes
    for new, old in enumerate(reduced.kept):
        full[old] = choice[new]
    for step in reversed(reduced.steps):
        if step[0] == "free":
            full[step[1]] = step[2]
        elif step[0] == "leaf":
            _, n, m, arg = step
            full[n] = int(arg[full[m]])
        else:
            _, n, a, c, arg = step
            full[n] = int(arg[full[a], full[c]])
    return [int(c) for c in full]
