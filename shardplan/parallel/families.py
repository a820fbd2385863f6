"""What a parallelism family is to the search: the protocol one loop composes them by.

A *family* is one way the step is rewritten before it is sharded: a pipeline
(:mod:`shardplan.parallel.pipeline_search`), recomputation (:mod:`shardplan.parallel.recompute`), a sequence split of
attention (:mod:`shardplan.parallel.sequence`). Each implements :class:`Family`:

* :meth:`Family.explore`: its candidates for a setting (``None`` or ``"off"``: the step as written;
  ``"auto"``: searched; a value: that one), as a generator that is sent each candidate's
  :class:`Outcome`, so a family can search adaptively (recomputation changes one layer class at a
  time while the step improves; a pipeline tries deeper stage counts only where none fitted);
* :meth:`Family.enter`: how a candidate is traced (its trace wrapped: the step run inside the
  pipeline, under the recomputation policies, with its attention routed) and on which mesh;
* :meth:`Family.record`: what the plan says of it (``plan.pipeline``, ``plan.remat``, ``plan.context``);
* :meth:`Family.finish` and :meth:`Family.explain`: its word on the chosen plan (the best candidate it
  beat, warnings) and on a search where nothing fitted.

:func:`shardplan.planning.search.plan_search` nests the families (context, pipeline, recomputation) and plans
every combination their generators ask for. Its lower bound for a candidate is the candidate's own
traced program: the planner drops it at the program's step floor, then at its unconstrained optimum,
wherever either cannot beat the best plan found so far by any family
(:func:`shardplan.planning.planner.plan_jaxpr`'s ``beat``). A new family is one module implementing this.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from typing import Any


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What planning a candidate gave: the best plan of it and of everything nested inside it
    (``None``: none fitted, or none could beat the best so far), and where none fitted the error
    saying why (``None`` where every plan was only slower than the best so far)."""

    plan: Any = None
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True)
class Alongside:
    """A candidate a family asks to be planned on a thread alongside its next ones (CP-SAT lets go
    of the interpreter for most of its time); its :class:`Outcome` is sent when the family yields
    :data:`JOIN`, and only then does its plan join the best so far (the same point whatever the
    machine, so the plan does not depend on which finished first). Only where every family nested
    inside is pinned (one plan per candidate)."""

    choice: Any


JOIN = object()       # yielded by a family: wait for its Alongside candidate and take its Outcome


@dataclasses.dataclass(frozen=True)
class Point:
    """A candidate as the search plans it: the step's trace with each outer family's choice
    applied, and the mesh it is planned on (a pipeline adds its stage axis)."""

    trace: Callable[[], Any]
    mesh: Any                                   # a MeshSpec
    chosen: tuple = ()                          # ((family, choice, note), ...), outermost first

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self.mesh.axis_names)

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        return tuple(self.mesh.axis_sizes)

    def choice(self, name: str, default=None):
        """The choice made so far by the family called ``name``."""
        return next((c for f, c, _ in self.chosen if f.name == name), default)

    def entered(self, family: Family, choice, note=None, *, trace=None, mesh=None) -> Point:
        """This point with ``family``'s ``choice`` applied: its trace and mesh as given (else as they
        were), and ``note``, what the choice's trace met, handed to :meth:`Family.record`."""
        return Point(trace or self.trace, mesh if mesh is not None else self.mesh,
                     self.chosen + ((family, choice, note),))


class Family:
    """One parallelism family, as :func:`shardplan.planning.search.plan_search` composes it. One object per
    search: it may keep what its candidates met (for :meth:`finish` and :meth:`explain`)."""

    name: str = ""                    # "pipeline", "remat", "context": Plan.choice's and Plan.searched's key
    errors: tuple[type[BaseException], ...] = ()   # a candidate that does not apply: the search goes on

    def __init__(self, setting):
        self.setting = setting

    def pinned(self) -> bool:
        """Whether the setting gives one candidate without searching."""
        return True

    def explore(self, point: Point, search, alone: bool = True) -> Generator[Any, Outcome | None, None]:
        """The candidates to plan at ``point``; each ``yield`` is sent its :class:`Outcome`.
        ``search`` has ``best`` (the best plan so far, by any family, or ``None``) and ``budget(mesh)``;
        ``alone``: every family nested inside is pinned, so a candidate may be planned :class:`Alongside`."""
        yield None

    def as_written(self, choice) -> bool:
        """Whether ``choice`` leaves the step as written (no pipeline, no recomputation traced, no split)."""
        return choice is None

    def from_plan(self, plan, point: Point):
        """The choice ``plan`` records (:meth:`record`'s), to :meth:`enter` it again at ``point``: a
        saved plan's step is traced as it was made."""
        return None

    def enter(self, choice, point: Point) -> Point:
        """``point`` with ``choice`` applied (:meth:`Point.entered`)."""
        return point.entered(self, choice)

    def record(self, plan, choice, note):
        """``plan`` saying what ``choice`` did (``note``: what its trace met)."""
        return plan

    def finish(self, plan, completed: list):
        """The chosen ``plan`` with this family's word on it (the best candidate it beat, of the
        ``completed`` plans: :attr:`~shardplan.plans.plan.Plan.searched`; warnings)."""
        return plan

    def explain(self, error: BaseException) -> BaseException:
        """The error of a search where nothing fitted, with this family's word on why it could not help."""
        return error
