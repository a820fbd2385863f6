"""The decorator and shardplan.plan on steps written as users write them: arguments, loops, caching, names."""

import json
import os
import typing

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest

import shardplan
from shardplan.planning import solving

MESH = shardplan.load_mesh("cpu-8", axes={"data": 2, "model": 4})


class Batch(typing.NamedTuple):
    x: jax.Array
    y: jax.Array


def _mixed_precision_step(state, batch: Batch, lr=0.1, unused=None):
    """fp32 master weights; the bf16 copy the forward uses is part of the state (returned anew)."""
    def loss_fn(w):
        h = batch.x.astype(jnp.bfloat16) @ w["kernel"].astype(jnp.bfloat16) + w["bias"].astype(jnp.bfloat16)
        return jnp.mean((h.astype(jnp.float32) - batch.y) ** 2)
    loss, g = jax.value_and_grad(loss_fn)(state["master"])
    master = jax.tree.map(lambda p, d: p - lr * d, state["master"], g)
    return {"master": master, "compute": jax.tree.map(lambda p: p.astype(jnp.bfloat16), master),
            "step": state["step"] + 1}, {"loss": loss}


def _state():
    master = {"kernel": jnp.linspace(-1, 1, 64 * 32).reshape(64, 32), "bias": jnp.linspace(0, 1, 32)}
    return {"master": master, "compute": jax.tree.map(lambda p: p.astype(jnp.bfloat16), master), "step": 0}


def _batch():
    return Batch(jnp.linspace(-1, 1, 16 * 64).reshape(16, 64), jnp.linspace(0, 1, 16 * 32).reshape(16, 32))


def test_state_leaves_come_back_with_their_input_sharding_and_a_loop_runs(tmp_path):
    f = shardplan.auto(_mixed_precision_step, mesh=MESH, donate_argnums=0, time_limit=2, cache=tmp_path)
    plain = jax.jit(_mixed_precision_step)
    state, ref_state, losses, want = _state(), _state(), [], []
    for _ in range(5):
        ref_state, m = plain(ref_state, _batch())
        want.append(float(m["loss"]))
    for _ in range(5):
        state, m = f(state, _batch())
        losses.append(float(m["loss"]))
    # bf16 dots: a contracting dimension split over devices sums its partial results in another
    # order (in bf16), as any hand-sharded jax.jit of this step does; 1e-3 is a few bf16 ulps.
    np.testing.assert_allclose(losses, want, rtol=1e-3)
    plan = f.plan
    out = {r.name: r.spec for r in plan.outputs}
    for r in plan.inputs:
        if r.name.startswith("[0]"):
            assert out[r.name] == r.spec, r.name      # the same pytree path, the same sharding
    assert int(state["step"]) == 5


def test_keyword_static_and_donated_arguments_by_name(tmp_path):
    def step(state, *, batch, scale, train):
        loss = jnp.mean((batch @ state["w"]) ** 2) * scale
        return ({"w": state["w"] * (0.9 if train else 1.0)}, loss)
    f = shardplan.auto(step, mesh=MESH, static_argnames=("scale", "train"), donate_argnames="state", time_limit=2,
                       cache=tmp_path)
    state = {"w": jnp.ones((32, 8))}
    x = jnp.ones((16, 32))
    want = jax.jit(step, static_argnames=("scale", "train"))(state, batch=x, scale=2.0, train=True)[1]
    state, got = f(state, batch=x, scale=2.0, train=True)
    state, _ = f(state, batch=x, scale=2.0, train=True)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    assert f._last.traced.donated == (True, False)
    assert len(f._cache) == 1      # the second call reuses the first call's plan and executable


@pytest.mark.parametrize("kwargs, message", [
    ({"static_argnums": 0, "donate_argnums": 0}, "both static and donated"),
    ({"static_argnames": "nope"}, "static_argnames names 'nope', which is not a parameter"),
    ({"donate_argnums": "state"}, "donate_argnums takes ints"),
])
def test_bad_call_options_name_the_argument(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        shardplan.auto(lambda state, batch: state, mesh=MESH, **kwargs)


@pytest.mark.parametrize("limit", [0, -1, float("nan"), float("inf"), True])
def test_bad_time_limit_is_refused(limit):
    with pytest.raises(ValueError, match="time_limit=.* is not a positive number"):
        shardplan.plan(lambda x: x * 2, jnp.ones((8, 8)), mesh=MESH, time_limit=limit)


@pytest.mark.parametrize("budget", [float("nan"), float("inf"), -1, 0])
def test_bad_memory_budget_is_refused(budget):
    with pytest.raises(ValueError, match="memory_budget=.* is not a number of bytes|memory_budget"):
        shardplan.plan(lambda x: x * 2, jnp.ones((8, 8)), mesh=MESH, memory_budget=budget)


def test_committed_arrays_on_another_sharding_are_moved_once(tmp_path):
    f = shardplan.auto(_mixed_precision_step, mesh=MESH, donate_argnums=0, time_limit=2, cache=tmp_path)
    state = jax.device_put(_state(), jax.devices()[3])     # committed to one device
    state, m = f(state, _batch())
    state, m = f(state, _batch())
    assert np.isfinite(float(m["loss"]))


def test_a_mesh_from_jax_make_mesh_with_its_default_explicit_axes(tmp_path):
    """jax.make_mesh makes Explicit axes unless told otherwise, and JAX refuses a sharding
    constraint over one: the plan runs over the mesh's Auto view, and arrays the user placed on
    the Explicit mesh are moved there (jit refuses the two meshes in one call)."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    batch = jax.device_put(_batch(), NamedSharding(mesh, P("data")))
    state = jax.device_put(_state(), NamedSharding(mesh, P()))
    want_state, want = jax.jit(_mixed_precision_step)(state, batch)
    f = shardplan.auto(_mixed_precision_step, mesh=mesh, donate_argnums=0, time_limit=2, cache=tmp_path)
    got_state, got = f(state, batch)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(got_state["master"]["kernel"], want_state["master"]["kernel"], rtol=1e-5)
    for _ in range(3):
        got_state, got = f(got_state, batch)
    assert np.isfinite(float(got["loss"]))
    assert got_state["master"]["kernel"].sharding.mesh.axis_types == (AxisType.Auto,) * 2
    assert list(got_state["master"]["kernel"].sharding.mesh.devices.flat) == list(mesh.devices.flat)
    again = shardplan.auto(_mixed_precision_step, mesh=mesh, plan=f.plan, donate_argnums=0)
    np.testing.assert_allclose(again(_state(), batch)[1]["loss"], want["loss"], rtol=1e-5)
    # A preset's plan, called where the user has set that Explicit mesh (jax.set_mesh): the step
    # is traced and lowered in the plan's own context.
    in_context = shardplan.auto(_mixed_precision_step, mesh=MESH, time_limit=2, cache=tmp_path)
    with jax.set_mesh(mesh):
        np.testing.assert_allclose(in_context(_state(), _batch())[1]["loss"], want["loss"], rtol=1e-5)


def test_roles_follow_what_the_step_returns_not_the_argument_position(tmp_path):
    """An optimizer state passed as its own positional argument and returned anew is state; the
    one argument neither returned nor donated is the batch."""
    def train_step(weights, moments, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w["w"]) ** 2))(weights)
        moments = jax.tree.map(lambda m, d: 0.9 * m + d, moments, g)
        return jax.tree.map(lambda w, m: w - 0.1 * m, weights, moments), moments, loss
    w = {"w": jnp.ones((64, 64))}
    p = shardplan.plan(train_step, w, jax.tree.map(jnp.zeros_like, w), jnp.ones((16, 64)), mesh=MESH,
                       time_limit=2, cache=tmp_path)
    assert {r.name: r.role for r in p.inputs} == {"[0]['w']": "state", "[1]['w']": "state", "[2]": "batch"}
    assert p.cost.memory_bytes_by_role["batch"] == next(r.bytes_per_device for r in p.inputs if r.name == "[2]")


def test_plans_are_read_back_from_the_cache_without_solving(tmp_path, monkeypatch):
    args = (jax.eval_shape(_state), _batch())
    first = shardplan.plan(_mixed_precision_step, *args, mesh=MESH, time_limit=2, cache=tmp_path)
    [entry] = [p for p in os.listdir(tmp_path) if p.endswith(".json")]

    def no_solving(*a, **k):
        raise AssertionError("the solver ran although the plan was cached")
    monkeypatch.setattr(solving, "solve", no_solving)
    monkeypatch.setattr(solving, "solve_exact", no_solving)
    second = shardplan.plan(_mixed_precision_step, *args, mesh=MESH, time_limit=2, cache=tmp_path)
    assert second.specs_by_tensor() == first.specs_by_tensor() and second.in_tree == first.in_tree
    # A corrupt entry is never trusted: a warning, then a fresh plan (with the solver).
    monkeypatch.undo()
    with open(tmp_path / entry, "w") as f:
        f.write('{"format": "shardplan.plan/1", "mesh_na')
    with pytest.warns(UserWarning, match="ignoring the unreadable cached plan"):
        third = shardplan.plan(_mixed_precision_step, *args, mesh=MESH, time_limit=2, cache=tmp_path)
    assert third.specs_by_tensor() == first.specs_by_tensor()
    json.loads((tmp_path / entry).read_text())      # rewritten whole
    # Another budget or mesh is another entry.
    shardplan.plan(_mixed_precision_step, *args, mesh=shardplan.load_mesh("cpu-8", axes={"data": 8}), time_limit=2,
                   cache=tmp_path)
    assert len([p for p in os.listdir(tmp_path) if p.endswith(".json")]) == 2


def test_no_cache_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDPLAN_CACHE_DIR", str(tmp_path))
    shardplan.plan(_mixed_precision_step, jax.eval_shape(_state), _batch(), mesh=MESH, time_limit=2, cache=False)
    assert os.listdir(tmp_path) == []


def test_explain_names_rows_by_pytree_path_and_source_line(tmp_path):
    plan = shardplan.plan(_mixed_precision_step, jax.eval_shape(_state), _batch(), mesh=MESH, time_limit=2,
                          cache=tmp_path)
    names = [r.name for r in plan.outputs]
    assert "[0]['master']['kernel']" in names and "[1]['loss']" in names
    assert "[1].x" in [r.name for r in plan.inputs]
    here = os.path.basename(__file__)
    assert any(f"@ {here}:" in r.name for r in plan.activations)
    assert f"@ {here}:" in plan.explain()


def test_in_shardings_mirror_the_positional_arguments(tmp_path):
    state, batch = jax.eval_shape(_state), _batch()
    plan = shardplan.plan(_mixed_precision_step, state, batch, mesh=MESH, time_limit=2, cache=tmp_path)
    state_sh, batch_sh = plan.in_shardings()
    assert jax.tree.structure(state_sh) == jax.tree.structure(state)
    assert isinstance(batch_sh, Batch)
    # ... so the state can be made on its planned shardings directly, as the README shows.
    made = jax.jit(_state, out_shardings=state_sh)()
    assert made["master"]["kernel"].sharding == state_sh["master"]["kernel"]
    # With keyword arguments: (args, kwargs).
    kw_plan = shardplan.plan(lambda s, *, b: _mixed_precision_step(s, b), state, b=batch, mesh=MESH, time_limit=2,
                             cache=tmp_path)
    args_sh, kwargs_sh = kw_plan.in_shardings()
    assert set(kwargs_sh) == {"b"} and len(args_sh) == 1


def test_a_python_scalar_step_counter_compiles_once(tmp_path):
    f = shardplan.auto(_mixed_precision_step, mesh=MESH, donate_argnums=0, time_limit=2, cache=tmp_path)
    state, batches = _state(), [_batch() for _ in range(3)]     # "step": 0, a Python int
    compiles = []
    listener = lambda event, secs, **kw: (compiles.append(event)
                                          if event == "/jax/core/compile/backend_compile_duration" else None)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        state, _ = f(state, batches[0])            # plans and compiles
        before = len(compiles)
        for batch in batches:
            state, _ = f(state, batch)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(f._cache) == 1 and before >= 1 and len(compiles) == before


def test_a_plan_that_does_not_fit_ends_its_progress_saying_so_and_kept_lines_are_whole(monkeypatch):
    import io

    from shardplan.errors import InfeasibleBudgetError
    from shardplan.util import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    err = Terminal()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(InfeasibleBudgetError):
        shardplan.plan(_mixed_precision_step, _state(), _batch(), mesh=MESH, memory_budget="1KiB", time_limit=2,
                       cache=False)
    last = err.getvalue().rstrip("\n").rsplit("\r", 1)[-1]
    assert "no plan fits the budget of 0.00 GiB: needs at least" in last, err.getvalue()
    with progress.Status(enabled=True, stream=err) as line:
        line.done("x" * 300)
    assert "x" * 300 + "\n" in err.getvalue()


def test_progress_shows_each_stage_on_a_terminal_and_nothing_elsewhere(tmp_path, monkeypatch):
    import io

    from shardplan.util import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for terminal, ci in ((True, None), (True, "true"), (False, None)):
        err = Terminal() if terminal else io.StringIO()
        monkeypatch.setattr("sys.stderr", err)
        if ci:
            monkeypatch.setenv("CI", ci)
        else:
            monkeypatch.delenv("CI", raising=False)
        f = shardplan.auto(_mixed_precision_step, mesh=MESH, donate_argnums=0, time_limit=2, cache=False)
        f(_state(), _batch())
        text = err.getvalue()
        if terminal and not ci:
            stages = ["tracing _mixed_precision_step", "traced:", "solving", "planned:", "compiling the planned step",
                      "compiled in"]
            at = [text.find(s) for s in stages]
            assert -1 not in at and at == sorted(at), text
            assert progress.wanted(err)
        else:
            assert "shardplan" not in text, text


def test_the_collector_is_paused_while_a_search_plans_and_restored_after(monkeypatch):
    import gc

    from shardplan.planning import search
    seen = []
    real = search.plan_jaxpr

    def plan_jaxpr(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(search, "plan_jaxpr", plan_jaxpr)
    assert gc.isenabled()
    shardplan.plan(_mixed_precision_step, _state(), _batch(), mesh=MESH, donate_argnums=0, time_limit=2, cache=False)
    assert seen and not any(seen) and gc.isenabled()
    seen.clear()
    with pytest.raises(shardplan.InfeasibleBudgetError):
        shardplan.plan(_mixed_precision_step, _state(), _batch(), mesh=MESH, donate_argnums=0, time_limit=2,
                       cache=False, memory_budget="1KiB")
    assert seen and not any(seen) and gc.isenabled()
    gc.disable()            # paused by the caller: left paused
    try:
        shardplan.plan(_mixed_precision_step, _state(), _batch(), mesh=MESH, time_limit=2, cache=False)
        assert not gc.isenabled()
    finally:
        gc.enable()
