"""Host offload: residuals a ``jax.checkpoint`` policy keeps in the host's pinned memory.

The user's own offloading checkpoint is planned around (the copies keep their operand's sharding,
the host tensors take no device memory where the target holds them apart), ``remat="offload"``
asks the planner for it, and ``remat="auto"`` weighs it per layer class against recomputation.
The GPU and TPU compilers' host memory is checked with the deviceless compilers.
"""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardplan
from shardplan.compiler import targets
from shardplan.parallel import recompute
from shardplan.parallel.recompute import Site

OFFLOAD = jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
TX = optax.adamw(1e-3)
needs_gpu = pytest.mark.skipif(not targets.available("gpu"), reason="the CUDA compiler is not installed "
                               "(pip install 'shardplan[aot]')")


def _block(h, w):
    w_in, w_out = w
    return h + jnp.tanh(h @ w_in) @ w_out, None


def _step(wide_block=_block, narrow_block=_block, classes="ab"):
    def loss(params, x, y):
        h = x
        for c, block in zip(classes, (wide_block, narrow_block)):
            h, _ = shardplan.layer_scan(block, h, (params[f"{c}_in"], params[f"{c}_out"]))
        return jnp.mean((h - y) ** 2)

    def train_step(state, batch):
        params, opt = state
        value, grads = jax.value_and_grad(loss)(params, batch["x"], batch["y"])
        updates, opt = TX.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), value
    return train_step


def _shapes(d, wide, narrow, layers):
    return {"a_in": (layers, d, wide), "a_out": (layers, wide, d), "b_in": (layers, d, narrow),
            "b_out": (layers, narrow, d)}


def _concrete(d=64, wide=1024, narrow=64, layers=4, batch=512):
    ks = jax.random.split(jax.random.key(0), 6)
    params = {k: jax.random.normal(kk, s) * 0.05 for kk, (k, s) in zip(ks, _shapes(d, wide, narrow, layers).items())}
    data = {"x": jax.random.normal(ks[4], (batch, d)), "y": jax.random.normal(ks[5], (batch, d))}
    return (params, TX.init(params)), data


def _abstract(d, wide, narrow, layers, batch, dtype=jnp.bfloat16):
    params = {k: jax.ShapeDtypeStruct(s, dtype) for k, s in _shapes(d, wide, narrow, layers).items()}
    return jax.eval_shape(lambda: (params, TX.init(params))), \
        {"x": jax.ShapeDtypeStruct((batch, d), dtype), "y": jax.ShapeDtypeStruct((batch, d), dtype)}


KW = dict(donate_argnums=(0,), cache=False)


def _plan_quietly(step, state, batch, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no "no sharding rule for device_put"
        return shardplan.plan(step, jax.eval_shape(lambda: state), batch, **KW, **kw)


def _runs_like_jit(f, step, state, batch, steps=3):
    ref_state, mine = state, jax.tree.map(jnp.copy, state)
    jitted = jax.jit(step)
    for _ in range(steps):
        ref_state, ref_loss = jitted(ref_state, batch)
        mine, loss = f(mine, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)


# -- the user's own offloading checkpoint ---------------------------------------------------------------

@pytest.mark.slow
def test_the_users_offloading_checkpoint_is_planned_around_and_runs_like_jit():
    state, batch = _concrete()
    offloaded = _step(jax.checkpoint(_block, policy=OFFLOAD), jax.checkpoint(_block, policy=OFFLOAD))
    kept = _step(jax.checkpoint(_block, policy=DOTS), jax.checkpoint(_block, policy=DOTS))
    p = _plan_quietly(offloaded, state, batch, mesh="h100-8")
    q = _plan_quietly(kept, state, batch, mesh="h100-8")
    # What "dots" keeps on the device, offload keeps on the host: each layer's two dot results.
    d, wide, narrow, layers, rows = 64, 1024, 64, 4, 512
    kept_bytes = layers * rows * (wide + d + narrow + d) * 4
    assert p.cost.offload_bytes * 8 >= kept_bytes        # at most split 8 ways
    assert p.cost.offload_bytes > 0 and p.cost.offload_s > 0 and q.cost.offload_bytes == 0
    assert p.cost.memory_bytes < q.cost.memory_bytes
    assert "offloaded to host memory" in p.explain()
    f = shardplan.auto(offloaded, plan=p, donate_argnums=(0,))
    _runs_like_jit(f, offloaded, state, batch)


def test_offloading_named_residuals_is_planned_around_and_runs_like_jit():
    from jax.ad_checkpoint import checkpoint_name

    def named(h, w):
        w_in, w_out = w
        return h + checkpoint_name(jnp.tanh(h @ w_in), "hidden") @ w_out, None
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["hidden"], offload_src="device",
        offload_dst="pinned_host")
    state, batch = _concrete()
    step = _step(jax.checkpoint(named, policy=policy), _block)
    p = _plan_quietly(step, state, batch, mesh="h100-8")
    # The wide class's tanh results: 4 layers of 512 x 1024 f32, split at most 8 ways.
    assert 4 * 512 * 1024 * 4 / 8 <= p.cost.offload_bytes <= 4 * 512 * 1024 * 4
    _runs_like_jit(shardplan.auto(step, plan=p, donate_argnums=(0,)), step, state, batch)
    # A tag alone changes nothing on a GPU: the same plan's memory and step as the untagged block.
    # (The tanh's result and its tag are both residuals: stacked twice by the layer scan, one
    # buffer on the GPU and TPU compilers, two on XLA's CPU compiler; both checked by compiling.)
    tagged, plain = _plan_quietly(_step(named, named), state, batch, mesh="h100-8"), \
        _plan_quietly(_step(), state, batch, mesh="h100-8")
    assert tagged.cost.memory_bytes == plain.cost.memory_bytes and tagged.cost.step_s == plain.cost.step_s
    tagged, plain = _plan_quietly(_step(named, named), state, batch, mesh="cpu-8"), \
        _plan_quietly(_step(), state, batch, mesh="cpu-8")
    # Up to jax 0.11 tanh's derivative reads tanh's result: it is saved besides its tag. From jax 0.12
    # (one_minus_square) only the tag is saved, in its place: the same memory (both checked by compiling).
    tanh_saved = "one_minus_square" not in str(jax.make_jaxpr(jax.grad(jnp.tanh))(1.0))
    assert (tagged.cost.memory_bytes > plain.cost.memory_bytes) == tanh_saved


def test_on_the_cpu_compiler_host_tensors_stay_in_device_memory():
    state, batch = _concrete()
    offloaded = _step(jax.checkpoint(_block, policy=OFFLOAD), jax.checkpoint(_block, policy=OFFLOAD))
    kept = _step(jax.checkpoint(_block, policy=DOTS), jax.checkpoint(_block, policy=DOTS))
    p = _plan_quietly(offloaded, state, batch, mesh="cpu-8")
    q = _plan_quietly(kept, state, batch, mesh="cpu-8")
    assert p.cost.offload_bytes == 0 and p.cost.offload_s == 0
    # XLA's CPU compiler drops the copies: the residuals take the device memory "dots" gives them.
    assert p.cost.memory_bytes == pytest.approx(q.cost.memory_bytes, rel=0.05)


@needs_gpu
def test_offloaded_bytes_are_what_the_gpu_compiler_holds_in_host_memory():
    state, batch = _concrete()
    step = _step(jax.checkpoint(_block, policy=OFFLOAD), jax.checkpoint(_block, policy=OFFLOAD))
    f = shardplan.auto(step, mesh="h100-8", **KW)
    audit = f.audit_for("gpu", jax.eval_shape(lambda: state), batch)
    assert audit.host is not None and audit.host.compiled_bytes > 0
    assert audit.host.predicted_bytes == pytest.approx(audit.host.compiled_bytes, rel=0.01)
    assert "host memory per device" in audit.table()
    kept = shardplan.auto(_step(jax.checkpoint(_block, policy=DOTS), jax.checkpoint(_block, policy=DOTS)),
                          mesh="h100-8", **KW).audit_for("gpu", jax.eval_shape(lambda: state), batch)
    # The device memory the compiled program saves is the host's share (within 10%).
    saved = kept.memory.compiled_bytes - audit.memory.compiled_bytes
    assert saved == pytest.approx(audit.host.compiled_bytes, rel=0.1)


def test_device_put_inside_a_step_is_a_sharding_constraint_or_a_gather():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    to_model = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model"))

    def step(w, x):
        def loss(w):
            h = jax.device_put(x @ w, to_model)
            return jnp.sum(jnp.tanh(h))
        value, g = jax.value_and_grad(loss)(w)
        return w - 0.1 * g, value
    w, x = jnp.ones((64, 256)) * 0.01, jnp.ones((128, 64))
    p = shardplan.plan(step, w, x, mesh=mesh, cache=False)
    put = [r for r in p.activations if "device_put" in r.name and r.shape == (128, 256)]
    assert put and all(r.spec[1] == ("model",) and r.spec[0] == () for r in put)
    f = shardplan.auto(step, mesh=mesh)
    np.testing.assert_allclose(f(w, x)[1], jax.jit(step)(w, x)[1], rtol=1e-5)


# -- the planner's offload policy --------------------------------------------------------------------------

def test_remat_offload_by_name_runs_like_jit():
    state, batch = _concrete()
    step = _step()
    f = shardplan.auto(step, mesh="h100-8", remat="offload", **KW)
    _runs_like_jit(f, step, state, batch)
    assert [s["policy"] for s in f.plan.remat["sites"]] == ["offload", "offload"]
    assert f.plan.cost.offload_bytes > 0


def test_remat_offload_is_refused_where_the_compiler_keeps_one_memory():
    state, batch = _concrete()
    with pytest.raises(recompute.RecomputeError, match="remat='offload'.*XLA's CPU compiler"):
        shardplan.plan(_step(), jax.eval_shape(lambda: state), batch, mesh="cpu-8", remat="offload", **KW)


def _with_host_link(bandwidth: float):
    spec = shardplan.load_mesh("h100-8")
    return dataclasses.replace(spec, device=dataclasses.replace(spec.device, offload_bandwidth=bandwidth))


@pytest.mark.slow
def test_auto_offloads_the_wide_class_where_the_host_link_beats_recomputing():
    """Layers of width 8192 / 32768 in bf16 on an H100, 3 GiB a device: neither "none" nor "dots"
    fits. Every host copy shows in the step (measured so on an H200), so over PCIe (50 GB/s) the
    copies of a layer's dot results cost more than recomputing them, and "full" is chosen; over
    a link as fast as a GH200's NVLink-C2C (450 GB/s) they cost less, and "offload" is. The narrow
    class, small, recomputes no matmul either way: it keeps every residual ("none") or every
    matmul result ("dots_all", which recomputes only the tanh, and spares the copy the GPU makes
    of a kept tanh slice for its weight-gradient matmul; the two are within 0.1%)."""
    state, batch = _abstract(8192, 32768, 1024, 4, 16384)
    step = _step()
    keeps_matmuls = ("none", "dots_all")
    pcie = shardplan.plan(step, state, batch, mesh=_with_host_link(50e9), remat="auto", memory_budget="3GiB", **KW)
    (wide, narrow) = [s["policy"] for s in pcie.remat["sites"]]
    assert wide == "full" and narrow in keeps_matmuls, pcie.remat
    c2c = shardplan.plan(step, state, batch, mesh=_with_host_link(450e9), remat="auto", memory_budget="3GiB", **KW)
    (wide, narrow) = [s["policy"] for s in c2c.remat["sites"]]
    assert wide == "offload" and narrow in keeps_matmuls, c2c.remat
    for auto in (pcie, c2c):
        assert auto.cost.memory_bytes <= shardplan.parse_bytes("3GiB")
    assert c2c.cost.step_s == pytest.approx(c2c.cost.compute_s + c2c.cost.comm_s + c2c.cost.offload_s)
    offload = shardplan.plan(step, state, batch, mesh=_with_host_link(50e9),
                             remat="offload", memory_budget="3GiB", **KW)
    fast = shardplan.plan(step, state, batch, mesh=_with_host_link(450e9), remat="offload", memory_budget="3GiB", **KW)
    # The same residuals over a link 9x slower: 9x the seconds, all of them in the step.
    assert offload.cost.offload_bytes == pytest.approx(fast.cost.offload_bytes) and fast.cost.offload_s > 0
    assert offload.cost.offload_s == pytest.approx(9 * fast.cost.offload_s, rel=1e-6)
    assert offload.cost.step_s == pytest.approx(offload.cost.compute_s + offload.cost.comm_s + offload.cost.offload_s)
    full = shardplan.plan(step, state, batch, mesh=_with_host_link(450e9), remat="full", memory_budget="3GiB", **KW)
    assert c2c.cost.step_s < full.cost.step_s
    for name in ("none", "dots"):
        with pytest.raises(shardplan.InfeasibleBudgetError):
            shardplan.plan(step, state, batch, mesh="h100-8", remat=name, memory_budget="3GiB", **KW)
    assert offload.cost.step_s > pcie.cost.step_s           # what auto declined over PCIe


def _one_class(state):
    params = {k: v for k, v in state[0].items() if k.startswith("a_")}
    return params, TX.init(params)


@pytest.mark.slow
def test_in_a_pipeline_dots_and_offload_keep_the_projections():
    """A pipeline runs its stages under a vmap, which gives every matmul a batch dimension: the
    policies that keep "matmuls without batch dimensions" kept none and recomputed like "full".
    Under a pipeline they keep the matmuls with no batch dimension but the vmap's."""
    from shardplan.parallel.pipeline import PipelineConfig
    state, batch = _concrete(layers=4)
    state, step = _one_class(state), _step(classes="a")
    config = PipelineConfig(2, 4)
    kw = dict(pipeline=config, time_limit=2, **KW)
    gpu = shardplan.load_mesh("h100-8", axes={"stage": 2, "data": 4})
    plans = {name: shardplan.plan(step, jax.eval_shape(lambda: state), batch, mesh=gpu, remat=name, **kw)
             for name in ("dots", "offload", "full")}
    assert plans["offload"].cost.offload_bytes > 0
    assert plans["full"].cost.offload_bytes == plans["dots"].cost.offload_bytes == 0
    # "dots" keeps the projections' results on the device, "offload" on the host, "full" nowhere.
    assert plans["dots"].cost.memory_bytes > plans["full"].cost.memory_bytes
    assert plans["dots"].cost.memory_bytes > plans["offload"].cost.memory_bytes
    # And it trains like jax.jit (on CPU devices: "dots", the offload refused there).
    f = shardplan.auto(step, mesh=shardplan.load_mesh("cpu-8", axes={"stage": 2, "data": 4}), remat="dots", **kw)
    _runs_like_jit(f, step, state, batch)


# -- the search's order, on synthetic plans ------------------------------------------------------------------

class _Plan:
    def __init__(self, step):
        self.cost = type("C", (), {"step_s": step})()


def test_the_search_prices_offload_beside_recomputation():
    sites = {"k": Site("k", "m:1 (f)", 4, False)}
    policies = recompute.policies_for(True)
    asked = []

    def evaluate(prices):
        def run(choices, beat=float("inf")):
            asked.append(choices["k"])
            p = choices["k"]
            return None if p in ("none", "dots_all") else _Plan(prices[p])
        return run
    _, best, _ = recompute.search(evaluate({"dots": 1.1, "offload": 1.05, "full": 1.3}), sites, policies=policies)
    assert best.cost.step_s == 1.05 and sorted(asked) == sorted(policies)
    asked.clear()
    _, best, _ = recompute.search(evaluate({"dots": 1.1, "offload": 1.4, "full": 1.3}), sites, policies=policies)
    assert best.cost.step_s == 1.1 and sorted(asked) == sorted(policies)
    assert "offload" not in recompute.policies_for(False)
