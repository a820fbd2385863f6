"""Which partial-sum reductions XLA's collective combiners merge into one collective.

A reduction that nothing else in its loop trip waits on (a per-layer gradient flowing only into
a scan's stacked gradient, or a top-level gradient flowing only into the optimizer update) is
combined with its like by XLA's all-reduce and reduce-scatter combiners: each then pays only its
share of one collective's latency (:meth:`shardplan.compiler.cost.CostModel.reduce_table`'s ``share``).
"""

from __future__ import annotations

from shardplan.compiler.liveness import ACCUMULATE, FUSIBLE, feeds_stacked_output
from shardplan.ir.graph import Graph

__all__ = ["ACCUMULATE", "combined_reductions", "feeds_stacked_output", "feeds_update"]

def feeds_update(g: Graph, tid: int) -> bool:
    """Whether ``tid``, made at the top level, only flows through elementwise work into outputs.

    Such a tensor is a gradient on its way into the optimizer update. No gradient reduction
    reads another's result, so XLA's collective combiners merge them: like the per-layer
    reductions of a scan (:func:`feeds_stacked_output`), they share one collective's latency.
    """
    if g.loop_of[tid]:
        return False
    outputs = {t for t in g.outputs if t is not None}
    stack, seen, reached = [tid], {tid}, False
    while stack:
        t = stack.pop()
        reached |= t in outputs
        for prim, outs in g.readers.get(t, []):
            if prim not in FUSIBLE and prim not in ACCUMULATE:      # (calls are walked inline: not readers)
                return False
            for o in outs:
                if o not in seen:
                    seen.add(o)
                    stack.append(o)
    return reached


def combined_reductions(g: Graph) -> dict[int, int]:
    """Partial sums XLA reduces in one combined collective per loop trip -> how many share it.

    In a scan over layers every per-layer gradient that only flows into the stacked gradient
    (:func:`feeds_stacked_output`) is independent of the others, and XLA's all-reduce
    and reduce-scatter combiners merge their reductions into one tuple-shaped collective per
    trip; at the top level so are the gradients that only flow into the optimizer update
    (:func:`feeds_update`). Each then pays 1/k of one collective's latency, k being how
    many share the trip (the top level is loop 0).
    """
    made = [d.out for d in g.dots] + [e.dst for e in g.edges if e.produced is not None]
    members = [t for t in dict.fromkeys(made) if feeds_stacked_output(g, t) or feeds_update(g, t)]
    per_loop: dict[int, int] = {}
    for t in members:
        per_loop[g.loop_of[t]] = per_loop.get(g.loop_of[t], 0) + 1
    return {t: per_loop[g.loop_of[t]] for t in members}
