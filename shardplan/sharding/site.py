"""What a sharding rule sees of one equation (:class:`Site`), and the registry of rules by primitive
name (:data:`RULES`, :func:`rule`); the rules themselves are in :mod:`shardplan.sharding.rules`
and :mod:`shardplan.sharding.indexing`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from shardplan.ir.graph import Graph, PairEdge

Spec = tuple[tuple[str, ...], ...]


def clear(spec: Spec, dims) -> Spec:
    """``spec`` with the dimensions ``dims`` unsharded."""
    return tuple(() if d in dims else axes for d, axes in enumerate(spec))


def rank(g: Graph, t) -> int:
    """Tensor ``t``'s rank (0 for a literal, ``None``)."""
    return g.tensors[t].rank if t is not None else 0


@dataclasses.dataclass
class Site:
    """One equation of the step as its rule sees it: the graph being built, the equation, its
    operand and result tensors (``None`` for a literal) and how many times a step runs it."""
    g: Graph
    eqn: object
    ins: list
    outs: list
    mult: float

    @property
    def prim(self) -> str:
        return self.eqn.primitive.name

    @property
    def params(self) -> dict:
        return self.eqn.params

    @property
    def out(self):
        return self.outs[0] if self.outs else None

    @property
    def operands(self) -> list:
        """The operands that are arrays of rank one or more."""
        return [t for t in self.ins if t is not None and rank(self.g, t) > 0]

    @property
    def shape_out(self) -> tuple:
        return self.g.tensors[self.out].shape if self.out is not None else ()

    def rank(self, t) -> int:
        return rank(self.g, t)

    def edge(self, src, dst, required=None, produced=None, passthrough=None, rewrite=None, sized=False):
        """A :class:`PairEdge` from ``src`` to ``dst``: ``required`` maps ``dst``'s spec to the one
        ``src`` must have; ``produced`` maps ``src``'s spec to ``dst``'s and the axes left partial."""
        if src is not None and dst is not None:
            self.g.add_edge(PairEdge(src, dst, self.prim, self.mult, required=required, produced=produced,
                                     passthrough=passthrough, rewrite=rewrite, sized=sized))

    def replicated(self, src, dst):
        """``src`` gathered whole (replicated) to make ``dst``."""
        self.edge(src, dst, required=lambda s, r=rank(self.g, src): ((),) * r)

    def whole_along(self, src, dst, dims):
        """``dst`` keeps ``src``'s sharding but for ``dims``, which are whole on every device."""
        self.edge(src, dst, required=lambda s, dims=frozenset(dims): clear(s, dims))


# The rules, by primitive name: each adds unions, dots or pair edges for one equation.
RULES: dict[str, Callable[[Site], None]] = {}


def rule(*primitives: str):
    """Register the decorated function as the rule of ``primitives``."""
    def register(fn):
        for name in primitives:
            assert name not in RULES, f"two rules for {name!r}"
            RULES[name] = fn
        return fn
    return register
