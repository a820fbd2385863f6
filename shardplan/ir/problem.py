"""The ILP's data: its decisions (:class:`Node`, each with its options' cost and memory), the
cost tables between pairs of them (:class:`EdgeTables`) and the whole :class:`Problem`, which
:mod:`shardplan.sharding.strategies` prices and :mod:`shardplan.solve.solver` / :mod:`shardplan.solve.exact` solve."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Node:
    """One decision: a group of tensors (``kind='group'``) or a dot (``kind='dot'``)."""

    kind: str
    key: int                       # group root tensor id, or index into graph.dots
    options: list[tuple]           # group: per option, class -> axes; dot: per option, axes per dot dim
    cost: np.ndarray               # seconds per option (compute, and collectives inside the node)
    memory: np.ndarray             # [points, options] bytes per device of live tensors
    label: str = ""
    signature: int = 0             # equal for nodes of repeated layers (same shapes, ops and options)


class EdgeTables(dict):
    """The cost tables between pairs of nodes: ``{(a, b): [options of a, options of b]}`` seconds,
    each pair once with ``a < b``. Read and write them through these methods, in either
    orientation; the convention lives here only."""

    def table(self, a: int, b: int) -> np.ndarray:
        """``[options of a, options of b]``."""
        return self[(a, b)] if a < b else self[(b, a)].T

    def add(self, a: int, b: int, table: np.ndarray) -> None:
        """Add ``table`` (``[options of a, options of b]``, ``a != b``) to the pair's table."""
        if a < b:
            self[(a, b)] = self.get((a, b), 0) + table
        else:
            self[(b, a)] = self.get((b, a), 0) + table.T

    def drop(self, a: int, b: int) -> np.ndarray | None:
        """Remove the pair's table; returns it as ``[options of a, options of b]`` (``None`` if absent)."""
        t = self.pop((min(a, b), max(a, b)), None)
        return t if t is None or a < b else t.T

    def keep_options(self, n: int, keep: np.ndarray, neighbours) -> None:
        """Keep only options ``keep`` of node ``n`` in its tables with ``neighbours``."""
        for m in neighbours:
            if n < m:
                self[(n, m)] = self[(n, m)][keep, :]
            else:
                self[(m, n)] = self[(m, n)][:, keep]

    def neighbours(self, num_nodes: int) -> dict[int, list[int]]:
        """Node -> the nodes it shares a table with."""
        adj: dict[int, list[int]] = {i: [] for i in range(num_nodes)}
        for a, b in self:
            adj[a].append(b)
            adj[b].append(a)
        return adj


@dataclasses.dataclass
class Problem:
    nodes: list[Node]
    edges: EdgeTables                           # (node a, node b) -> [options a, options b] seconds
    base_memory: np.ndarray                     # [points] bytes that no option changes
    node_of_group: dict[int, int]
    node_of_dot: dict[int, int]

    def __post_init__(self):
        if not isinstance(self.edges, EdgeTables):
            self.edges = EdgeTables(self.edges)
