"""What a plan holds beyond each tensor at its own PartitionSpec: resharded matmul operands kept
between their readers, and gradients' partial sums waiting for a combined collective. Their bytes
depend on a pair of choices (an operand's spec and its matmul's; a matmul's and its result's), so
the ILP's checkpoints (one linear row of node memories each) leave them out; the plan's predicted
memory counts them (:func:`held_bytes`), and the planner solves again under a lower budget where
they put a plan over its own (``planning/planner.py``).

**Resharded copies.** XLA's SPMD partitioner reshards a matmul's operand (an all-gather, an
all-to-all, a slice) into a buffer of its own, and its CSE pass makes one buffer of the same
reshard of the same value: where the forward matmul and the backward one read a weight or an
activation resharded the same way (a gathered weight read by ``x @ w`` and by ``dy @ w.T``), the
copy is made once, before the first, and freed after the last. With layers unrolled that is one
copy a layer, held from its forward to its backward (a ZeRO-3 plan's every gathered weight: the
CPU and GPU compilers' buffer assignments, ``tests/compiler/test_held.py``). A differentiated
``jax.checkpoint`` reads its inputs through an optimisation barrier, so its recomputed matmuls
reshard a value of their own (:attr:`~shardplan.ir.graph.Graph.region_of`). Where every reader of
a stored value reads the one copy, the value dies at the reshard and the copy takes its place.
Only the top level's matmuls count: a loop body reshards its slice each trip, held for one trip.

**Combined partial sums.** XLA's all-reduce and reduce-scatter combiners merge the top-level
gradients' reductions (:func:`~shardplan.compiler.combine.combined_reductions`) into collectives
of up to :data:`COMBINE_THRESHOLD` bytes each, in schedule order; a combined collective runs
after the last of its gradients is computed, so each gradient's unreduced partial sum (the
matmul's result, at its product spec) waits for it, and the reduced results are allocated beside
them there. On the CPU compiler an FSDP step's eight weight gradients wait for one all-reduce, on
the GPU's for one reduce-scatter (their buffer assignments).
"""

from __future__ import annotations

import numpy as np

from shardplan.compiler import layout
from shardplan.compiler.pricing import dot_specs

# XLA's default combine threshold of its all-reduce and reduce-scatter combiners, bytes of the
# combined collective's result (kDefaultAllReduceCombineThreshold, xla/service/collective_utils.h).
COMBINE_THRESHOLD = 30 * 2**20 + 7


def held_bytes(graph, price, spec_of: dict, dot_option) -> np.ndarray:
    """Bytes per device a plan holds at each of ``graph``'s memory checkpoints beyond its tensors
    at their own specs: resharded matmul operands and waiting partial sums. ``spec_of`` maps a
    tensor to its PartitionSpec, ``dot_option(k)`` gives dot ``k``'s chosen option."""
    out = np.zeros(len(graph.points))
    if not graph.points or not graph.point_index:
        return out
    index = np.array(graph.point_index)
    heap = 1.0 + price.m.mesh.device.heap_overhead
    return (_copies(graph, price, spec_of, dot_option, index, heap)
            + _partials(graph, price, spec_of, dot_option, index, heap))


def _heap(price, nbytes: float, heap: float) -> float:
    return layout.heap_bytes(nbytes, price.m.tiled) * heap


def _copies(g, price, spec_of, dot_option, index, heap) -> np.ndarray:
    out = np.zeros(len(index))
    spans: dict[tuple, list] = {}     # (tensor, spec, item size, region) -> [first, last, readers]
    keys_of: dict[int, set] = {}
    for k, dot in enumerate(g.dots):
        at = g.scheduled.get(dot.out)
        if g.loop_of[dot.out] or at is None:
            continue
        req_l, req_r, *_ = dot_specs(dot, dot_option(k))
        for tid, need in ((dot.lhs, req_l), (dot.rhs, req_r)):
            if need == spec_of[tid] or tid in g.fused and g.compiler != "cpu":
                # (A transpose fused into its matmuls: the CPU compiler gathers it once, into
                # a copy CSE shares; the GPU compiler transposes the shard and gathers it again
                # for each matmul, its buffer assignment shows.)
                continue
            key = (tid, need, price.moved_itemsize(dot, g.tensors[tid]), g.region_of[dot.out])
            span = spans.setdefault(key, [at, at, 0])
            span[0], span[1], span[2] = min(span[0], at), max(span[1], at), span[2] + 1
            keys_of.setdefault(tid, set()).add(key)
    for (tid, need, itemsize, _), (first, last, count) in spans.items():
        t = g.tensors[tid]
        nbytes = _heap(price, price.m.memory_bytes(t.shape, itemsize, need, price.stored_as(tid)[1]), heap)
        out += np.where((index >= first) & (index <= last), nbytes, 0.0)
        # The value dies at the reshard where nothing else reads it: the copy takes its place.
        readers = g.readers.get(tid, [])
        if tid in g.inputs or len(keys_of[tid]) > 1 or len(readers) != count or \
                any(p != "dot_general" for p, _ in readers):
            continue
        own = _heap(price, price.stored_bytes(tid, spec_of[tid]), heap)
        for p, live in enumerate(g.points):
            if index[p] >= first and tid in live:
                out[p] -= own
    return out


def _partials(g, price, spec_of, dot_option, index, heap) -> np.ndarray:
    out = np.zeros(len(index))
    waiting = []                      # (scheduled at, combiner key, partial bytes, reduced bytes, tensor)
    for k, dot in enumerate(g.dots):
        t = dot.out
        at = g.scheduled.get(t)
        if g.loop_of[t] or at is None or t not in g.combined or t in g.fused:
            continue
        _, _, prod, partial, _ = dot_specs(dot, dot_option(k))
        if not partial:
            continue
        itemsize, minor = price.stored_as(t)
        shape = g.tensors[t].shape
        whole = price.m.memory_bytes(shape, itemsize, prod, minor)
        # Reduced as the plan pins it (CostModel.reduced_spec): scattered over the partial axes
        # the tensor's own spec splits (a reduce-scatter), summed whole over the rest.
        made = price.m.reduced_spec(prod, partial, spec_of[t])
        reduced = price.m.memory_bytes(shape, itemsize, made, minor)
        kind = _kind(g, made, prod)
        waiting.append((at, (kind, tuple(sorted(partial))), whole, reduced, price.stored_bytes(t, spec_of[t]), t))
    for e in g.edges:
        # The combiner merges the other partial sums of its loop trip too (a loss, a bias's or a
        # norm scale's reduce over the batch): they decide when the collective runs.
        t = e.dst
        at = g.scheduled.get(t)
        if e.produced is None or g.loop_of[t] or at is None or t not in g.combined:
            continue
        # (A scatter by operand passthrough moves its updates first: Pricer.edge_comms.)
        moved = price.scattered_updates(e, spec_of[e.src], spec_of[t])
        prod, partial = e.produced(spec_of[e.src] if moved is None else moved)
        if not partial:
            continue
        itemsize, minor = price.stored_as(t)
        shape = g.tensors[t].shape
        made = price.m.reduced_spec(prod, partial, spec_of[t])
        kind = _kind(g, made, prod)
        waiting.append((at, (kind, tuple(sorted(partial))), price.m.memory_bytes(shape, itemsize, prod, minor),
                        price.m.memory_bytes(shape, itemsize, made, minor), price.stored_bytes(t, spec_of[t]), t))
    # Each combiner merges its collectives in schedule order up to the threshold (on the
    # collective's result).
    groups: dict[tuple, list[list]] = {}
    for at, key, whole, reduced, own, t in sorted(waiting, key=lambda w: w[0]):
        runs = groups.setdefault(key, [[]])
        if runs[-1] and sum(m[2] for m in runs[-1]) + reduced > COMBINE_THRESHOLD:
            runs.append([])
        runs[-1].append((at, whole, reduced, own, t))
    for runs in groups.values():
        for run in runs:
            if len(run) < 2:
                continue
            end = max(m[0] for m in run)          # the collective runs after the last of them
            for at, whole, reduced, own, t in run:
                # From its matmul to the collective the partial sum is held, not the tensor at
                # its own spec that the checkpoints count; at the collective, both. (Where the
                # matmul runs, its node counts the partial sum: Enumerator's unreduced product.)
                for p, live in enumerate(g.points):
                    if at <= index[p] <= end:
                        if t not in g.running[p]:
                            out[p] += _heap(price, whole, heap)
                        if index[p] < end and t in live:
                            out[p] -= _heap(price, own, heap)
    return out


def _kind(g, made, prod) -> str:
    """The combiner a partial sum's reduction goes to: a reduce-scatter's where it is reduced
    to a split spec, but on the CPU compiler, which emits every reduce-scatter as an all-reduce
    (its users keep their slice: :func:`shardplan.compiler.hlo.collectives`)."""
    return "all-reduce" if made == prod or g.compiler == "cpu" else "reduce-scatter"
