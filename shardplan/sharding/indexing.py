"""The sharding rules of indexing: ``gather`` (an embedding lookup among them, which a
vocabulary-parallel rewrite can compute in place) and the scatters (``x.at[i].set``, ``.add``),
registered in :data:`shardplan.sharding.site.RULES`."""

from __future__ import annotations

import dataclasses

from shardplan.sharding.site import Site, rank, rule
from shardplan.tracing.rewrites import VOCAB_PARALLEL_GATHER, vocab_parallel_applies


@rule("gather")
def gather_rule(site: Site) -> None:
    g, eqn, ins, out, edge = site.g, site.eqn, site.ins, site.out, site.edge
    dn = eqn.params["dimension_numbers"]
    slice_sizes = eqn.params["slice_sizes"]
    operand, indices = ins[0], ins[1]
    op_shape = g.tensors[operand].shape
    idx_rank = rank(g, indices)
    out_rank = rank(g, out)
    offset_dims = list(dn.offset_dims)
    batch_out = [d for d in range(out_rank) if d not in offset_dims]
    idx_batch = list(range(idx_rank - 1))      # the last indices dim is the index vector
    out_of_idx = dict(zip(idx_batch, batch_out))
    op_batching = list(getattr(dn, "operand_batching_dims", ()))
    idx_batching = list(getattr(dn, "start_indices_batching_dims", ()))
    window = [d for d in range(len(op_shape)) if d not in dn.collapsed_slice_dims and d not in op_batching]
    out_of_op = dict(zip(window, offset_dims))
    for od, idd in zip(op_batching, idx_batching):
        out_of_op[od] = out_of_idx[idd]

    def operand_required(s):
        return tuple(s[out_of_op[d]] if d in out_of_op and (d in op_batching or slice_sizes[d] == op_shape[d])
                     else () for d in range(len(op_shape)))

    def indices_required(s):
        return tuple(s[out_of_idx[d]] if d in out_of_idx else () for d in range(idx_rank))

    def operand_passthrough(src, dst):
        # XLA's gather partitioner keeps an operand sharded along whole window (or batching) dims
        # and gathers in place: those dims of the result come out sharded the same way, its
        # index dims follow the indices (priced on their own edge, in the result's spec).
        spec = [()] * out_rank
        for d, axes in enumerate(src):
            if not axes:
                continue
            if d not in out_of_op or not (d in op_batching or slice_sizes[d] == op_shape[d]):
                return None
            spec[out_of_op[d]] = axes
        used = {a for axes in spec for a in axes}
        for od in batch_out:
            if not spec[od]:
                spec[od] = tuple(a for a in dst[od] if a not in used)
                used.update(spec[od])
        return tuple(spec)
    rewrite = None
    if vocab_parallel_applies(eqn):
        def vocab_parallel(src, dst):
            # A row lookup from a table split by rows (an embedding split over its vocabulary):
            # each device looks up the ids in its rows, the partial results are summed.
            rows = src[0]
            if not rows or any(a in rows for axes in dst for a in axes):
                return None
            made = tuple(dst[d] if d in batch_out else () for d in range(out_rank))
            for d, axes in enumerate(src[1:], start=1):
                if any(a in axes for b in made for a in b):
                    return None
                made = made[:out_of_op[d]] + (axes,) + made[out_of_op[d] + 1:]
            return VOCAB_PARALLEL_GATHER, made, rows
        rewrite = vocab_parallel
    edge(operand, out, required=operand_required, passthrough=operand_passthrough, rewrite=rewrite)
    edge(indices, out, required=indices_required)


@dataclasses.dataclass
class _ScatterDims:
    """How a scatter's operand (and result), indices and updates dimensions correspond."""

    op_shape: tuple
    up_shape: tuple
    idx_rank: int
    scatter_up: list        # the updates' dims that index (one per index, not window dims)
    window_op: list         # the operand's window dims (neither inserted nor batching)
    op_batching: list
    up_of_op: dict          # operand dim -> the updates' dim over it (window and batching dims)
    up_of_idx: dict         # indices dim -> the updates' dim over it
    idx_of_op: dict         # operand batching dim -> the indices' batching dim

    @classmethod
    def of(cls, g, eqn, operand, indices, updates) -> _ScatterDims:
        dn = eqn.params["dimension_numbers"]
        up_rank, op_rank, idx_rank = rank(g, updates), rank(g, operand), rank(g, indices)
        window_up = list(dn.update_window_dims)
        scatter_up = [d for d in range(up_rank) if d not in window_up]
        op_batching = list(getattr(dn, "operand_batching_dims", ()))
        idx_batching = list(getattr(dn, "scatter_indices_batching_dims", ()))
        window_op = [d for d in range(op_rank) if d not in dn.inserted_window_dims and d not in op_batching]
        up_of_op = dict(zip(window_op, window_up))
        up_of_idx = dict(zip(range(idx_rank - 1), scatter_up))
        idx_of_op = dict(zip(op_batching, idx_batching))
        for od, idd in idx_of_op.items():
            up_of_op[od] = up_of_idx[idd]
        return cls(g.tensors[operand].shape, g.tensors[updates].shape, idx_rank, scatter_up, window_op,
                   op_batching, up_of_op, up_of_idx, idx_of_op)

    def whole(self, d: int) -> bool:
        """Whether the updates cover operand dim ``d`` whole (a dim each device can keep its shard of)."""
        return d in self.up_of_op and self.op_shape[d] == self.up_shape[self.up_of_op[d]]


@rule("scatter")
def scatter_rule(site: Site) -> None:
    """A scatter that overwrites (``x.at[i].set(u)``): each device writes its own shard of the
    result, from the updates split as the result is on the window dims the scatter keeps whole
    (and on the batching dims of a vmapped scatter, with the indices), whole on the others: a
    write cannot be split into partial results to sum, as a scatter-add's can."""
    g, eqn, ins, out, edge = site.g, site.eqn, site.ins, site.out, site.edge
    operand, indices, updates = ins[0], ins[1], ins[2]
    g.union(operand, out)
    m = _ScatterDims.of(g, eqn, operand, indices, updates)

    def updates_spec(dst):
        spec = [()] * len(m.up_shape)
        for d, u in m.up_of_op.items():
            if m.whole(d):
                spec[u] = dst[d]
        return tuple(spec)
    edge(updates, out, required=updates_spec)
    if indices is not None and m.idx_rank:
        edge(indices, out, required=lambda dst: tuple(
            next((dst[od] for od, idd in m.idx_of_op.items() if idd == d), ()) for d in range(m.idx_rank)))


@rule("scatter-add", "scatter_add")
def scatter_add_rule(site: Site) -> None:
    g, eqn, ins, out, edge = site.g, site.eqn, site.ins, site.out, site.edge
    operand, indices, updates = ins[0], ins[1], ins[2]
    g.union(operand, out)
    m = _ScatterDims.of(g, eqn, operand, indices, updates)
    op_rank, idx_rank, up_of_op, window_op = len(m.op_shape), m.idx_rank, m.up_of_op, m.window_op

    def produced(s):
        spec = tuple(s[up_of_op[d]] if m.whole(d) else () for d in range(op_rank))
        used = {a for axes in spec for a in axes}
        partial = tuple(a for d in m.scatter_up for a in s[d] if a not in used)
        return spec, partial

    passthrough_dims = {d for d in window_op if m.whole(d)}

    def operand_passthrough(s, dst):
        # XLA's "operand passthrough" scatter: where the result is split along whole window dims,
        # the updates are resharded to be split the same way on their window dims (keeping what
        # they split on their scatter dims on other axes: partial sums, reduced after the local
        # scatter), and each device scatters into its own shard of those dims. A result split on
        # other dims too (an embedding table's rows) is held whole along them while it is
        # scattered into, its partial sums all-reduced, then sliced. None where no whole window
        # dim is split: XLA scatters the updates as they are.
        through = {d for d, axes in enumerate(dst) if axes and d in passthrough_dims}
        if not through:
            return None
        taken = {a for d in through for a in dst[d]}
        need = [tuple(a for a in axes if a not in taken) for axes in s]
        for d, u in up_of_op.items():
            if d in window_op:
                need[u] = dst[d] if d in through else ()
        return tuple(need)
    edge(updates, out, produced=produced, passthrough=operand_passthrough)
    if indices is not None and idx_rank:
        edge(indices, updates, required=lambda s: tuple(s[m.up_of_idx[d]] if d in m.up_of_idx else ()
                                                        for d in range(idx_rank)))
