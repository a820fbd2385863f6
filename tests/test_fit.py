"""The memory budget held on the compiled program: a plan XLA compiles over budget is planned again."""

import jax
import pytest

import shardplan
from shardplan.audit import compiled_memory
from shardplan.errors import InfeasibleBudgetError
from shardplan.models.train import reference

REF = reference("gpt-tiny", scan=True)
STATE = jax.eval_shape(REF.init, jax.random.key(0))
BATCH = REF.batch(64, abstract=True)


def _auto(budget, **kw):
    return shardplan.auto(REF.train_step, mesh="cpu-8", memory_budget=budget, donate_argnums=(0,), time_limit=2,
                          cache=False, **kw)


def test_a_plan_compiled_over_budget_is_planned_again_until_it_fits():
    # Unbounded, this step's plan is predicted 7.5-7.9 MB per device and compiles to about 5%
    # more (XLA's heap): at 8.0 MB the first plan fits the prediction but not the program.
    budget = 8_000_000
    f = _auto(budget)
    plan = f.make_plan(STATE, BATCH)
    compiled = f._last._executable          # compiled while planning: the mesh is the priced hardware
    assert compiled is not None
    assert compiled_memory(compiled) <= budget
    assert len(plan.warnings) == 1 and plan.warnings[0].startswith("planned again under"), plan.warnings
    # The loop keeps its program: calling the step compiles nothing more.
    state = jax.jit(REF.init, out_shardings=plan.in_shardings()[0])(jax.random.key(0))
    for _ in range(2):
        state, metrics = f(state, REF.batch(64))
    assert f._last._executable is compiled and float(metrics["loss"]) > 0


def test_no_plan_that_compiles_under_the_budget_is_an_error_naming_the_least_that_compiled():
    budget = 7_100_000     # above the leanest prediction (6.9 MB), below what such plans compile to
    with pytest.raises(InfeasibleBudgetError, match=r"on the compiled program .*The least a compiled plan needed "
                                                    r"is [\d.]+ MiB: set memory_budget to at least that") as e:
        _auto(budget).make_plan(STATE, BATCH)
    assert e.value.min_feasible_bytes > budget
    # ... and that budget does compile.
    f = _auto(e.value.min_feasible_bytes)
    f.make_plan(STATE, BATCH)
    assert compiled_memory(f._last._executable) <= e.value.min_feasible_bytes


def test_a_plan_for_other_hardware_is_not_held_to_this_compiler():
    # An H100 plan lowered on fake CPU devices: the CPU's bytes are not the H100's program.
    f = shardplan.auto(REF.train_step, mesh="h100-8", donate_argnums=(0,), time_limit=2, cache=False)
    f.make_plan(STATE, BATCH)
    assert f._last._executable is None
