"""The memory budget held on the compiled program, not only on the prediction.

The planner's memory model is an estimate; XLA's buffer assignment is the truth. After compiling
a plan for the hardware it runs on, :func:`fit_compiled` reads the program's bytes per device
(argument + output + temp - alias, :func:`shardplan.compiler.footprint.compiled_memory`) and,
where they exceed the budget, plans again under a budget tightened by the overshoot, until the
program fits or no plan does.
The error then names the least memory any compiled plan needed.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from shardplan.compiler.footprint import compiled_memory
from shardplan.errors import InfeasibleBudgetError
from shardplan.util.sizes import format_bytes

TRIES = 4            # plans compiled at most (the first included)
_MARGIN = 0.99       # aim a little under the budget: the compiled size is not linear in it
_LEANEST_SLACK = 1.001  # the leanest plan's predicted bytes, as a budget: room for their rounding


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One plan compiled: the budget it was planned under, its predicted and compiled bytes per device."""

    budget_bytes: int
    predicted_bytes: float
    compiled_bytes: float


def _largest_everywhere(value: float) -> float:
    """The largest ``value`` over all processes (each compiles the same program; this keeps every
    process's decision to re-plan the same even if their compilers disagreed)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils
    every = multihost_utils.process_allgather(np.array([value], dtype=np.float64))
    return float(np.max(every))


def fit_compiled(plan_for: Callable[[int], Any], compile_plan: Callable[[Any], Any], budget: int,
                 predicted: Callable[[Any], float], *, tries: int = TRIES, say=None,
                 identity: Callable[[Any], Any] | None = None):
    """Plan under ``budget``, compile, and re-plan under a tighter budget while the compiled
    program holds more than ``budget`` bytes per device.

    ``plan_for(b)`` plans under ``b`` bytes (it raises :class:`InfeasibleBudgetError` when no
    plan fits); ``compile_plan(p)`` compiles what it returned, giving ``(result, compiled)``
    where ``compiled`` has ``memory_analysis()`` (a compiler that refuses a program over the
    device's memory, as libtpu does, counts as over budget by the bytes it reports);
    ``predicted(p)`` is the plan's predicted bytes per device. Returns ``(p, result, attempts)``.
    ``identity(p)`` (e.g. the plan's digest) says when a tighter budget gave a plan already
    compiled: it is not compiled again.
    """
    attempts: list[Attempt] = []
    compiled_before: dict[Any, float] = {}
    planned_under = budget
    leanest_tried = False
    limit = budget          # the budget, or the device's memory where a compiler refused less
    compiles = 0
    for _ in range(tries):
        try:
            made = plan_for(planned_under)
        except InfeasibleBudgetError as e:
            if not attempts:
                raise
            least = e.min_feasible_bytes
            if least and not leanest_tried and least < attempts[-1].budget_bytes:
                # Tightened past every plan: the leanest plan is the last one worth compiling.
                leanest_tried, planned_under = True, int(least * _LEANEST_SLACK)
                continue
            raise _too_big(budget, attempts, f"no plan fits the tightened budget {format_bytes(planned_under)} "
                                             f"({least and format_bytes(least)} predicted at least)", limit) from e
        key = identity(made) if identity is not None else None
        if key is not None and key in compiled_before:
            used = compiled_before[key]            # the same plan again: over budget, as before
            result = None
        else:
            compiles += 1
            try:
                result, compiled = compile_plan(made)
                used = compiled_memory(compiled)
            except Exception as e:      # noqa: BLE001 - only the compiler's out-of-memory refusal is ours
                used = compile_oom_bytes(e)
                if used is None:
                    raise
                result = None           # libtpu refuses to compile a program over the chip's memory
                held = compile_oom_limit(e)
                if held is not None and held < limit:
                    limit = int(held)   # a budget over the device's memory: the device's is the one to meet
                    if say is not None:
                        say(f"the device holds {format_bytes(held)}, under the budget {format_bytes(budget)}: "
                            f"planning for {format_bytes(held)}")
            used = _largest_everywhere(used)
            if key is not None:
                compiled_before[key] = used
        attempts.append(Attempt(planned_under, predicted(made), used))
        if used <= budget and result is not None:
            return made, result, attempts
        # From what the plan was predicted to need (at most the budget it was planned under): a plan
        # predicted well under its budget would otherwise come back unchanged.
        tighter = int(min(planned_under, attempts[-1].predicted_bytes) * min(limit, used) / used * _MARGIN)
        if say is not None:
            over = (f"the budget {format_bytes(budget)}" if limit == budget
                    else f"the device memory {format_bytes(limit)}")
            say(f"the compiled program needs {format_bytes(used)} per device, over {over}"
                f": planning again under {format_bytes(tighter)}")
        planned_under = tighter
    raise _too_big(budget, attempts, f"{compiles} plan{'s' * (compiles != 1)} compiled, none fits", limit)


_OOM = re.compile(r"Ran out of memory (?:in memory space \w+\. Used |on HBM, the total memory required for HLO "
                  r"temporaries \()([0-9.]+)([KMGT]?)")


_HELD = re.compile(r"(?:exceeds available HBM \(| of )([0-9.]+)([KMGT]?)(?:\)| hbm)")


def compile_oom_limit(error: BaseException) -> float | None:
    """The device memory a compiler that refused the program as too big held it against
    (XLA TPU: "... exceeds available HBM (15.75G)", "Used 15.89G of 15.75G hbm"), else ``None``."""
    if compile_oom_bytes(error) is None:
        return None
    return _bytes_of(_HELD.search(str(error)))


def compile_oom_bytes(error: BaseException) -> float | None:
    """The bytes per device a compiler that refused the program as too big reported using
    (XLA TPU: "Ran out of memory in memory space hbm. Used 15.89G of 15.75G hbm", or "... on HBM,
    the total memory required for HLO temporaries (22.91G) exceeds ...": at least that), else ``None``."""
    return _bytes_of(_OOM.search(str(error)))


def _bytes_of(found: re.Match | None) -> float | None:
    """Bytes of a matched compiler figure ("15.75" and a unit letter "G"), None without a match."""
    if found is None:
        return None
    return float(found.group(1)) * 1024 ** " KMGT".index(found.group(2) or " ")


def _too_big(budget: int, attempts: list[Attempt], why: str, limit: int | None = None) -> InfeasibleBudgetError:
    least = min(a.compiled_bytes for a in attempts)
    tried = "; ".join(f"planned under {format_bytes(a.budget_bytes)}: predicted {format_bytes(a.predicted_bytes)}, "
                      f"compiled {format_bytes(a.compiled_bytes)}" for a in attempts)
    device = limit if limit is not None and limit < budget else None
    if device is not None or least <= budget:
        # The compiler refused the programs as over the device's memory, below the budget asked for.
        held = f"the device's {format_bytes(device)}" if device is not None else "the device's memory"
        advice = (f"The least a compiled plan needed is {format_bytes(least)}, over {held} (the compiler "
                  f"refuses programs over that, whatever the budget): use more devices, recompute activations "
                  f"or shrink the batch.")
    else:
        advice = (f"The least a compiled plan needed is {format_bytes(least)}: set memory_budget to at least that, "
                  f"use more devices, recompute activations or shrink the batch.")
    return InfeasibleBudgetError(
        f"no plan fits memory_budget={format_bytes(budget)} per device on the compiled program ({why}). "
        f"{advice} Tried: {tried}",
        budget_bytes=budget, min_feasible_bytes=int(np.ceil(least)), largest_tensors=[])
