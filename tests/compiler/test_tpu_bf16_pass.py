"""float32 matmuls on a TPU: operands moved as bfloat16; a reduce-scatter's axes go minor.

At DEFAULT precision a TPU multiplies float32 operands in one bfloat16 pass, and libtpu rounds
them to bfloat16 before it gathers them (the convert moves ahead of the collective, through
reshapes and a layer scan's stacking). The planner prices such moves at 2 bytes an element on
TPU meshes. Checked against libtpu: the TPU audit matrix (benchmarks/RESULTS.md, session 19)
and the compile test at the end.
"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import shardplan
from shardplan.compiler import targets
from shardplan.compiler.bf16_pass import read_as_bf16
from shardplan.compiler.cost import CostModel
from shardplan.sharding.rules import apply_rule
from shardplan.tracing.walk import build_graph

f32 = jnp.float32


def _graph(fn, *args):
    closed = jax.make_jaxpr(fn)(*args)
    return build_graph(closed, [f"in{i}" for i in range(len(closed.jaxpr.invars))], apply_rule)


def _by_shape(g, shape):
    return [t.id for t in g.tensors if t.shape == shape]


def test_a_dot_knows_whether_it_multiplies_in_one_bfloat16_pass():
    x, w = jax.ShapeDtypeStruct((8, 16), f32), jax.ShapeDtypeStruct((16, 32), f32)
    xb, wb = jax.ShapeDtypeStruct((8, 16), jnp.bfloat16), jax.ShapeDtypeStruct((16, 32), jnp.bfloat16)
    assert [d.bf16_pass for d in _graph(lambda a, b: a @ b, x, w).dots] == [True]
    assert [d.bf16_pass for d in _graph(lambda a, b: jnp.dot(a, b, precision="highest"), x, w).dots] == [False]
    assert [d.bf16_pass for d in _graph(lambda a, b: a @ b, xb, wb).dots] == [False]


def test_read_as_bf16_follows_reshapes_to_dots_and_stops_at_other_readers():
    def step(x, w):
        h = x.reshape(8, 4, 16)               # read only by the dot: moves as bf16
        y = jnp.einsum("bhd,de->bhe", h, w)
        z = x.reshape(8, 64) * 2.0            # x itself is also read by a multiply: not narrowed
        return jnp.sum(y) + jnp.sum(z)

    g = _graph(step, jax.ShapeDtypeStruct((8, 64), f32), jax.ShapeDtypeStruct((16, 32), f32))
    narrow = read_as_bf16(g)
    reshaped = _by_shape(g, (8, 4, 16))
    assert reshaped and all(t in narrow for t in reshaped)
    assert not any(t in narrow for t in _by_shape(g, (8, 64)))       # x, and its reshape read by the multiply
    assert not any(t in narrow for t in _by_shape(g, (8, 4, 32)))    # the dot's result: read by a sum
    highest = _graph(lambda x, w: jnp.sum(jnp.einsum("bhd,de->bhe", x.reshape(8, 4, 16), w, precision="highest")),
                     jax.ShapeDtypeStruct((8, 64), f32), jax.ShapeDtypeStruct((16, 32), f32))
    assert not read_as_bf16(highest)


def test_a_residual_stacked_for_dots_of_the_backward_scan_is_read_as_bf16():
    # A layer scan's residual whose backward readers are weight-gradient dots (bf16 passes).
    def loss(ws, x):
        def body(h, w):
            return jnp.tanh(h.reshape(16, 32) @ w).reshape(16, 2, 16), None
        h, _ = jax.lax.scan(body, x, ws)
        return jnp.sum(h)

    args = (jax.ShapeDtypeStruct((3, 32, 32), f32), jax.ShapeDtypeStruct((16, 2, 16), f32))
    g = _graph(jax.grad(loss), *args)
    narrow = read_as_bf16(g)
    by_op = {g.tensors[t].path.split(".", 2)[-1]: t for t in g.stacked}
    assert by_op["reshape:0"] in narrow           # the layer input, read by the weight-gradient dot
    # The tanh output and 1 - tanh^2 are stacked too; an elementwise op reads them: not narrowed.
    assert by_op["tanh:0"] not in narrow and by_op["sub:0"] not in narrow
    assert not any(t in narrow for t in g.level_outputs if t not in g.stacked)


def test_only_tpu_meshes_price_the_bf16_pass():
    from shardplan.compiler.pricing import Pricer
    g = _graph(lambda a, b: a @ b, jax.ShapeDtypeStruct((64, 128), f32), jax.ShapeDtypeStruct((128, 256), f32))
    dot, rhs = g.dots[0], g.tensors[g.dots[0].rhs]
    tpu = Pricer(g, CostModel(shardplan.load_mesh("tpu-v5e-256")))
    gpu = Pricer(g, CostModel(shardplan.load_mesh("h100-8")))
    assert tpu.moved_itemsize(dot, rhs) == 2 and gpu.moved_itemsize(dot, rhs) == 4
    assert not gpu.a.narrow


def test_a_reduce_scatter_puts_its_axes_minor_to_the_dimensions_own():
    # A result split over model and partial over data, reduce-scattered over data onto the same
    # dimension: each device splits its own model block, so the dimension ends ('model', 'data').
    # In mesh order, ('data', 'model'), it is a layout XLA's dot handler cannot reach by a
    # reduce-scatter (libtpu gathered gpt2-small's 1.5 GiB logits gradient instead).
    m = CostModel(shardplan.load_mesh("tpu-v5e-256", axes={"data": 16, "model": 16}))
    assert m.reduced_spec((("model",), ()), ("data",), (("data",), ("model",))) == (("model", "data"), ())
    assert m.reduced_spec((("data",), ()), ("model",), (("data", "model"), ())) == (("data", "model"), ())
    # Asked for in mesh order, the devices' blocks are then permuted: a collective-permute is priced.
    kinds = [c.kind for c in m.reduce_partial((50304, 768), 4, (("model",), ()), ("data",), (("data", "model"), ()))]
    assert kinds == ["reduce-scatter", "collective-permute"]
    assert [c.kind for c in m.reduce_partial((50304, 768), 4, (("model",), ()), ("data",),
                                             (("model", "data"), ()))] == ["reduce-scatter"]
    # The same on GPU and CPU meshes: XLA's SPMD partitioner does it on every compiler
    # (tests/compiler/test_cost.py compiles it).
    gpu = CostModel(shardplan.load_mesh("h100-8", axes={"data": 2, "model": 4}))
    assert gpu.reduced_spec((("model",), ()), ("data",), (("data",), ("model",))) == (("model", "data"), ())


@pytest.mark.slow
@pytest.mark.skipif(not targets.available("tpu"), reason="libtpu is not installed (pip install 'shardplan[aot]')")
def test_collectives_of_a_float32_model_match_libtpu(tmp_path):
    # llama-tiny on 256 v5e chips as (16, 16): its attention operands are gathered over 'model'
    # as bf16 (384 KiB, not 768): the prediction is exact on libtpu (it was +42.8%).
    run = subprocess.run([sys.executable, "-m", "shardplan.cli", "audit", "--model", "llama-tiny", "--mesh",
                          "tpu-v5e-256", "--axes", "data=16,model=16", "--batch", "256", "--target", "tpu",
                          "--time-limit", "10"],
                         capture_output=True, text=True, env={"CI": "true", "PATH": "/usr/bin:/bin",
                                                               "HOME": str(tmp_path)}, timeout=600)
    assert run.returncode in (0, 1), run.stderr[-2000:]
    row = next(line for line in run.stdout.splitlines() if line.startswith("all collectives"))
    error = float(row.split("%")[0].split()[-1])
    assert abs(error) <= 5.0, run.stdout
