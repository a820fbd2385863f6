"""Choosing a pipeline: which configurations to plan, and the mesh each runs on.

The planner plans a step once per candidate pipeline (the step traced inside
:func:`~shardplan.pipeline.pipelined`, so the pipeline's compute, bubble, stage-to-stage moves
and the activations its microbatches keep are in the traced program the ILP prices) and keeps
the candidate with the lowest predicted step that fits the memory budget. A pipeline's stage
axis is split off the mesh's outermost axis (the one that crosses nodes on a multi-node mesh):
``{"data": 16, "model": 8}`` with 4 stages plans on ``{"stage": 4, "data": 4, "model": 8}``.
"""

from __future__ import annotations

import dataclasses

import jax

from shardplan.mesh import MeshSpec
from shardplan.pipeline import PipelineConfig, PipelineError, Schedule, pipelined

STAGE_AXIS = "stage"
MAX_AUTO_STAGES = 16


@dataclasses.dataclass(frozen=True)
class Candidate:
    config: PipelineConfig | None       # None: no pipeline
    mesh: MeshSpec


def with_stage_axis(mesh: MeshSpec, stages: int, axis: str = STAGE_AXIS) -> MeshSpec:
    """``mesh`` with a stage axis of ``stages`` devices: as it is where it has one of that size;
    else split off the outermost axis whose size ``stages`` divides (laid as
    :meth:`MeshSpec.with_axes` lays axes, so a stage axis across nodes rides the inter-node link)."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    if axis in sizes:
        if sizes[axis] != stages:
            raise PipelineError(f"mesh {mesh.name} has a {axis!r} axis of {sizes[axis]} devices, not {stages}: use "
                                f"stages={sizes[axis]}")
        return mesh
    for name, size in sizes.items():
        if size % stages == 0:
            rest = {k: (v // stages if k == name else v) for k, v in sizes.items()}
            return mesh.with_axes({axis: stages, **{k: v for k, v in rest.items() if v > 1 or k != name}})
    raise PipelineError(f"no axis of mesh {mesh.name} {sizes} splits into {stages} stages; use stages dividing one "
                        "of the axis sizes")


def candidates(mesh: MeshSpec, setting) -> list[Candidate]:
    """What to plan for ``pipeline=setting``: ``None`` or ``"off"``, no pipeline; a
    :class:`PipelineConfig`, that one; an int ``N``, ``N`` stages (GPipe with ``2N`` and ``8N``
    microbatches, circular with 2 rounds and ``2N``) and, ``"auto"``, those for every stage count
    up to 16 that divides the outermost mesh axis, and no pipeline."""
    if setting is None or setting == "off":
        return [Candidate(None, mesh)]
    if isinstance(setting, PipelineConfig):
        return [Candidate(setting, with_stage_axis(mesh, setting.stages, setting.axis))]
    if isinstance(setting, bool) or not (setting == "auto" or isinstance(setting, int) and setting >= 1):
        raise PipelineError(f"pipeline={setting!r}: give 'auto', 'off', a number of stages or a PipelineConfig")
    if setting == "auto":
        outer = mesh.axis_sizes[0]
        counts = [s for s in range(2, min(outer, MAX_AUTO_STAGES) + 1) if outer % s == 0]
        out = [Candidate(None, mesh)]
    else:
        counts, out = ([setting] if setting > 1 else []), ([] if setting > 1 else [Candidate(None, mesh)])
    for s in counts:
        staged = with_stage_axis(mesh, s)
        out += [Candidate(PipelineConfig(s, 2 * s), staged), Candidate(PipelineConfig(s, 8 * s), staged),
                Candidate(PipelineConfig(s, 2 * s, Schedule.CIRCULAR, repeats=2), staged)]
    return out


def trace_for(trace, config: PipelineConfig | None, axis_names, axis_sizes):
    """``trace()`` (a step's trace) inside ``config``'s pipeline on a mesh of these axes (as it
    is where ``config`` is ``None``). ``None`` where the pipeline does not apply (the step has no
    :func:`~shardplan.pipeline.layer_scan`)."""
    if config is None:
        return trace()
    auto = (jax.sharding.AxisType.Auto,) * len(axis_names)
    with pipelined(config, jax.sharding.AbstractMesh(tuple(axis_sizes), tuple(axis_names), axis_types=auto)) as use:
        traced = trace()
    return traced if use.pipelined else None
