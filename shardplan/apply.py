"""Apply a plan: re-emit the step's jaxpr with ``with_sharding_constraint`` where the plan says.

The jaxpr is evaluated primitive by primitive (as ``jax.core.eval_jaxpr`` does in jax 0.10); every result
the plan gives a spec is constrained to it, and the operands and result of each ``dot_general``
are constrained to the specs of the dot's chosen strategy (the result first to the spec the
strategy computes, then to the tensor's own), so XLA's partitioner runs the strategy the plan
priced instead of resharding an operand to suit the result. Bodies of ``scan``, ``while``, ``cond`` and ``remat`` are rebuilt
with their constraints inside; other calls are inlined, bar the pipeline's stage shift
(:data:`~shardplan.walk.SHIFT_CALL`), bound whole with its result constrained.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.extend import core as jcore
from jax.sharding import NamedSharding

from shardplan.cost import Spec, reshard_steps, to_partition_spec
from shardplan.graph import Graph
from shardplan.rewrites import emit
from shardplan.walk import CALL_PRIMITIVES, body_prefix, eqn_path, is_shift, sub_jaxpr

_REBUILT_CALLS = {"remat2", "checkpoint", "remat"}


class _Emitter:
    def __init__(self, graph: Graph, specs: dict[str, Spec], dot_operands: dict[str, tuple[Spec, ...]],
                 mesh: jax.sharding.Mesh, operand_pins: dict[tuple[str, str], Spec] | None = None,
                 result_pins: dict[str, Spec] | None = None, rewrites: dict[str, dict] | None = None):
        self.g = graph
        self.rewrites = rewrites or {}
        self.specs = specs
        self.dot_operands = dot_operands
        self.mesh = mesh
        self.operand_pins = operand_pins or {}
        self.result_pins = result_pins or {}

    def constrain(self, x, spec: Spec | None, have: Spec | None = None):
        """``x`` constrained to ``spec``; where it is known to be ``have``, through the steps of
        :func:`~shardplan.cost.reshard_steps` (the ones the cost model priced), so that XLA never
        gets a reshard it can only do by replicating first."""
        if spec is None or not getattr(x, "ndim", 0) or len(spec) != x.ndim:
            return x
        steps = reshard_steps(have, spec, self.mesh.axis_names) if have is not None and len(have) == x.ndim else []
        for step in steps[:-1]:
            x = jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, to_partition_spec(step)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, to_partition_spec(spec)))

    def spec_of_input(self, here: str, k: int) -> Spec | None:
        """The planned spec of operand ``k`` of the equation at ``here`` (``None``: not a planned tensor)."""
        tid = self.g.eqn_inputs.get((here, k))
        return None if tid is None else self.specs.get(self.g.tensors[tid].path)

    def rebuild(self, closed, prefix: str) -> jcore.ClosedJaxpr:
        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=getattr(v.aval, "weak_type", False))
                 for v in closed.jaxpr.invars]
        return jax.make_jaxpr(lambda *a: self.eval(closed.jaxpr, closed.consts, a, prefix))(*avals)

    def eval(self, jaxpr, consts, args, prefix: str = "") -> list:
        """Evaluate ``jaxpr`` (at ``prefix``, as :func:`~shardplan.graph.eqn_path` names it) under
        the plan's constraints."""
        env = {}

        def read(v):
            return v.val if isinstance(v, jcore.Literal) else env[v]

        for v, c in zip(jaxpr.constvars, consts):
            env[v] = c
        for k, (v, a) in enumerate(zip(jaxpr.invars, args)):
            # A scan body's inputs (its slice of each scanned operand, its carry and consts) held
            # at their planned specs: left free, XLA may reshard a scanned stack whole, inside the
            # loop, to suit the first reader of its slice (a layer's weight gathered for its
            # matmul: the whole stack gathered once a layer). Other bodies' inputs are the
            # outer tensors, planned there (no spec at this path).
            env[v] = self.constrain(a, self.specs.get(f"{prefix}in:{k}")) if prefix else a
        for position, eqn in enumerate(jaxpr.eqns):
            ins = [read(v) for v in eqn.invars]
            prim, params = eqn.primitive, dict(eqn.params)
            name = prim.name
            here = eqn_path(prefix, position, eqn)
            if f"{here}:0" in self.rewrites:      # another computation of this op (shardplan.rewrites)
                params = self.rewrites[f"{here}:0"]
                self._store(env, eqn, here, emit(params["kind"], eqn, ins, self.mesh, params))
                continue
            computed = None
            if name in ("dot_general", "conv_general_dilated"):
                if f"{here}:0" in self.dot_operands:
                    lhs, rhs, *computed = self.dot_operands[f"{here}:0"]
                    ins = [self.constrain(ins[0], lhs, self.spec_of_input(here, 0)),
                           self.constrain(ins[1], rhs, self.spec_of_input(here, 1))] + ins[2:]
            elif self.operand_pins:
                ins = self._pin_operands(eqn, here, ins)
            inner = body_prefix(here, eqn)
            if name == "scan":
                params["jaxpr"] = self.rebuild(params["jaxpr"], inner)
            elif name == "while":
                params["body_jaxpr"] = self.rebuild(params["body_jaxpr"], inner)
            elif name == "cond":
                params["branches"] = tuple(self.rebuild(b, body_prefix(here, eqn, k))
                                           for k, b in enumerate(params["branches"]))
            elif name in _REBUILT_CALLS:
                closed = jcore.ClosedJaxpr(params["jaxpr"], [])
                new = self.rebuild(closed, inner)
                if new.consts:
                    # Inlined as rebuilt (its constraints already inside): evaluated plainly, not
                    # through the plan again, whose paths would read it as top-level equations.
                    for v, x in zip(eqn.outvars, jax.core.eval_jaxpr(new.jaxpr, new.consts, *ins)):
                        env[v] = x
                    continue
                params["jaxpr"] = new.jaxpr
            elif name in CALL_PRIMITIVES and not is_shift(eqn):
                # Inlined: its results are its body's, constrained there.
                body, body_consts = sub_jaxpr(eqn)
                for v, x in zip(eqn.outvars, self.eval(body, body_consts, ins, inner)):
                    env[v] = x
                continue
            with eqn.ctx.manager:
                outs = prim.bind(*ins, **prim.get_bind_params(params))
            made = {}
            if computed:
                outs = self.constrain(outs, computed[0])
                made[0] = computed[0]
            self._store(env, eqn, here, outs if prim.multiple_results else [outs], made)
        return [read(v) for v in jaxpr.outvars]

    def _pin_operands(self, eqn, here: str, ins: list) -> list:
        """Reshard operands where the plan priced it: before the op, not after (XLA would otherwise
        often broadcast or reshape a small operand first and reshard the larger result)."""
        pinned = list(ins)
        for k in range(len(ins)):
            src = self.g.eqn_inputs.get((here, k))
            if src is None:
                continue
            src = self.g.tensors[src].path
            for j in range(len(eqn.outvars)):
                spec = self.operand_pins.get((src, f"{here}:{j}"))
                if spec is not None:
                    pinned[k] = self.constrain(ins[k], spec, self.specs.get(src))
                    break
        return pinned

    def _store(self, env, eqn, here: str, outs, made: dict[int, Spec] | None = None) -> None:
        """The results, constrained to their planned specs (from ``made[j]``, the spec result
        ``j`` is known to have, where given)."""
        made = dict(made or {})
        for j, (v, x) in enumerate(zip(eqn.outvars, outs)):
            path = f"{here}:{j}"
            if path in self.result_pins:
                x = self.constrain(x, self.result_pins[path])      # as the op makes it, then resharded
                made[j] = self.result_pins[path]
            env[v] = self.constrain(x, self.specs.get(path), made.get(j))


def constrained_function(closed_jaxpr, graph: Graph, specs: dict[str, Spec],
                         dot_operands: dict[str, tuple[Spec, ...]], mesh: jax.sharding.Mesh,
                         operand_pins: dict[tuple[str, str], Spec] | None = None,
                         result_pins: dict[str, Spec] | None = None,
                         rewrites: dict[str, dict] | None = None) -> Callable:
    """A function of the flat inputs that computes the jaxpr under the plan's constraints (and
    the plan's rewrites in place of the equations they replace)."""
    emitter = _Emitter(graph, specs, dot_operands, mesh, operand_pins, result_pins, rewrites)

    def run(*flat_args):
        return emitter.eval(closed_jaxpr.jaxpr, closed_jaxpr.consts, flat_args)
    return run
