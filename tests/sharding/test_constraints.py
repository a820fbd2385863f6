"""A user's own ``with_sharding_constraint`` is held by the plan: the constrained tensor gets the
constraint's spec on every dimension it names (unsharded where it says ``None``), the planner
shards the rest around it, and the planned step computes what plain ``jax.jit`` computes."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardplan

MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _step(spec, mesh=MESH):
    def step(w, x):
        def loss(w):
            h = jnp.tanh(x @ w["a"])
            h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, spec))     # the user's line
            return jnp.mean((h @ w["b"]) ** 2)
        value, grads = jax.value_and_grad(loss)(w)
        return jax.tree.map(lambda p, g: p - 0.1 * g, w, grads), value
    return step


def _args():
    k = jax.random.split(jax.random.key(0), 3)
    return ({"a": jax.random.normal(k[0], (64, 256)) / 8, "b": jax.random.normal(k[1], (256, 64)) / 16},
            jax.random.normal(k[2], (32, 64)))


@pytest.mark.parametrize("spec,expected", [
    (P("data", "model"), (("data",), ("model",))),
    (P(None, "data"), ((), ("data",))),
    (P(("data", "model"), P.UNCONSTRAINED), (("data", "model"), None)),
])
def test_a_users_constraint_is_held_and_the_step_matches_jit(spec, expected):
    w, x = _args()
    step = shardplan.auto(_step(spec), mesh=MESH, cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got_w, got_loss = step(w, x)
    want_w, want_loss = jax.jit(_step(spec))(w, x)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_w), jax.tree.leaves(want_w)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    plan = step.plan
    assert not plan.warnings
    rows = [r for r in plan.activations if r.shape == (32, 256) and "sharding_constraint" in r.name]
    assert rows, [r.name for r in plan.activations]
    for r in rows:
        for d, axes in enumerate(expected):
            if axes is not None:
                assert tuple(r.spec[d]) == axes, (r.name, r.spec)


def test_a_constraint_on_an_axis_the_mesh_lacks_is_not_held_and_says_so():
    other = jax.make_mesh((2, 4), ("batch", "tensor"), axis_types=(AxisType.Auto,) * 2)
    w, x = _args()
    with pytest.warns(UserWarning, match=r"names mesh axis 'batch', which mesh .* does not have \(axes: data, "
                                         r"model\); the planner does not hold it"):
        shardplan.plan(_step(P("batch", None), other), w, x, mesh="cpu-8", cache=False)


def test_contradicting_constraints_keep_the_first_and_say_so():
    def step(x):
        a = jax.lax.with_sharding_constraint(x, NamedSharding(MESH, P("data", None)))
        b = jax.lax.with_sharding_constraint(x, NamedSharding(MESH, P("model", None)))
        return a * b
    with pytest.warns(UserWarning, match=r"contradicts the one at .*; the first one is kept"):
        shardplan.plan(step, jnp.ones((32, 8)), mesh=MESH, cache=False)


def _stack_step(mesh):
    def loss(ws, x):
        def body(h, w):
            return jnp.tanh(h @ w)[:, :h.shape[1]] + h, None
        h, _ = jax.lax.scan(body, x, ws)
        return jnp.sum(h ** 2)
    return lambda ws, x: ws - 0.1 * jax.grad(loss)(ws, x)


def _gathers(text: str) -> list[tuple[int, ...]]:
    import re
    return [tuple(int(d) for d in m.group(1).split(","))
            for m in re.finditer(r"= f32\[([\d,]+)\]\{[^}]*\} all-gather\(", text)]


def test_a_scan_bodys_slice_of_a_stack_is_held_at_its_planned_spec():
    """Each layer's slice of a scanned weight stack is pinned inside the loop body to the spec
    the plan gives it. XLA's partitioner, left free there, may reshard the whole stack (inside the
    loop, once a layer) to suit the slice's first reader: the hand-written loop below does, on this
    CPU compiler too. That turned GPT-3 175B's plan on two v5p slices from 498 GiB of collectives
    a step into 4.87 TiB (RESULTS.md, session 23)."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    stored, gathered = P(None, None, ("data", "model")), P(None, "model")

    def by_hand(pin):
        def loss(ws, x):
            def body(h, w):
                if pin:
                    w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P(*stored[1:])))
                w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, gathered))
                return jnp.tanh(h @ w)[:, :256] + h, None
            return jnp.sum(jax.lax.scan(body, x, ws)[0])
        step = lambda ws, x: ws - 0.1 * jax.grad(loss)(ws, x)
        ws = jax.ShapeDtypeStruct((8, 256, 1024), jnp.float32, sharding=NamedSharding(mesh, stored))
        x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("data")))
        return _gathers(jax.jit(step, out_shardings=NamedSharding(mesh, stored)).lower(ws, x).compile().as_text())

    assert (8, 256, 512) in by_hand(pin=False)            # the whole stack, gathered in the loop
    pinned_gathers = by_hand(pin=True)
    assert (256, 512) in pinned_gathers and all(shape[0] != 8 for shape in pinned_gathers)   # one layer at a time

    # The planner's step: every scan body input is constrained to its planned spec first thing.
    ws, x = jax.ShapeDtypeStruct((8, 128, 4096), jnp.float32), jax.ShapeDtypeStruct((1024, 128), jnp.float32)
    f = shardplan.auto(_stack_step(mesh), mesh=mesh, donate_argnums=(0,), cache=False)
    f.make_plan(ws, x)
    specs = f.plan.specs_by_tensor()
    closed = jax.make_jaxpr(f._compiled((ws, x), {}).jitted)(ws, x)
    scans = [e for e in closed.jaxpr.eqns[0].params["jaxpr"].jaxpr.eqns if e.primitive.name == "scan"]
    assert scans
    for eqn in scans:
        body = eqn.params["jaxpr"].jaxpr
        pinned = {e.invars[0]: e.params["sharding"].spec for e in body.eqns
                  if e.primitive.name == "sharding_constraint" and e.invars[0] in body.invars}
        ranked = [v for v in body.invars if v.aval.ndim]
        assert ranked and all(v in pinned for v in ranked), "a scan body input is left to XLA"
    assert any("/in:" in path for path in specs), "no scan body input has a planned spec"
