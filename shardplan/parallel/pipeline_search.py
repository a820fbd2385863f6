"""Choosing a pipeline: which configurations to plan, and the mesh each runs on.

The planner plans a step once per candidate pipeline (the step traced inside
:func:`~shardplan.parallel.pipeline.pipelined`, so the pipeline's compute, bubble, stage-to-stage moves
and the activations its microbatches keep are in the traced program the ILP prices) and keeps
the candidate with the lowest predicted step that fits the memory budget. A pipeline's stage
axis is split off the mesh's outermost axis (the one that crosses nodes on a multi-node mesh):
``{"data": 16, "model": 8}`` with 4 stages plans on ``{"stage": 4, "data": 4, "model": 8}``.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from shardplan.devices.mesh import MeshSpec
from shardplan.errors import InfeasibleBudgetError
from shardplan.parallel.defaults import runner_up
from shardplan.parallel.families import JOIN, Alongside, Family
from shardplan.parallel.pipeline import (
    NoLayerStackError,
    PipelineConfig,
    PipelineError,
    Schedule,
    StackSite,
    pipelined,
    recognising,
    seen_stacks,
)
from shardplan.util.progress import said

STAGE_AXIS = "stage"
MAX_AUTO_STAGES = 16
MAX_DEEP_STAGES = 64       # tried only where no pipeline of up to MAX_AUTO_STAGES fits


@dataclasses.dataclass(frozen=True)
class Candidate:
    config: PipelineConfig | None       # None: no pipeline
    mesh: MeshSpec


def with_stage_axis(mesh: MeshSpec, stages: int, axis: str = STAGE_AXIS) -> MeshSpec:
    """``mesh`` with a stage axis of ``stages`` devices: as it is where it has one of that size;
    else split off the outermost axis whose size ``stages`` divides (laid as
    :meth:`MeshSpec.with_axes` lays axes, so a stage axis across nodes rides the inter-node link)."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    staged = staged_axes(sizes, stages, axis, name=mesh.name)
    return mesh if staged == sizes else mesh.with_axes(staged)


def staged_axes(sizes: dict[str, int], stages: int, axis: str = STAGE_AXIS, *, name: str = "mesh") -> dict[str, int]:
    """The mesh axes ``{name: size}`` with a stage axis of ``stages`` devices, as
    :func:`with_stage_axis` lays them (the stage axis first, split off the outermost axis it divides)."""
    if axis in sizes:
        if sizes[axis] != stages:
            raise PipelineError(f"mesh {name} has a {axis!r} axis of {sizes[axis]} devices, not {stages}: use "
                                f"stages={sizes[axis]}")
        return dict(sizes)
    for split, size in sizes.items():
        if size % stages == 0:
            rest = {k: (v // stages if k == split else v) for k, v in sizes.items()}
            return {axis: stages, **{k: v for k, v in rest.items() if v > 1 or k != split}}
    raise PipelineError(f"no axis of mesh {name} {sizes} splits into {stages} stages; use stages dividing one "
                        "of the axis sizes")


def microbatch_counts(staged: MeshSpec, stages: int, batch: int) -> list[int]:
    """Microbatch counts worth planning for ``stages`` stages on ``staged`` (the mesh with its
    stage axis) and a global ``batch``: from ``stages`` to ``16 * stages``, dividing the batch,
    and each microbatch dividing over the mesh axes other than the stage axis (bar the innermost,
    the tensor-parallel one, where there are two or more): a microbatch whose rows do not split
    over the data axes is computed whole on every data rank (GPT-3 175B on 1024 A100s with 2
    stages: 96-sequence microbatches over a data axis of 64 planned at 7x the step of 384-sequence
    ones). Counts that divide the batch, where none also divides over the data axes."""
    rows = _rows(staged)
    dividing = [m for m in range(stages, 16 * stages + 1) if batch % m == 0]
    return [m for m in dividing if (batch // m) % rows == 0] or dividing


def _rows(staged: MeshSpec) -> int:
    """Devices a microbatch's rows split over: the mesh axes other than the stage axis, bar the
    innermost (the tensor-parallel one) where there are two or more."""
    sizes = [n for a, n in zip(staged.axis_names, staged.axis_sizes) if a != STAGE_AXIS and n > 1]
    return math.prod(sizes[:-1] if len(sizes) >= 2 else sizes)


def candidates(mesh: MeshSpec, setting, stack: StackSite | None = None,
               budget_bytes: float = math.inf, deep: bool = False) -> list[Candidate]:
    """What to plan for ``pipeline=setting``: ``None`` or ``"off"``, no pipeline; a
    :class:`PipelineConfig`, that one; an int ``N``, ``N`` stages and, ``"auto"``, every stage
    count up to 16 that divides the outermost mesh axis (and the layers), and no pipeline;
    ``deep=True``: with ``"auto"``, the stage counts from 17 to 64 instead (and no other).

    Per stage count ``S``: GPipe with few microbatches (the least of
    :func:`microbatch_counts` from ``2S``) and with many (the most up to ``8S``), and the
    circular schedule with 2 rounds and the few. ``stack`` (the step's layer stack, from
    :func:`probe`) decides the counts (without it, ``2S`` and ``8S``), and whether the many and
    the circular candidates sum their weight gradients once per step (``replicas``, one row
    group per data rank): where a stage's weights and their gradients, split over the innermost
    mesh axis alone, take at most half of ``budget_bytes``."""
    if setting is None or setting == "off":
        return [Candidate(None, mesh)]
    if isinstance(setting, PipelineConfig):
        return [Candidate(setting, with_stage_axis(mesh, setting.stages, setting.axis))]
    if isinstance(setting, bool) or not (setting == "auto" or isinstance(setting, int) and setting >= 1):
        raise PipelineError(f"pipeline={setting!r}: give 'auto', 'off', a number of stages or a PipelineConfig")
    if setting == "auto":
        outer = mesh.axis_sizes[0]
        low, high = (MAX_AUTO_STAGES + 1, MAX_DEEP_STAGES) if deep else (2, MAX_AUTO_STAGES)
        counts = [s for s in range(low, min(outer, high) + 1) if outer % s == 0]
        if stack is not None:
            counts = [s for s in counts if stack.layers % s == 0]
        out = [] if deep else [Candidate(None, mesh)]
    else:
        counts, out = ([setting] if setting > 1 else []), ([] if setting > 1 else [Candidate(None, mesh)])
    for s in counts:
        staged = with_stage_axis(mesh, s)
        few, many, replicas = 2 * s, 8 * s, 1
        if stack is not None and stack.batch is not None:
            ms = microbatch_counts(staged, s, stack.batch)
            if not ms:
                continue         # fewer rows than stages: no microbatch for every stage
            few = next((m for m in ms if m >= 2 * s), ms[-1])
            many = max((m for m in ms if m <= 8 * s), default=few)
            rows, inner = _rows(staged), staged.axis_sizes[-1]
            if rows > 1 and (stack.batch // many) % rows == 0 and (stack.batch // few) % rows == 0 \
                    and 2 * stack.nbytes / (s * inner) <= budget_bytes / 2:
                replicas = rows
        configs = [PipelineConfig(s, few)]
        if many != few or replicas > 1:
            configs.append(PipelineConfig(s, many, replicas=replicas))
        if stack is None or stack.layers % (2 * s) == 0:
            configs.append(PipelineConfig(s, few, Schedule.CIRCULAR, repeats=2, replicas=replicas))
        out += [Candidate(c, staged) for c in configs]
    return out


def probe(trace) -> tuple[StackSite | None, list[str], int]:
    """``(the step's layer stack, why its other layer stacks cannot be pipelined, how many stacks a
    pipeline could split)``, from tracing it outside a pipeline: a :func:`~shardplan.parallel.pipeline.layer_scan`
    or a plain loop recognised as one (:func:`~shardplan.parallel.pipeline.recognising`); the stack is ``None``
    where it has none, or more than one of different shapes."""
    with seen_stacks() as seen, recognising():
        trace()
    sites = seen.sites
    return (sites[0] if sites and len(set(sites)) == 1 else None), seen.refused, len(sites)


def rounds(mesh: MeshSpec, setting, trace, budget_bytes: float) \
        -> tuple[list[Candidate], list[Candidate], str | None]:
    """``(candidates, deeper ones, why no pipeline is tried)`` for ``pipeline=setting`` on a step
    traced by ``trace()``: the deeper ones (17 to 64 stages, ``"auto"`` only) are for where none of
    the first fits (GPT-3-sized stacks on thousands of GPUs: Megatron-LM ran 35 and 64 stages). The
    step is traced once more, outside any pipeline, to read its layer stack, where the setting
    searches stage counts. Each list is in :func:`_promise` order. The reason is ``None`` unless
    ``"auto"`` found a layer stack but no stage count to split it in."""
    searched = setting == "auto" or isinstance(setting, int) and not isinstance(setting, bool)
    stack, refused, splittable = probe(trace) if searched else (None, [], 0)
    if setting == "auto" and not splittable:
        # No stack a pipeline can split: no pipeline is planned (each would say so, NoLayerStackError).
        return [Candidate(None, mesh)], [], ("pipeline='auto' tried no pipeline: " + "; ".join(refused)
                                             if refused else None)
    first = sorted(candidates(mesh, setting, stack, budget_bytes), key=_promise)
    if setting != "auto":
        return first, [], None
    deeper = sorted(candidates(mesh, setting, stack, budget_bytes, deep=True), key=_promise)
    why = None
    if stack is None and refused:
        why = "pipeline='auto' tried no pipeline: " + "; ".join(refused)
    if stack is not None and all(c.config is None for c in first + deeper):
        outer, name = mesh.axis_sizes[0], mesh.axis_names[0]
        counts = [s for s in range(2, min(outer, MAX_DEEP_STAGES) + 1) if outer % s == 0]
        dividing = [s for s in counts if stack.layers % s == 0]
        why = (f"pipeline='auto' tried no pipeline: the stages split mesh axis {name!r} ({outer} devices), and "
               + ("it splits into no stage count from 2 to 64" if not counts else
                  f"none of its stage counts {counts} divides the {stack.layers} layers of the layer_scan"
                  if not dividing else f"a batch of {stack.batch} has too few rows for {dividing} stages")
               + "; planned without a pipeline (give pipeline=N or a PipelineConfig that fits, on a mesh whose "
               "outermost axis has N devices)")
    return first, deeper, why


def _promise(c: Candidate) -> tuple:
    """The order candidates are planned in, likeliest to win first, so that the best plan so far
    cuts the later ones short (:func:`shardplan.api.plan`): no pipeline, then the deepest
    pipelines (the least memory a device), each with its smallest bubble first (most
    microbatches times rounds: GPipe with many, circular, GPipe with few)."""
    if c.config is None:
        return (0, 0, 0)
    return (1, -c.config.stages, -c.config.microbatches * c.config.repeats)


def trace_for(trace, config: PipelineConfig | None, axis_names, axis_sizes):
    """``(traced step, why not pipelined)``: ``trace()`` (a step's trace, its plain layer stacks
    recognised: :func:`~shardplan.parallel.pipeline.recognising`) inside ``config``'s pipeline on a mesh
    of these axes (as it is where ``config`` is ``None``). The traced step is ``None`` where the
    pipeline does not apply (the step has no layer stack it can split), and the reasons say why
    each stack met was not split."""
    if config is None:
        with recognising():
            return trace(), []
    auto = (jax.sharding.AxisType.Auto,) * len(axis_names)
    with pipelined(config, jax.sharding.AbstractMesh(tuple(axis_sizes), tuple(axis_names), axis_types=auto)) as use, \
            recognising():
        traced = trace()
    return (traced if use.pipelined else None), use.refused


class PipelineFamily(Family):
    """Pipelines as a :class:`~shardplan.parallel.families.Family`: the candidates of :func:`rounds`, the
    deeper ones only where none of the first fits; the plan without a pipeline is planned alongside
    the deepest stage count's (where every family inside is pinned)."""

    name = "pipeline"
    errors = (PipelineError,)

    def __init__(self, setting):
        super().__init__(setting)
        self.untried = None             # why "auto" tried no pipeline
        self.searched = False           # whether any pipeline was a candidate

    def pinned(self) -> bool:
        return not (self.setting == "auto" or isinstance(self.setting, int) and not isinstance(self.setting, bool))

    def explore(self, point, search, alone: bool = True):
        cands, deeper, self.untried = rounds(point.mesh, self.setting, point.trace, search.budget(point.mesh))
        if self.untried:
            said(self.untried)
        if not cands:
            raise PipelineError(f"pipeline={self.setting!r}: no pipeline of this setting splits the step (its batch "
                                "has fewer rows than stages); give a batch with a row for every stage, or "
                                "pipeline='off'")
        self.searched = self.searched or any(c.config is not None for c in cands)
        deepest = next((c.config.stages for c in cands if c.config is not None), None)
        pending, failures = False, []
        for k, cand in enumerate(cands):
            if pending and (cand.config is None or cand.config.stages != deepest):
                outcome, pending = (yield JOIN), False
                _said_alongside(outcome)
            if cand.config is None and deepest is not None and alone:
                pending = True
                yield Alongside(cand)
                said(f"pipeline candidate 1/{len(cands)}: none, planned alongside the next ({deepest} stages)")
                continue
            if cand.config is not None and len(cands) > 1:
                said(f"pipeline candidate {k + 1}/{len(cands)}: {cand.config.describe()}")
            outcome = yield cand
            if outcome.error is not None:
                failures.append(outcome.error)
            if isinstance(outcome.error, NoLayerStackError):
                break                    # no other pipeline applies either
        if pending:
            _said_alongside((yield JOIN))
        if isinstance(failures[-1] if failures else None, NoLayerStackError):
            return
        if deeper and search.best is None and all(isinstance(e, InfeasibleBudgetError) for e in failures):
            said(f"no pipeline of up to {MAX_AUTO_STAGES} stages fits: trying deeper ones")
            self.searched = True
            for cand in deeper:
                said(f"pipeline candidate: {cand.config.describe()}")
                yield cand

    def enter(self, cand: Candidate, point):
        def trace():
            traced, refused = trace_for(point.trace, cand.config, cand.mesh.axis_names, cand.mesh.axis_sizes)
            if traced is None:
                raise NoLayerStackError(
                    "the step has no layer stack a pipeline can split"
                    + (": " + "; ".join(refused) if refused else
                       " (a jax.lax.scan over stacked layer weights, as nn.scan and nnx.scan run, or a "
                       "shardplan.layer_scan; layers unrolled in a Python loop, each with its own weights, are "
                       "recomputed but not pipelined)")
                    + "; plan with pipeline='off'")
            return traced
        return point.entered(self, cand.config, trace=trace, mesh=cand.mesh)

    def record(self, plan, config, note):
        return dataclasses.replace(plan, pipeline=None if config is None else config.to_json())

    def from_plan(self, plan, point):
        return Candidate(plan.pipeline_config(), point.mesh)

    def finish(self, plan, completed):
        if self.untried:
            plan = dataclasses.replace(plan, warnings=plan.warnings + (self.untried,))
        if self.searched:
            plan = dataclasses.replace(plan, searched={**plan.searched,
                                                       "pipeline": runner_up(completed, plan, "pipeline")})
        return plan




def _said_alongside(outcome) -> None:
    if outcome.plan is not None:
        said(f"without a pipeline (planned alongside): {outcome.plan.solver.status}, predicted step "
             f"{outcome.plan.cost.step_s * 1e3:.3f} ms")
    elif isinstance(outcome.error, InfeasibleBudgetError):
        said("without a pipeline (planned alongside): no plan fits the budget")
