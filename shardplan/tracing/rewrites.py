"""Strategies that emit another computation than the traced one: the seam for parallelism that
sharding constraints alone cannot express (pipeline stages, ring attention, expert dispatch).

A rule offers such a strategy on an edge (:class:`~shardplan.ir.graph.PairEdge`'s ``rewrite``): for
a pair of specs, the kind, the spec the rewritten op makes its result in and the mesh axes the
result is partial over. The ILP prices it like any other alternative (the reduction of the
partial result); when the plan chooses it, :attr:`Plan.rewrites` records it under the
equation's result path, and :mod:`shardplan.sharding.apply` calls the kind's emitter here in place of the
equation: a ``shard_map`` body over the plan's mesh.

One kind so far: ``vocab-parallel-gather``, a row lookup from a table split by rows (an embedding
split over its vocabulary, as Megatron's VocabParallelEmbedding): each device looks up the ids
that fall in its rows, the others contribute zeros, and the results are summed over the mesh
axes that split the rows. It moves the looked-up activations once instead of gathering the
whole table, which XLA's gather partitioner does for a table split on the indexed dimension.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from shardplan.compiler.cost import Spec, to_partition_spec

VOCAB_PARALLEL_GATHER = "vocab-parallel-gather"


def vocab_parallel_applies(eqn) -> bool:
    """Whether a ``gather`` looks up whole rows of its operand by one index per row (what
    ``table[ids]`` and ``jnp.take(table, ids, axis=0)`` trace to)."""
    if eqn.primitive.name != "gather":
        return False
    dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
    operand, indices = eqn.invars[0].aval, eqn.invars[1].aval
    out_rank = len(eqn.outvars[0].aval.shape)
    return (tuple(dn.collapsed_slice_dims) == (0,) and tuple(dn.start_index_map) == (0,)
            and not getattr(dn, "operand_batching_dims", ()) and len(operand.shape) >= 2
            and indices.shape[-1:] == (1,) and tuple(sizes) == (1,) + tuple(operand.shape[1:])
            and tuple(dn.offset_dims) == tuple(range(out_rank - len(operand.shape) + 1, out_rank)))


def _vocab_parallel_gather(eqn, ins, mesh: jax.sharding.Mesh, params: dict) -> list:
    table, ids = ins
    operand: Spec = params["operand"]
    made: Spec = params["made"]
    rows = tuple(operand[0])
    batch_rank = len(made) - (len(operand) - 1)
    ids_spec = to_partition_spec(tuple(made[:batch_rank]) + ((),))
    dn, mode = eqn.params["dimension_numbers"], eqn.params["mode"]
    fill = eqn.params.get("fill_value")
    vocab = table.shape[0]

    def body(t, i):
        n = t.shape[0]
        shard = 0
        for a in rows:                      # this device's block of rows, major axis first
            shard = shard * mesh.shape[a] + lax.axis_index(a)
        local = i - shard * n
        mine = (local >= 0) & (local < n)
        got = lax.gather(t, jnp.clip(local, 0, n - 1), dn, (1,) + t.shape[1:],
                         mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)
        got = jnp.where(mine[..., :1].reshape(mine.shape[:-1] + (1,) * (t.ndim - 1)), got, 0)
        return lax.psum(got, rows)

    if mode == lax.GatherScatterMode.CLIP:
        ids = jnp.clip(ids, 0, vocab - 1)
    run = jax.shard_map(body, mesh=mesh, in_specs=(to_partition_spec(operand), ids_spec),
                        out_specs=to_partition_spec(made))
    out = run(table, ids)
    if mode == lax.GatherScatterMode.FILL_OR_DROP:      # an id outside the table reads the fill value
        ok = ((ids >= 0) & (ids < vocab))[..., :1].reshape(ids.shape[:-1] + (1,) * (table.ndim - 1))
        out = jnp.where(ok, out, _fill_value(out.dtype) if fill is None else fill).astype(out.dtype)
    return [out]


def _fill_value(dtype):
    """``lax.gather``'s default fill: NaN for inexact types, the most negative value for signed
    integers, the largest for unsigned, ``True`` for booleans."""
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.nan
    if jnp.issubdtype(dtype, jnp.bool_):
        return True
    info = jnp.iinfo(dtype)
    return info.min if jnp.issubdtype(dtype, jnp.signedinteger) else info.max


EMITTERS: dict[str, Callable] = {VOCAB_PARALLEL_GATHER: _vocab_parallel_gather}


def emit(kind: str, eqn, ins: list, mesh: jax.sharding.Mesh, params: dict) -> list:
    """The results of ``eqn`` computed by the rewrite ``kind`` on the plan's mesh."""
    return EMITTERS[kind](eqn, ins, mesh, params)
