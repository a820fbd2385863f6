"""The call people write first, ``shardplan.auto(step, mesh=..., memory_budget=...)``, reaches
every family by default (shardplan.parallel.defaults): recomputation where the step as written does not
fit, a sequence split for a long sequence under a budget, a pipeline across a slow inter-node
link; ``"off"`` keeps the step as written; where nothing fits, the error says what each family
needed."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardplan
from shardplan.devices.mesh import Axis, make_jax_mesh

import scan_steps


@pytest.mark.parametrize("written", ["scan", "unrolled"])
def test_a_gpt_too_large_as_written_is_recomputed_by_default(written):
    """12 layers, d 1024, batch 64, bf16, in a plain jax.lax.scan (or a Python loop) with no
    jax.checkpoint, on 8 H100s under 6 GiB: as written it needs about 18 GiB."""
    build = scan_steps.abstract_gpt if written == "scan" else scan_steps.abstract_unrolled_gpt
    step, args = build(12, 1024, 16, 1024, 50304, 64)
    with pytest.raises(shardplan.InfeasibleBudgetError, match="smallest budget that works"):
        shardplan.plan(step, *args, mesh="h100-8", memory_budget="6GiB", remat="off", context="off", cache=False)
    p = shardplan.plan(step, *args, mesh="h100-8", memory_budget="6GiB", cache=False)
    assert p.cost.memory_bytes <= 6 * 2**30
    assert [s["policy"] for s in p.remat["sites"]] != ["none"] and p.remat["sites"][0]["layers"] == 12
    assert any("planned with recomputation (remat='auto'), searched by default" in w for w in p.warnings)


def _attention_step(batch, seq, heads, width=128):
    """A step calling jax.nn.dot_product_attention itself (causal), as a user writes it."""
    def loss(w, x):
        q, k, v = ((x @ w[n]).reshape(batch, seq, heads, width // heads) for n in "qkv")
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return jnp.mean((x + o.reshape(batch, seq, width) @ w["o"]) ** 2)

    def step(w, x):
        value, grads = jax.value_and_grad(loss)(w, x)
        return jax.tree.map(lambda a, g: a - 0.1 * g, w, grads), value
    keys = jax.random.split(jax.random.key(0), 5)
    w = {n: jax.random.normal(k, (width, width)) * 0.1 for n, k in zip("qkvo", keys)}
    return step, (w, jax.random.normal(keys[4], (batch, seq, width)))


def test_a_long_sequence_under_a_budget_is_split_by_default_and_trains_like_jit():
    step, (w, x) = _attention_step(2, 2048, 8)
    mesh = make_jax_mesh(("data", "seq"), (2, 4))
    with pytest.raises(shardplan.InfeasibleBudgetError):
        shardplan.plan(step, w, x, mesh=mesh, hardware="h100-8", memory_budget="48MiB", context="off", cache=False)
    f = shardplan.auto(step, mesh=mesh, hardware="h100-8", memory_budget="48MiB", donate_argnums=(0,), cache=False)
    got_w, want_w = jax.tree.map(jnp.copy, w), w
    for _ in range(5):
        got_w, got = f(got_w, x)
        want_w, want = jax.jit(step)(want_w, x)
        np.testing.assert_allclose(got, want, rtol=1e-5)
    assert f.plan.context is not None and f.plan.cost.memory_bytes <= 48 * 2**20
    assert any("planned with a sequence split (context='auto')" in w for w in f.plan.warnings)


def _slow_link(axes: dict) -> shardplan.MeshSpec:
    """Nodes of 8 H100s joined by 10 Gb Ethernet (1.25 GB/s a device) instead of InfiniBand."""
    h100 = shardplan.load_mesh("h100-8x8")
    ethernet = dataclasses.replace(h100.inter_node_link, name="ethernet", bandwidth=1.25e9, latency=30e-6)
    devices = (Axis("all", int(np.prod(list(axes.values()))), ethernet),)
    return dataclasses.replace(h100, name="h100-ethernet", axes=devices, inter_node_link=ethernet).with_axes(axes)


def test_a_slow_inter_node_link_gets_a_pipeline_by_default():
    """A 6.7B GPT (32 layers, d 4096) on 4 nodes of 8 H100s over Ethernet: the default searches
    pipelines on a mesh of several nodes, and the one it keeps is at least twice as fast."""
    step, args = scan_steps.abstract_gpt(32, 4096, 32, 1024, 32768, 64)
    mesh = _slow_link({"data": 4, "model": 8})
    p = shardplan.plan(step, *args, mesh=mesh, cache=False)
    off = shardplan.plan(step, *args, mesh=mesh, pipeline="off", cache=False)
    assert p.pipeline is not None and off.pipeline is None
    assert off.cost.step_s >= 2 * p.cost.step_s, (off.cost.step_s, p.cost.step_s)


def _mlp_stack_step(layers=4, width=64, batch=32):
    """A plain jax.lax.scan over stacked MLP weights (no attention), SGD."""
    def loss(w, x):
        return jnp.mean(jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)[0] ** 2)

    def step(w, x):
        value, grad = jax.value_and_grad(loss)(w, x)
        return w - 0.1 * grad, value
    return step, (jnp.ones((layers, width, width)) * 0.05, jnp.ones((batch, width)))


def test_off_keeps_the_step_as_written_and_the_error_lists_each_family():
    step, args = _mlp_stack_step()
    mesh = shardplan.load_mesh("cpu-8", axes={"data": 2, "model": 4})
    with pytest.raises(shardplan.InfeasibleBudgetError) as written:
        shardplan.plan(step, *args, mesh=mesh, memory_budget="4KiB", remat="off", context="off", pipeline="off",
                       cache=False, time_limit=2)
    assert "Tried" not in str(written.value)
    with pytest.raises(shardplan.InfeasibleBudgetError, match=r"Tried, with the least memory each needs:\n"
                       r"  - the step as written: needs about .*\n  - recomputation \(remat='auto'\): needs about "
                       r".*\n  - a sequence split \(context='auto'\): needs about .* \(context='auto' could not help: "
                       r"the step has no attention.*\n  - a pipeline \(pipeline='auto'\): needs about") as searched:
        shardplan.plan(step, *args, mesh=mesh, memory_budget="10KiB", cache=False, time_limit=2)
    needs = dict(searched.value.tried)
    assert needs["recomputation (remat='auto')"] < needs["the step as written"]
    assert searched.value.min_feasible_bytes == min(b for b in needs.values() if b is not None)
    # Under what the arguments alone take split over all 8 devices (9 KiB), no family is tried.
    with pytest.raises(shardplan.InfeasibleBudgetError, match=r"no pipeline, recomputation or sequence split can "
                       r"help: the step's arguments alone take 9.00 KiB a device") as floor:
        shardplan.plan(step, *args, mesh=mesh, memory_budget="4KiB", cache=False, time_limit=2)
    assert "Tried" not in str(floor.value) and floor.value.floor_bytes == 9 * 1024


def test_a_step_that_fits_as_written_is_planned_as_written():
    us = scan_steps.build("jax_scan_gpt")
    mesh = shardplan.load_mesh("cpu-8", axes={"data": 2, "model": 4})
    p = shardplan.plan(us.fn, *us.args, mesh=mesh, cache=False, **us.jit)
    assert p.remat is None and p.pipeline is None and p.context is None and not p.warnings
