"""Reductions XLA's partitioner computes wrongly, and the planner's rule that keeps them out of
every plan (``xla_bugs.miscompiled_reduction``): whatever XLA gets wrong here, the rule must
name, or a plan could ask for it and train on wrong numbers."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.compiler.xla_bugs import miscompiled_reduction
from shardplan.ir.graph import DotOp

AXES = ("data", "fsdp", "model")
# "etd,etf->edf": the expert-weight gradient of a one-hot-dispatched MoE layer.
DOT = DotOp(lhs=0, rhs=1, out=2, dims=((0, 0, 0), (1, 1, None), (2, None, 1), (None, 2, 2)), mult=1.0, source="")


def _cases():
    """(batch axes of the operands, contraction axes, the result's batch axes, its d axes)."""
    out = []
    for batch in ((), ("data",), ("model",)):
        rest = [a for a in AXES if a not in batch]
        for n in (1, 2):
            for contraction in itertools.permutations(rest, n):
                free = [a for a in AXES if a not in batch and a not in contraction]
                for k in range(len(contraction) + 1):
                    for moved in itertools.combinations(contraction, k):
                        out.append((batch, contraction, batch + moved, ()))
                        if k == 1 and len(contraction) == 2:   # the other axis onto a free dim
                            out.append((batch, contraction, batch + moved,
                                        tuple(a for a in contraction if a not in moved)))
                if free and batch:
                    out.append((batch, contraction, batch + tuple(free), ()))
    return out


def _spec(*dims):
    return P(*[d if len(d) != 1 else d[0] if d else None for d in dims])


@pytest.mark.slow
def test_every_reduction_xla_miscompiles_is_priced_out():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), AXES)
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(4, 16, 8)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(4, 16, 8)), jnp.float32)
    expected = np.einsum("etd,etf->edf", np.asarray(a), np.asarray(b))
    wrong, flagged = [], []
    for batch, contraction, out_batch, out_d in _cases():
        operand = NamedSharding(mesh, _spec(batch, contraction, ()))
        result = NamedSharding(mesh, _spec(out_batch, out_d, ()))

        def f(a, b):
            a = jax.lax.with_sharding_constraint(a, operand)
            b = jax.lax.with_sharding_constraint(b, operand)
            return jax.lax.with_sharding_constraint(jnp.einsum("etd,etf->edf", a, b), result)

        error = float(np.max(np.abs(np.asarray(jax.jit(f)(a, b)) - expected)) / np.max(np.abs(expected)))
        case = (batch, contraction, out_batch, out_d)
        if error > 1e-5:
            wrong.append(case)
        if miscompiled_reduction(DOT, (batch, (), ()), (contraction,), (out_batch, out_d, ())):
            flagged.append(case)
    missed = [c for c in wrong if c not in flagged]
    assert not missed, f"XLA computes these wrongly and the planner would plan them: {missed}"
    # On this jax the rule is XLA's bug exactly (16 of these 78 reductions); where a later XLA
    # computes them all correctly the rule only costs plans some strategies, and can go.
    if wrong:
        assert sorted(flagged) == sorted(wrong), sorted(set(flagged) - set(wrong))


def test_the_rule_reads_batch_dimensions_only():
    # A plain matmul (no batch dimension) reduce-scattered onto a dim split elsewhere is fine.
    matmul = DotOp(lhs=0, rhs=1, out=2, dims=((0, None, 0), (1, 0, None), (None, 1, 1)), mult=1.0, source="")
    assert not miscompiled_reduction(matmul, (("data",), ()), (("fsdp", "model"),), (("data", "fsdp"), ()))
    assert miscompiled_reduction(DOT, (("data",), (), ()), (("fsdp", "model"),), (("data", "fsdp"), (), ()))
    assert not miscompiled_reduction(DOT, (("data",), (), ()), (("fsdp", "model"),),
                                     (("data", "fsdp", "model"), (), ()))
    assert not miscompiled_reduction(DOT, ((), (), ()), (("fsdp", "model"),), (("data", "fsdp"), (), ()))
