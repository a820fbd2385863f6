"""What XLA's partitioner gets wrong, kept out of plans: the rules and their cost."""

from __future__ import annotations

from shardplan.compiler.cost import Spec

# XLA's Shardy partitioner (jax 0.10.2, every backend) computes a wrong result for a batched
# dot whose batch dimension is already split (say experts over `data`), whose contraction is
# split over two or more mesh axes (tokens over ('fsdp', 'model')), when the result's batch
# dimension is to take some but not all of those axes (experts over ('data', 'fsdp')): it slices
# the local batch as if it were whole, and the shards the other `data` rank holds are lost. Seen
# as a wrong expert-weight gradient in a top-k MoE step; the cases are in tests/compiler/test_xla_bugs.py.
# Such a reduction is priced out of every plan (an hour a step); the partitioner's own choice for
# the same operands, or the whole contraction's axes, or none of them, compute correctly.
MISCOMPILED_S = 3600.0


def miscompiled_reduction(dot, produced: Spec, groups, dst: Spec) -> bool:
    """Whether reducing this dot's partial sums (``groups``: the axes of each split contraction)
    from ``produced`` to ``dst`` is the reduction XLA miscompiles (see ``MISCOMPILED_S``)."""
    for o in batch_dims_out(dot):
        if not produced[o]:
            continue
        have = set(dst[o]) if o < len(dst) else set()
        for group in groups or ():
            if len(group) > 1 and 0 < len(have & set(group)) < len(group):
                return True
    return False


def batch_dims_out(dot) -> list[int]:
    """The result dims of a dot's batch dimensions (in both operands and the result)."""
    return [o for l, r, o in dot.dims if l is not None and r is not None and o is not None]
