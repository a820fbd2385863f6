"""A differentiated ``jax.checkpoint`` in layers unrolled at the top level: XLA's CPU compiler
drops the checkpoint's optimisation barriers before its CSE and its scheduling, so the step holds
what it holds without the checkpoints, while the recomputation's collectives still run; the GPU
compiler recomputes and saves. The planner's graph follows each (tracing/walk.py, _recomputed)."""

import jax
import jax.numpy as jnp
import pytest

import shardplan
from shardplan.compiler import targets

N, D, LAYERS = 4096, 1024, 6


def _step(checkpointed: bool):
    def layer(h, w):
        return jnp.tanh(jnp.tanh(h @ w) @ w.T) + h
    f = jax.checkpoint(layer) if checkpointed else layer

    def step(ws, x):
        def loss(ws):
            h = x
            for i in range(LAYERS):
                h = f(h, ws[i])
            return jnp.sum(h * h)
        value, grads = jax.value_and_grad(loss)(ws)
        return ws - 0.01 * grads, value
    return step


def _audit(checkpointed: bool):
    ws, x = jnp.full((LAYERS, D, D), 0.01), jnp.ones((N, D))
    f = shardplan.auto(_step(checkpointed), mesh=shardplan.load_mesh("cpu-8", axes={"data": 8}),
                       donate_argnums=(0,), cache=False, remat="off")
    f.make_plan(ws, x)
    return f.plan, f.audit_for("cpu", ws, x)


def test_checkpointed_unrolled_layers_hold_on_the_cpu_compiler_what_they_hold_without():
    plain_plan, plain = _audit(False)
    plan, audit = _audit(True)
    # The compiled programs: the same memory, the checkpointed one's collectives more (each
    # recomputed layer gathers its weight again).
    assert audit.memory.compiled_bytes == pytest.approx(plain.memory.compiled_bytes, rel=0.01)
    assert audit.comm_bytes[1] > 1.2 * plain.comm_bytes[1]
    # The plan: the same memory (it was 24% under), the recomputation's collectives and matmuls.
    assert abs(audit.memory_error()) < 0.03, audit.table()
    assert audit.comm_bytes[0] == pytest.approx(audit.comm_bytes[1], rel=0.01)
    assert plan.cost.step_s > 1.2 * plain_plan.cost.step_s


def test_the_gpu_compiler_recomputes_checkpointed_layers_and_the_plan_saves_there_too():
    if not targets.available("gpu"):
        pytest.skip("the GPU compiler is not installed (pip install 'shardplan[aot]')")
    ws = jax.ShapeDtypeStruct((LAYERS, D, D), jnp.float32)
    x = jax.ShapeDtypeStruct((N, D), jnp.float32)
    mesh = shardplan.load_mesh("h100-8", axes={"data": 8})
    memory = {}
    for checkpointed in (False, True):
        f = shardplan.auto(_step(checkpointed), mesh=mesh, donate_argnums=(0,), cache=False, remat="off")
        f.make_plan(ws, x)
        compiled, _, _ = f.compile_for("gpu", ws, x)
        memory[checkpointed] = (f.plan.cost.memory_bytes, compiled.memory_analysis().temp_size_in_bytes)
    assert memory[True][1] < 0.8 * memory[False][1]          # compiled: recomputed, less held
    assert memory[True][0] < 0.9 * memory[False][0]          # planned so (arguments included)
