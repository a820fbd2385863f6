"""Layer stacks as models write them, recognised while shardplan traces a step.

A stack of layers is written as a ``jax.lax.scan`` over stacked weights (by hand, or through
Linen's ``nn.scan`` and NNX's ``nnx.scan``, which lower to it) or as a ``jax.lax.fori_loop``
over the layer index. While shardplan traces a step (:func:`step_inputs`), those calls are
looked at as einsum attention is: a *differentiated* loop (run under ``jax.grad``) whose scanned
inputs include a stacked weight of the step's arguments (a leaf of shape ``[layers, ...]`` that
is one of the step's input leaves, cast or not) is a layer stack, and so is a differentiated
``fori_loop`` with static bounds over an activation. A layer stack is a layer class for
recomputation, and where its carry is the activation (every carry leaf with the batch first) and
what its body collects per layer does not depend on it, a stack a pipeline can split. Everything else runs as
written. :func:`classify_scan` and :func:`classify_fori` say which, :func:`why_not_pipelined`
why a stack cannot be pipelined; :mod:`shardplan.parallel.pipeline` routes the calls.

Only calls made through ``jax.lax.scan`` / ``jax.lax.fori_loop`` while the step is traced are
seen (``from jax.lax import scan`` bound before shardplan patched the name is not): the patch is
in place only during shardplan's own traces, and a call from another thread, or nested in a
stack's body, runs as it would without shardplan.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
import threading

import jax
import jax.numpy as jnp
from jax._src import core as _core
from jax._src.interpreters import ad as _ad

ORIGINAL_SCAN = jax.lax.scan
ORIGINAL_FORI = jax.lax.fori_loop

_STEP_SHAPES: contextvars.ContextVar = contextvars.ContextVar("shardplan_step_shapes", default=None)
_INSIDE: contextvars.ContextVar = contextvars.ContextVar("shardplan_inside_stack", default=False)
_DIFF: contextvars.ContextVar = contextvars.ContextVar("shardplan_differentiating", default=None)

# Frames of these packages stand between a model's line and the loop it runs (nn.scan, nnx.scan).
_LIBRARY = ("jax", "jaxlib", "flax", "contextlib", "functools")
_ROUTERS = (__name__, "shardplan.parallel.pipeline")       # this module and the one that routes the loops


@dataclasses.dataclass(frozen=True)
class Found:
    """A loop recognised as a layer stack: where the model runs it and its layer count; for a
    ``fori_loop``, why a pipeline cannot split it."""

    where: str
    layers: int
    unpipelinable: str | None = None


@contextlib.contextmanager
def step_inputs(leaves):
    """Within this context the step whose input leaves are ``leaves`` is being traced: its
    stacked weights are told by their shapes."""
    token = _STEP_SHAPES.set(frozenset(tuple(x.shape) for x in leaves if getattr(x, "ndim", 0) >= 2))
    try:
        yield
    finally:
        _STEP_SHAPES.reset(token)


@contextlib.contextmanager
def inside():
    """Within this context a stack's own body (or shardplan's loops around it) is traced: loops
    there run as written."""
    token = _INSIDE.set(True)
    try:
        yield
    finally:
        _INSIDE.reset(token)


@contextlib.contextmanager
def differentiating():
    """Within this context a function about to be differentiated is traced on its own
    (:mod:`shardplan.parallel.unrolled`): its loops are differentiated ones, and every layer stack it
    runs (recognised, or marked with ``layer_scan``/``layer_remat``) is noted in the list it yields."""
    marked: list = []
    token = _DIFF.set(marked)
    try:
        yield marked
    finally:
        _DIFF.reset(token)


def note(where: str) -> None:
    """Note the layer stack at ``where`` for the :func:`differentiating` trace on, if any."""
    marked = _DIFF.get()
    if marked is not None:
        marked.append(where)


def looking() -> bool:
    """Whether a loop called now is one a step being traced runs at its stack level."""
    return _STEP_SHAPES.get() is not None and not _INSIDE.get()


def differentiated() -> bool:
    """Whether the code running now is differentiated (a ``jax.grad``/``jax.vjp`` trace is
    among the current traces, or a function about to be differentiated is traced on its own,
    :func:`differentiating`):
    a loop outside one (a gradient-accumulation loop around ``jax.grad``, an optimizer's) keeps
    no residuals to recompute and is no layer stack."""
    if _DIFF.get() is not None:
        return True
    trace = _core.trace_ctx.trace
    while trace is not None:
        if isinstance(trace, (_ad.JVPTrace, _ad.LinearizeTrace)):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def user_frame() -> str:
    """``module:line (function)`` of the model's line that runs the loop: the first frame up
    the stack outside jax, flax and this module (stable wherever the code is installed)."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "?")
        if module.split(".")[0] not in _LIBRARY and module not in _ROUTERS:
            return f"{module}:{frame.f_lineno} ({frame.f_code.co_qualname})"
        frame = frame.f_back
    return "?"


def _floating(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def classify_scan(f, init, xs, length, reverse: bool = False) -> Found | None:
    """A ``jax.lax.scan(f, init, xs, length)`` call: a :class:`Found` layer stack, or ``None``."""
    if not looking() or reverse or not differentiated():
        return None
    leaves = jax.tree.leaves(xs)
    n = length if length is not None else (leaves[0].shape[0] if leaves and getattr(leaves[0], "ndim", 0) else None)
    shapes = _STEP_SHAPES.get()
    stacked = [x for x in leaves if _floating(x) and x.ndim >= 2 and x.shape[0] == n and tuple(x.shape) in shapes]
    if n is None or n < 2 or not stacked:
        return None
    note(user_frame())
    return Found(user_frame(), int(n))


def classify_fori(lower, upper, init) -> Found | None:
    """A ``jax.lax.fori_loop(lower, upper, body, init)`` call: a layer stack (never pipelined:
    its body reads each layer's weights by index, not as scanned inputs), or ``None``."""
    if not looking() or not differentiated():
        return None
    try:
        n = int(upper) - int(lower)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return None                   # dynamic bounds: a while loop, not differentiable in reverse anyway
    if n < 2 or not any(_floating(x) and x.ndim >= 2 for x in jax.tree.leaves(init)):
        return None
    note(user_frame())
    return Found(user_frame(), n, "a jax.lax.fori_loop reads each layer's weights by its index inside the body; a "
                                  "pipeline splits a jax.lax.scan over the stacked weights (jax.lax.scan(layer, x, "
                                  "stacked)), which gives each stage its layers")


@dataclasses.dataclass(frozen=True)
class Body:
    """A plain loop's body traced once, as ``jax.lax.scan`` traces it: ``fn`` evaluates the
    traced program (called again by a pipeline or a recomputation, it runs none of the model's
    Python again: a Linen body advances its RNG streams each time it runs), ``jaxpr`` is it."""

    fn: object
    jaxpr: object               # ClosedJaxpr of (carry, x) -> (carry, y)


def one_layer(xs):
    """The shapes of one layer of stacked ``xs``."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), xs)


def traced_once(f, *example) -> Body:
    """``f``, a loop's body, traced once on arguments like ``example`` (a scan's: the carry and
    :func:`one_layer` of its inputs)."""
    with inside():
        closed, out = jax.make_jaxpr(f, return_shape=True)(*example)
    out_tree = jax.tree.structure(out)

    def fn(*args):
        return jax.tree.unflatten(out_tree, jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *jax.tree.leaves(args)))
    return Body(fn, closed)


def why_not_pipelined(body: Body, init, xs, n: int) -> str | None:
    """Why a pipeline cannot run this scan's layers (``None``: it can): it needs the activation
    as the carry, and whatever the body collects per layer (its ys: with NNX, the state a layer
    updates, such as an RNG counter) independent of the activation, so that it is computed
    from the stacked inputs alone, once per layer, beside the pipeline."""
    leads = [(jax.tree_util.keystr(p) or "the carry", x.shape[0] if getattr(x, "ndim", 0) else None)
             for p, x in jax.tree_util.tree_leaves_with_path(init)]
    sizes = {s for _, s in leads}
    if not leads or len(sizes) != 1 or None in sizes:
        shown = ", ".join(f"{w}: {'a scalar' if s is None else s}" for w, s in leads[:4]) or "nothing"
        return (f"its carry is not the activation alone (leading sizes {shown}); a pipeline moves a carry whose "
                "leaves all have the batch first between stages")
    if any(getattr(x, "ndim", 0) < 1 or x.shape[0] != n for x in jax.tree.leaves(xs)):
        return "not every scanned input is stacked per layer (leading dimension the layer count)"
    carry_leaves = len(jax.tree.leaves(init))
    jaxpr = body.jaxpr.jaxpr
    if _reads_any(jaxpr, carry_leaves, jaxpr.outvars[carry_leaves:]):
        return ("its body collects outputs per layer that depend on the activation (the scan's ys); a pipeline "
                "keeps only the carry")
    return None


def _reads_any(jaxpr, first: int, outvars) -> bool:
    """Whether any of ``outvars`` of ``jaxpr`` depends on its first ``first`` inputs (an
    equation's outputs depend on all of its inputs, nested bodies included)."""
    tainted = set(jaxpr.invars[:first])
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, _core.Literal) and v in tainted for v in eqn.invars):
            tainted.update(eqn.outvars)
    return any(not isinstance(v, _core.Literal) and v in tainted for v in outvars)


class _Patch:
    """Names in ``jax`` (``jax.lax.scan``, ``jax.lax.fori_loop``, ``jax.grad``, ...) replaced by
    routers while any thread traces a step (counted, so nested and concurrent traces share one
    patch)."""

    def __init__(self):
        self.lock, self.users, self.saved = threading.Lock(), 0, {}

    @contextlib.contextmanager
    def installed(self, routers: dict):
        """``routers``: ``{"lax.scan": fn, "grad": fn, ...}``, names under ``jax``."""
        with self.lock:
            if self.users == 0:
                for name, fn in routers.items():
                    owner, attr = _owner(name)
                    self.saved[name] = getattr(owner, attr)
                    setattr(owner, attr, fn)
            self.users += 1
        try:
            yield
        finally:
            with self.lock:
                self.users -= 1
                if self.users == 0:
                    for name, fn in self.saved.items():
                        owner, attr = _owner(name)
                        setattr(owner, attr, fn)
                    self.saved.clear()


def _owner(name: str):
    *path, attr = name.split(".")
    owner = jax
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


PATCH = _Patch()
