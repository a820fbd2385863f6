"""How far a predicted memory lands from what the compiler compiles, measured on models nobody
tuned the cost model on: the seeded random corpus of :mod:`shardplan.benchmarks.fidelity`, whose
rows per compiler ship with the package (``benchmarks/results/fidelity_<compiler>.json``).
:meth:`shardplan.plans.plan.Plan.explain` gives the band of the plan's compiler with its memory."""

from __future__ import annotations

import functools
import importlib.resources
import json

import numpy as np


@functools.cache
def memory_band(compiler: str) -> tuple[int, float, float] | None:
    """``(models, 90th percentile, worst)`` of the absolute relative error of the predicted memory
    per device on ``compiler``'s corpus (``"cpu"``, ``"gpu"``, ``"tpu"``); ``None`` where no run of
    the corpus for that compiler ships."""
    try:
        text = importlib.resources.files("shardplan.benchmarks").joinpath(
            "results", f"fidelity_{compiler}.json").read_text(encoding="utf-8")
        rows = json.loads(text)["rows"].get(compiler, [])
    except (OSError, ModuleNotFoundError, ValueError, KeyError):
        return None
    errors = np.abs([r["memory_error"] for r in rows if r.get("status") == "ok" and r.get("memory_error") is not None])
    if not len(errors):
        return None
    return len(errors), float(np.percentile(errors, 90)), float(errors.max())


def describe(compiler: str) -> str:
    """The band as one line of :meth:`~shardplan.plans.plan.Plan.explain`."""
    band = memory_band(compiler)
    if band is None:
        return f"memory band: no run of the seeded corpus for the {compiler} compiler ships with this version"
    n, p90, worst = band
    return (f"memory band: on the {compiler} compiler's seeded corpus ({n} models nobody tuned on), 90% of "
            f"predicted memories within {p90:.0%} of the compiled, the worst {worst:.0%} (benchmarks/RESULTS.md)")
