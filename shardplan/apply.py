"""Apply a plan: re-emit the step's jaxpr with ``with_sharding_constraint`` where the plan says.

The jaxpr is evaluated primitive by primitive (as ``jax.core.eval_jaxpr`` does in jax 0.10); every result
the plan gives a spec is constrained to it, and the operands and result of each ``dot_general``
are constrained to the specs of the dot's chosen strategy (the result first to the spec the
strategy computes, then to the tensor's own), so XLA's partitioner runs the strategy the plan
priced instead of resharding an operand to suit the result. Bodies of ``scan``, ``while``, ``cond`` and ``remat`` are rebuilt
with their constraints inside; other calls are inlined.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.extend import core as jcore
from jax.sharding import NamedSharding

from shardplan.cost import Spec, to_partition_spec
from shardplan.graph import CALL_PRIMITIVES, Graph, sub_jaxpr

_REBUILT_CALLS = {"remat2", "checkpoint", "remat"}


class _Emitter:
    def __init__(self, graph: Graph, specs: dict[int, Spec], dot_operands: dict[int, tuple[Spec, ...]],
                 mesh: jax.sharding.Mesh, operand_pins: dict[tuple[int, int], Spec] | None = None,
                 result_pins: dict[int, Spec] | None = None):
        self.g = graph
        self.specs = specs
        self.dot_operands = dot_operands
        self.mesh = mesh
        self.operand_pins = operand_pins or {}
        self.result_pins = result_pins or {}

    def constrain(self, x, spec: Spec | None):
        if spec is None or not getattr(x, "ndim", 0) or len(spec) != x.ndim:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, to_partition_spec(spec)))

    def rebuild(self, closed) -> jcore.ClosedJaxpr:
        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=getattr(v.aval, "weak_type", False))
                 for v in closed.jaxpr.invars]
        return jax.make_jaxpr(lambda *a: self.eval(closed.jaxpr, closed.consts, a))(*avals)

    def eval(self, jaxpr, consts, args) -> list:
        env = {}

        def read(v):
            return v.val if isinstance(v, jcore.Literal) else env[v]

        for v, c in zip(jaxpr.constvars, consts):
            env[v] = c
        for v, a in zip(jaxpr.invars, args):
            env[v] = a
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            prim, params = eqn.primitive, dict(eqn.params)
            name = prim.name
            computed = None
            if name in ("dot_general", "conv_general_dilated"):
                out_tid = self.g.eqn_outputs.get((id(eqn), 0))
                if out_tid in self.dot_operands:
                    lhs, rhs, *computed = self.dot_operands[out_tid]
                    ins = [self.constrain(ins[0], lhs), self.constrain(ins[1], rhs)]
            elif self.operand_pins:
                ins = self._pin_operands(eqn, ins)
            if name == "scan":
                params["jaxpr"] = self.rebuild(params["jaxpr"])
            elif name == "while":
                params["body_jaxpr"] = self.rebuild(params["body_jaxpr"])
            elif name == "cond":
                params["branches"] = tuple(self.rebuild(b) for b in params["branches"])
            elif name in _REBUILT_CALLS:
                closed = jcore.ClosedJaxpr(params["jaxpr"], [])
                new = self.rebuild(closed)
                if new.consts:
                    outs = self.eval(new.jaxpr, new.consts, ins)
                    self._store(env, eqn, outs)
                    continue
                params["jaxpr"] = new.jaxpr
            elif name in CALL_PRIMITIVES:
                body, body_consts = sub_jaxpr(eqn)
                self._store(env, eqn, self.eval(body, body_consts, ins))
                continue
            with eqn.ctx.manager:
                outs = prim.bind(*ins, **prim.get_bind_params(params))
            if computed:
                outs = self.constrain(outs, computed[0])
            self._store(env, eqn, outs if prim.multiple_results else [outs])
        return [read(v) for v in jaxpr.outvars]

    def _pin_operands(self, eqn, ins: list) -> list:
        """Reshard operands where the plan priced it: before the op, not after (XLA would otherwise
        often broadcast or reshape a small operand first and reshard the larger result)."""
        outs = [self.g.eqn_outputs.get((id(eqn), j)) for j in range(len(eqn.outvars))]
        pinned = list(ins)
        for k in range(len(ins)):
            src = self.g.eqn_inputs.get((id(eqn), k))
            for dst in outs:
                spec = self.operand_pins.get((src, dst))
                if spec is not None:
                    pinned[k] = self.constrain(ins[k], spec)
                    break
        return pinned

    def _store(self, env, eqn, outs) -> None:
        for j, (v, x) in enumerate(zip(eqn.outvars, outs)):
            tid = self.g.eqn_outputs.get((id(eqn), j))
            if tid is not None and tid in self.result_pins:
                x = self.constrain(x, self.result_pins[tid])      # as the op makes it, then resharded
            env[v] = self.constrain(x, self.specs.get(tid)) if tid is not None else x


def constrained_function(closed_jaxpr, graph: Graph, specs: dict[int, Spec],
                         dot_operands: dict[int, tuple[Spec, ...]], mesh: jax.sharding.Mesh,
                         operand_pins: dict[tuple[int, int], Spec] | None = None,
                         result_pins: dict[int, Spec] | None = None) -> Callable:
    """A function of the flat inputs that computes the jaxpr under the plan's constraints."""
    emitter = _Emitter(graph, specs, dot_operands, mesh, operand_pins, result_pins)

    def run(*flat_args):
        return emitter.eval(closed_jaxpr.jaxpr, closed_jaxpr.consts, flat_args)
    return run
