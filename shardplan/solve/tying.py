"""Repeated layers solved once: nodes with the same signature share one choice.

Unrolled layers give nodes that agree in shapes, ops, source lines and options (their
:attr:`~shardplan.ir.problem.Node.signature`). Tying them makes one node of each class: costs
and memory add up, and the edges between two classes add up too, since every member pair
chooses the same options. The tied problem is about the size of one layer, and its optimum is
the best plan in which every repeated layer is sharded alike.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from shardplan.ir.problem import EdgeTables, Problem


@dataclasses.dataclass
class Tied:
    problem: Problem
    rep: list[int]            # original node -> index of its class in ``problem``
    classes: int


def tie(problem: Problem) -> Tied:
    index: dict[tuple, int] = {}
    rep: list[int] = []
    nodes = []
    for node in problem.nodes:
        key = (node.kind, node.signature) if node.signature else ("unique", len(rep))
        if key in index:
            k = index[key]
            first = nodes[k]
            nodes[k] = dataclasses.replace(first, cost=first.cost + node.cost, memory=first.memory + node.memory)
        else:
            k = index[key] = len(nodes)
            nodes.append(dataclasses.replace(node, cost=node.cost.copy(), memory=node.memory.copy()))
        rep.append(k)
    edges = EdgeTables()
    for (a, b), table in problem.edges.items():
        ra, rb = rep[a], rep[b]
        if ra == rb:
            nodes[ra].cost = nodes[ra].cost + np.diagonal(table)
        else:
            edges.add(ra, rb, table)
    tied = Problem(nodes, edges, problem.base_memory, {}, {})
    return Tied(tied, rep, len(nodes))


def untie(tied: Tied, choice: list[int]) -> list[int]:
    return [choice[k] for k in tied.rep]
