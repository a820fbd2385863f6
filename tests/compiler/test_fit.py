"""The memory budget held on the compiled program: a plan XLA compiles over budget is planned again."""

import jax
import pytest

import shardplan
from shardplan.compiler.audit import compiled_memory
from shardplan.errors import InfeasibleBudgetError
from shardplan.models.train import reference

REF = reference("gpt-tiny", scan=True)
STATE = jax.eval_shape(REF.init, jax.random.key(0))
BATCH = REF.batch(64, abstract=True)


def _auto(budget, **kw):
    return shardplan.auto(REF.train_step, mesh="cpu-8", memory_budget=budget, donate_argnums=(0,), time_limit=2,
                          cache=False, fit_compiled=True, **kw)


def test_the_loop_plans_again_under_a_tighter_budget_until_the_program_fits():
    # A planner whose programs compile to 10% over their prediction, and a plan per budget.
    from types import SimpleNamespace

    from shardplan.compiler.fit import fit_compiled

    class Program:
        def __init__(self, nbytes):
            self.nbytes = nbytes

        def memory_analysis(self):
            return SimpleNamespace(argument_size_in_bytes=self.nbytes, output_size_in_bytes=0, temp_size_in_bytes=0,
                                   alias_size_in_bytes=0)
    asked, said = [], []
    made, result, attempts = fit_compiled(lambda b: asked.append(b) or 0.97 * b,
                                          lambda p: (("program", p), Program(1.1 * p)),
                                          1000, lambda p: p, say=said.append)
    # Tightened from what the plan was predicted to need (970), by the overshoot.
    assert len(attempts) == len(asked) == 2 and asked[0] == 1000 and asked[1] == int(970 * 1000 / 1067 * 0.99)
    assert attempts[-1].compiled_bytes <= 1000 < attempts[0].compiled_bytes and result == ("program", made)
    assert "planning again under" in said[0]
    # A planner that cannot go below 950 predicted: four tries, then the error names the least.
    with pytest.raises(InfeasibleBudgetError, match=r"\(4 plans compiled, none fits\). The least a compiled plan "
                                                    r"needed is 1.02 KiB") as e:
        fit_compiled(lambda b: max(950.0, 0.97 * b), lambda p: (p, Program(1.1 * p)), 1000, lambda p: p)
    assert e.value.min_feasible_bytes == 1045
    # A tighter budget that gives the plan already compiled is not compiled again.
    compiles = []
    made, _, attempts = fit_compiled(lambda b: 950.0 if b > 400 else 0.97 * b,
                                     lambda p: compiles.append(p) or (p, Program(2 * p)), 1000, lambda p: p,
                                     identity=lambda p: p)
    # 1000 -> 950 (compiles to 1900); 495 -> 950 again (not compiled); 257 -> 249.29 (498.6, fits)
    assert [a.budget_bytes for a in attempts] == [1000, 495, 257]
    assert compiles == [950.0, 0.97 * 257] and made == 0.97 * 257
    # Tightened past every plan (none predicted under 900): the leanest plan is compiled before
    # giving up, and here it fits (a lean plan's program is no bigger than predicted).
    def lean_or_none(b):
        if b < 900:
            raise InfeasibleBudgetError("no plan fits", budget_bytes=b, min_feasible_bytes=900, largest_tensors=[])
        return 900.0 if b < 950 else 0.97 * b
    made, _, attempts = fit_compiled(lean_or_none, lambda p: (p, Program(p if p == 900.0 else 1.2 * p)), 1000,
                                     lambda p: p)
    assert [a.budget_bytes for a in attempts] == [1000, int(900 * 1.001)] and made == 900.0
    # A compiler that refuses a program over the device's memory (libtpu) counts as over budget.
    from shardplan.compiler.fit import compile_oom_bytes

    def refusing(p):
        if p > 600:
            raise RuntimeError("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran "
                               "out of memory in memory space hbm. Used 1.5K of 1.0K hbm. Exceeded hbm capacity")
        return p, Program(p)
    made, _, attempts = fit_compiled(lambda b: 0.97 * b, refusing, 1000, lambda p: p)
    assert [a.compiled_bytes for a in attempts[:2]] == [1536, 1536] and made <= 600 and len(attempts) == 3
    assert compile_oom_bytes(ValueError("Used 15.89G of 15.75G")) is None
    assert compile_oom_bytes(RuntimeError("Ran out of memory in memory space hbm. Used 15.89G of 15.75G hbm")) == \
        pytest.approx(15.89 * 2**30)
    assert compile_oom_bytes(RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required "
                                          "for HLO temporaries (22.91G) exceeds available HBM")) == \
        pytest.approx(22.91 * 2**30)


def test_a_budget_over_the_devices_memory_is_held_to_the_device_the_compiler_names():
    # libtpu refuses a program over the chip's memory whatever the budget; the loop then plans
    # for the chip's memory (it used to scale the budget up by budget / refused bytes).
    from types import SimpleNamespace

    from shardplan.compiler.fit import compile_oom_limit, fit_compiled

    def program(nbytes):
        return SimpleNamespace(memory_analysis=lambda: SimpleNamespace(
            argument_size_in_bytes=nbytes, output_size_in_bytes=0, temp_size_in_bytes=0, alias_size_in_bytes=0))

    def refusing(p):
        if p > 900:
            raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
                               f"temporaries ({p * 1.28 / 1024:.2f}K) exceeds available HBM (1.00K).")
        return p, program(p)
    said = []
    made, _, attempts = fit_compiled(lambda b: min(0.97 * b, 1200.0), refusing, 4000, lambda p: p, say=said.append)
    assert [a.budget_bytes for a in attempts] == [4000, int(1200 * 1024 / attempts[0].compiled_bytes * 0.99)]
    assert made <= 900 and any("the device holds 1.00 KiB, under the budget" in s for s in said)
    with pytest.raises(InfeasibleBudgetError, match=r"\(4 plans compiled, none fits\). The least a compiled plan "
                                                    r"needed is [\d.]+ KiB, over the device's 1.00 KiB") as e:
        fit_compiled(lambda b: 1100.0, refusing, 4000, lambda p: p)
    assert "set memory_budget" not in str(e.value)
    assert compile_oom_limit(RuntimeError("Ran out of memory in memory space hbm. Used 15.89G of 15.75G hbm")) == \
        pytest.approx(15.75 * 2**30)


def test_no_plan_that_compiles_under_the_budget_is_an_error_naming_the_least_that_compiled():
    # The step as written (by default, recomputation would be searched where it does not fit).
    budget = 7_100_000     # above the leanest prediction (6.9 MB), below what such plans compile to
    with pytest.raises(InfeasibleBudgetError, match=r"on the compiled program .*The least a compiled plan needed "
                                                    r"is [\d.]+ MiB: set memory_budget to at least that") as e:
        _auto(budget, remat="off", context="off").make_plan(STATE, BATCH)
    assert e.value.min_feasible_bytes > budget
    # ... and that budget does compile.
    f = _auto(e.value.min_feasible_bytes, remat="off", context="off")
    f.make_plan(STATE, BATCH)
    assert compiled_memory(f._last._executable) <= e.value.min_feasible_bytes


def test_a_plan_for_other_hardware_is_not_held_to_this_compiler():
    # An H100 plan lowered on fake CPU devices: the CPU's bytes are not the H100's program.
    f = shardplan.auto(REF.train_step, mesh="h100-8", donate_argnums=(0,), time_limit=2, cache=False,
                       fit_compiled=True)
    f.make_plan(STATE, BATCH)
    assert f._last._executable is None
    # On CPU devices (they share the host's memory) only when asked.
    f = shardplan.auto(REF.train_step, mesh="cpu-8", donate_argnums=(0,), time_limit=2, cache=False)
    f.make_plan(STATE, BATCH)
    assert f._last._executable is None
