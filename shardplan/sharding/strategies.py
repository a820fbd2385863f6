"""Candidate shardings for every group and ``dot_general``, priced into the ILP's problem.

A group's option maps each mesh axis to at most one of its dimension classes; a dot's option
maps each mesh axis to at most one of its dimensions (batch, free or contracting). The
:class:`Problem` holds, per node, the options with their linear cost and memory, and per pair
of nodes a cost table: the input of the ILP in :mod:`shardplan.solve.solver`. What each option
and pair of options costs is :mod:`shardplan.compiler.pricing`'s.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable

import numpy as np

from shardplan.compiler import layout, splitk
from shardplan.compiler.cost import CostModel, Spec
from shardplan.compiler.pricing import Analyses, Pricer, dot_specs, partial_groups
from shardplan.compiler.tables import dot_table, edge_table
from shardplan.ir.graph import Graph
from shardplan.ir.problem import EdgeTables, Node, Problem

_LAYER_INDEX = re.compile(r"\[\d+\]|_\d+\b")


def _assignments(choices_per_axis: list[list[int]]):
    """Every way to give each mesh axis one of its choices (-1: unused)."""
    return itertools.product(*[[-1] + c for c in choices_per_axis])


class Enumerator:
    """Turns a :class:`Graph` and a :class:`CostModel` into a :class:`Problem`."""

    def __init__(self, graph: Graph, model: CostModel, donated_outputs: frozenset[int] = frozenset(),
                 fixed: dict[int, Spec] | None = None, fed: frozenset[int] = frozenset(),
                 analyses: Analyses | None = None):
        self.fixed = fixed or {}     # tensor -> spec it must have (inputs of a hand-written plan)
        self.fed = fed               # inputs loaded from the hosts every step (the batch)
        self.g = graph
        self.m = model
        self.axes = model.mesh.axis_names
        self.sizes = model.mesh.axis_sizes
        self.groups = graph.groups()
        self.pinned = graph.pinned_classes()
        self.donated_outputs = donated_outputs
        self.price = Pricer(graph, model, analyses)      # the analyses computed once, if not handed in
        self._node_options: list[list] | None = None
        self.required = self._required_classes()
        self._full: tuple[Problem, dict[int, list[Spec]]] | None = None
        self._untrafficked: list[np.ndarray] = []     # per node of _full, its cost less the ILP's HBM traffic
        self._ends: tuple | None = None          # build()'s node of each tensor, edge and dot operand
        # Tables priced for some options of their two nodes (:meth:`build` with ``allowed``),
        # by (edge or dot and side, options of one node, of the other): a search by mesh axes
        # asks for the same ones round after round.
        self._tables: dict[tuple, np.ndarray] = {}

    def _required_classes(self) -> dict[int, tuple[str, ...]]:
        """The graph's sharding constraints on this mesh: each class's axes in mesh order, axes of
        one device dropped; a constraint naming an axis the mesh lacks is not held (warned)."""
        sizes = dict(zip(self.axes, self.sizes))
        out = {}
        for c, axes in self.g.required_classes().items():
            unknown = [a for a in axes if a not in sizes]
            if unknown:
                self.g.warn_once(f"constraint axis {unknown[0]}", f"shardplan: a sharding constraint names mesh "
                                 f"axis {unknown[0]!r}, which mesh {self.m.mesh.name} does not have (axes: "
                                 f"{', '.join(self.axes)}); the planner does not hold it")
                continue
            out[c] = tuple(a for a in self.axes if a in axes and sizes[a] > 1)
        return out

    # -- options ---------------------------------------------------------------------------------
    def group_classes(self, root: int) -> list[int]:
        seen = []
        for t in self.groups[root]:
            for d in range(self.g.tensors[t].rank):
                c = self.g.dim_class(t, d)
                if c not in seen:
                    seen.append(c)
        return seen

    def group_options(self, root: int) -> list[dict[int, tuple[str, ...]]]:
        classes = self.group_classes(root)
        sizes: dict[int, set[int]] = {c: set() for c in classes}
        repeated = set()
        for t in self.groups[root]:
            ts = self.g.tensors[t]
            cls = [self.g.dim_class(t, d) for d in range(ts.rank)]
            repeated.update(c for c in cls if cls.count(c) > 1)
            for c, n in zip(cls, ts.shape):
                sizes[c].add(n)
        required = {c: self.required[c] for c in classes if c in self.required}
        at = {a: c for c, axes in required.items() for a in axes}       # axes a constraint places
        usable = [c for c in classes if c not in self.pinned and c not in repeated and c not in required]
        per_axis = [[at[axis]] if axis in at else
                    [-1] + [c for c in usable if all(n % size == 0 and n >= size for n in sizes[c])] if size > 1
                    else [-1] for axis, size in zip(self.axes, self.sizes)]
        options = []
        splits: dict[tuple, bool] = {}       # (class, axes): whether every size divides; one axis always does
        for pick in itertools.product(*per_axis):
            option: dict[int, tuple[str, ...]] = {}
            for axis, c in zip(self.axes, pick):
                if c >= 0:
                    option[c] = option.get(c, ()) + (axis,)
            for c, axes in option.items():
                if len(axes) > 1 and (c, axes) not in splits:
                    splits[(c, axes)] = all(n % self.m.shards(axes) == 0 for n in sizes[c])
            if all(len(axes) == 1 or splits[(c, axes)] for c, axes in option.items()):
                options.append(option)
        return options

    def dot_options(self, dot_index: int) -> list[tuple[tuple[str, ...], ...]]:
        dot = self.g.dots[dot_index]
        dim_size = self.price.dot_sizes(dot)
        per_axis = [[i for i, n in enumerate(dim_size) if n % size == 0 and n >= size and i not in dot.fixed]
                    if size > 1 else [] for size in self.sizes]
        options = []
        for pick in _assignments(per_axis):
            option = [()] * len(dot.dims)
            for axis, i in zip(self.axes, pick):
                if i >= 0:
                    option[i] = option[i] + (axis,)
            if all(dim_size[i] % self.m.shards(a) == 0 for i, a in enumerate(option) if a):
                options.append(tuple(option))
        return options

    @staticmethod
    def tensor_spec_from(graph: Graph, tid: int, option: dict[int, tuple[str, ...]]) -> Spec:
        t = graph.tensors[tid]
        return tuple(option.get(graph.dim_class(tid, d), ()) for d in range(t.rank))


    # -- the problem ------------------------------------------------------------------------------
    def node_options(self) -> list[list]:
        """Every node's options in :meth:`build`'s node order (groups, then dots), the fixed
        specs applied: what ``allowed`` indexes. Computed once."""
        if self._node_options is None:
            g = self.g
            out = []
            for root, members in self.groups.items():
                ranked = [t for t in members if g.tensors[t].rank]
                if not ranked:
                    continue
                options = self.group_options(root)
                if not options:
                    t = ranked[0]
                    held = {d: self.required[self.g.dim_class(t, d)] for d in range(g.tensors[t].rank)
                            if self.g.dim_class(t, d) in self.required}
                    raise ValueError(f"no sharding of {g.tensors[t].name} {g.tensors[t].shape} ({g.tensors[t].source}) "
                                     f"holds its sharding constraints (dimension: mesh axes {held}) on mesh "
                                     f"{dict(zip(self.axes, self.sizes))}: an axis does not divide its dimension; "
                                     "constrain to axes whose sizes divide it")
                pins = [(t, self.fixed[t]) for t in ranked if t in self.fixed]
                if pins:
                    options = [o for o in options if all(self.tensor_spec_from(g, t, o) == s for t, s in pins)]
                    if not options:
                        t, s = pins[0]
                        raise ValueError(f"no sharding of {g.tensors[t].name} {g.tensors[t].shape} matches the fixed "
                                         f"spec {s} together with {len(pins) - 1} other fixed tensor(s) of its "
                                         "group; fix a spec whose sharded dimensions divide evenly")
                out.append(options)
            out += [self.dot_options(k) for k in range(len(g.dots))]
            self._node_options = out
        return self._node_options

    def table_cells(self) -> int:
        """How many cells :meth:`build`'s cost tables would have, counted before repeated layers
        are tied (what building them all costs, roughly)."""
        g, (full, _) = self.g, self._full_nodes()
        count = [len(n.options) for n in full.nodes]
        size = lambda tid: count[full.node_of_group[g.group_of(tid)]]
        cells = sum(size(e.src) * size(e.dst) for e in g.edges)
        return cells + sum(count[full.node_of_dot[k]] * sum(map(size, (d.lhs, d.rhs, d.out)))
                           for k, d in enumerate(g.dots))

    def _full_nodes(self) -> tuple[Problem, dict[int, list[Spec]]]:
        """Every node with all its options (costs, memory), no tables, and every grouped
        tensor's spec per option of its node: computed once, subset by :meth:`build`."""
        if self._full is not None:
            return self._full
        g = self.g
        all_options = self.node_options()
        points = g.points
        live_at: dict[int, list[int]] = {}
        for p, live in enumerate(points):
            for t in live:
                if t not in self.donated_outputs:
                    live_at.setdefault(t, []).append(p)
        always = {t for t in g.inputs if g.tensors[t].rank}
        base_memory = np.zeros(len(points))
        heap = 1.0 + self.m.mesh.device.heap_overhead    # temporaries live in XLA's heap, inputs do not
        for t in g.inputs:
            if not g.tensors[t].rank:
                base_memory += g.tensors[t].nbytes
        base_memory += self.price.a.tuple_slots * layout.HEAP_ALIGN
        # A shard_map body's own temporaries, at every checkpoint (an upper bound: it runs at one).
        base_memory += max((r.temp_bytes for r in g.manual), default=0.0) * heap

        nodes: list[Node] = []
        self._untrafficked = []
        node_of_group: dict[int, int] = {}
        spec_of: dict[int, list[Spec]] = {}
        for root, members in self.groups.items():
            ranked = [t for t in members if g.tensors[t].rank]
            if not ranked:
                for t in members:
                    nbytes = layout.heap_bytes(self.m.memory_bytes((), g.tensors[t].dtype.itemsize, ()), self.m.tiled)
                    for p in live_at.get(t, []):
                        base_memory[p] += nbytes * heap
                continue
            options = all_options[len(nodes)]
            cost = np.zeros(len(options))
            traffic = np.zeros(len(options))
            memory = np.zeros((len(points), len(options)))
            # Tensors whose dims fall in the same classes share their specs, and of the same
            # shape their bytes: a group's hundreds of tensors have a few dozen of each.
            specs_of_classes: dict[tuple, list] = {}
            bytes_of: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
            for t in ranked:
                tt = g.tensors[t]
                classes = tuple(g.dim_class(t, d) for d in range(tt.rank))
                specs = specs_of_classes.get(classes)
                if specs is None:
                    specs = specs_of_classes[classes] = [tuple(o.get(c, ()) for c in classes) for o in options]
                spec_of[t] = specs
                itemsize, minor = self.price.stored_as(t)
                key = (classes, tt.shape, itemsize, minor)
                if key not in bytes_of:     # (arguments' bytes, a temporary's in the heap) per option
                    laid = np.array([self.m.memory_bytes(tt.shape, itemsize, s, minor) for s in specs])
                    bytes_of[key] = laid, layout.heap_bytes(laid, self.m.tiled)
                per_dev, in_heap = bytes_of[key]
                if t in self.fed:
                    cost += np.array([self.price.input_seconds(t, s) for s in specs])
                if t in g.shifts:
                    cost += np.array([sum(sec for _, sec in self.price.shift_comms(t, s)) for s in specs])
                traffic += self.price.hbm_seconds(t, per_dev)
                for p in live_at.get(t, []):
                    memory[p] += in_heap * heap
                if t in always and not (g.host_apart and tt.host):
                    memory += per_dev[None, :]
            node_of_group[root] = len(nodes)
            label = g.tensors[ranked[0]].name
            where = tuple((g.tensors[t].shape, g.tensors[t].dtype.name, self.price.a.traffic.get(t, 0),
                           _LAYER_INDEX.sub("#", g.tensors[t].source)) for t in ranked)
            signature = hash((where, tuple(tuple(spec_of[t]) for t in ranked)))
            nodes.append(Node("group", root, options, cost + traffic, memory, label, signature))
            self._untrafficked.append(cost)

        node_of_dot: dict[int, int] = {}
        per_option: dict[tuple, np.ndarray] = {}   # dots alike (recomputed, repeated) priced once
        for k, dot in enumerate(g.dots):
            options = all_options[len(nodes)]
            alike = (dot.dims, dot.fixed, self.price.dot_sizes(dot),
                     *((g.tensors[t].shape, g.tensors[t].dtype.name) for t in (dot.lhs, dot.rhs, dot.out)))
            if alike not in per_option:
                per_option[alike] = np.array([self.price.dot_compute(dot, o) for o in options])
            cost = dot.mult * per_option[alike]
            node_of_dot[k] = len(nodes)
            shapes = tuple(g.tensors[t].shape for t in (dot.lhs, dot.rhs, dot.out))
            signature = hash((dot.dims, shapes, dot.source, tuple(options)))
            memory = np.zeros((len(points), len(options)))
            running = [p for p, ops in enumerate(g.running) if dot.out in ops]
            held = [p for p, ops in enumerate(g.held) if dot.out in ops]
            combining = [p for p, ops in enumerate(g.combining) if dot.out in ops]
            if (running or held or combining) and self.m.gpu is not None:
                # a GPU matmul split K ways: its float32 partial sums (splitk.partials_live)
                memory = splitk.partials_live([self.price.split_k(dot, o) for o in options],
                                              [bool(dot_specs(dot, o)[3]) for o in options],
                                              len(points), running, held, combining, heap,
                                              tuple(8 * g.tensors[t].dtype.itemsize for t in (dot.lhs, dot.rhs)))
            if running and dot.out not in g.fused:
                memory[running] += self._unreduced(dot, options, heap)[None, :]
            if running and g.compiler == "cpu":
                memory[running] += self._reordered(dot, options, heap)[None, :]
            nodes.append(Node("dot", k, options, cost, memory, dot.source, signature))
            self._untrafficked.append(cost)
        self._full = Problem(nodes, EdgeTables(), base_memory, node_of_group, node_of_dot), spec_of
        return self._full

    def _unreduced(self, dot, options, heap: float) -> np.ndarray:
        """Per option, the bytes of a matmul's partial sums where it leaves them (a contracted
        dimension split over mesh axes): XLA's SPMD partitioner emits the local matmul whole at
        the product's spec, then its all-reduce or reduce-scatter into another buffer, so while it
        runs the unreduced product is held beside what the tensor's own spec counts (a
        data-parallel weight gradient: the whole f32[8192,384] before its reduce-scatter to
        f32[8192,48], in the CPU compiler's buffer assignment; tests/sharding/test_unreduced.py)."""
        t = self.g.tensors[dot.out]
        itemsize, minor = self.price.stored_as(dot.out)
        out = np.zeros(len(options))
        for i, o in enumerate(options):
            _, _, prod, partial, _ = dot_specs(dot, o)
            if partial:
                whole = self.m.memory_bytes(t.shape, itemsize, prod, minor)
                out[i] = layout.heap_bytes(whole, self.m.tiled) * heap
        return out

    def _reordered(self, dot, options, heap: float) -> np.ndarray:
        """Per option, the bytes of the operands XLA's CPU compiler copies into the order its
        matmul kernel reads (:func:`shardplan.compiler.layout.cpu_dot_copies`), at the spec the
        option reads them: a copy of its own where the operand is kept as it is for another
        reader (a weight gradient's activation, read by the matmuls of the gradient of the
        layer's input too); an operand read by this matmul alone is made in that order."""
        g = self.g
        shapes = [g.tensors[t].shape for t in (dot.lhs, dot.rhs)]
        copied = layout.cpu_dot_copies(dot.dims, *shapes)
        out = np.zeros(len(options))
        for side, tid in enumerate((dot.lhs, dot.rhs)):
            if not copied[side] or tid in g.fused or (tid not in g.inputs and len(g.readers.get(tid, ())) < 2):
                continue
            for i, o in enumerate(options):
                need = dot_specs(dot, o)[side]
                out[i] += layout.heap_bytes(self.price.stored_bytes(tid, need), self.m.tiled) * heap
        return out

    def step_floor(self) -> float:
        """No plan's predicted step is below this: every node at its cheapest, the pairs between
        them left out, and HBM traffic too (the ILP counts it one way, the prediction another:
        :mod:`shardplan.compiler.traffic`; never below zero)."""
        self._full_nodes()
        return float(sum(c.min() for c in self._untrafficked if len(c)))

    def build(self, allowed: list | None = None, *, tables: bool = True) -> Problem:
        """The :class:`Problem`. ``allowed`` keeps, per node, only these of its
        :meth:`node_options` (indices; ``None``: all): its tables are priced for those alone,
        which is how a search over a few options at a time avoids pricing them all.
        ``tables=False``: nodes only (their options, costs and memory), no edges."""
        g = self.g
        full, full_specs = self._full_nodes()
        node_of_group, node_of_dot = full.node_of_group, full.node_of_dot
        if allowed is None:
            allowed = [None] * len(full.nodes)
        # (Node(...) rather than dataclasses.replace: this runs for every node at every step of
        # a by-axes search.)
        nodes = [Node(n.kind, n.key, n.options, n.cost.copy(), n.memory, n.label, n.signature) if ok is None else
                 Node(n.kind, n.key, [n.options[i] for i in ok], n.cost[ok], n.memory[:, ok], n.label,
                      hash((n.signature, tuple(ok))))
                 for n, ok in zip(full.nodes, allowed)]
        edges = EdgeTables()
        if not tables:
            return Problem(nodes, edges, full.base_memory, node_of_group, node_of_dot)
        if self._ends is None:      # each grouped tensor's node; each edge's and dot operand's nodes
            self._ends = ([(t, node_of_group[g.group_of(t)]) for t in full_specs],
                          [(node_of_group[g.group_of(e.src)], node_of_group[g.group_of(e.dst)]) for e in g.edges],
                          [[node_of_group[g.group_of(tid)] for tid in (d.lhs, d.rhs, d.out)] for d in g.dots])
        tensor_nodes, edge_nodes, dot_nodes = self._ends
        spec_of = {}
        for t, n in tensor_nodes:
            ok = allowed[n]
            spec_of[t] = full_specs[t] if ok is None else [full_specs[t][i] for i in ok]
        kept_keys = [None if ok is None else tuple(ok) for ok in allowed]

        def add_table(a: int, b: int, table: np.ndarray) -> None:
            if a == b:
                nodes[a].cost += np.diagonal(table).copy()
            else:
                edges.add(a, b, table)

        def kept(key, a: int, b: int, price: Callable[[], np.ndarray]) -> np.ndarray:
            """``price()``, or the table priced before for these options of nodes ``a`` and ``b``."""
            if allowed[a] is None or allowed[b] is None:
                return price()
            key += (kept_keys[a], kept_keys[b])
            if key not in self._tables:
                self._tables[key] = price()
            return self._tables[key]

        for i, (e, (a, b)) in enumerate(zip(g.edges, edge_nodes)):
            add_table(a, b, kept(("edge", i), a, b, lambda e=e: edge_table(self.price, e, spec_of)))

        for k, dot in enumerate(g.dots):
            node = node_of_dot[k]
            options = nodes[node].options
            specs = functools.cache(lambda options=options: ([dot_specs(dot, o) for o in options],
                                                             [partial_groups(dot, o) for o in options]))
            for role, tid, other in zip(("lhs", "rhs", "out"), (dot.lhs, dot.rhs, dot.out), dot_nodes[k]):
                add_table(node, other, kept(("dot", k, role), node, other,
                                            lambda dot=dot, role=role, tid=tid, specs=specs:
                                            dot_table(self.price, dot, role, tid, spec_of, *specs())))
        return Problem(nodes, edges, full.base_memory, node_of_group, node_of_dot)
