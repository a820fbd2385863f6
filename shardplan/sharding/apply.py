"""Apply a plan: re-emit the step's jaxpr with ``with_sharding_constraint`` where the plan says.

The jaxpr is evaluated primitive by primitive (as ``jax.core.eval_jaxpr`` does in jax 0.10); every result
the plan gives a spec is constrained to it, and the operands and result of each ``dot_general``
are constrained to the specs of the dot's chosen strategy (the result first to the spec the
strategy computes, then to the tensor's own), so XLA's partitioner runs the strategy the plan
priced instead of resharding an operand to suit the result. Bodies of ``scan``, ``while``, ``cond``
and ``remat`` are rebuilt with their constraints inside; other calls are inlined, bar the pipeline's
stage shift (:data:`~shardplan.tracing.walk.SHIFT_CALL`), bound whole with its result constrained.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import NamedSharding

from shardplan.compiler.cost import Spec, reshard_steps, to_partition_spec
from shardplan.ir.graph import Graph
from shardplan.tracing.rewrites import emit
from shardplan.tracing.walk import CALL_PRIMITIVES, body_prefix, eqn_path, is_shift, sub_jaxpr

_REBUILT_CALLS = {"remat2", "checkpoint", "remat"}
_LOOPS = frozenset(("scan", "while"))
# A reduction's result at most this fraction of the tensor it reads (a loss's label gather, a
# metric's argmax): pinned before the next loop (:func:`pinned_before_loops`).
_REDUCES = 8


def _has_loop(eqn) -> bool:
    if eqn.primitive.name in _LOOPS:
        return True
    if eqn.primitive.name == "cond":
        return any(_has_loop(e) for b in eqn.params["branches"] for e in b.jaxpr.eqns)
    if eqn.primitive.name in CALL_PRIMITIVES and not is_shift(eqn):
        return any(_has_loop(e) for e in sub_jaxpr(eqn)[0].eqns)
    return False


def _reads(eqn) -> list[list]:
    """For each result of ``eqn``, the operands it depends on (through a call's body: ``_take``'s
    result and the indices it keeps for its transpose depend on different operands)."""
    ins = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
    if eqn.primitive.name not in CALL_PRIMITIVES or is_shift(eqn):
        return [ins] * len(eqn.outvars)
    body, _ = sub_jaxpr(eqn)
    deps = {v: {k} for k, v in enumerate(body.invars)}
    for e in body.eqns:
        for v, got in zip(e.outvars, _reads(e)):
            deps[v] = set().union(*(deps.get(x, set()) for x in got))
    return [[eqn.invars[k] for k in sorted(deps.get(v, set())) if not isinstance(eqn.invars[k], jcore.Literal)]
            for v in body.outvars]


def _nbytes(vs) -> int:
    return sum(int(np.prod(v.aval.shape)) * np.dtype(v.aval.dtype).itemsize
               for v in vs if hasattr(v.aval, "shape") and not isinstance(v, jcore.Literal))


def pinned_before_loops(jaxpr, state: frozenset[int]) -> tuple[dict[int, list], set]:
    """The results in ``jaxpr`` to tie to the input of the loop that follows them: results of a
    reduction (at most 1/8 the size of a tensor the op reads) that feed no loop and no state
    output (``state``: the positions of the outputs the step returns its state in), such as the
    loss and metrics.

    Nothing the loop computes waits for such a result, so a compiler is free to compute it after
    the loop, and libtpu's scheduler does: gpt3-1.3b on 256 v5e chips gathers the loss's label
    logits after the backward loop, which keeps the float32 logits (393 MiB a chip) live through
    it (RESULTS.md, session 31). The emitter passes the results through one
    ``optimization_barrier`` with the loop's smallest input, so they are computed where the
    step's jaxpr has them and where the memory model counts them. A weight's gradient is no such
    result (it reaches the state): tying it would keep its reduction apart from the others'.

    Returns the ties, keyed by the loop's position (the variables tied to it), and the variables
    that reach a state output."""
    eqns = jaxpr.eqns
    outs = [v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)]
    stateful = {v for k, v in enumerate(jaxpr.outvars) if k in state and not isinstance(v, jcore.Literal)}
    returned = set(outs)      # what reaches an output: a result nothing reads is dead code, left so
    loops = [i for i, e in enumerate(eqns) if _has_loop(e)]
    reads = [_reads(e) for e in eqns]
    needed: set = set()
    for i in range(len(eqns) - 1, -1, -1):
        e = eqns[i]
        if i in loops:
            needed.update(v for v in e.invars if not isinstance(v, jcore.Literal))
            continue
        for v, ins in zip(e.outvars, reads[i]):
            for reach in (needed, stateful, returned):
                if v in reach:
                    reach.update(ins)
    pins: dict[int, list] = {}
    for i, e in enumerate(eqns):
        after = [j for j in loops if j > i]
        if not after or i in loops:
            continue
        for v, ins in zip(e.outvars, reads[i]):
            read = max((_nbytes([x]) for x in ins), default=0)
            if v in returned and v not in needed and v not in stateful \
                    and read >= _REDUCES * max(_nbytes([v]), 1):
                pins.setdefault(after[0], []).append(v)
    return pins, stateful


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
        self._var_specs: dict = {}      # the planned spec of each result stored (for _tie)

    def constrain(self, x, spec: Spec | None, have: Spec | None = None):
        """``x`` constrained to ``spec``; where it is known to be ``have``, through the steps of
        :func:`~shardplan.compiler.cost.reshard_steps` (the ones the cost model priced), so that XLA never
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

    def eval(self, jaxpr, consts, args, prefix: str = "", state: frozenset[int] | None = None,
             arg_specs: list | None = None) -> list:
        """Evaluate ``jaxpr`` (at ``prefix``, as :func:`~shardplan.ir.graph.eqn_path` names it) under
        the plan's constraints; with :func:`pinned_before_loops`' barriers where ``state`` is
        given (the step's level and the calls inlined there, not a loop's body). ``arg_specs``:
        the planned specs of an inlined call's operands."""
        env = {}
        pins, stateful = pinned_before_loops(jaxpr, state) if state is not None else ({}, set())

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
            self._var_specs[v] = self.specs.get(f"{prefix}in:{k}") or (arg_specs[k] if arg_specs else None)
        for position, eqn in enumerate(jaxpr.eqns):
            if position in pins:
                self._tie(env, pins[position], eqn)
            ins = [read(v) for v in eqn.invars]
            prim, params = eqn.primitive, dict(eqn.params)
            name = prim.name
            here = eqn_path(prefix, position, eqn)
            if f"{here}:0" in self.rewrites:      # another computation of this op (shardplan.tracing.rewrites)
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
                inner_state = None if state is None else \
                    frozenset(k for k, v in enumerate(eqn.outvars) if v in stateful)
                specs = [self._var_specs.get(x) if isinstance(x, jcore.Var) else None for x in eqn.invars]
                for v, bv, x in zip(eqn.outvars, body.outvars, self.eval(body, body_consts, ins, inner,
                                                                         state=inner_state, arg_specs=specs)):
                    env[v] = x
                    self._var_specs[v] = self._var_specs.get(bv)
                continue
            with eqn.ctx.manager:
                outs = prim.bind(*ins, **prim.get_bind_params(params))
            made = {}
            if computed:
                outs = self.constrain(outs, computed[0])
                made[0] = computed[0]
            self._store(env, eqn, here, outs if prim.multiple_results else [outs], made)
        return [read(v) for v in jaxpr.outvars]

    def _tie(self, env, made: list, loop) -> None:
        """Pass ``made`` with the smallest operand of ``loop`` whose spec the plan gives through
        one ``optimization_barrier``: the loop then waits for them. Each value leaves the barrier
        constrained to the spec it entered with, where known (else XLA's propagation may pick
        another for the barrier's tuple, and reshard the loop's operand around it)."""
        operands = [v for v in loop.invars if isinstance(v, jcore.Var) and v in env and self._var_specs.get(v)]
        made = [v for v in dict.fromkeys(made) if v in env]
        if not operands or not made:
            return
        anchor = min(operands, key=lambda v: _nbytes([v]))
        tied = made + [anchor]
        for v, x in zip(tied, jax.lax.optimization_barrier([env[v] for v in tied])):
            spec = self._var_specs.get(v)
            env[v] = self.constrain(x, spec, spec)

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
            self._var_specs[v] = self.specs.get(path)


def constrained_function(closed_jaxpr, graph: Graph, specs: dict[str, Spec],
                         dot_operands: dict[str, tuple[Spec, ...]], mesh: jax.sharding.Mesh,
                         operand_pins: dict[tuple[str, str], Spec] | None = None,
                         result_pins: dict[str, Spec] | None = None,
                         rewrites: dict[str, dict] | None = None, state: frozenset[int] | None = None) -> Callable:
    """A function of the flat inputs that computes the jaxpr under the plan's constraints (and
    the plan's rewrites in place of the equations they replace). ``state``: the positions of the
    flat outputs that return the step's state, where known (:func:`pinned_before_loops`)."""
    emitter = _Emitter(graph, specs, dot_operands, mesh, operand_pins, result_pins, rewrites)

    def run(*flat_args):
        return emitter.eval(closed_jaxpr.jaxpr, closed_jaxpr.consts, flat_args, state=state)
    return run
