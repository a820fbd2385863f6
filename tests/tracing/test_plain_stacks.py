"""Layer stacks written as plain loops (tests/scan_steps.py: jax.lax.scan, Linen nn.scan, NNX
nnx.scan over an nnx.vmap stack, jax.lax.fori_loop, and layers unrolled in a Python loop in
plain JAX, Linen and NNX; no shardplan call in the model) are recognised as layer classes and
(scans) pipeline stacks: planned with a pipeline and with each recomputation policy, run in a
loop of donated calls, they compute what the step computes."""

import jax
import numpy as np
import pytest
from jax.extend.core import jaxpr_as_fun

import shardplan
from shardplan.parallel.pipeline import PipelineError
from shardplan.parallel.recompute import RecomputeError

import scan_steps

N_STEPS = 5
MESH = {"data": 2, "model": 4}
SCANS = ["jax_scan_gpt", "linen_scan_dropout", "nnx_scan_dropout"]
UNROLLED = ["jax_unrolled_gpt", "linen_unrolled_dropout", "nnx_unrolled_dropout"]


def _mesh():
    return shardplan.load_mesh("cpu-8", axes=MESH)


def _as_traced(auto_fn, us):
    """The planned step's own traced program (its pipeline and recomputation in it), run
    unsharded by ``jax.jit``: what the sharded plan must compute."""
    c = auto_fn._compiled(us.args, us.kwargs)
    run = jax.jit(jaxpr_as_fun(c.traced.closed))

    def step(state, *rest, **kwargs):
        leaves = c.traced.flat_args(auto_fn.call, (state, *rest), kwargs)
        return jax.tree_util.tree_unflatten(c.traced.out_tree, run(*leaves))
    return step


def _planned(us, **kw):
    return shardplan.auto(us.fn, mesh=_mesh(), time_limit=2, cache=False, **us.jit, **kw)


@pytest.mark.parametrize("name", SCANS)
def test_a_plain_scan_is_pipelined_and_computes_its_step(name):
    us = scan_steps.build(name)
    f = _planned(us, pipeline=2)
    _, losses = us.loop(f, N_STEPS)
    assert f.plan.pipeline is not None and f.plan.pipeline["stages"] == 2
    fresh = scan_steps.build(name)
    reference = jax.jit(us.fn, **us.jit) if "dropout" not in name else _as_traced(f, fresh)
    _, expected = fresh.loop(reference, N_STEPS)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert "pipeline: 2 stages" in f.plan.explain()


@pytest.mark.parametrize("name,policy", [(n, p) for n in SCANS + ["fori_stack"] + UNROLLED
                                         for p in ("dots_all", "dots", "full")])
def test_a_plain_loop_is_a_layer_class_for_each_recomputation_policy(name, policy):
    us = scan_steps.build(name)
    f = _planned(us, remat=policy)
    _, losses = us.loop(f, N_STEPS)
    sites = f.plan.remat["sites"]
    assert [s["policy"] for s in sites] == [policy] and sites[0]["layers"] == scan_steps.LAYERS
    assert sites[0]["where"].startswith("scan_steps:")        # the model's own line, not flax's or jax's
    _, expected = scan_steps.build(name).loop(jax.jit(us.fn, **us.jit), N_STEPS)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)


def test_the_recomputation_policy_changes_what_the_step_keeps():
    us = scan_steps.build("jax_scan_gpt")
    kept = {p: shardplan.plan(us.fn, *us.args, mesh=_mesh(), remat=p, cache=False, **us.jit).cost.memory_bytes
            for p in ("none", "full")}
    assert kept["full"] < kept["none"]


def test_a_fori_loop_stack_is_not_pipelined_and_the_error_says_why():
    us = scan_steps.build("fori_stack")
    with pytest.raises(PipelineError,
                       match=r"layer stack at scan_steps:.*fori_loop reads each layer's weights by its index"):
        shardplan.plan(us.fn, *us.args, mesh=_mesh(), pipeline=2, cache=False, **us.jit)


@pytest.mark.parametrize("name", UNROLLED)
def test_unrolled_layers_are_not_pipelined_and_the_error_says_why(name):
    us = scan_steps.build(name)
    with pytest.raises(PipelineError, match=r"no layer stack a pipeline can split.*unrolled in a Python loop"):
        shardplan.plan(us.fn, *us.args, mesh=_mesh(), pipeline=2, cache=False, **us.jit)


def test_unrolled_layers_recompute_what_the_step_keeps_less_of():
    us = scan_steps.build("jax_unrolled_gpt")
    plans = {p: shardplan.plan(us.fn, *us.args, mesh=_mesh(), remat=p, cache=False, **us.jit) for p in ("none", "full")}
    assert plans["full"].remat["sites"] and {s["policy"] for s in plans["full"].remat["sites"]} == {"full"}
    # Recomputed, the layers keep less from the forward pass to the backward. This small step's
    # fullest point is later, where its gradients wait whole for their one combined all-reduce
    # (compiler/held.py), which recomputation leaves as it is: the CPU compiler's programs hold
    # 1,090,160 and 1,086,192 bytes.
    assert plans["full"].cost.memory_bytes <= plans["none"].cost.memory_bytes


def test_a_scan_whose_carry_is_not_the_activation_is_named_and_planned_without_a_pipeline():
    import jax.numpy as jnp

    def step(w, x):
        def loss(w):
            def body(c, wl):
                h, n = c
                return (jnp.tanh(h @ wl), n + 1), None
            (h, _), _ = jax.lax.scan(body, (x, 0), w)
            return (h ** 2).mean()
        return jax.grad(loss)(w)
    w, x = jnp.ones((4, 16, 16)) * 0.1, jnp.ones((16, 16))
    with pytest.raises(PipelineError, match=r"carry is not the activation alone.*a scalar"):
        shardplan.plan(step, w, x, mesh=_mesh(), pipeline=2, cache=False)
    p = shardplan.plan(step, w, x, mesh=_mesh(), remat="full", cache=False)
    assert [s["policy"] for s in p.remat["sites"]] == ["full"]


def test_loops_that_are_not_layer_stacks_run_as_written():
    """A loop outside differentiation (gradient accumulation) and a scan over data (not stacked
    weights of the step's arguments) are no layer class."""
    import jax.numpy as jnp

    def step(w, xs):
        def loss(w, x):
            def chunk(acc, xc):                    # a scan over chunks of the batch
                return acc + jnp.sum(jnp.tanh(xc @ w)), None
            return jax.lax.scan(chunk, 0.0, x.reshape(4, -1, x.shape[-1]))[0]

        def accumulate(i, g):                      # not differentiated
            return g + jax.grad(loss)(w, xs[i])
        return jax.lax.fori_loop(0, 2, accumulate, jnp.zeros_like(w))
    w, xs = jnp.ones((16, 16)) * 0.1, jnp.ones((2, 32, 16))
    p = shardplan.plan(step, w, xs, mesh=_mesh(), remat="full", cache=False)
    assert not (p.remat or {}).get("sites")
    assert any("no layer" in w for w in p.warnings)


def test_offload_on_a_recognised_stack_is_refused_on_a_cpu_mesh():
    us = scan_steps.build("jax_scan_gpt")
    with pytest.raises(RecomputeError, match="offload"):
        shardplan.plan(us.fn, *us.args, mesh=_mesh(), remat="offload", cache=False, **us.jit)


def test_dropout_in_a_pipelined_plain_scan_draws_fresh_masks_per_microbatch():
    """Per-layer keys scanned with the weights by a plain jax.lax.scan: pipelined, each
    microbatch draws its own masks, as the rows of the whole batch do."""
    import jax.numpy as jnp
    layers, batch, width, microbatches = 4, 16, 32, 4

    def step(w, keys, x):
        def forward(w):
            def body(h, xs):
                wl, k = xs
                return h @ wl * jax.random.bernoulli(k, 0.5, h.shape), None
            return jax.lax.scan(body, x, (w, keys))[0]
        out, pull = jax.vjp(forward, w)
        return pull(out)[0], out
    w = jnp.broadcast_to(jnp.eye(width), (layers, width, width))
    keys, x = jax.random.split(jax.random.key(0), layers), jnp.ones((batch, width))
    f = shardplan.auto(step, mesh=_mesh(), pipeline=shardplan.PipelineConfig(2, microbatches), cache=False)
    out = np.asarray(f(w, keys, x)[1])
    assert f.plan.pipeline is not None
    rows = [out[m::microbatches] for m in range(microbatches)]        # microbatch m: rows m, m + M, ...
    assert not any(np.array_equal(rows[0], r) for r in rows[1:])
    assert 0.02 < out.mean() < 0.12                                    # four layers keeping half: 1/16 kept
