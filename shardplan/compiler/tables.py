"""The pair tables of the ILP: for an edge between two groups, or between a dot and the tensor
it reads or makes, the seconds per step of each pair of their options' specs. Priced once per
distinct pair of specs (a table's rows and columns repeat a few specs many times), by the
vectorised reshard and reduce tables of :class:`shardplan.compiler.cost.CostModel`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from shardplan.compiler.cost import REDUCE_OP
from shardplan.compiler.xla_bugs import MISCOMPILED_S, batch_dims_out, miscompiled_reduction


def _distinct(values: list) -> tuple[list, np.ndarray]:
    """The distinct values in first-seen order, and each value's index among them."""
    seen: dict = {}
    index = np.array([seen.setdefault(v, len(seen)) for v in values], dtype=np.intp)
    return list(seen), index


def _cheaper_in_place(moved: np.ndarray, made: list[list], price: Callable) -> None:
    """``moved[i, j]`` (the operand resharded) replaced by the price of running the op in
    place, ``made[i][j]`` (a spec, or a reduction row; ``None`` where it cannot), where that
    is cheaper. ``price(distinct made)`` gives ``[distinct made, columns]`` seconds."""
    rows, index = _distinct([m for row in made for m in row if m is not None])
    if not rows:
        return
    after = price(rows)
    flat = iter(index)
    for i, row in enumerate(made):
        for j, m in enumerate(row):
            if m is not None:
                k = next(flat)
                if moved[i, j] > 0:
                    moved[i, j] = min(moved[i, j], after[k, j])


def edge_table(pricer, e, spec_of: dict) -> np.ndarray:
    """Seconds per step of edge ``e`` for each pair of its two tensors' specs (``spec_of``:
    per tensor, its node's options' specs)."""
    g, m = pricer.g, pricer.m
    if e.required is not None and e.passthrough is None and e.rewrite is None:
        # The operand is resharded to what the op requires: the price depends only on
        # the operand's shape and the two specs, shared by every edge that moves alike.
        src = g.tensors[e.src]
        haves, h_index = _distinct(spec_of[e.src])
        needs, n_index = _distinct([e.need(d, m.sizes) for d in spec_of[e.dst]])
        cells = m.reshard_table(src.shape, pricer.src_itemsize(e), haves, needs)
        table = e.mult * cells[np.ix_(h_index, n_index)]
    elif e.required is not None:
        # The operand moves, or the op runs on it in place and its result moves:
        # whichever is cheaper, per pair of specs.
        src, out = g.tensors[e.src], g.tensors[e.dst]
        haves, h_index = _distinct(spec_of[e.src])
        dsts, d_index = _distinct(spec_of[e.dst])
        needs, n_index = _distinct([e.need(d, m.sizes) for d in dsts])
        moved = m.reshard_table(src.shape, pricer.src_itemsize(e), haves, needs)[:, n_index]
        made = [[e.passthrough(have, d) for d in dsts] for have in haves]
        _cheaper_in_place(moved, made, lambda outs: m.reshard_table(
            out.shape, pricer.dst_itemsize(e), outs, dsts))
        if e.rewrite is not None:
            rewritten = [[(r[1], r[2], None) if (r := e.rewrite(have, d)) else None for d in dsts]
                         for have in haves]
            _cheaper_in_place(moved, rewritten, lambda rows: m.reduce_table(
                out.shape, pricer.dst_itemsize(e), rows, dsts))
        table = e.mult * moved[np.ix_(h_index, d_index)]
    elif not e.primitive.startswith("scatter"):
        # A result made as ``produced`` (partial over some axes) and reduced to the spec
        # its group gives it.
        haves, h_index = _distinct(spec_of[e.src])
        dsts, d_index = _distinct(spec_of[e.dst])
        made, m_index = _distinct([(p, tuple(part), REDUCE_OP) for p, part in map(e.produced, haves)])
        dst = g.tensors[e.dst]
        cells = m.reduce_table(dst.shape, pricer.dst_itemsize(e), made, dsts,
                               g.combined.get(e.dst, 1))[m_index]
        table = e.mult * cells[np.ix_(h_index, d_index)]
    else:       # a scatter's partial sums (rare): priced cell by cell
        haves, h_index = _distinct(spec_of[e.src])
        dsts, d_index = _distinct(spec_of[e.dst])
        cells = np.array([[pricer.edge_seconds(e, have, d) for d in dsts] for have in haves])
        table = cells.reshape(len(haves), len(dsts))[np.ix_(h_index, d_index)]
    return table


def dot_table(pricer, dot, role: str, tid: int, spec_of: dict, derived, groups) -> np.ndarray:
    """Seconds per step between a dot's options and the specs of its operand or result ``tid``
    (``role``: lhs, rhs or out; ``derived``, ``groups``: each option's specs and partial-sum groups)."""
    g, m = pricer.g, pricer.m
    # The price depends on the dot option only through what it needs of this tensor
    # (or, for the result, what it makes): priced once per distinct pair.
    wants, w_index = _distinct([(d[0],) if role == "lhs" else (d[1],) if role == "rhs"
                                else (d[2], d[3], groups[i]) for i, d in enumerate(derived)])
    haves, h_index = _distinct(spec_of[tid])
    t = g.tensors[tid]
    shape, itemsize = t.shape, pricer.wire(t) if role == "out" else pricer.moved_itemsize(dot, t)
    if role == "out":
        cells = m.reduce_table(shape, itemsize, wants, haves, g.combined.get(tid, 1))
        for i, (prod, _, grp) in enumerate(wants):       # skipped fast: most dots have no batch
            if any(prod[o] for o in batch_dims_out(dot)) and any(len(axes) > 1 for axes in grp or ()):
                for j, have in enumerate(haves):
                    if miscompiled_reduction(dot, prod, grp, have):
                        cells[i, j] += MISCOMPILED_S
    else:
        cells = m.reshard_table(shape, itemsize, haves, [w[0] for w in wants]).T
        stacked = g.stacked_input(tid) if m.gpu is not None else None
        if stacked is not None:
            cells = cells + _relayout_seconds(pricer, stacked, shape, haves, [w[0] for w in wants]) / dot.mult
    return dot.mult * cells[np.ix_(w_index, h_index)]


def _relayout_seconds(pricer, stacked: int, shape, haves: list, wants: list) -> np.ndarray:
    """``[wants, haves]`` seconds a GPU spends laying a stacked loop input out again once a step,
    where the loop gathers its slice along a dimension that is not the slice's major one: XLA's
    GPU all-gather needs the gathered dimension major, and its layout assignment gives that
    layout to the whole stacked input before the loop, a copy of it (llama3-8b on h100-8 (2, 4):
    bf16[7168,32,4096] copies of two FFN weights, 1.75 GiB each, through the step; RESULTS.md,
    session 30). Its memory is not modelled; this price (the copy's HBM read and write) makes
    the planner prefer the spec that gathers along the major dimension where both cost the same."""
    m = pricer.m
    t = pricer.g.tensors[stacked]
    major = next((d for d, n in enumerate(shape) if n > 1), 0)
    out = np.zeros((len(wants), len(haves)))
    for j, have in enumerate(haves):
        gathered = [i for i, want in enumerate(wants)
                    if any(set(have[d]) - set(want[d]) for d in range(major + 1, len(shape)))]
        if gathered:
            out[gathered, j] = 2 * m.per_device_bytes(t.shape, t.dtype.itemsize, ((),) + tuple(have)) \
                / m.mesh.device.hbm_bandwidth
    return out
