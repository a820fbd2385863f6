"""float32 matmuls on a TPU: what moves as bfloat16.

At DEFAULT precision a TPU multiplies float32 operands in one bfloat16 pass
(:attr:`shardplan.ir.graph.DotOp.bf16_pass`), and libtpu rounds them before it moves them: the
convert goes ahead of the collective, through reshapes and a layer scan's stacking. The planner
prices such reshards at 2 bytes an element on TPU meshes (:class:`shardplan.compiler.pricing.Pricer`).
"""

from __future__ import annotations

from shardplan.compiler.liveness import DOTS
from shardplan.ir.graph import DotOp, Graph

# Ops that only relabel or reorder elements: a bfloat16 rounding after them can move before them.
LAYOUT = frozenset({"reshape", "transpose", "squeeze", "expand_dims", "copy", "copy_p", "name"})


def read_as_bf16(g: Graph) -> frozenset[int]:
    """The float32 tensors that every reader multiplies in one bfloat16 pass (a dot at DEFAULT
    precision, :attr:`DotOp.bf16_pass`), directly or through :data:`LAYOUT` ops, a layer scan's
    stacking included (a residual whose backward readers are such dots): on a TPU, libtpu rounds
    such a tensor to bfloat16 before it moves or stacks it (the convert goes ahead of the
    collective), so a reshard of it moves 2 bytes an element. A tensor the step returns, or a
    loop carries, is not one."""
    dots: dict[int, list[DotOp]] = {}
    for d in g.dots:
        for t in (d.lhs, d.rhs):
            dots.setdefault(t, []).append(d)
    returned = {t for t in g.outputs if t is not None}
    memo: dict[int, bool] = {}

    def narrow(t: int) -> bool:
        if t in memo:
            return memo[t]
        memo[t] = False
        readers = g.readers.get(t, [])
        stacked = g.stacked_into.get(t)
        if g.tensors[t].dtype.name != "float32" or t in returned or (t in g.level_outputs and stacked is None) \
                or not (readers or stacked is not None) or not all(d.bf16_pass for d in dots.get(t, ())):
            return False
        for prim, outs in readers:
            if prim in DOTS:
                continue
            if prim in LAYOUT and outs and all(narrow(o) for o in outs):
                continue
            if prim == "scan" and all(b is not None and narrow(b) for b in g.scanned_into.get(t, [None])):
                continue
            return False
        memo[t] = stacked is None or narrow(stacked)
        return memo[t]

    return frozenset(t for t in range(len(g.tensors)) if narrow(t))
