"""Activation recomputation chosen per layer class, jointly with the sharding.

A *layer class* is a place in the model's code that runs layers: a :func:`~shardplan.parallel.pipeline.layer_scan`
call (a scanned stack) or a function wrapped by :func:`layer_remat` (one unrolled layer, called
once per layer from the same line), told apart further by the shapes it is called with, so one
``LayerStack`` class used for an encoder of width 512 and a decoder of width 1024 gives two
classes. Each class gets one of :data:`POLICIES`, the ``jax.checkpoint`` policies MaxText offers:

* ``"none"``: every residual kept for the backward pass;
* ``"dots_all"``: the results of every matmul kept (``dots_saveable``), the rest recomputed;
* ``"dots"``: the matmuls without batch dimensions kept, that is the weight projections
  (``dots_with_no_batch_dims_saveable``, MaxText's "minimal"); attention scores are recomputed;
* ``"offload"``: what ``"dots"`` keeps, held in the host's pinned memory instead of the device's
  (copied out in the forward pass, back for the backward; ``offload_dot_with_no_batch_dims``,
  MaxText's "minimal_offloaded"). Offered for scanned classes where the target holds host memory
  apart (GPU, TPU; XLA's CPU compiler drops the copies), priced at the device's
  ``offload_bandwidth``; unrolled layers gain nothing by it (the compilers fetch the residuals
  back early), and it is refused there;
* ``"full"``: only each layer's input kept, everything else recomputed (``nothing_saveable``).

The step is traced once per assignment of policies (inside :func:`recomputing`); the traced
program then holds what each policy recomputes, so the ILP prices the recomputed FLOPs (and any
collective they repeat) and the activations each keeps, on the sharding it chooses with them.
:func:`search` picks the assignment with the lowest predicted step that fits the budget. A class
whose code already recomputes (the user's own ``jax.checkpoint``/``nnx.remat`` inside it) keeps
the user's policy unless a policy is asked for by name.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import itertools
import math
import sys
from collections.abc import Callable

import jax

from shardplan.compiler.targets import compiler_kind
from shardplan.errors import ShardplanError
from shardplan.parallel.defaults import runner_up
from shardplan.parallel.families import Family
from shardplan.tracing import stacks
from shardplan.util.progress import said

# Named policies -> jax.checkpoint_policies attribute; ordered from the least device memory saved to the most.
POLICIES = {"none": None, "dots_all": "dots_saveable", "dots": "dots_with_no_batch_dims_saveable",
            "offload": "offload_dot_with_no_batch_dims", "full": "nothing_saveable"}
USER = "user"       # the class's own jax.checkpoint is kept
OFFLOADING = frozenset({"offload"})       # policies that need host memory apart from the device's


class RecomputeError(ShardplanError, ValueError):
    """A recomputation setting that cannot apply: the message names it and what works."""


# Policies that keep (or offload) the matmuls without batch dimensions: a layer's projections.
_UNBATCHED = frozenset({"dots", "offload"})


def checkpoint_policy(name: str, vmapped: int = 0):
    """The ``jax.checkpoint_policies`` function of a named policy; ``None`` for ``"none"``.

    ``vmapped``: how many ``vmap`` levels the layer runs under (a pipeline runs its stages under
    one, two with row groups). ``vmap`` gives every matmul in the layer that many batch
    dimensions, so ``"dots"`` and ``"offload"`` (matmuls without batch dimensions) would keep
    nothing and recompute like ``"full"``; under ``vmapped`` levels they keep the matmuls with at
    most that many batch dimensions, which the projections are and attention's (batch and heads,
    plus the levels) are not."""
    if name not in POLICIES:
        raise RecomputeError(f"recomputation policy {name!r} is not one of {', '.join(POLICIES)} (remat= also takes "
                             "'auto', searched, and 'off', the step as written)")
    if name in OFFLOADING:
        policy = getattr(jax.checkpoint_policies, POLICIES[name])("device", "pinned_host")
    else:
        policy = None if POLICIES[name] is None else getattr(jax.checkpoint_policies, POLICIES[name])
    if not vmapped or name not in _UNBATCHED:
        return policy

    def unbatched(prim, *avals, **params):
        if prim.name == "dot_general":
            (contracting, (lhs_batch, rhs_batch)) = params["dimension_numbers"]
            if len(lhs_batch) <= vmapped and len(rhs_batch) <= vmapped:
                # What the policy does with such a matmul where it has no batch dimensions.
                params = dict(params, dimension_numbers=(contracting, ((), ())))
        return policy(prim, *avals, **params)
    return unbatched


# XLA's CPU compiler schedules an unrolled layer's recomputation as soon as its inputs are ready,
# in the forward pass, so it holds what the layer without recomputation holds (compiled, 4 layers
# of d 512 on cpu-8: 398.28 MiB with "full", 398.31 MiB without). A scanned layer's is in the
# backward loop, where it saves. The GPU compiler's scheduler keeps it late (tests/parallel/test_unrolled.py).
CPU_UNROLLED = ("XLA's CPU compiler runs an unrolled layer's recomputation in the forward pass, as soon as its "
                "inputs are ready, so it holds what the layers without recomputation hold; a scanned stack's "
                "recomputation saves memory there, and the GPU and TPU compilers keep it for the backward pass")


def policies_for(host_apart: bool) -> tuple[str, ...]:
    """The policies a target offers: host offload only where host memory is apart (GPU, TPU)."""
    return tuple(p for p in POLICIES if host_apart or p not in OFFLOADING)


@dataclasses.dataclass
class Site:
    """One layer class as the traced step met it."""

    key: str            # where + a hash of the shapes it was called with: stable across processes and runs
    where: str          # "models.layers:160 (LayerStack.__call__)"
    layers: int         # layers of this class the step runs (a scan's length, or one per call; a model
                        # differentiated twice in the step counts twice)
    checkpointed: bool  # the code already recomputes (its own jax.checkpoint)
    scanned: bool = True  # a layer_scan (else unrolled layers: layer_remat)

    def to_json(self, policy: str) -> dict:
        return {"key": self.key, "where": self.where, "layers": self.layers, "policy": policy}


@dataclasses.dataclass
class _Active:
    choices: dict[str, str] | str     # key -> policy, or one policy for every class
    sites: dict[str, Site]


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("shardplan_recompute", default=None)


@contextlib.contextmanager
def recomputing(choices: dict[str, str] | str):
    """Within this context (while a step is traced), every layer class recomputes as ``choices``
    says: a policy name for all, or ``{site key: policy}`` (a class not named: ``"none"``;
    :data:`USER`: its own checkpoint as written). Yields ``{key: Site}`` of the classes met."""
    for name in ([choices] if isinstance(choices, str) else choices.values()):
        if name != USER:
            checkpoint_policy(name)
    active = _Active(choices, {})
    token = _ACTIVE.set(active)
    try:
        yield active.sites
    finally:
        _ACTIVE.reset(token)


def active() -> bool:
    """Whether a step is traced for recomputation now (:func:`recomputing`)."""
    return _ACTIVE.get() is not None


def caller(depth: int) -> str:
    """``module:line (function)`` of the frame ``depth`` above the caller: stable wherever the
    code is installed, unlike a file path."""
    frame = sys._getframe(depth + 1)
    module = frame.f_globals.get("__name__", "?")
    return f"{module}:{frame.f_lineno} ({frame.f_code.co_qualname})"


def _shapes(tree) -> str:
    leaves = jax.tree.leaves(tree)
    return ",".join(f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}" for x in leaves)


def recomputes(jaxpr) -> bool:
    """Whether ``jaxpr`` recomputes anything itself (a ``jax.checkpoint`` inside, at any depth)."""
    from jax.extend.core import jaxprs_in_params
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("checkpoint", "remat2", "remat"):
            return True
        if any(recomputes(getattr(j, "jaxpr", j)) for j in jaxprs_in_params(eqn.params)):
            return True
    return False


def _already_checkpointed(f, args) -> bool:
    """Whether ``f`` on abstract ``args`` recomputes anything itself (a ``jax.checkpoint`` inside)."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x)), args)
    try:
        return recomputes(jax.make_jaxpr(f)(*abstract).jaxpr)
    except Exception:          # noqa: BLE001 - a body we cannot trace alone is traced in place, as written
        return False


def _policy_for(where: str, shape_sig: str, f, probe_args, layers: int, *, scanned: bool,
                checkpointed: bool | None = None) -> str | None:
    """The policy the active context gives this class (``None``: leave ``f`` as it is);
    ``checkpointed``: whether ``f`` recomputes itself (``None``: found by tracing it)."""
    active = _ACTIVE.get()
    if active is None:
        return None
    key = f"{where}#{hashlib.sha256(shape_sig.encode()).hexdigest()[:8]}"
    site = active.sites.get(key)
    if site is None:
        if checkpointed is None:
            checkpointed = _already_checkpointed(f, probe_args)
        site = active.sites[key] = Site(key, where, 0, checkpointed, scanned)
    site.layers += layers
    if isinstance(active.choices, str):
        policy = active.choices
    else:
        # A class the choices do not name keeps what its code does: its own checkpoint, or none.
        policy = active.choices.get(key, USER if site.checkpointed else "none")
    if policy in OFFLOADING and not scanned:
        raise RecomputeError(
            f"remat={policy!r} for the unrolled layers at {where}: XLA's GPU and TPU compilers start each "
            "offloaded residual's copy back to the device as early as they can, so unrolled layers save no "
            "device memory by it (compiled: more than with 'dots'). Offload pays in a scanned stack: call "
            f"shardplan.layer_scan there, or give this class another policy (remat={{{key!r}: 'full'}})")
    return policy


def _wrap(f, policy: str | None, *, in_scan: bool, vmapped: int = 0):
    if policy in (None, USER, "none"):
        return f
    # In a scan body, CSE across trips cannot undo the recomputation: prevent_cse is not needed.
    return jax.checkpoint(f, policy=checkpoint_policy(policy, vmapped), prevent_cse=not in_scan)


def scan_body(f, init, xs, where: str, vmapped: int = 0, checkpointed: bool | None = None):
    """``f`` (a :func:`~shardplan.parallel.pipeline.layer_scan` body) under its class's policy;
    ``vmapped``: the ``vmap`` levels it will run under (:func:`checkpoint_policy`);
    ``checkpointed``: whether ``f`` recomputes itself (``None``: found by tracing it)."""
    if _ACTIVE.get() is None:
        return f
    leaves = jax.tree.leaves(xs)
    layers = int(leaves[0].shape[0]) if leaves and getattr(leaves[0], "ndim", 0) else 1
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), xs)
    return loop_body(f, (init, one), layers, where, vmapped, shapes=(init, xs), checkpointed=checkpointed)


def loop_body(f, probe_args: tuple, layers: int, where: str, vmapped: int = 0, shapes=None,
              checkpointed: bool | None = None):
    """``f``, the body of a loop over ``layers`` layers run from ``where`` (a scan's or a
    ``fori_loop``'s, called with arguments shaped as ``probe_args``), under its class's policy.
    ``shapes``: what tells the class apart (default ``probe_args``); ``checkpointed``: as
    :func:`scan_body`'s."""
    if _ACTIVE.get() is None:
        return f
    policy = _policy_for(where, _shapes(probe_args if shapes is None else shapes), f, probe_args, layers,
                         scanned=True, checkpointed=checkpointed)
    return _wrap(f, policy, in_scan=True, vmapped=vmapped)


def unrolled_layer(f, where: str, shape_sig: str, checkpointed: bool):
    """``f``, one of the unrolled repeated layers the model runs from ``where``
    (:mod:`shardplan.parallel.unrolled`), called with arguments of types ``shape_sig``, under its class's
    policy; ``checkpointed``: whether ``f`` recomputes itself."""
    if _ACTIVE.get() is None:
        return f
    policy = _policy_for(where, shape_sig, f, (), 1, scanned=False, checkpointed=checkpointed)
    return _wrap(f, policy, in_scan=False)


def layer_remat(f: Callable) -> Callable:
    """``f`` (one layer of an unrolled stack, called once per layer) recomputed as the planner
    chooses for its class: the line that calls ``layer_remat`` with the shapes ``f`` gets. Outside
    planning it is ``f`` itself.

    >>> for block in blocks:                                # doctest: +SKIP
    ...     x = shardplan.layer_remat(block)(x)
    """
    where = caller(1)

    @functools.wraps(f)
    def call(*args):
        stacks.note(where)
        if _ACTIVE.get() is None:
            return f(*args)
        policy = _policy_for(where, _shapes(args), f, args, 1, scanned=False)
        return _wrap(f, policy, in_scan=False)(*args)

    return call


# -- choosing ------------------------------------------------------------------------------------

def search(evaluate: Callable[[dict[str, str], float], object], sites: dict[str, Site], **kw):
    """:func:`assignments` driven by ``evaluate(choices, beat)``, which traces and plans the step
    under ``{key: policy}`` (``None`` where no plan fits, or none can be faster than ``beat``
    seconds, the best so far). Returns ``(choices, plan, tried)`` as :func:`assignments` does."""
    walk = assignments(sites, **kw)
    best, plan = math.inf, None
    try:
        while True:
            choices = walk.send(plan)
            plan = evaluate(choices, best)
            if plan is not None:
                best = min(best, plan.cost.step_s)
    except StopIteration as done:
        return done.value


def assignments(sites: dict[str, Site], *, policies=policies_for(False), say: Callable[[str], None] = lambda text: None,
                max_exhaustive: int = 2, first=..., unrolled_saves: bool = True):
    """The assignments of ``policies`` to the classes in ``sites`` worth planning, as a generator:
    each ``{key: policy}`` it yields is sent back its plan (``None`` where no plan fits, or none
    can beat the best so far). ``first``: the plan for the step as written, if already made.
    Returns ``(choices, plan, tried)``: the assignment whose plan is predicted the fastest, that
    plan (``None`` where nothing fits) and ``tried``, the ``(choices, plan or None)`` in order.

    No recomputation is tried first. Then every assignment is planned for up to ``max_exhaustive``
    classes; beyond that each policy for all classes, then one class at a time changed while the
    step improves. Nothing is skipped because no recomputation fits: recomputing adds compute but
    keeps fewer residuals, and each kept one costs HBM traffic (a scan zero-fills every stacked
    residual and copies a matmul's into it; :func:`shardplan.compiler.traffic.hbm_traffic`), so on a GPU
    ``dots`` measured faster than ``none`` with memory to spare (RESULTS.md, "Recomputation").
    ``unrolled_saves``: whether the compiler holds less for recomputed unrolled layers (not
    XLA's CPU compiler: :data:`CPU_UNROLLED`); where not, those classes keep ``"none"``.
    """
    free = [k for k, s in sites.items() if not s.checkpointed]
    fixed = {k: USER for k, s in sites.items() if s.checkpointed}
    tried: list[tuple[dict[str, str], object]] = []
    seen: dict[tuple, object] = {}

    def run(assign: dict[str, str]):
        ident = tuple(sorted(assign.items()))
        if ident not in seen:
            choices = {**fixed, **assign}
            say(", ".join(f"{sites[k].where.split(' ')[0]} {p}" for k, p in assign.items()) or "as written")
            seen[ident] = yield choices
            tried.append((choices, seen[ident]))
        return seen[ident]

    def better(a, b):
        return a is not None and (b is None or a.cost.step_s < b.cost.step_s)

    base = {k: "none" for k in free}
    if first is not ...:
        seen[tuple(sorted(base.items()))] = first
        tried.append(({**fixed, **base}, first))
    best_assign, best = base, (yield from run(base))
    if not free:
        return {**fixed, **best_assign}, best, tried
    # Host offload only for scanned classes (see _policy_for).
    offered = {k: [p for p in policies if sites[k].scanned or p not in OFFLOADING] for k in free}
    free = [k for k in free if sites[k].scanned or unrolled_saves]
    if not free:
        return {**fixed, **best_assign}, best, tried
    if len(free) <= max_exhaustive:
        grid = [dict(zip(free, combo)) for combo in itertools.product(*(offered[k] for k in free))]
    else:
        grid = [{k: p if p in offered[k] else "full" for k in free} for p in policies]
    rank = {p: i for i, p in enumerate(POLICIES)}
    for assign in sorted(grid, key=lambda a: sum(rank[p] for p in a.values())):   # least memory saved first
        plan = yield from run(assign)
        if better(plan, best):
            best_assign, best = assign, plan
    if len(free) > max_exhaustive and best is not None:
        improved = True
        while improved:
            improved = False
            for k, p in itertools.product(free, policies):
                assign = {**best_assign, k: p}
                if best_assign[k] == p or p not in offered[k]:
                    continue
                plan = yield from run(assign)
                if better(plan, best):
                    best_assign, best, improved = assign, plan, True
    return {**fixed, **best_assign}, best, tried


# -- as a family of the search ---------------------------------------------------------------------

NO_LAYERS = ("the step has no layer stack (a jax.lax.scan over stacked layer weights, as nn.scan and nnx.scan "
             "run, a jax.lax.fori_loop over layers under jax.grad, a shardplan.layer_scan or shardplan.layer_remat)")


def record(sites: dict[str, Site], choices) -> dict | None:
    """``Plan.remat`` for a step traced under ``choices`` (``None``: not traced for recomputation)
    meeting ``sites``."""
    if choices is None:
        return None
    pick = (lambda k: choices) if isinstance(choices, str) else \
        (lambda k: choices.get(k, USER if sites[k].checkpointed else "none"))
    return {"sites": [site.to_json(pick(k)) for k, site in sites.items()]}


class RematFamily(Family):
    """Recomputation as a :class:`~shardplan.parallel.families.Family`: ``"auto"`` plans the step as
    written, which meets its layer classes, then :func:`assignments`' policies for them; a policy
    name or ``{class key: policy}`` is that one; ``None``: the step as written, not traced for
    recomputation at all."""

    name = "remat"

    def __init__(self, setting):
        super().__init__(setting)
        self.classes: dict[str, Site] = {}       # every class met
        self.no_layers = False                   # "auto" met no class to recompute
        self.cpu = False                         # planned for XLA's CPU compiler (CPU_UNROLLED)
        self._met: dict[str, Site] = {}          # the classes the last candidate entered met

    def pinned(self) -> bool:
        return self.setting != "auto"

    def explore(self, point, search, alone: bool = True):
        self.cpu = compiler_kind(point.mesh) == "cpu"
        if self.setting != "auto":
            yield self.setting
            return
        written = yield {}                       # the step as written: meets its layer classes
        sites = self._met
        if not sites:
            self.no_layers = True
            return
        host = compiler_kind(point.mesh) != "cpu"
        walk = assignments(sites, first=written.plan, policies=policies_for(host), unrolled_saves=host,
                           say=lambda text: said(f"recomputation candidate: {text}"))
        plan = None
        while True:
            try:
                choices = walk.send(plan)
            except StopIteration:
                return
            plan = (yield choices).plan

    def enter(self, choices, point):
        if choices is None:
            return point.entered(self, None, {})
        sites: dict[str, Site] = {}
        named = choices is self.setting and isinstance(choices, dict) and point.choice("pipeline") is None

        def trace():
            with recomputing(choices) as met:
                traced = point.trace()
            sites.clear()
            sites.update(met)
            self.classes.update(met)
            unknown = sorted(set(choices) - set(met)) if named else []
            if unknown:
                raise RecomputeError(
                    f"remat names layer classes the step does not have: {', '.join(map(repr, unknown))}; its "
                    "classes are " + (", ".join(repr(k) for k in met) or "none")
                    + " (plan.remat['sites'] lists each class's key)")
            return traced
        self._met = sites
        return point.entered(self, choices, sites, trace=trace)

    def record(self, plan, choices, sites):
        return dataclasses.replace(plan, remat=record(sites, choices))

    def from_plan(self, plan, point):
        return None if plan.remat is None else {s["key"]: s["policy"] for s in plan.remat["sites"]}

    def finish(self, plan, completed):
        remat = self.setting
        if remat == "auto" and (plan.remat or {}).get("sites"):
            plan = dataclasses.replace(plan, searched={**plan.searched, "remat": runner_up(completed, plan, "remat")})
        unrolled = {k for k, site in self.classes.items() if not site.scanned} if self.cpu else set()
        wasted = [s["where"] for s in (plan.remat or {}).get("sites", [])
                  if s["key"] in unrolled and s["policy"] not in ("none", USER)]
        if wasted:
            plan = dataclasses.replace(plan, warnings=plan.warnings + (
                f"remat={remat!r} recomputes the unrolled layers at {', '.join(wasted)}, but {CPU_UNROLLED}: "
                "the predicted memory counts a saving this compiler does not make",))
        if (self.no_layers or remat not in (None, "auto")) and not (plan.remat or {}).get("sites"):
            plan = dataclasses.replace(plan, warnings=plan.warnings + (
                f"remat={remat!r}: {NO_LAYERS}, so no layer's recomputation could be "
                + ("chosen" if remat == "auto" else "set") + "; the step is planned as written",))
        return plan

    def explain(self, error):
        if self.setting == "auto" and self.no_layers:
            error.no_layers = True
        return error
