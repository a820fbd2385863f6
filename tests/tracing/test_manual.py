"""Manual regions (``jax.shard_map``) in a user's step: planned around, priced from their bodies,
and computing what ``jax.jit`` computes (8 fake CPU devices)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardplan
from shardplan.compiler import targets
from shardplan.compiler.hlo import collectives
from shardplan.devices.mesh import make_jax_mesh
from shardplan.parallel.context import ring_attention
from shardplan.tracing.manual import body_costs, body_peak

B, S, E, H = 4, 64, 64, 4


def _params(layers=None):
    shape = (E, E) if layers is None else (layers, E, E)
    keys = jax.random.split(jax.random.key(0), 4)
    return {n: jax.random.normal(k, shape) * 0.1 for n, k in zip("qkvo", keys)}


def _layer(mesh, x, w):
    q, k, v = ((x @ w[n]).reshape(B, S, H, E // H) for n in "qkv")
    o = ring_attention(q, k, v, mesh=mesh, seq_axes=("seq",), batch_axes=("data",), causal=True)
    return x + o.reshape(B, S, E) @ w["o"]


def _step(mesh, scanned):
    def loss(w, x):
        if scanned:
            x, _ = jax.lax.scan(lambda h, wl: (_layer(mesh, h, wl), None), x, w)
        else:
            x = _layer(mesh, x, w)
        return jnp.mean(x ** 2)

    def step(w, x):
        value, grads = jax.value_and_grad(loss)(w, x)
        return jax.tree.map(lambda a, g: a - 0.1 * g, w, grads), value
    return step


@pytest.mark.slow
@pytest.mark.parametrize("scanned", [False, True])
def test_a_step_with_ring_attention_is_planned_around_it_and_trains_like_jit(scanned):
    mesh = make_jax_mesh(("data", "seq"), (2, 4))
    step = _step(mesh, scanned)
    w, x = _params(2 if scanned else None), jax.random.normal(jax.random.key(9), (B, S, E))
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # no "no sharding rule for primitive 'shard_map'"
        f = shardplan.auto(step, mesh=mesh, hardware="h100-8", donate_argnums=(0,))
        got_w, want_w = jax.tree.map(jnp.copy, w), w
        for _ in range(3):
            got_w, got = f(got_w, x)
            want_w, want = jax.jit(step)(want_w, x)
    assert not f.plan.warnings
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_w), jax.tree.leaves(want_w)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))
    # The bodies' K/V rotations are in the prediction, byte for byte.
    compiled = f.lower(got_w, x).compile()
    permuted = sum(c.nbytes * c.count for c in collectives(compiled.as_text(), mesh) if c.kind == "collective-permute")
    assert permuted > 0
    assert f.plan.cost.comm_bytes_by_kind["collective-permute"] == pytest.approx(permuted)
    assert f.plan.cost.comm_bytes_by_axis["seq"] >= permuted


def test_body_costs_count_loop_trips_and_the_costliest_branch():
    mesh = make_jax_mesh(("x",), (8,))

    def body(a):
        def trip(c, _):
            c = jax.lax.ppermute(c, "x", [(i, (i + 1) % 8) for i in range(8)])
            return jax.lax.cond(c.sum() > 0, lambda c: c @ c, lambda c: c, c), None
        a = jax.lax.scan(trip, a, None, length=3)[0]
        return jax.lax.psum(a, "x")

    region = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P())
    jaxpr = jax.make_jaxpr(region)(jnp.ones((64, 8)))
    [eqn] = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    costs = body_costs(eqn.params["jaxpr"], {"x": 8})
    assert [(c.kind, c.axes, c.nbytes, n) for c, n in costs.comms] == [
        ("collective-permute", ("x",), 8 * 8 * 4, 3.0), ("all-reduce", ("x",), 8 * 8 * 4, 1.0)]
    assert costs.flops["float32"] == 3 * 2 * 8 * 8 * 8


def test_a_shard_map_over_another_mesh_than_the_plans_is_refused_by_name():
    mesh = make_jax_mesh(("data", "seq"), (2, 4))
    step = _step(mesh, scanned=False)
    w, x = _params(), jax.random.normal(jax.random.key(9), (B, S, E))
    other = make_jax_mesh(("data", "seq"), (4, 2))
    f = shardplan.auto(step, mesh=other, hardware="h100-8")
    with pytest.raises(shardplan.ShardplanError, match=r"shard_map at .*context.py.* runs over mesh axes "
                                                        r"\{'data': 2, 'seq': 4\}.*plan on the mesh"):
        f(w, x)


def test_a_partly_manual_shard_map_is_gathered_with_a_warning_and_still_right():
    mesh = make_jax_mesh(("data", "model"), (2, 4))

    def step(w, x):
        def body(a):
            return jax.lax.psum(a, "model")
        h = jax.shard_map(body, mesh=mesh, in_specs=P(None, "model"), out_specs=P(), axis_names={"model"})(x @ w)
        return w - 0.1 * jnp.mean(h) * w, jnp.mean(h)

    w, x = jnp.ones((E, E)) * 0.01, jax.random.normal(jax.random.key(1), (8, E))
    f = shardplan.auto(step, mesh=mesh, hardware="h100-8")
    with pytest.warns(UserWarning, match=r"leaves mesh axes \['data'\] automatic \(axis_names=\).*gathered to "
                                         "replicated.*manual over every mesh axis"):
        got = f(w, x)
    want = jax.jit(step)(w, x)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)


def test_body_traffic_counts_what_xla_materialises():
    # Per device: a [8, 64] f32 shard. The reduction reads its operand and writes its result;
    # the loop's in-place update moves only the [1, 64] row it writes, 4 times; the slice
    # reads its row; the elementwise chain (exp, mul) is fused and moves nothing.
    mesh = make_jax_mesh(("x",), (8,))

    def body(a):
        def trip(buf, i):
            row = jax.lax.dynamic_slice_in_dim(a, i, 1, 0)
            return jax.lax.dynamic_update_slice_in_dim(buf, jnp.exp(row) * 2.0, i, 0), None
        buf = jax.lax.scan(trip, jnp.zeros_like(a), jnp.arange(4))[0]
        return jnp.sum(buf, axis=0, keepdims=True)

    region = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    jaxpr = jax.make_jaxpr(region)(jnp.ones((64, 64)))
    [eqn] = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    costs = body_costs(eqn.params["jaxpr"], {"x": 8})
    row, shard = 64 * 4, 8 * 64 * 4
    assert costs.hbm_bytes == 4 * (row + 2 * row) + 2 * shard + 2 * row


# Programs on one device's 4 MiB operand x, with the bytes XLA's GPU compiler holds for them
# beyond their operand and result (its temporaries): what manual.body_peak models.
MIB = 2 ** 20


def _exp_chain(x):                 # fused into the reduction that reads it: nothing is stored
    return jnp.sum(jnp.exp(x * 2.0) + 1.0)


def _exp_into_a_dot(x):            # fused into the GEMM that alone reads it: its result is stored
    return jnp.sum(jnp.exp(x) @ x)


def _loop_in_place(x):             # a loop's state is updated in place: one buffer
    def trip(c, i):
        return jax.lax.dynamic_update_slice_in_dim(c, jax.lax.dynamic_slice_in_dim(x, i, 1) * 2.0, i, 0), None
    return jnp.sum(jax.lax.scan(trip, jnp.zeros_like(x), jnp.arange(8))[0])


def _loop_in_a_branch(x):          # a conditional's branch copies its operand: two buffers
    def update(y):
        return jax.lax.scan(lambda c, i: (c.at[i].add(1.0), None), y, jnp.arange(8))[0]
    return jnp.sum(jax.lax.cond(jnp.sum(x) > 0, update, lambda y: y + 1.0, x * 2.0))


PEAKS = [(_exp_chain, 0), (_exp_into_a_dot, 4 * MIB), (_loop_in_place, 4 * MIB), (_loop_in_a_branch, 8 * MIB)]
X = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)


@pytest.mark.parametrize("fn, held", PEAKS, ids=[f.__name__ for f, _ in PEAKS])
def test_body_peak_holds_the_buffers_xla_keeps(fn, held):
    assert body_peak(jax.make_jaxpr(fn)(X).jaxpr) == pytest.approx(held, abs=64 * 2 ** 10)


@pytest.mark.skipif(not targets.available("gpu"), reason="the CUDA compiler is not installed "
                    "(pip install 'shardplan[aot]')")
@pytest.mark.parametrize("fn, held", PEAKS, ids=[f.__name__ for f, _ in PEAKS])
def test_body_peak_is_what_the_gpu_compiler_holds(fn, held):
    # Compiled for one H100 with no GPU present (never run).
    mesh, _ = targets.target_mesh(shardplan.load_mesh("h100-8"), "gpu")
    x = jax.ShapeDtypeStruct(X.shape, X.dtype, sharding=jax.sharding.SingleDeviceSharding(mesh.devices.flat[0]))
    temp = jax.jit(fn).lower(x).compile().memory_analysis().temp_size_in_bytes
    assert temp == pytest.approx(body_peak(jax.make_jaxpr(fn)(X).jaxpr), abs=64 * 2 ** 10)
