"""What a plan holds beyond its tensors (shardplan/compiler/held.py): a matmul operand resharded
the same way for the forward and the backward pass is one copy, held from the first matmul to the
last; gradients reduced by one combined collective wait for it as whole partial sums. The compiled
programs' buffer assignments show both, and the plan's predicted memory counts them."""

import tempfile

import jax
import jax.numpy as jnp
import pytest

import shardplan
from shardplan.compiler import footprint

LAYERS, D, BATCH = 6, 1024, 8192


def _step(params, x):
    def loss(p):
        h = x
        for w in p:                      # layers unrolled in Python: top-level matmuls
            h = jnp.tanh(h @ w)
        return jnp.sum(h * h)
    value, grads = jax.value_and_grad(loss)(params)
    return [w - 0.1 * g for w, g in zip(params, grads)], value


def test_a_weight_gathered_for_its_forward_matmul_is_held_until_its_backward_one():
    params = [jnp.full((D, D), 0.01, jnp.float32) for _ in range(LAYERS)]
    x = jnp.ones((BATCH, D), jnp.float32)
    f = shardplan.auto(_step, mesh=shardplan.load_mesh("cpu-8", axes={"data": 8}), donate_argnums=(0,),
                       cache=False)
    f.make_plan(params, x)
    # Weights and batch split over `data` (ZeRO-3): each weight gathered whole for its matmuls.
    assert [r.spec for r in f.plan.inputs] == [(("data",), ())] * (LAYERS + 1)
    with tempfile.TemporaryDirectory() as folder:
        f.lower(params, x).compile(compiler_options={"xla_dump_to": folder})
        heap = footprint.dumped_heap(folder)
    gathered = [b for b in heap.buffers if b[4][0].startswith("all-gather") and b[0] == D * D * 4]
    # One all-gather a weight (XLA's CSE: the forward's and the backward's are one), each live
    # across the turn from the forward pass to the backward, but the first layer's: its input
    # is not differentiated, so no backward matmul reads its weight.
    assert len(gathered) == LAYERS
    assert sum(b[1] <= heap.peak_step <= b[2] for b in gathered) == LAYERS - 1
    # Counted (and the weight gradients' partial sums, waiting for one combined all-reduce), the
    # prediction is the compiled program's within the heap allowance the model adds to live
    # temporaries (device.heap_overhead, 10%); without them it was 35% under.
    audit = f.audit_for("cpu", params, x)
    assert abs(audit.memory_error()) < 0.10, audit.table()


def test_gradients_reduced_by_one_combined_all_reduce_wait_for_it_whole_on_the_gpu():
    import re

    from shardplan.compiler import targets
    if not targets.available("gpu"):
        pytest.skip("the GPU compiler is not installed (pip install 'shardplan[aot]')")
    params = [jax.ShapeDtypeStruct((D, D), jnp.float32) for _ in range(LAYERS)]
    x = jax.ShapeDtypeStruct((BATCH, D), jnp.float32)
    f = shardplan.auto(_step, mesh=shardplan.load_mesh("h100-8", axes={"data": 8}), donate_argnums=(0,),
                       cache=False)
    f.make_plan(params, x)
    assert [r.spec for r in f.plan.inputs] == [((), ())] * LAYERS + [(("data",), ())]     # data parallel
    compiled, _, _ = f.compile_for("gpu", params, x)
    # XLA's all-reduce combiner: the six weight gradients (and the loss) in one all-reduce of their
    # concatenation, after the last of them.
    sizes = [int(m.group(1)) for m in re.finditer(r"= f32\[(\d+)\]\{0\} all-reduce-start\(", compiled.as_text())]
    assert sizes == [LAYERS * D * D + 1], sizes
    # Counted whole until then, with the reduced results beside them there, the prediction is the
    # compiled program's within the model's heap allowance (10%) and a little (it was 17% under).
    audit = f.audit_for("gpu", params, x)
    assert abs(audit.memory_error()) < 0.15, audit.table()
