"""What each parallelism family does when the user leaves it at its default.

``shardplan.auto(step, mesh=..., memory_budget=...)`` with no other flag searches the families
where they can help, so that a step written without shardplan in mind gets them:

* **pipeline**: searched (``"auto"``) on a mesh of several nodes, where the stage axis rides the
  slow inter-node link and a pipeline can replace its collectives by one activation a
  microbatch; off on one node, unless the step as written does not fit (below);
* **recomputation** and **context** (a sequence split of attention): the step as written first;
  where it does not fit the budget, recomputation, a sequence split and (on one node) a
  pipeline are each searched, then recomputation with each of the others, and the fastest plan
  that fits is kept (``plan.warnings`` says which family made it fit, and how to pin it).

``"off"`` keeps the step exactly as written; ``"auto"`` always searches; a policy, a stage
count or a config pins one. Where nothing fits, :class:`~shardplan.errors.InfeasibleBudgetError`
lists what was tried per family and the least memory each needed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from shardplan.devices.mesh import MeshSpec
from shardplan.errors import InfeasibleBudgetError, ShardplanError
from shardplan.util.progress import Status
from shardplan.util.sizes import format_bytes


def pipeline_default(mesh: MeshSpec, pipeline, context):
    """``pipeline=`` as the planner takes it: where left at ``None``, ``"auto"`` on a mesh of
    several nodes (unless a sequence split is asked for: it is not planned with a pipeline),
    else none; ``"off"``: none."""
    if pipeline is None:
        return "auto" if mesh.nodes > 1 and context in (None, "off") else None
    return None if pipeline == "off" else pipeline


@dataclasses.dataclass(frozen=True)
class _Try:
    """One way to plan a step that does not fit as written: each family's setting, and a label."""

    label: str                  # "recomputation (remat='auto')"
    pipeline: object
    remat: object
    context: object
    alone: _Try | None = None   # a pair: its family other than recomputation, as tried alone


def _less(e: Exception, written: InfeasibleBudgetError) -> bool:
    """Whether a family's failure ``e`` needed less memory than the step as written."""
    return (isinstance(e, InfeasibleBudgetError) and e.min_feasible_bytes is not None
            and written.min_feasible_bytes is not None and e.min_feasible_bytes < written.min_feasible_bytes)


def planned(plan_pinned: Callable, mesh: MeshSpec, budget: int, pipeline, remat, context, written=None):
    """``(plan, rest)`` from ``plan_pinned(pipeline, remat, context, beat, written)`` (each setting
    as the planner takes it: ``None`` for none; ``None`` back where no plan could beat ``beat``
    seconds; ``written``: why the step exactly as written does not fit, where known)
    with the defaults above applied to the settings left at ``None``. ``written``: the step as
    written already planned, or its :class:`InfeasibleBudgetError`."""
    first_pipeline = pipeline_default(mesh, pipeline, context)
    as_remat = None if remat in (None, "off") else remat
    as_context = None if context in (None, "off") else context
    if written is None:
        try:
            return plan_pinned(first_pipeline, as_remat, as_context, math.inf, None)
        except InfeasibleBudgetError as e:
            written = e
    if not isinstance(written, InfeasibleBudgetError):
        return written
    singles, pairs = _fallbacks(pipeline, remat, context, first_pipeline, as_remat, as_context)
    if not singles:
        raise written
    if written.floor_bytes is not None and budget < written.floor_bytes:
        # No family changes what the arguments take: none is tried.
        why = (f"no pipeline, recomputation or sequence split can help: the step's arguments alone take "
               f"{format_bytes(written.floor_bytes)} a device, split evenly over all {mesh.num_devices} devices")
        with Status() as line:
            least = "" if written.min_feasible_bytes is None else \
                f"needs at least {written.min_feasible_bytes / 2**30:.2f} GiB a device; "
            line.done(f"no plan fits the budget of {budget / 2**30:.2f} GiB: {least}{why}")
        written.args = (f"{written.args[0]}\n({why})",) + written.args[1:]
        raise written
    found, failed = [], [("the step as written", written)]
    # Where the first plan was the step exactly as written, a try that meets it again knows it does not fit.
    known = written if first_pipeline is None and as_remat is None and as_context is None else None
    helped = set()                         # the families that alone needed less memory than the step as written

    def attempt(t: _Try) -> None:
        # Each try planned to beat the best plan of the tries before it: one that cannot is dropped early.
        beat = min((plan.cost.step_s for _, (plan, _) in found), default=math.inf)
        try:
            got = plan_pinned(t.pipeline, t.remat, t.context, beat, known)
        except ShardplanError as e:        # over the budget, or the family does not apply (no attention, no stack)
            failed.append((t.label, e))
            if _less(e, written):
                helped.add(t)
            return
        if got is not None:
            found.append((t, got))

    for t in singles:
        with Status() as line:
            line.done(f"the step as written needs {_least(written)} a device, over the budget: trying {t.label}")
        attempt(t)
    if not found and singles[0].remat == "auto" and singles[0] in helped:
        # Recomputation with each other family that helped alone: only where no family alone fits.
        for t in pairs:
            if t.alone in helped:
                attempt(t)
    if not found:
        error = _explained(written, failed, mesh, budget)
        least = "" if error.min_feasible_bytes is None else \
            f": needs at least {error.min_feasible_bytes / 2**30:.2f} GiB a device, with every family tried"
        with Status() as line:
            line.done(f"no plan fits the budget of {budget / 2**30:.2f} GiB{least}")
        raise error
    t, (plan, rest) = min(found, key=lambda f: f[1][0].cost.step_s)
    note = (f"the step as written needs {_least(written)} a device, over memory_budget={format_bytes(budget)}: "
            f"planned with {t.label}, searched by default (pass remat='off', context='off', pipeline='off' to keep "
            "the step as written, or pin the family's setting)")
    return dataclasses.replace(plan, warnings=plan.warnings + (note,)), rest


def _fallbacks(pipeline, remat, context, first_pipeline, as_remat, as_context) -> tuple[list[_Try], list[_Try]]:
    """What to plan where the step as written does not fit: each family left at its default
    alone, and recomputation with each of the others."""
    singles = []
    if remat is None:
        singles.append(_Try("recomputation (remat='auto')", first_pipeline, "auto", as_context))
    if context is None:
        # A sequence split is not planned with a pipeline: a defaulted pipeline gives way.
        singles.append(_Try("a sequence split (context='auto')", None if pipeline is None else first_pipeline,
                            as_remat, "auto"))
    if pipeline is None and first_pipeline is None and as_context is None:     # not with a sequence split
        singles.append(_Try("a pipeline (pipeline='auto')", "auto", as_remat, None))
    pairs = [_Try(t.label.replace("(", "with recomputation (remat='auto', "), t.pipeline, "auto", t.context, t)
             for t in singles[1:]] if remat is None else []
    return singles, pairs


def _least(e: InfeasibleBudgetError) -> str:
    return "an unknown amount" if e.min_feasible_bytes is None else f"about {format_bytes(e.min_feasible_bytes)}"


def _why(e: Exception) -> str:
    if isinstance(e, InfeasibleBudgetError):
        if getattr(e, "no_layers", False):
            return "could not help: the step has no layer stack to recompute"
        # A search's own word on why it could not help (sequence.search: no attention to split).
        said = [x for x in str(e).splitlines()[1:] if x.startswith("(")]
        return f"needs {_least(e)}" + "".join(f" {x}" for x in said)
    return f"does not apply: {str(e).splitlines()[0]}"


def _explained(written: InfeasibleBudgetError, failed: list, mesh: MeshSpec, budget: int) -> InfeasibleBudgetError:
    """One error for all the families tried: each one's least memory, the least of them all."""
    least = min((e.min_feasible_bytes for _, e in failed
                 if isinstance(e, InfeasibleBudgetError) and e.min_feasible_bytes is not None), default=None)
    lines = "\n".join(f"  - {label}: {_why(e)}" for label, e in failed)
    listing = ", ".join(f"{n} ({format_bytes(b)})" for n, b in written.largest_tensors)
    error = InfeasibleBudgetError(
        f"no plan fits memory_budget={format_bytes(budget)} per device on mesh {mesh.name} "
        f"{dict(zip(mesh.axis_names, mesh.axis_sizes))}. Tried, with the least memory each needs:\n{lines}\n"
        f"The smallest budget that works is {'unknown' if least is None else 'about ' + format_bytes(least)}"
        + (f". Largest inputs: {listing}" if listing else "")
        + ". Raise the budget, use more devices, or shrink the batch.",
        budget_bytes=budget, min_feasible_bytes=least if least is not None else written.min_feasible_bytes,
        largest_tensors=written.largest_tensors)
    error.tried = [(label, e.min_feasible_bytes if isinstance(e, InfeasibleBudgetError) else None)
                   for label, e in failed]
    return error


def runner_up(completed: list, best, family: str) -> str:
    """For :attr:`~shardplan.plans.plan.Plan.searched`: the fastest of ``completed`` whose choice for ``family``
    differs from ``best``'s, and its predicted step against ``best``'s."""
    others = [p for p in completed if p.choice(family) != best.choice(family)]
    if not others:
        return "no other candidate fitted the budget or could beat it"
    other = min(others, key=lambda p: p.cost.step_s)
    return f"best other: {other.choice(family)}, predicted {_seconds(other.cost.step_s)} against " \
           f"{_seconds(best.cost.step_s)}"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"
