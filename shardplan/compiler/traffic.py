"""HBM traffic: how many times each tensor of a step crosses a device's memory per use.

Two counts (:func:`hbm_traffic`): the one the ILP prices shardings with (every tensor on a
sharding edge written once and read once), and the one a chosen plan's step is predicted with,
as XLA runs it: fused results never stored, a stored one read once per kernel that reads it, and
a scan's stacked results filled and copied in (profiled on an H200: ``benchmarks/RESULTS.md``,
session 21). Both counts have the copies the GPU compiler makes of a scanned operand's slices
that a matmul reads (:func:`copied_slices`).
"""

from __future__ import annotations

import math

from shardplan.ir.graph import Graph


def hbm_traffic(graph: Graph, *, fused: bool = False) -> dict[int, int]:
    """How many times each tensor crosses HBM per use.

    A tensor that a dot, a non-elementwise op or the step's boundary reads or writes is
    materialised: written once and read once; intermediates inside a group of elementwise ops
    cost nothing. (Dots price their own operand traffic.)

    With ``fused``, as XLA runs the step (what a plan's predicted step is priced with): a result
    :func:`shardplan.compiler.liveness.fuse` computes inside its readers (:attr:`~shardplan.ir.graph.Graph.fused`)
    costs nothing whatever edge it sits on, a stored one is written once and read once per kernel
    that reads it, and a scan's stacked results cost what XLA does to build them (below).
    Without, every tensor on a sharding edge counts once each way: the form the ILP prices
    shardings with. Fused results have no cost of their own in the other form, so no option of
    theirs ever beats another, and the solver's dead-end elimination
    (:func:`shardplan.solve.simplify.eliminate_dead_ends`) could no longer shrink a layer's problem to
    what the exact solver takes; and the plans the ILP finds stay those the audits hold.

    A scan's stacked results, as XLA builds them (profiled on an H200, session 21):
    each stacked buffer is first filled with zeros, copied from a buffer of zeros (``copy`` of a
    ``broadcast``: its whole size read and written), and a layer's slice that a matmul produces is
    copied into it (read and written again), as is a slice the loop takes in (its carry, its
    scanned operand); an elementwise producer writes its slice in place.
    Without recomputation, XLA copied 23.1 GiB of zeros into gpt2-small's (batch 16) stacked
    buffers, and copy kernels took 15.5 ms of its 145 ms step (3.5 ms under ``dots``); llama3-8b
    (4 layers): 8.2 GiB, 60.8 ms of 291 (4.2 under ``dots``). That is much of why recomputing
    measured faster. Each slice's maker is the walk's (:attr:`~shardplan.ir.graph.Graph.made_by`):
    a slice with none is the loop's input.
    """
    traffic: dict[int, int] = {}
    for e in graph.edges:
        traffic[e.src] = traffic[e.dst] = 2
    for d in graph.dots:
        traffic.setdefault(d.out, 0)
    for t in graph.shifts:              # a roll reads its operand and writes its result
        traffic[t] = 2
    for t in graph.inputs:
        traffic[t] = max(traffic.get(t, 0), 1)
    for t in graph.outputs:
        if t is not None:
            traffic[t] = 2
    if fused:
        traffic = _as_fused(graph, traffic)
    for t in copied_slices(graph):      # read out of the stack and written: a relabelling reader adds nothing
        traffic[t] = max(traffic.get(t, 0), 2)
    return {t: n for t, n in traffic.items() if n}


def _as_fused(graph: Graph, traffic: dict[int, int]) -> dict[int, int]:
    """:func:`hbm_traffic`'s count as XLA fuses the step, from the ILP's."""
    reads: dict[int, int] = {}
    for t, n in traffic.items():
        if n == 2 and t not in graph.fused:
            traffic[t] = 1 + max(1, _kernel_reads(graph, t, reads))
    traffic = {t: n for t, n in traffic.items() if t not in graph.fused}
    dot_outs = {d.out for d in graph.dots}
    made = graph.made_by
    for body, stacked in graph.stacked_into.items():
        if graph.tensors[stacked].host:                 # offloaded: priced as host copies
            continue
        traffic[stacked] = traffic.get(stacked, 0) + 2  # the zero fill: a buffer of zeros copied in
        source = body
        while source in made and made[source][0] in _NO_OPS and made[source][1]:
            source = made[source][1][0]
        if source in dot_outs or source not in made:
            traffic[body] = traffic.get(body, 0) + 2    # a matmul's result or the loop's input: copied in
    return traffic


# Ops XLA compiles to nothing: jax.checkpoint passes the residuals it saves through a
# reduce_precision that keeps every bit (a barrier to CSE).
_NO_OPS = frozenset({"reduce_precision", "copy", "copy_p"})


_DOTS = ("dot_general", "conv_general_dilated")


def _kernel_reads(graph: Graph, t: int, memo: dict[int, int]) -> int:
    """How many kernels read ``t`` from HBM: each reader that stores its result, and through a
    reader fused away, each kernel that one is computed in (XLA recomputes a fused result in every
    reader). Dots are left out: they price their own operands."""
    if t in memo:
        return memo[t]
    memo[t] = 1                              # a cycle guard; loops carry tensors into themselves
    n = 0
    for prim, outs in graph.readers.get(t, []):
        if prim in _DOTS:
            continue
        if outs and all(o in graph.fused for o in outs):
            n += sum(_kernel_reads(graph, o, memo) for o in outs)
        else:
            n += 1
    memo[t] = n
    return n


# Readers the GPU compiler hands a buffer of their own: a matmul (cuBLAS and Triton GEMMs read
# their operands from memory), a loop or branch (its operands are its tuple's), an optimization
# barrier.
_MATERIALISING = frozenset(_DOTS) | {"scan", "while", "cond", "optimization_barrier"}
# Ops that only relabel a value (a shape, a layout, a dtype): XLA folds them into the copy (a
# bitcast, the copy's layout, a convert at its root), so a slice read through them is copied all
# the same. A broadcast counts only where it adds size-1 dimensions (``w[None]``).
_LAYOUT_OPS = frozenset({"reshape", "squeeze", "transpose", "convert_element_type", "broadcast_in_dim"}) | _NO_OPS


def copied_slices(graph: Graph) -> set[int]:
    """The scan body inputs that are a scanned operand's per-trip slice the GPU compiler copies
    out of its stack each trip: a ``dynamic_slice_fusion`` (on a device, an asynchronous
    ``fusion-start``/``fusion-done`` pair) that reads the slice and writes it once a trip. It does
    so where the slice reaches, through ops that only relabel it, a reader that needs a buffer of
    its own (a matmul, a nested loop, an optimization barrier), or an input of a differentiated
    ``jax.checkpoint`` with ``prevent_cse`` (which JAX lowers behind an optimization barrier):
    a layer's weights, or a stacked residual the backward loop reads. Both traffic counts price
    such a slice as read and written once a trip (a converted one at its stored width, a little
    over the convert's narrower write). The compiler copies some other slices too (one only
    reduce fusions read, at times); those are not priced. The TPU compiler fuses the slice into
    its reader; the CPU compiler's time is not priced. GPT-3 175B's pipeline, its weights held
    whole over ``model`` in the forward loop, copied 11,584 GiB of them a step this way
    (``benchmarks/RESULTS.md``, session 24)."""
    if graph.compiler != "gpu":
        return set()
    out = set()
    for bodies in graph.scanned_into.values():
        for bt in bodies:
            if bt is not None and _needs_buffer(graph, bt, set()):
                out.add(bt)
    return out


def _needs_buffer(graph: Graph, t: int, seen: set[int]) -> bool:
    seen.add(t)
    if t in graph.barriered:
        return True
    size = math.prod(graph.tensors[t].shape)
    for prim, outs in graph.readers.get(t, []):
        if prim in _MATERIALISING:
            return True
        if prim in _LAYOUT_OPS and any(o not in seen and math.prod(graph.tensors[o].shape) == size
                                       and _needs_buffer(graph, o, seen) for o in outs):
            return True
    return False
