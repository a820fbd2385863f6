"""What each sharding of a step's tensors and dots costs on a mesh: the collectives of an op
edge or a dot for a pair of specs, the bytes a tensor is stored and moved as, its HBM traffic,
a dot's compute (split K ways on a GPU), input loading and host offload. The cost model
(:class:`~shardplan.compiler.cost.CostModel`) prices each collective; :class:`Analyses` holds
what the compiler makes of the graph as a whole, computed once per graph."""

from __future__ import annotations

import dataclasses
import math

from shardplan.compiler import splitk
from shardplan.compiler.bf16_pass import LAYOUT, read_as_bf16
from shardplan.compiler.cost import COLLECTIVE_PERMUTE, REDUCE_OP, Comm, CostModel, Spec
from shardplan.compiler.layout import minor_dims
from shardplan.compiler.traffic import hbm_traffic
from shardplan.ir.graph import Graph


def wire_itemsize(dtype, widened: bool) -> int:
    """Bytes an element of ``dtype`` moves as in a collective: its own, but 4 for bfloat16 where
    the compiler computes bfloat16 in float32 (``widened``: XLA's CPU compiler, which runs every
    bfloat16 collective in float32, a convert ahead of it and one after; all-gathers of parameters
    as much as all-reduces of gradients; tests/compiler/test_hlo.py)."""
    return 4 if widened and dtype.name == "bfloat16" else dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Analyses:
    """What the compiler makes of a step's graph as a whole, independent of any sharding:
    computed once per graph (and kind of compiler) and handed to the pricing and the enumerator."""
    traffic: dict            # tensor -> HBM crossings per use, as the ILP counts them (traffic.hbm_traffic)
    priced_traffic: dict     # the same as XLA fuses: a plan's predicted step
    narrow: frozenset        # on a TPU: float32 tensors only bfloat16-pass dots read (bf16_pass)
    minor: dict              # on a TPU: tensor -> the dims batched matmuls fix as its tiles
    tuple_slots: int         # on a TPU: the heap slots of tuple results (loops, multi-result kernels)
    widened: bool            # XLA's CPU compiler: bfloat16 computed (and moved) as float32

    @classmethod
    def of(cls, graph: Graph, tiled: bool) -> Analyses:
        """The analyses of ``graph`` for a compiler that lays arrays out in tiles (a TPU) or not."""
        return cls(traffic=hbm_traffic(graph), priced_traffic=hbm_traffic(graph, fused=True),
                   narrow=read_as_bf16(graph) if tiled else frozenset(),
                   minor=minor_dims(graph) if tiled else {},
                   tuple_slots=graph.tuple_results if tiled else 0,
                   widened=graph.compiler == "cpu")


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


def partial_groups(dot, option) -> tuple[tuple[str, ...], ...]:
    """The partial-sum axes of one dot option, per contracting dimension."""
    return tuple(axes for (l, r, o), axes in zip(dot.dims, option) if o is None and axes)


class Pricer:
    """Prices the options of one graph's tensors, op edges and dots on one mesh's cost model."""

    def __init__(self, graph: Graph, model: CostModel, analyses: Analyses | None = None):
        self.g = graph
        self.m = model
        self.a = analyses if analyses is not None else Analyses.of(graph, model.tiled)
        self._inputs = frozenset(graph.inputs)
        self._returned = frozenset(t for t in graph.outputs if t is not None)
        # Per-instance memo (a method-level lru_cache would pin every Pricer for good).
        self._bytes_memo: dict[tuple, float] = {}

    def dot_sizes(self, dot) -> tuple[int, ...]:
        """The iteration extent of each of a dot's dims."""
        if dot.sizes is not None:
            return dot.sizes
        lhs, rhs = self.g.tensors[dot.lhs], self.g.tensors[dot.rhs]
        return tuple(lhs.shape[l] if l is not None else rhs.shape[r] for l, r, _ in dot.dims)

    def laid_bytes(self, tid: int, spec: Spec) -> float:
        """Bytes per device of a tensor of this spec in its own dtype, as the device lays it out."""
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
        m, share = self.m, self.g.combined.get(edge.dst, 1)
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
        """Bytes an element of tensor ``t`` moves as in a collective (:func:`wire_itemsize`)."""
        return wire_itemsize(t.dtype, self.a.widened)

    def src_itemsize(self, edge) -> int:
        """Bytes an element of an edge's operand moves as where it is resharded for the op: 2
        where a layout op hands it on only to bfloat16-pass dots on a TPU (:func:`read_as_bf16`),
        else :meth:`wire`."""
        t = self.g.tensors[edge.src]
        return 2 if edge.dst in self.a.narrow and edge.primitive in LAYOUT and t.dtype.itemsize == 4 \
            else self.wire(t)

    def dst_itemsize(self, edge) -> int:
        """Bytes an element of an edge's result moves as where it is resharded after the op."""
        t = self.g.tensors[edge.dst]
        return 2 if edge.dst in self.a.narrow else self.wire(t)

    def moved_itemsize(self, dot, t) -> int:
        """Bytes an element of a dot's operand takes where it is resharded for the dot: 2 for
        float32 operands at DEFAULT precision on a TPU (libtpu rounds them to bfloat16 for the
        one-pass matmul before it gathers them), else :meth:`wire`."""
        return 2 if dot.bf16_pass and self.m.tiled else self.wire(t)

    def dot_comms(self, dot, option, lhs_spec: Spec, rhs_spec: Spec, out_spec: Spec) -> list[tuple[Comm, float]]:
        """The collectives of one dot strategy (operand resharding, partial-sum reduction), priced."""
        req_l, req_r, prod, partial, _ = dot_specs(dot, option)
        out = []
        for tid, have, need in ((dot.lhs, lhs_spec, req_l), (dot.rhs, rhs_spec, req_r)):
            t = self.g.tensors[tid]
            out += self.m.reshard_items(t.shape, self.moved_itemsize(dot, t), have, need)
        t = self.g.tensors[dot.out]
        groups = partial_groups(dot, option)
        out += self.m.reduce_items(t.shape, self.wire(t), prod, partial, out_spec, groups,
                                   self.g.combined.get(dot.out, 1))
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
            return t.dtype.itemsize, self.a.minor.get(tid)
        if tid in self.a.narrow:
            return 2, self.a.minor.get(tid)
        if self.a.widened and t.dtype.name == "bfloat16" and tid not in self._returned:
            return 4, None
        return t.dtype.itemsize, self.a.minor.get(tid)

    def stored_bytes(self, tid: int, spec: Spec) -> float:
        """Bytes per device a tensor of this spec holds (:meth:`stored_as`)."""
        t = self.g.tensors[tid]
        itemsize, minor = self.stored_as(tid)
        return self.m.memory_bytes(t.shape, itemsize, spec, minor)

    def hbm_seconds(self, tid: int, per_device_bytes, *, priced: bool = False):
        """Seconds per step a tensor of these bytes per device spends crossing HBM (its reads
        and writes, :func:`hbm_traffic`: as the ILP counts them, or with ``priced`` as XLA fuses)."""
        traffic = self.a.priced_traffic if priced else self.a.traffic
        return self.g.tensors[tid].mult * traffic.get(tid, 0) * per_device_bytes / self.m.mesh.device.hbm_bandwidth

    def dot_compute(self, dot, option) -> float:
        req_l, req_r, prod, _, _ = dot_specs(dot, option)
        flops = 2.0
        for size, axes in zip(self.dot_sizes(dot), option):
            flops *= math.ceil(size / self.m.shards(axes))
        out_bytes = self.laid_bytes(dot.out, prod)
        nbytes = self.laid_bytes(dot.lhs, req_l) + self.laid_bytes(dot.rhs, req_r) + out_bytes
        lhs = self.g.tensors[dot.lhs]
        split = self.split_k_partials(dot, option) if self.m.gpu is not None else 0.0
        if not split:
            return self.m.compute_time(flops, nbytes, lhs.dtype.name)
        # Split K ways on a GPU (shardplan.compiler.splitk): the matmul writes float32 partial sums in
        # place of its result, and a second kernel reads them and writes the result.
        return self.m.compute_time(flops, nbytes - out_bytes + split, lhs.dtype.name) + \
            (split + out_bytes) / self.m.mesh.device.hbm_bandwidth

    def split_k_partials(self, dot, option) -> float:
        """Bytes of the float32 partial sums XLA splits this dot option's matmul into on the
        mesh's GPU (:mod:`shardplan.compiler.splitk`; 0 unsplit)."""
        batch, m, n, k, s = self.split_k(dot, option)
        return splitk.partial_bytes(batch, m, n, s)

    def split_k(self, dot, option) -> tuple[int, int, int, int, int]:
        """``(batch, m, n, k, split)`` of this dot option's matmul on the mesh's GPU, per device
        (:mod:`shardplan.compiler.splitk`; split 1: not split)."""
        local = [math.ceil(size / self.m.shards(axes)) if axes else size
                 for size, axes in zip(self.dot_sizes(dot), option)]
        batch, m, n, k = splitk.matmul_dims(dot.dims, local)
        lhs, rhs, out = (self.g.tensors[t].dtype for t in (dot.lhs, dot.rhs, dot.out))
        return batch, m, n, k, splitk.splits(self.m.gpu, batch, m, n, k, lhs, rhs, out)
