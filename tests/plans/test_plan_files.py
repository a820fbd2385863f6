"""A plan that stands alone: saved, loaded in another process, applied without the solver; and
the errors a wrong, edited, truncated or foreign plan file gets."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

import shardplan
from shardplan.errors import PlanFileError
from shardplan.models.train import reference

MESH = shardplan.load_mesh("cpu-8", axes={"data": 2, "model": 4})
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _losses(f, state, batch, n=3):
    out = []
    for _ in range(n):
        state, metrics = f(state, batch)
        out.append(float(metrics["loss"]))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """gpt-tiny's step planned in place on (2, 4), its plan saved, and the losses of 3 steps."""
    ref = reference("gpt-tiny", scan=True)
    f = shardplan.auto(ref.train_step, mesh=MESH, donate_argnums=(0,), cache=False)
    losses = _losses(f, ref.init(jax.random.key(0)), ref.batch(8))
    path = str(tmp_path_factory.mktemp("plans") / "gpt.json")
    f.plan.save(path)
    return path, f.plan, losses


@pytest.mark.slow
def test_a_saved_plan_runs_in_a_fresh_process_without_the_solver(saved):
    path, _, losses = saved
    script = textwrap.dedent(f"""
        import json, jax, shardplan
        from shardplan.planning import planner, solving
        from shardplan.solve import solver, exact
        def refuse(*a, **k):
            raise AssertionError("the solver was called")
        planner.plan_jaxpr = solving.solve = solving.solve_exact = solving._solve_wide = refuse
        solver.solve = exact.solve_exact = refuse
        from shardplan.models.train import reference
        ref = reference("gpt-tiny", scan=True)
        f = shardplan.auto(ref.train_step, plan={path!r}, donate_argnums=(0,))
        state, batch, out = ref.init(jax.random.key(0)), ref.batch(8), []
        for _ in range(3):
            state, m = f(state, batch)
            out.append(float(m["loss"]))
        print(json.dumps(out))
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == losses     # the same program: the same bits


def test_plan_apply_binds_the_step(saved):
    path, plan, losses = saved
    ref = reference("gpt-tiny", scan=True)
    f = shardplan.Plan.load(path).apply(ref.train_step, donate_argnums=(0,))
    assert _losses(f, ref.init(jax.random.key(0)), ref.batch(8)) == losses
    assert f.plan.digest() == plan.digest()
    assert jax.tree.structure(f.plan.in_shardings()) == jax.tree.structure(plan.in_shardings())


def test_truncated_foreign_and_missing_files_get_one_line(saved, tmp_path):
    path, _, _ = saved
    text = Path(path).read_text()
    cases = {"truncated.json": (text[: len(text) // 2], "not valid JSON"),
             "foreign.json": (json.dumps({"hello": 1}), "not a shardplan plan"),
             "list.json": ("[1, 2]", "not a shardplan plan"),
             "binary.json": (None, "not a text file")}
    for name, (content, message) in cases.items():
        p = tmp_path / name
        if content is None:
            p.write_bytes(b"\xff\xfe\x00garbage")
        else:
            p.write_text(content)
        with pytest.raises(PlanFileError, match=message) as e:
            shardplan.Plan.load(str(p))
        assert str(p) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(PlanFileError, match="cannot read"):
        shardplan.Plan.load(str(tmp_path / "absent.json"))


def test_edited_plans_are_refused(saved, tmp_path):
    path, _, _ = saved
    data = json.loads(Path(path).read_text())

    def load(edit):
        d = json.loads(json.dumps(data))
        edit(d)
        p = tmp_path / "edited.json"
        p.write_text(json.dumps(d))
        return shardplan.Plan.load(str(p))

    with pytest.raises(PlanFileError, match="mesh axis 'bogus'"):
        load(lambda d: d["inputs"][0].update(spec=[["bogus"]] + d["inputs"][0]["spec"][1:]))
    with pytest.raises(PlanFileError, match="fingerprint"):
        load(lambda d: d["signature"].__setitem__(3, "3.mul:0 float32[1]"))
    with pytest.raises(PlanFileError, match="missing key 'outputs'"):
        load(lambda d: d.pop("outputs"))
    with pytest.raises(PlanFileError, match="schema"):
        load(lambda d: d.update(schema=1))
    with pytest.raises(PlanFileError, match="appears twice"):
        load(lambda d: d["inputs"][0].update(spec=[["data"], ["data"]]))

    def indivisible(d):       # a dimension split in 8 that 8 does not divide
        row = next(r for r in d["inputs"] if any(n % 8 for n in r["shape"]))
        k = next(i for i, n in enumerate(row["shape"]) if n % 8)
        row["spec"] = [["data", "model"] if i == k else [] for i in range(len(row["shape"]))]
    with pytest.raises(PlanFileError, match="which does not divide it"):
        load(indivisible)


def test_a_plan_is_checked_when_it_is_built_not_only_when_it_is_loaded(saved):
    import dataclasses

    from shardplan.errors import InvalidPlanError
    plan = shardplan.Plan.load(saved[0])
    row = plan.inputs[0]
    bogus = dataclasses.replace(row, spec=(("bogus",),) + row.spec[1:])
    with pytest.raises(InvalidPlanError, match=re.escape(f"{row.name}: PartitionSpec uses mesh axis 'bogus'")):
        dataclasses.replace(plan, inputs=(bogus,) + plan.inputs[1:])
    with pytest.raises(InvalidPlanError, match="do not match sizes"):
        dataclasses.replace(plan, axis_sizes=plan.axis_sizes[:-1])


def test_a_train_state_plan_binds_in_another_process(tmp_path):
    """A flax TrainState's static fields (apply_fn, tx) print with other addresses in every
    process: the plan matches the step by leaf paths and signature, not by that text."""
    import re

    import flax.linen as nn
    import optax
    from flax.training import train_state

    model = nn.Dense(8)
    state = train_state.TrainState.create(apply_fn=model.apply, tx=optax.sgd(0.1),
                                          params=model.init(jax.random.key(0), jax.numpy.ones((1, 16))))
    x = jax.numpy.ones((32, 16))

    def step(s, x):
        loss, g = jax.value_and_grad(lambda p: (s.apply_fn(p, x) ** 2).mean())(s.params)
        return s.apply_gradients(grads=g), loss
    here = shardplan.auto(step, mesh=MESH, cache=False)
    expected = float(here(state, x)[1])
    text = re.sub(r"0x[0-9a-f]+", "0xdeadbeef", here.plan.to_json())       # as another process prints it
    assert text != here.plan.to_json()
    there = shardplan.auto(step, plan=shardplan.Plan.from_json(text))
    assert float(there(state, x)[1]) == expected


def test_a_plan_for_another_step_names_what_differs(saved):
    path, _, _ = saved
    ref = reference("gpt-tiny", scan=True)
    state = jax.eval_shape(ref.init, jax.random.key(0))
    # Another batch size: the first input that differs is named with both shapes.
    f = shardplan.auto(ref.train_step, plan=path)
    with pytest.raises(shardplan.PlanMismatchError, match=r"input \[1\]\['inputs'\] is int32\[4, 32\] in the step"):
        f.make_plan(state, ref.batch(4, abstract=True))
    # Another model: its argument leaves differ.
    other = reference("mlp-tiny")
    with pytest.raises(shardplan.PlanMismatchError, match=f"{path} does not match this step: input \\d+ is \\[0\\]"):
        shardplan.auto(other.train_step, plan=path).make_plan(jax.eval_shape(other.init, jax.random.key(0)),
                                                              other.batch(8, abstract=True))
    # The same arguments, another computation (unrolled layers): the first differing equation.
    unrolled = reference("gpt-tiny", scan=False)
    with pytest.raises(shardplan.PlanMismatchError, match="does not match this step"):
        shardplan.auto(unrolled.train_step, plan=path).make_plan(
            jax.eval_shape(unrolled.init, jax.random.key(0)), unrolled.batch(8, abstract=True))
    # A mesh of other axes than the plan's.
    with pytest.raises(shardplan.PlanMismatchError, match="was made for mesh axes"):
        shardplan.auto(ref.train_step, plan=path, mesh=shardplan.load_mesh("cpu-8", axes={"data": 8}))
