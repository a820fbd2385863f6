"""Candidate shardings for every group and ``dot_general``, and what each costs.

A group's option maps each mesh axis to at most one of its dimension classes; a dot's option
maps each mesh axis to at most one of its dimensions (batch, free or contracting). The
:class:`Problem` holds, per node, the options with their linear cost and memory, and per pair
of nodes a cost table: the input of the ILP in :mod:`shardplan.solve.solver`.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Callable

import numpy as np

from shardplan.compiler import layout, splitk
from shardplan.compiler.bf16_pass import LAYOUT, read_as_bf16
from shardplan.compiler.combine import combined_reductions
from shardplan.compiler.cost import COLLECTIVE_PERMUTE, REDUCE_OP, Comm, CostModel, Spec
from shardplan.compiler.layout import minor_dims
from shardplan.compiler.tables import dot_table, edge_table
from shardplan.compiler.traffic import hbm_traffic
from shardplan.ir.graph import Graph
from shardplan.ir.problem import EdgeTables, Node, Problem

_LAYER_INDEX = re.compile(r"\[\d+\]|_\d+\b")


def _assignments(choices_per_axis: list[list[int]]):
    """Every way to give each mesh axis one of its choices (-1: unused)."""
    return itertools.product(*[[-1] + c for c in choices_per_axis])


class Enumerator:
    """Turns a :class:`Graph` and a :class:`CostModel` into a :class:`Problem`."""

    def __init__(self, graph: Graph, model: CostModel, donated_outputs: frozenset[int] = frozenset(),
                 fixed: dict[int, Spec] | None = None, fed: frozenset[int] = frozenset()):
        self.fixed = fixed or {}     # tensor -> spec it must have (inputs of a hand-written plan)
        self.fed = fed               # inputs loaded from the hosts every step (the batch)
        self.g = graph
        self.m = model
        self.axes = model.mesh.axis_names
        self.sizes = model.mesh.axis_sizes
        self.groups = graph.groups()
        self.pinned = graph.pinned_classes()
        self.donated_outputs = donated_outputs
        self.traffic = hbm_traffic(graph)                   # the ILP's
        self.priced_traffic = hbm_traffic(graph, fused=True)  # a plan's predicted step
        self._bytes_memo: dict[tuple, float] = {}
        self.combined = combined_reductions(graph)
        self.narrow = read_as_bf16(graph) if model.tiled else frozenset()
        self.minor = minor_dims(graph) if model.tiled else {}     # TPU tiles fixed by batched matmuls
        # the TPU compiler's heap slot per tuple result, apart from the arrays (none elsewhere)
        self.tuple_slots = graph.tuple_results if model.tiled else 0
        self._inputs = frozenset(graph.inputs)
        self._returned = frozenset(t for t in graph.outputs if t is not None)
        # XLA's CPU compiler computes bfloat16 in float32: the values it makes are held widened
        # (the arguments and results keep the caller's bfloat16).
        self.widened = graph.compiler == "cpu"
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
        dim_size = self.dot_sizes(dot)
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

    def dot_sizes(self, dot) -> tuple[int, ...]:
        """The iteration extent of each of a dot's dims."""
        if dot.sizes is not None:
            return dot.sizes
        lhs, rhs = self.g.tensors[dot.lhs], self.g.tensors[dot.rhs]
        return tuple(lhs.shape[l] if l is not None else rhs.shape[r] for l, r, _ in dot.dims)

    @staticmethod
    def tensor_spec_from(graph: Graph, tid: int, option: dict[int, tuple[str, ...]]) -> Spec:
        t = graph.tensors[tid]
        return tuple(option.get(graph.dim_class(tid, d), ()) for d in range(t.rank))

    @staticmethod
    def dot_specs(dot, option) -> tuple[Spec, Spec, Spec, tuple[str, ...], tuple[int, int, int]]:
        """Required lhs and rhs specs, produced out spec and its partial-sum axes for one dot option."""
        ranks = [0, 0, 0]
        for l, r, o in dot.dims:
            for k, d in enumerate((l, r, o)):
                if d is not None:
                    ranks[k] = max(ranks[k], d + 1)
        specs = [[()] * n for n in ranks]
        partial: tuple[str, ...] = ()
        for (l, r, o), axes in zip(dot.dims, option):
            for k, d in enumerate((l, r, o)):
                if d is not None:
                    specs[k][d] = axes
            if o is None:
                partial += axes
        return tuple(specs[0]), tuple(specs[1]), tuple(specs[2]), partial, tuple(ranks)

    @staticmethod
    def partial_groups(dot, option) -> tuple[tuple[str, ...], ...]:
        """The partial-sum axes of one dot option, per contracting dimension."""
        return tuple(axes for (l, r, o), axes in zip(dot.dims, option) if o is None and axes)

    # -- costs -----------------------------------------------------------------------------------
    # Per-instance memo tables (a method-level lru_cache would pin every Enumerator for good).
    def _bytes(self, tid: int, spec: Spec) -> float:
        key = (tid, spec)
        if key not in self._bytes_memo:
            t = self.g.tensors[tid]
            self._bytes_memo[key] = self.m.memory_bytes(t.shape, t.dtype.itemsize, spec)
        return self._bytes_memo[key]

    def operand_reshard(self, edge, src_spec: Spec, dst_spec: Spec) \
            -> tuple[list[tuple[Comm, float]], Spec | None, Spec | None, tuple | None]:
        """For an edge with ``required``: its collectives, the spec its operand is resharded to
        before the op, the spec the op makes its result in before that is resharded (each
        ``None`` where nothing moves), and the rewrite chosen for the op (``(kind, made, partial)``,
        :mod:`shardplan.tracing.rewrites`; ``None``: the op as traced). The operand moves unless the op
        can run on it in place (``passthrough``, or a ``rewrite`` whose partial result is then
        reduced) and that is cheaper; the table takes the cheapest the same way."""
        t = self.g.tensors[edge.src]
        need = edge.need(dst_spec, self.m.sizes)
        comms = self.scaled(self.m.reshard_items(t.shape, self.src_itemsize(edge), src_spec, need), edge.mult)
        best = (comms, (need if comms else None), None, None)
        if not comms:
            return best
        out = self.g.tensors[edge.dst]
        made = edge.passthrough(src_spec, dst_spec) if edge.passthrough is not None else None
        if made is not None:
            other = self.scaled(self.m.reshard_items(out.shape, self.dst_itemsize(edge), made, dst_spec), edge.mult)
            if sum(sec for _, sec in other) < sum(sec for _, sec in best[0]):
                best = (other, None, made, None)
        rewrite = edge.rewrite(src_spec, dst_spec) if edge.rewrite is not None else None
        if rewrite is not None:
            _, made, partial = rewrite
            other = self.scaled(self.m.reduce_items(out.shape, self.dst_itemsize(edge), made, partial, dst_spec),
                                edge.mult)
            if sum(sec for _, sec in other) < sum(sec for _, sec in best[0]):
                best = (other, None, None, rewrite)
        return best

    def scattered_updates(self, edge, src_spec: Spec, dst_spec: Spec) -> Spec | None:
        """For a scatter's updates-to-result edge: the spec the updates are resharded to where XLA
        scatters by operand passthrough (each device into its own shard of the result); ``None``
        where it scatters the updates as they are (index passthrough, partial sums reduced).
        XLA picks by a size estimate (gather_scatter_handler.cc, ScatterPartitionMethodCostModel):
        operand passthrough holds the result's shard and the resharded updates; index passthrough
        holds the whole result and the updates as they are. The indices (small) are left out."""
        if not edge.primitive.startswith("scatter") or edge.passthrough is None:
            return None
        need = edge.passthrough(src_spec, dst_spec)
        if need is None:
            return None
        m, t, src = self.m, self.g.tensors[edge.dst], self.g.tensors[edge.src]
        held = m.per_device_bytes(t.shape, t.dtype.itemsize, edge.produced(need)[0]) + \
            m.per_device_bytes(src.shape, src.dtype.itemsize, need)
        whole = t.dtype.itemsize * math.prod(t.shape) + m.per_device_bytes(src.shape, src.dtype.itemsize, src_spec)
        return need if held <= whole or not edge.produced(src_spec)[1] else None

    def edge_comms(self, edge, src_spec: Spec, dst_spec: Spec) -> list[tuple[Comm, float]]:
        """The collectives of one op edge, each with its seconds per step."""
        if edge.required is not None:
            return self.operand_reshard(edge, src_spec, dst_spec)[0]
        produced, partial = edge.produced(src_spec)
        t = self.g.tensors[edge.dst]
        m, share = self.m, self.combined.get(edge.dst, 1)
        need = self.scattered_updates(edge, src_spec, dst_spec)
        if need is not None:
            # The updates move (an all-to-all, a gather, or a local slice), each device scatters
            # into its shard of the window dims; axes the updates still split elsewhere leave
            # partial sums of that shard, all-reduced, then sliced where the result is split on
            # other dims too.
            src = self.g.tensors[edge.src]
            made, left = edge.produced(need)
            items = m.reshard_items(src.shape, self.wire(src), src_spec, need) + \
                m.reduce_items(t.shape, self.wire(t), made, left, made, share=share) + \
                m.reshard_items(t.shape, self.wire(t), made, dst_spec)
            return self.scaled(items, edge.mult)
        if edge.primitive.startswith("scatter") and partial:
            # XLA's partitioner all-reduces a scatter's partial sums whole, then slices; it does
            # not turn them into a reduce-scatter. Dimensions the target shards and the updates
            # do not are sliced locally first (free), so the all-reduce moves only that slice.
            used = {a for axes in produced for a in axes} | set(partial)
            sliced = []
            for have, want in zip(produced, dst_spec):
                extra = () if have else tuple(a for a in want if a not in used)
                used.update(extra)
                sliced.append(have or extra)
            sliced = tuple(sliced)
            items = m.reduce_items(t.shape, self.wire(t), sliced, partial, sliced, share=share) + \
                m.reshard_items(t.shape, self.wire(t), sliced, dst_spec)
        else:
            items = m.reduce_items(t.shape, self.dst_itemsize(edge), produced, partial, dst_spec, REDUCE_OP, share)
        return self.scaled(items, edge.mult)

    def edge_seconds(self, edge, src_spec: Spec, dst_spec: Spec) -> float:
        """Seconds per step of :meth:`edge_comms`."""
        return sum(sec for _, sec in self.edge_comms(edge, src_spec, dst_spec))

    def wire(self, t) -> int:
        """Bytes an element of tensor ``t`` moves as in a collective: its own, but 4 for
        bfloat16 on XLA's CPU compiler, which runs every bfloat16 collective in float32 (a convert
        ahead of it and one after: all-gathers of parameters as much as all-reduces of gradients;
        tests/compiler/test_hlo.py)."""
        return 4 if self.widened and t.dtype.name == "bfloat16" else t.dtype.itemsize

    def src_itemsize(self, edge) -> int:
        """Bytes an element of an edge's operand moves as where it is resharded for the op: 2
        where a layout op hands it on only to bfloat16-pass dots on a TPU (:func:`read_as_bf16`),
        else :meth:`wire`."""
        t = self.g.tensors[edge.src]
        return 2 if edge.dst in self.narrow and edge.primitive in LAYOUT and t.dtype.itemsize == 4 \
            else self.wire(t)

    def dst_itemsize(self, edge) -> int:
        """Bytes an element of an edge's result moves as where it is resharded after the op."""
        t = self.g.tensors[edge.dst]
        return 2 if edge.dst in self.narrow else self.wire(t)

    def moved_itemsize(self, dot, t) -> int:
        """Bytes an element of a dot's operand takes where it is resharded for the dot: 2 for
        float32 operands at DEFAULT precision on a TPU (libtpu rounds them to bfloat16 for the
        one-pass matmul before it gathers them), else :meth:`wire`."""
        return 2 if dot.bf16_pass and self.m.tiled else self.wire(t)

    def dot_comms(self, dot, option, lhs_spec: Spec, rhs_spec: Spec, out_spec: Spec) -> list[tuple[Comm, float]]:
        """The collectives of one dot strategy (operand resharding, partial-sum reduction), priced."""
        req_l, req_r, prod, partial, _ = self.dot_specs(dot, option)
        out = []
        for tid, have, need in ((dot.lhs, lhs_spec, req_l), (dot.rhs, rhs_spec, req_r)):
            t = self.g.tensors[tid]
            out += self.m.reshard_items(t.shape, self.moved_itemsize(dot, t), have, need)
        t = self.g.tensors[dot.out]
        groups = self.partial_groups(dot, option)
        out += self.m.reduce_items(t.shape, self.wire(t), prod, partial, out_spec, groups,
                                   self.combined.get(dot.out, 1))
        return self.scaled(out, dot.mult)

    @staticmethod
    def scaled(items: list[tuple[Comm, float]], mult: float) -> list[tuple[Comm, float]]:
        """Collectives issued ``mult`` times a step: their seconds per step."""
        return [(c, mult * sec) for c, sec in items]

    def shift_comms(self, tid: int, spec: Spec) -> list[tuple[Comm, float]]:
        """The collectives of a rolled tensor (:attr:`Graph.shifts`, the pipeline's stage shift)
        of this spec, each with its seconds per step: where the rolled dimension (0) is split, each
        device sends the row it holds last to the next device along those axes (one
        collective-permute of a row of its shard); nothing moves where it is whole."""
        t = self.g.tensors[tid]
        axes = spec[0]
        if not axes:
            return []
        rows = -(-t.shape[0] // self.m.shards(axes))
        c = Comm(COLLECTIVE_PERMUTE, tuple(axes), self.m.per_device_bytes(t.shape, self.wire(t), spec) / rows)
        return [(c, t.mult * self.m.collective_time(c))]

    def input_seconds(self, tid: int, spec: Spec) -> float:
        """Seconds per step the hosts spend loading an input (the batch) of this spec: each node
        loads its share (:meth:`MeshSpec.node_shards`), all nodes at once. The same for every
        spec on one node, so only meshes of several nodes price it."""
        mesh = self.m.mesh
        if mesh.nodes == 1:
            return 0.0
        t = self.g.tensors[tid]
        return t.nbytes / mesh.node_shards([a for axes in spec for a in axes]) / mesh.device.host_bandwidth

    def offload_seconds(self, tid: int, spec: Spec) -> float:
        """Seconds per step a transfer's result (:attr:`~shardplan.ir.graph.Graph.transfers`) of this
        spec takes over the host link; nothing where the target keeps host tensors in device
        memory (XLA's CPU compiler drops the copy)."""
        if not self.g.host_apart:
            return 0.0
        t = self.g.tensors[tid]
        return t.mult * self.m.memory_bytes(t.shape, t.dtype.itemsize, spec) / self.m.mesh.device.offload_bandwidth

    def stored_as(self, tid: int) -> tuple[int, tuple[int, ...] | None]:
        """(item size, tiled dimensions) a tensor is held in device memory with: on a TPU, a
        float32 tensor only bfloat16-pass dots read is stored as its rounding (not an argument:
        the caller holds those), and a batched dot's operand or result tiles its own dimensions
        (:func:`shardplan.compiler.layout.minor_dims`); on XLA's CPU compiler, a bfloat16 tensor the step
        makes (not an argument, not a result) as float32, which that compiler computes it in."""
        t = self.g.tensors[tid]
        if tid in self._inputs:
            return t.dtype.itemsize, self.minor.get(tid)
        if tid in self.narrow:
            return 2, self.minor.get(tid)
        if self.widened and t.dtype.name == "bfloat16" and tid not in self._returned:
            return 4, None
        return t.dtype.itemsize, self.minor.get(tid)

    def stored_bytes(self, tid: int, spec: Spec) -> float:
        """Bytes per device a tensor of this spec holds (:meth:`stored_as`)."""
        t = self.g.tensors[tid]
        itemsize, minor = self.stored_as(tid)
        return self.m.memory_bytes(t.shape, itemsize, spec, minor)

    def hbm_seconds(self, tid: int, per_device_bytes, *, priced: bool = False):
        """Seconds per step a tensor of these bytes per device spends crossing HBM (its reads
        and writes, :func:`hbm_traffic`: as the ILP counts them, or with ``priced`` as XLA fuses)."""
        traffic = self.priced_traffic if priced else self.traffic
        return self.g.tensors[tid].mult * traffic.get(tid, 0) * per_device_bytes / self.m.mesh.device.hbm_bandwidth

    def dot_compute(self, dot, option) -> float:
        req_l, req_r, prod, _, _ = self.dot_specs(dot, option)
        flops = 2.0
        for size, axes in zip(self.dot_sizes(dot), option):
            flops *= math.ceil(size / self.m.shards(axes))
        out_bytes = self._bytes(dot.out, prod)
        nbytes = self._bytes(dot.lhs, req_l) + self._bytes(dot.rhs, req_r) + out_bytes
        lhs = self.g.tensors[dot.lhs]
        split = self._split_k_partials(dot, option) if self.m.gpu is not None else 0.0
        if not split:
            return self.m.compute_time(flops, nbytes, lhs.dtype.name)
        # Split K ways on a GPU (shardplan.compiler.splitk): the matmul writes float32 partial sums in
        # place of its result, and a second kernel reads them and writes the result.
        return self.m.compute_time(flops, nbytes - out_bytes + split, lhs.dtype.name) + \
            (split + out_bytes) / self.m.mesh.device.hbm_bandwidth

    def _split_k_partials(self, dot, option) -> float:
        """Bytes of the float32 partial sums XLA splits this dot option's matmul into on the
        mesh's GPU (:mod:`shardplan.compiler.splitk`; 0 unsplit)."""
        batch, m, n, k, s = self._split_k(dot, option)
        return splitk.partial_bytes(batch, m, n, s)

    def _split_k(self, dot, option) -> tuple[int, int, int, int, int]:
        """``(batch, m, n, k, split)`` of this dot option's matmul on the mesh's GPU, per device
        (:mod:`shardplan.compiler.splitk`; split 1: not split)."""
        local = [math.ceil(size / self.m.shards(axes)) if axes else size
                 for size, axes in zip(self.dot_sizes(dot), option)]
        batch, m, n, k = splitk.matmul_dims(dot.dims, local)
        lhs, rhs, out = (self.g.tensors[t].dtype for t in (dot.lhs, dot.rhs, dot.out))
        return batch, m, n, k, splitk.splits(self.m.gpu, batch, m, n, k, lhs, rhs, out)

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
        base_memory += self.tuple_slots * layout.HEAP_ALIGN
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
                itemsize, minor = self.stored_as(t)
                key = (classes, tt.shape, itemsize, minor)
                if key not in bytes_of:     # (arguments' bytes, a temporary's in the heap) per option
                    laid = np.array([self.m.memory_bytes(tt.shape, itemsize, s, minor) for s in specs])
                    bytes_of[key] = laid, layout.heap_bytes(laid, self.m.tiled)
                per_dev, in_heap = bytes_of[key]
                if t in self.fed:
                    cost += np.array([self.input_seconds(t, s) for s in specs])
                if t in g.shifts:
                    cost += np.array([sum(sec for _, sec in self.shift_comms(t, s)) for s in specs])
                traffic += self.hbm_seconds(t, per_dev)
                for p in live_at.get(t, []):
                    memory[p] += in_heap * heap
                if t in always and not (g.host_apart and tt.host):
                    memory += per_dev[None, :]
            node_of_group[root] = len(nodes)
            label = g.tensors[ranked[0]].name
            where = tuple((g.tensors[t].shape, g.tensors[t].dtype.name, self.traffic.get(t, 0),
                           _LAYER_INDEX.sub("#", g.tensors[t].source)) for t in ranked)
            signature = hash((where, tuple(tuple(spec_of[t]) for t in ranked)))
            nodes.append(Node("group", root, options, cost + traffic, memory, label, signature))
            self._untrafficked.append(cost)

        node_of_dot: dict[int, int] = {}
        per_option: dict[tuple, np.ndarray] = {}   # dots alike (recomputed, repeated) priced once
        for k, dot in enumerate(g.dots):
            options = all_options[len(nodes)]
            alike = (dot.dims, dot.fixed, self.dot_sizes(dot),
                     *((g.tensors[t].shape, g.tensors[t].dtype.name) for t in (dot.lhs, dot.rhs, dot.out)))
            if alike not in per_option:
                per_option[alike] = np.array([self.dot_compute(dot, o) for o in options])
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
                memory = splitk.partials_live([self._split_k(dot, o) for o in options],
                                              [bool(self.dot_specs(dot, o)[3]) for o in options],
                                              len(points), running, held, combining, heap)
            nodes.append(Node("dot", k, options, cost, memory, dot.source, signature))
            self._untrafficked.append(cost)
        self._full = Problem(nodes, EdgeTables(), base_memory, node_of_group, node_of_dot), spec_of
        return self._full

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
            add_table(a, b, kept(("edge", i), a, b, lambda e=e: edge_table(self, e, spec_of)))

        for k, dot in enumerate(g.dots):
            node = node_of_dot[k]
            options = nodes[node].options
            specs = functools.cache(lambda options=options: ([self.dot_specs(dot, o) for o in options],
                                                             [self.partial_groups(dot, o) for o in options]))
            for role, tid, other in zip(("lhs", "rhs", "out"), (dot.lhs, dot.rhs, dot.out), dot_nodes[k]):
                add_table(node, other, kept(("dot", k, role), node, other,
                                            lambda dot=dot, role=role, tid=tid, specs=specs:
                                            dot_table(self, dot, role, tid, spec_of, *specs())))
        return Problem(nodes, edges, full.base_memory, node_of_group, node_of_dot)
