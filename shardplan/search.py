"""The outer search around the ILP: the step traced and planned once per candidate pipeline
(:mod:`shardplan.pipeline_search`), recomputation policy (:mod:`shardplan.recompute`) and way
to split its attention over the sequence (:mod:`shardplan.sequence`), the lowest predicted step
that fits the budget kept; and a plan's step traced again as it was made."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
from collections.abc import Callable

from shardplan import cache as plan_cache
from shardplan import defaults, pipeline_search, recompute, sequence
from shardplan.defaults import runner_up
from shardplan.errors import InfeasibleBudgetError, PlanMismatchError
from shardplan.mesh import MeshSpec
from shardplan.pipeline import NoLayerStackError, PipelineError
from shardplan.plan import Plan
from shardplan.planner import PlannerOptions, plan_jaxpr
from shardplan.progress import Status, silenced
from shardplan.sizes import parse_bytes
from shardplan.solver import StopToken, stoppable
from shardplan.targets import compiler_kind
from shardplan.trace import TracedStep


def budget_for(memory_budget, mesh_spec: MeshSpec) -> int:
    """Bytes per device: the given budget, or what a program may allocate on the device
    (:attr:`~shardplan.mesh.Device.budget_bytes`)."""
    return parse_bytes(memory_budget) if memory_budget is not None else mesh_spec.device.budget_bytes


def plan_traced(traced: TracedStep, mesh_spec: MeshSpec, budget: int, options: PlannerOptions, cache=True,
                beat: float = math.inf):
    """Plan a traced step, or read its plan back from the on-disk cache (:mod:`shardplan.cache`).
    ``beat``: :func:`~shardplan.planner.plan_jaxpr`'s (a plan no faster than ``beat`` seconds
    may come back over the budget, or unsolved; it is not cached)."""
    directory = plan_cache.cache_dir(cache)
    key = plan_cache.plan_key(traced, mesh_spec, budget, options) if directory else ""
    cached = plan_cache.load(directory, key)
    p, graph = plan_jaxpr(traced.closed, traced.names, traced.arg_of, mesh_spec, budget, donated=traced.donated,
                          options=options, in_tree=traced.arg_tree, out_tree=traced.out_tree,
                          state_pairs=traced.state_pairs, out_names=traced.out_names, cached=cached, beat=beat)
    if cached is None and p.cost.memory_bytes <= budget and p.cost.step_s < beat:
        plan_cache.store(directory, key, p)
    return p, graph


NO_LAYERS = ("the step has no layer stack (a jax.lax.scan over stacked layer weights, as nn.scan and nnx.scan "
             "run, a jax.lax.fori_loop over layers under jax.grad, a shardplan.layer_scan or shardplan.layer_remat)")


def remat_setting(remat):
    """``remat=`` checked: ``None`` (the default), ``"off"``, ``"auto"``, a policy name or
    ``{class key: policy}``."""
    if remat is None or remat in ("auto", "off"):
        return remat
    if not isinstance(remat, (str, dict)):
        raise recompute.RecomputeError(f"remat={remat!r}: give 'auto', 'off', None or a policy name "
                                       f"({', '.join(recompute.POLICIES)})")
    with recompute.recomputing(remat):     # checks every name
        pass
    return remat


def _trace_in(trace: Callable[[], TracedStep], config, remat, axis_names, axis_sizes, named: bool = False):
    """``(traced step, layer classes met)``: ``trace()`` inside ``config``'s pipeline (``None``:
    none) with recomputation ``remat`` (:func:`shardplan.recompute.recomputing`; ``None``: the
    step as written). Raises :class:`NoLayerStackError` where the step has no layer stack to pipeline;
    ``named``: ``remat`` is the user's own ``{class key: policy}``, whose keys must be classes the step has."""
    with contextlib.ExitStack() as stack:
        sites = stack.enter_context(recompute.recomputing(remat)) if remat is not None else {}
        traced, refused = pipeline_search.trace_for(trace, config, axis_names, axis_sizes)
    if named and isinstance(remat, dict) and config is None:
        unknown = sorted(set(remat) - set(sites))
        if unknown:
            raise recompute.RecomputeError(
                f"remat names layer classes the step does not have: {', '.join(map(repr, unknown))}; its classes are "
                + (", ".join(repr(k) for k in sites) or "none") + " (plan.remat['sites'] lists each class's key)")
    if traced is None:
        raise NoLayerStackError(
            "the step has no layer stack a pipeline can split"
            + (": " + "; ".join(refused) if refused else
               " (a jax.lax.scan over stacked layer weights, as nn.scan and nnx.scan run, or a shardplan.layer_scan;"
               " layers unrolled in a Python loop, each with its own weights, are recomputed but not pipelined)")
            + "; plan with pipeline='off'")
    return traced, sites


def _remat_record(sites: dict, choices) -> dict | None:
    """``Plan.remat`` for a step traced under ``choices`` meeting ``sites``."""
    if choices is None:
        return None
    pick = (lambda k: choices) if isinstance(choices, str) else \
        (lambda k: choices.get(k, recompute.USER if sites[k].checkpointed else "none"))
    return {"sites": [site.to_json(pick(k)) for k, site in sites.items()]}


def host_apart(mesh_spec: MeshSpec) -> bool:
    """Whether the mesh's compiler holds host-offloaded tensors apart from device memory."""
    return compiler_kind(mesh_spec) != "cpu"


def _check_offload(remat, mesh_spec: MeshSpec) -> None:
    named = [remat] if isinstance(remat, str) else list(remat.values()) if isinstance(remat, dict) else []
    if not host_apart(mesh_spec) and any(p in recompute.OFFLOADING for p in named):
        raise recompute.RecomputeError(
            f"remat='offload' holds residuals in host memory, but mesh {mesh_spec.name!r} runs through XLA's CPU "
            "compiler, which keeps host and device memory as one: nothing would be saved. Plan on the GPU or TPU "
            "mesh it will run on (mesh='h100-8', hardware=...), or choose another policy")


def plan_search(trace: Callable[[], TracedStep], mesh_spec: MeshSpec, memory_budget, options: PlannerOptions,
                cache, setting=None, remat=None, context=None, written=None) -> tuple[Plan, tuple]:
    """``(plan, (graph, traced step))``: the step planned with each family as set, a family left
    at its default (``None``) searched where it can help (:func:`shardplan.defaults.planned`):
    a pipeline on a mesh of several nodes; recomputation, a sequence split and (on one node) a
    pipeline where the step as written does not fit the budget. ``"off"`` keeps the step as
    written. ``written``: the step as written already planned (``(plan, rest)``) or found not to
    fit (its :class:`InfeasibleBudgetError`)."""
    return defaults.planned(
        lambda p, r, c: _plan_pinned(trace, mesh_spec, memory_budget, options, cache, p, r, c),
        mesh_spec, budget_for(memory_budget, mesh_spec), setting, remat, context, written)


def _plan_pinned(trace: Callable[[], TracedStep], mesh_spec: MeshSpec, memory_budget, options: PlannerOptions,
                 cache, setting, remat=None, context=None) -> tuple[Plan, tuple]:
    """``(plan, (graph, traced step))``: the step planned for every candidate pipeline of
    ``setting`` (:func:`shardplan.pipeline_search.candidates`) and, with ``remat="auto"``, every
    recomputation :func:`shardplan.recompute.search` tries (a policy name or ``{class key:
    policy}``: that one), and with ``context``, every way to run its attention
    (:func:`shardplan.sequence.search`); the lowest predicted step that fits the budget kept."""
    _check_offload(remat, mesh_spec)
    if context is not None:
        return sequence.search(trace, lambda t: _plan_pinned(t, mesh_spec, memory_budget, options, cache, setting,
                                                              remat), mesh_spec, context, setting)
    cands, deeper, untried = pipeline_search.rounds(mesh_spec, setting, trace, budget_for(memory_budget, mesh_spec))
    if untried:
        with Status() as line:
            line.done(untried)
    if deeper:
        cands.append(None)            # here: deeper pipelines follow where nothing before fitted
    best, failures, no_layers = None, [], False

    met = {}             # the layer classes of the last trace, kept when its plan does not fit

    def traced_in(cand, choices):
        traced, sites = _trace_in(trace, cand.config, choices, cand.mesh.axis_names, cand.mesh.axis_sizes,
                                  named=choices is remat)
        met.clear()
        met.update(sites)
        return traced, sites

    def plan_in(cand, choices, beat=math.inf, traced=None):
        """The plan in ``cand`` under ``choices``; ``None`` where no plan can be faster than
        ``beat`` seconds (the unconstrained optimum is not: under the budget it only gets slower on
        the ILP's objective, and all but always on the prediction).
        ``traced``: the step traced in ``cand`` (``traced_in``'s), if it was already."""
        traced, sites = traced if traced is not None else traced_in(cand, choices)
        budget = budget_for(memory_budget, cand.mesh)
        # Where the plan without the budget does not fit and is no faster than ``beat``, the
        # planner stops there (under the budget it only gets slower: a heuristic for the prediction).
        p, graph = plan_traced(traced, cand.mesh, budget, options, cache, beat=beat)
        if p.cost.step_s >= beat:
            return None
        return dataclasses.replace(p, pipeline=None if cand.config is None else cand.config.to_json(),
                                   remat=_remat_record(sites, choices)), (graph, traced), sites

    completed = []       # every plan that came back: the candidates each family's choice beat

    def keep(found, ties=False):
        nonlocal best
        for p, rest in found:
            completed.append(p)
            if best is None or p.cost.step_s < best[0].cost.step_s or ties and p.cost.step_s == best[0].cost.step_s:
                best = (p, rest)

    # With pipelines to plan, the plan without one is made on a thread alongside the deepest
    # stage count's (CP-SAT, most of its time, lets go of the interpreter) and joins the best
    # so far only after them: the same point whatever the machine, so the plan does not depend
    # on how fast either finishes.
    alongside, deepest = None, next((c.config.stages for c in cands if c is not None and c.config is not None), None)

    def join_alongside():
        nonlocal alongside
        if alongside is None:
            return
        try:
            got = alongside()
        except InfeasibleBudgetError as e:
            alongside = None
            failures.append(e)
            with Status() as line:
                line.done("without a pipeline (planned alongside): no plan fits the budget")
            return
        alongside = None
        with Status() as line:
            line.done(f"without a pipeline (planned alongside): {got[0].solver.status}, predicted step "
                      f"{got[0].cost.step_s * 1e3:.3f} ms")
        keep([got[:2]], ties=True)           # the same step: no pipeline is the simpler plan

    try:
        for k, cand in enumerate(cands):
            if alongside is not None and (cand is None or cand.config is None or cand.config.stages != deepest):
                join_alongside()
            if cand is None:
                if best is None and all(isinstance(e, InfeasibleBudgetError) for e in failures):
                    with Status() as line:
                        line.done("no pipeline of up to 16 stages fits: trying deeper ones")
                    cands += deeper
                continue
            if cand.config is not None and len(cands) > 1:
                with Status() as line:
                    line.done(f"pipeline candidate {k + 1}/{len(cands)}: {cand.config.describe()}")
            try:
                if remat != "auto" and cand.config is None and deepest is not None:
                    alongside = _on_thread(functools.partial(plan_in, cand, remat, traced=traced_in(cand, remat)))
                    with Status() as line:
                        line.done(f"pipeline candidate 1/{len(cands)}: none, planned alongside the next "
                                  f"({deepest} stages)")
                    continue
                if remat != "auto":
                    got = plan_in(cand, remat, best[0].cost.step_s if best is not None and cand.config else math.inf)
                    found = [] if got is None else [got[:2]]      # None: no faster than the best so far
                else:
                    made = {}

                    def evaluate(choices, beat=math.inf, cand=cand, made=made):
                        try:
                            found = plan_in(cand, choices, beat)
                        except InfeasibleBudgetError as e:
                            failures.append(e)
                            return None
                        if found is None:
                            return None
                        made[id(found[0])] = found[:2]
                        return found[0]

                    def say(text):
                        with Status() as line:
                            line.done(f"recomputation candidate: {text}")

                    first = evaluate({})                 # the step as written: meets its layer classes
                    sites = dict(met)
                    no_layers = no_layers or not sites
                    if sites:
                        _, first, _ = recompute.search(evaluate, sites, say=say, first=first,
                                                       policies=recompute.policies_for(host_apart(cand.mesh)),
                                                       unrolled_saves=compiler_kind(cand.mesh) != "cpu")
                    completed.extend(p for p, _ in made.values() if p is not first)
                    found = [] if first is None else [made[id(first)]]
            except (PipelineError, InfeasibleBudgetError) as e:
                failures.append(e)
                if isinstance(e, NoLayerStackError):
                    break              # no other pipeline applies either
                continue
            keep(found)
        join_alongside()
    except BaseException:                # Ctrl-C, or an error: the plan made alongside is given up
        if alongside is not None:
            alongside.stop()
        raise
    if best is None:
        # The least memory any candidate needed, else why none applied.
        infeasible = [e for e in failures if isinstance(e, InfeasibleBudgetError)]
        error = min(infeasible, key=lambda e: e.min_feasible_bytes or float("inf")) if infeasible else failures[0]
        if remat == "auto" and no_layers and isinstance(error, InfeasibleBudgetError):
            error.no_layers = True
        raise error
    if untried:
        best = (dataclasses.replace(best[0], warnings=best[0].warnings + (untried,)), best[1])
    searched = dict(best[0].searched)
    if any(c is not None and c.config is not None for c in cands):
        searched["pipeline"] = runner_up(completed, best[0], "pipeline")
    if remat == "auto" and (best[0].remat or {}).get("sites"):
        searched["remat"] = runner_up(completed, best[0], "remat")
    best = (dataclasses.replace(best[0], searched=searched), best[1])
    unrolled = {k for k, site in met.items() if not site.scanned} if compiler_kind(mesh_spec) == "cpu" else set()
    wasted = [s["where"] for s in (best[0].remat or {}).get("sites", [])
              if s["key"] in unrolled and s["policy"] not in ("none", recompute.USER)]
    if wasted:
        best = (dataclasses.replace(best[0], warnings=best[0].warnings + (
            f"remat={remat!r} recomputes the unrolled layers at {', '.join(wasted)}, but {recompute.CPU_UNROLLED}: "
            "the predicted memory counts a saving this compiler does not make",)), best[1])
    if (no_layers or remat not in (None, "auto")) and not (best[0].remat or {}).get("sites"):
        best = (dataclasses.replace(best[0], warnings=best[0].warnings + (
            f"remat={remat!r}: {NO_LAYERS}, so no layer's recomputation could be "
            + ("chosen" if remat == "auto" else "set") + "; the step is planned as written",)), best[1])
    return best


def _on_thread(work: Callable[[], object]) -> Callable[[], object]:
    """``work()`` started on a thread, silenced (:func:`shardplan.progress.silenced`); the
    returned function waits for its result (or raises its error), and its ``stop()`` stops the
    thread's CP-SAT solves (:class:`shardplan.solver.StopToken`). Waiting on an Event, not
    ``Thread.join``, keeps Ctrl-C working (see :func:`shardplan.solver._solve_interruptibly`)."""
    box, done, token = {}, threading.Event(), StopToken()

    def run():
        try:
            with silenced(), stoppable(token):
                box["value"] = work()
        except BaseException as e:          # handed to the waiting thread
            box["error"] = e
        finally:
            done.set()
    threading.Thread(target=run, name="shardplan-plan", daemon=True).start()

    def result():
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]
    result.stop = token.stop          # given up on: its CP-SAT solve ends at once, the next is not run
    return result


def traced_as_planned(trace: Callable[[], TracedStep], plan: Plan) -> TracedStep:
    """The step traced as ``plan`` was made: inside its pipeline, if it has one, with its recomputation."""
    choices = None if plan.remat is None else {s["key"]: s["policy"] for s in plan.remat["sites"]}
    if plan.context is not None:
        trace = sequence.traced_in(trace, plan.context_config(), plan.axis_names, plan.axis_sizes)
    try:
        traced, sites = _trace_in(trace, plan.pipeline_config(), choices, plan.axis_names, plan.axis_sizes)
    except NoLayerStackError as e:
        raise PlanMismatchError(f"the plan pipelines a layer stack, but in this step {e}") from None
    missing = [s["where"] for s in (plan.remat or {}).get("sites", ()) if s["key"] not in sites]
    if missing:
        raise PlanMismatchError(f"the plan recomputes the layer class at {missing[0]}, which this step does not "
                                "have (same code line and layer shapes): plan the step again")
    return traced
