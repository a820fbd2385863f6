"""Unrolled repeated layers as models write them, recognised while shardplan traces a step.

A model that runs its layers one after another in Python (``for block in self.blocks: x =
block(x)``, in Linen, NNX or plain JAX) traces to a forward program in which the same run of
equations repeats once per layer. While shardplan traces a step for recomputation
(:func:`shardplan.parallel.recompute.recomputing`), the function the step differentiates (the ``fun`` of
``jax.grad``, ``jax.value_and_grad`` or ``jax.vjp``, which ``nnx.grad``/``nnx.value_and_grad``
and flax's ``TrainState`` steps call) is traced on its own, once, and run from that program
(its Python runs once, as under ``jax.grad``: NNX's transforms keep state between the calls of
a step and would not run twice). Its forward program is searched for the longest run of
equations that repeats (:func:`find_layers`):

* the repeats have the same equations (primitive, parameters, shapes and dtypes) in the same
  order, at least two of them back to back, each with a matmul or a convolution that depends on
  the same one in the repeat before (the activation flows through them);
* a repeat starts where the fewest values cross from one to the next (the activation, and what
  every layer reads alike: a mask, positions);
* further stacks (an encoder and a decoder) are searched for in what is left.

Each such run is a layer class for recomputation (:class:`shardplan.parallel.recompute.Site`, unrolled):
each repeat runs under ``jax.checkpoint`` with its class's policy. Where the function holds a
layer stack shardplan already handles (a plain scan over stacked weights,
:func:`~shardplan.parallel.pipeline.layer_scan`, :func:`~shardplan.parallel.recompute.layer_remat`), no unrolled
layers are looked for. Nothing of this happens when recomputation is off (``remat="off"``, or
the step as written planned first). A pipeline does not split unrolled layers: each layer's
weights are its own arrays, where a pipeline splits one array stacked on a leading layer
dimension.

Only calls made through ``jax.grad``, ``jax.value_and_grad`` and ``jax.vjp`` while the step is
traced are seen (a name bound before shardplan patched it, ``from jax import grad`` or a
``jax.value_and_grad(loss)`` made at import, is not).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import os
import sys

import jax
import numpy as np
from jax._src import core as _core
from jax._src import source_info_util
from jax.extend.core import jaxprs_in_params

from shardplan.parallel import recompute
from shardplan.tracing import stacks

ORIGINAL_GRAD = jax.grad
ORIGINAL_VALUE_AND_GRAD = jax.value_and_grad
ORIGINAL_VJP = jax.vjp

_ROUTED: contextvars.ContextVar = contextvars.ContextVar("shardplan_unrolled_routed", default=False)

# Frames of these packages stand between a model's line and the layers it runs.
_LIBRARY = ("jax", "jaxlib", "flax", "optax", "shardplan", "contextlib", "functools")
_MATMULS = frozenset({"dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"})
_MAX_CLASSES = 4


@dataclasses.dataclass(frozen=True)
class Layers:
    """A run of unrolled repeated layers in a program: ``count`` repeats of ``period``
    equations, the first at equation ``start``."""

    start: int
    period: int
    count: int

    def blocks(self) -> list[range]:
        return [range(self.start + k * self.period, self.start + (k + 1) * self.period) for k in range(self.count)]


# -- finding the layers --------------------------------------------------------------------------

def _key(value, memo: dict):
    """A hashable stand-in for an equation parameter: equal for the same parameter in two layers."""
    if isinstance(value, (_core.ClosedJaxpr, _core.Jaxpr)):
        jaxpr = value.jaxpr if isinstance(value, _core.ClosedJaxpr) else value
        if id(jaxpr) not in memo:
            memo[id(jaxpr)] = ("jaxpr", tuple(str(v.aval) for v in jaxpr.invars),
                               tuple(_signature(e, memo) for e in jaxpr.eqns))
        return memo[id(jaxpr)]
    if isinstance(value, (tuple, list)):
        return tuple(_key(v, memo) for v in value)
    if isinstance(value, dict):
        return tuple((k, _key(v, memo)) for k, v in sorted(value.items(), key=lambda kv: str(kv[0])))
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if callable(value) and not isinstance(value, type):
        return getattr(value, "__qualname__", type(value).__name__)
    text = repr(value)
    return text if len(text) < 300 and " at 0x" not in text else type(value).__name__


def _signature(eqn, memo: dict) -> tuple:
    """What two layers' equations share: primitive, parameters, operand and result types
    (literal values aside: a layer's own constants, such as an RNG fold-in, differ)."""
    return (eqn.primitive.name, tuple(str(v.aval) for v in eqn.invars), tuple(str(v.aval) for v in eqn.outvars),
            tuple((k, _key(v, memo)) for k, v in sorted(eqn.params.items())))


def _has_matmul(eqns) -> bool:
    for eqn in eqns:
        if eqn.primitive.name in _MATMULS:
            return True
        if any(_has_matmul(getattr(j, "jaxpr", j).eqns) for j in jaxprs_in_params(eqn.params)):
            return True
    return False


def _crossings(jaxpr) -> np.ndarray:
    """``c[b]``: how many values made by equations before ``b`` are read at ``b`` or after."""
    n = len(jaxpr.eqns)
    made: dict = {}
    last: dict = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, _core.Literal) and v in made:
                last[v] = i
        for v in eqn.outvars:
            made[v] = i
    for v in jaxpr.outvars:
        if not isinstance(v, _core.Literal) and v in made:
            last[v] = n
    diff = np.zeros(n + 2, dtype=np.int64)
    for v, u in last.items():
        diff[made[v] + 1] += 1
        diff[u + 1] -= 1
    return np.cumsum(diff)[: n + 1]


def _chained(jaxpr, layers: Layers) -> bool:
    """Whether each repeat's matmuls depend on the same matmuls of the repeat before it: a
    stack, through which the activation flows, not copies side by side (heads summed into one
    value are chained by the sum alone, and not through their matmuls)."""
    blocks = layers.blocks()
    positions = [j for j in range(layers.period) if _has_matmul([jaxpr.eqns[blocks[0][j]]])]
    for prev, block in zip(blocks, blocks[1:]):
        for j in positions:
            tainted = set(jaxpr.eqns[prev[j]].outvars)
            for i in range(prev[j] + 1, block[j] + 1):
                eqn = jaxpr.eqns[i]
                if any(not isinstance(v, _core.Literal) and v in tainted for v in eqn.invars):
                    tainted.update(eqn.outvars)
            if not tainted & set(jaxpr.eqns[block[j]].outvars):
                return False
    return True


def _periodic_runs(ids: np.ndarray, min_period: int):
    """``(coverage, period, start, length)`` of every run over which ``ids`` repeats with a
    period: ``ids[start : start + length + period]`` is ``period``-periodic, ``length >= period``."""
    n = len(ids)
    for p in range(min_period, n // 2 + 1):
        same = np.concatenate(([0], (ids[:-p] == ids[p:]).astype(np.int8), [0]))
        edges = np.diff(same)
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        for a, r in zip(starts, ends - starts):
            if r >= p:
                yield (r + p) // p * p, p, int(a), int(r)


def find_layers(jaxpr, min_period: int = 1) -> list[Layers]:
    """The runs of unrolled repeated layers in ``jaxpr``'s top level, longest first (module doc)."""
    memo: dict = {}
    table: dict = {}
    ids = np.array([table.setdefault(_signature(e, memo), len(table)) for e in jaxpr.eqns], dtype=np.int64)
    crossing = _crossings(jaxpr)
    found: list[Layers] = []
    while len(found) < _MAX_CLASSES:
        best = None
        for coverage, p, a, r in sorted(_periodic_runs(ids, min_period), key=lambda c: (-c[0], c[1], c[2])):
            end = a + r + p
            options = []
            for phase in range(p):
                count = (end - a - phase) // p
                if count >= 2:
                    bounds = [a + phase + k * p for k in range(count + 1)]
                    options.append((-count, float(np.mean(crossing[bounds])), phase, count))
            for _, _, phase, count in sorted(options):
                layers = Layers(a + phase, p, count)
                if all(_has_matmul([jaxpr.eqns[i] for i in b]) for b in layers.blocks()) and _chained(jaxpr, layers):
                    best = layers
                    break
            if best is not None:
                break
        if best is None:
            break
        found.append(best)
        covered = range(best.start, best.start + best.period * best.count)
        ids[covered.start:covered.stop] = -1 - np.arange(len(covered)) - len(ids) * (len(found))
    return found


# -- naming them ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _modules_by_file(count: int) -> dict[str, str]:
    del count                     # the cache's key: rebuilt when modules are imported
    out = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path:
            out[os.path.realpath(path)] = name
    return out


def _frames(eqn) -> list[tuple[str, str, int]]:
    """The model's frames of ``eqn``, outermost first: ``(module, function, line)``."""
    modules = _modules_by_file(len(sys.modules))
    out = []
    for frame in source_info_util.user_frames(eqn.source_info.traceback):
        module = modules.get(os.path.realpath(frame.file_name), os.path.splitext(os.path.basename(frame.file_name))[0])
        if module.split(".")[0] not in _LIBRARY:
            out.append((module, frame.function_name, frame.start_line))
    return out[::-1]


def where(jaxpr, layers: Layers) -> str:
    """``module:line (function)`` of the model's line that runs the layers: the innermost model
    frame every layer's equations share (JAX keeps only the innermost frames of an equation's
    traceback, so a loop's own line may be cut off: then the innermost function they share,
    at its first line among them)."""
    eqns = [jaxpr.eqns[i] for i in range(layers.start, layers.start + layers.period * layers.count)]
    stacks = [_frames(e) for e in eqns]
    for key in (lambda f: f, lambda f: f[:2]):
        shared = set.intersection(*(set(map(key, fs)) for fs in stacks)) if stacks else set()
        if shared:
            # the innermost: the one latest in an equation's frames (outermost first)
            depth = {k: max(i for fs in stacks for i, f in enumerate(fs) if key(f) == k) for k in shared}
            innermost = max(shared, key=lambda k: (depth[k], k))
            line = min(f[2] for fs in stacks for f in fs if key(f) == innermost)
            return f"{innermost[0]}:{line} ({innermost[1]})"
    return "unrolled layers"


# -- running them recomputed ---------------------------------------------------------------------

def _last_reads(jaxpr) -> dict:
    """For each value, the last equation that reads it (``len(eqns)``: an output of ``jaxpr``)."""
    last = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, _core.Literal):
                last[v] = i
    for v in jaxpr.outvars:
        if not isinstance(v, _core.Literal):
            last[v] = len(jaxpr.eqns)
    return last


def _block_io(jaxpr, block: range, last: dict) -> tuple[list, list]:
    """A block's inputs (values it reads and does not make, in order) and outputs (values it
    makes that are read after it)."""
    made, inputs, seen = set(), [], set()
    for i in block:
        eqn = jaxpr.eqns[i]
        for v in eqn.invars:
            if not isinstance(v, _core.Literal) and v not in made and v not in seen:
                seen.add(v)
                inputs.append(v)
        made.update(eqn.outvars)
    outputs = [v for i in block for v in jaxpr.eqns[i].outvars if last.get(v, -1) >= block.stop]
    return inputs, outputs


def run(closed, found: list[Layers], args) -> list:
    """``closed`` evaluated on ``args``, each layer of ``found`` under ``jax.checkpoint`` with
    the policy the active recomputation gives its class."""
    jaxpr = closed.jaxpr
    starts = {}
    for layers in found:
        name = where(jaxpr, layers)
        for block in layers.blocks():
            starts[block.start] = (name, block)
    last = _last_reads(jaxpr)
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, _core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, args))
    i = 0
    while i < len(jaxpr.eqns):
        if i in starts:
            name, block = starts[i]
            inputs, outputs = _block_io(jaxpr, block, last)
            eqns = [jaxpr.eqns[k] for k in block]
            info = _core.DebugInfo("unrolled layer", name, tuple(f"in{k}" for k in range(len(inputs))),
                                   tuple(f"out{k}" for k in range(len(outputs))))
            sub = _core.Jaxpr([], inputs, outputs, eqns, _core.join_effects(*(e.effects for e in eqns)), info)
            fn = recompute.unrolled_layer(lambda *xs, sub=sub: _core.eval_jaxpr(sub, [], *xs), name,
                                          ",".join(str(v.aval) for v in inputs), recompute.recomputes(sub))
            env.update(zip(outputs, fn(*map(read, inputs))))
            i = block.stop
            continue
        eqn = jaxpr.eqns[i]
        params = eqn.primitive.get_bind_params(eqn.params)
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
            out = eqn.primitive.bind(*map(read, eqn.invars), **params)
        env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))
        i += 1
    return list(map(read, jaxpr.outvars))


# -- the routers ---------------------------------------------------------------------------------

def _wanted() -> bool:
    return recompute.active() and stacks.looking() and not _ROUTED.get()


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, _core.Tracer))


def recognised(fun):
    """``fun`` (a function about to be differentiated) run with its unrolled repeated layers
    recomputed as their classes are chosen (module doc); as written where it has none."""

    @functools.wraps(fun)
    def routed(*args, **kwargs):
        if not _wanted():
            return fun(*args, **kwargs)
        leaves, tree = jax.tree.flatten((args, kwargs))
        arrays = [i for i, x in enumerate(leaves) if _is_array(x)]

        def flat(*values):
            filled = list(leaves)
            for i, x in zip(arrays, values):
                filled[i] = x
            a, k = jax.tree.unflatten(tree, filled)
            return fun(*a, **k)

        token = _ROUTED.set(True)
        try:
            with stacks.differentiating() as marked:
                closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*(leaves[i] for i in arrays))
            found = [] if marked else find_layers(closed.jaxpr)
            outs = run(closed, found, [leaves[i] for i in arrays])
        finally:
            _ROUTED.reset(token)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return routed


def _underneath(name: str):
    """What ``jax.<name>`` was before :data:`ROUTERS` took its place (another router of
    shardplan's, or jax's own)."""
    return stacks.PATCH.saved.get(name, ORIGINALS[name])


@functools.wraps(ORIGINAL_GRAD)
def _grad(fun, *args, **kwargs):
    return _underneath("grad")(recognised(fun), *args, **kwargs)


@functools.wraps(ORIGINAL_VALUE_AND_GRAD)
def _value_and_grad(fun, *args, **kwargs):
    return _underneath("value_and_grad")(recognised(fun), *args, **kwargs)


@functools.wraps(ORIGINAL_VJP)
def _vjp(fun, *args, **kwargs):
    return _underneath("vjp")(recognised(fun), *args, **kwargs)


ROUTERS = {"grad": _grad, "value_and_grad": _value_and_grad, "vjp": _vjp}
ORIGINALS = {"grad": ORIGINAL_GRAD, "value_and_grad": ORIGINAL_VALUE_AND_GRAD, "vjp": ORIGINAL_VJP}
