"""Attention written out as einsum-softmax-einsum, recognised so that context parallelism can
reach it.

A model that writes ``softmax(mask(q @ k * scale)) @ v`` itself (two ``jnp.einsum`` calls or
matmuls and ``jax.nn.softmax`` or ``exp(s - max) / sum``; Flax's ``nnx.dot_product_attention``
and Linen's ``nn.dot_product_attention`` trace to the same) has no call the planner could route
the way it routes ``jax.nn.dot_product_attention``. While the planner traces a step with
:func:`shardplan.parallel.sequence.context_parallel`, the function given to ``jax.grad``,
``jax.value_and_grad`` or ``jax.vjp`` (``nnx.grad`` and ``nnx.value_and_grad`` call these) is
traced once more to a jaxpr (:func:`rewritten`), where each such attention is found
(:func:`find`) and replaced by :func:`shardplan.parallel.sequence.attention` on the same q, k and v, so the
differentiated function is the one with the context-parallel attention in it.

What is recognised: :mod:`shardplan.tracing.attention_pattern`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from shardplan.tracing.attention_pattern import Dataflow, Found, find
from shardplan.tracing.walk import scan_counts


def _bthd(x, labels: tuple[str, ...], order: str):
    """``x`` (dimensions ``labels``) transposed to ``order``'s labels, absent ones as size 1."""
    present = [lab for lab in order if lab in labels]
    x = jnp.transpose(x, [labels.index(lab) for lab in present])
    return jnp.expand_dims(x, [i for i, lab in enumerate(order) if lab not in labels])


def emit(found: Found, q, k, v, attention: Callable):
    """``found``'s second dot_general's result, computed by ``attention(q, k, v, causal, scale)``
    on ``[b, t, heads, d]`` operands."""
    q5 = _bthd(q, found.q_labels, "bthgd")
    b, t, h, g, d = q5.shape
    k4, v4 = _bthd(k, found.k_labels, "bthd"), _bthd(v, found.v_labels, "bthe")
    out = attention(q5.reshape(b, t, h * g, d), k4.astype(q.dtype), v4.astype(q.dtype),
                    causal=found.causal, scale=found.scale)
    out = out.reshape(b, t, h, g, v4.shape[-1])
    kept = [i for i, lab in enumerate("bthge") if lab in found.out_labels]
    out = out.reshape([out.shape[i] for i in kept])
    present = [lab for lab in "bthge" if lab in found.out_labels]
    return jnp.transpose(out, [present.index(lab) for lab in found.out_labels])


def _user_context(eqn, inherited):
    """Binding ``eqn`` again under its own source (or ``inherited``, the enclosing call's, where
    it has none, as the bodies of jax.numpy's jitted helpers): the planner's layer matching reads it."""
    try:
        from jax._src import source_info_util
        return source_info_util.user_context(eqn.source_info.traceback or inherited,
                                             name_stack=source_info_util.current_name_stack()
                                             + eqn.source_info.name_stack)
    except Exception:   # the source lines are for the planner's layer matching; never fatal
        return contextlib.nullcontext()


_INLINED = ("pjit", "jit", "closed_call", "core_call")


class _Interpreter:
    """Evaluates a jaxpr: calls (``jax.jit`` inside the step) inlined, scans and checkpoints
    rebuilt with their bodies evaluated the same way; with ``attention``, each :func:`find` hit's
    result computed by :func:`emit` (and what only fed it left out)."""

    def __init__(self, attention: Callable | None):
        self.attention = attention

    def eval(self, jaxpr, consts, args, constants: dict | None = None, inherited=None) -> list:
        env = {}

        def read(v):
            return v.val if isinstance(v, jcore.Literal) else env[v]
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = c
        for v, a in zip(jaxpr.invars, args):
            env[v] = a
        level, hits = None, {}
        if self.attention is not None:           # else only inlining: nothing to find
            level = Dataflow(jaxpr, {**(constants or {}), **_values(jaxpr.constvars, consts)})
            hits = {f.position: f for f in find(level)}
        needed = _needed(jaxpr, hits)
        for position, eqn in enumerate(jaxpr.eqns):
            if not needed[position]:
                continue
            if position in hits:
                f = hits[position]
                with _user_context(eqn, inherited):       # the new ops are the user's attention's
                    out = emit(f, read(f.q), read(f.k), read(f.v), self.attention)
                env[eqn.outvars[0]] = out.astype(eqn.outvars[0].aval.dtype)
                continue
            ins = [read(v) for v in eqn.invars]
            inner_known = [level.ref(v) for v in eqn.invars] \
                if level is not None and eqn.primitive.name in _NESTED else ()
            with _user_context(eqn, inherited):
                outs = self._bind(eqn, ins, inner_known, eqn.source_info.traceback or inherited)
            for v, x in zip(eqn.outvars, outs):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def _bind(self, eqn, ins, inner_known, traceback) -> list:
        name, params = eqn.primitive.name, eqn.params
        if name in _INLINED:
            body = params["jaxpr"]
            return self.eval(body.jaxpr, body.consts, ins, inherited=traceback)
        if name == "scan":
            return self._scan(params, ins, inner_known, traceback)
        if name in _CHECKPOINTS:
            body = params["jaxpr"]
            known = {v: f for v, f in zip(body.invars, inner_known) if f is not None}
            f = jax.checkpoint(lambda *a: self.eval(body, (), a, known, traceback), prevent_cse=params["prevent_cse"],
                               policy=params["policy"])
            return f(*ins)
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(params))
        return outs if eqn.primitive.multiple_results else [outs]

    def _scan(self, params, ins, inner_known, traceback) -> list:
        body, (nc, ncarry) = params["jaxpr"], scan_counts(params)
        consts, carry, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
        known = {v: f for v, f in zip(body.jaxpr.invars[:nc], inner_known[:nc]) if f is not None}

        def step(c, x):
            outs = self.eval(body.jaxpr, body.consts, [*consts, *c, *x], known, traceback)
            return outs[:ncarry], outs[ncarry:]
        carry, ys = lax.scan(step, list(carry), list(xs), length=params["length"], reverse=params["reverse"],
                             unroll=params["unroll"], _split_transpose=params.get("_split_transpose", False))
        return [*carry, *ys]


_CHECKPOINTS = ("checkpoint", "remat", "remat2")
_NESTED = ("scan",) + _CHECKPOINTS


def _values(constvars, consts) -> dict:
    return {v: ("value", c) for v, c in zip(constvars, consts) if not isinstance(c, jax.core.Tracer)}


def _needed(jaxpr, hits: dict) -> list[bool]:
    """Which equations still matter once each hit's result no longer needs its scores."""
    live = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    needed = [False] * len(jaxpr.eqns)
    for position in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[position]
        if not (eqn.effects or any(v in live for v in eqn.outvars)):
            continue
        needed[position] = True
        ins = (hits[position].q, hits[position].k, hits[position].v) if position in hits else eqn.invars
        live.update(v for v in ins if not isinstance(v, jcore.Literal))
    return needed


def _search(jaxpr, known: dict, record: Callable) -> int:
    """How many attentions :func:`find` meets in ``jaxpr`` and the scans and checkpoints in it,
    each told to ``record``; nothing is evaluated."""
    level = Dataflow(jaxpr, known)
    hits = find(level)
    for f in hits:
        record(f.shapes(), f.causal)
    count = len(hits)
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "scan":
            closed, (nc, _) = eqn.params["jaxpr"], scan_counts(eqn.params)
            inner = {v: level.ref(x) for v, x in zip(closed.jaxpr.invars[:nc], eqn.invars[:nc])}
            inner = {**{v: r for v, r in inner.items() if r is not None},
                     **_values(closed.jaxpr.constvars, closed.consts)}
            count += _search(closed.jaxpr, inner, record)
        elif name in _CHECKPOINTS:
            body = eqn.params["jaxpr"]
            inner = {v: level.ref(x) for v, x in zip(body.invars, eqn.invars)}
            count += _search(body, {v: r for v, r in inner.items() if r is not None}, record)
    return count


def rewritten(fun: Callable, attention: Callable | None, record: Callable | None = None) -> Callable:
    """``fun`` with each attention it writes out computed by ``attention(q, k, v, causal=,
    scale=)`` (``[b, t, heads, d]`` operands); ``record(shapes, causal)`` is told of each. With
    ``attention=None`` only recorded, and ``fun`` itself is what runs. A function this cannot
    search runs as written, with a warning that says why."""
    def run(*args, **kwargs):
        flat, tree = jax.tree.flatten((args, kwargs))

        def flat_fun(*leaves):
            a, kw = jax.tree.unflatten(tree, leaves)
            return fun(*a, **kw)
        try:
            closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*flat)
        except TypeError:          # arguments or results that are not arrays: nothing this can rewrite
            return fun(*args, **kwargs)
        out_tree = jax.tree.structure(out_shape)

        def as_written():
            # ``fun`` traced above, run from its trace: calling it again would run its Python
            # twice (an NNX transform pops its graph state once per call; a Linen body advances
            # its RNG streams).
            return jax.tree.unflatten(out_tree, jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *flat))
        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=getattr(v.aval, "weak_type", False))
                 for v in closed.jaxpr.invars]
        try:
            # the calls inlined first, so that a pattern across jax.numpy's jitted helpers is one jaxpr
            inlined = jax.make_jaxpr(lambda *a: _Interpreter(None).eval(closed.jaxpr, closed.consts, a))(*avals)
            found = _search(inlined.jaxpr, _values(inlined.jaxpr.constvars, inlined.consts),
                            record if attention is None and record is not None else lambda *_: None)
        except Exception as e:     # noqa: BLE001 - an unforeseen jaxpr must not stop the plan
            warnings.warn(f"shardplan: the attention {getattr(fun, '__name__', 'the function')} writes out could "
                          f"not be searched ({type(e).__name__}: {e}); it is planned as written, without a "
                          "sequence split", stacklevel=2)
            return as_written()
        if not found or attention is None:
            return as_written()                    # as written: the same program, the same jaxpr
        outs = _Interpreter(attention).eval(inlined.jaxpr, inlined.consts, flat)
        return jax.tree.unflatten(out_tree, outs)
    return run
