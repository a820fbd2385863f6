"""The step graph: scan bodies, and which per-layer gradient reductions XLA merges into one collective."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.compiler.combine import feeds_stacked_output, feeds_update
from shardplan.compiler.hlo import collectives
from shardplan.devices.mesh import make_jax_mesh
from shardplan.sharding.rules import apply_rule
from shardplan.tracing.walk import build_graph

LAYERS = 6


def _loss(params, x):
    def body(h, p):
        w1, b1, w2 = p
        return h + jnp.tanh(h @ w1 + b1) @ w2, None
    h, _ = jax.lax.scan(body, x, params)
    return jnp.sum(h ** 2)


def _args():
    f32 = jnp.float32
    params = (jax.ShapeDtypeStruct((LAYERS, 64, 128), f32), jax.ShapeDtypeStruct((LAYERS, 128), f32),
              jax.ShapeDtypeStruct((LAYERS, 128, 64), f32))
    return params, jax.ShapeDtypeStruct((32, 64), f32)


def test_per_layer_gradients_feed_the_stacked_gradient():
    closed = jax.make_jaxpr(jax.grad(_loss))(*_args())
    g = build_graph(closed, ["w1", "b1", "w2", "x"], apply_rule)
    feeds = {}
    for d in g.dots:
        if g.loop_of[d.out]:
            feeds.setdefault(g.tensors[d.out].shape, set()).add(feeds_stacked_output(g, d.out))
    # Weight gradients are stacked into the scan's output and read by nothing else in the body.
    assert feeds[(64, 128)] == feeds[(128, 64)] == {True}
    # Activation gradients (32, 64) feed the next trip.
    assert feeds[(32, 64)] == {False}
    assert not any(feeds_stacked_output(g, t) for t in g.inputs)


def test_xla_merges_the_per_layer_gradient_reductions():
    """The fact the cost model relies on: a data-parallel scanned step reduces all of one layer's
    weight gradients in one collective per trip, so each pays a share of one latency."""
    mesh = make_jax_mesh(("data",), (8,))
    f = jax.jit(jax.grad(_loss), in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))),
                out_shardings=NamedSharding(mesh, P()))
    comms = collectives(f.lower(*_args()).compile().as_text(), mesh)
    reductions = [c for c in comms if c.kind in ("all-reduce", "reduce-scatter")]
    assert sum(c.nbytes for c in reductions) >= 2 * 64 * 128 * 4     # the weight gradients are in there
    assert sum(c.count for c in reductions) == LAYERS                # one merged reduction per trip


def _sgd_step(params, x):
    """An unrolled (no scan) step with its update: every weight gradient only feeds the update."""
    def loss(ps):
        h = x
        for w1, w2 in ps:
            h = h + jnp.tanh(h @ w1) @ w2
        return jnp.sum(h ** 2)
    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def _unrolled_args(layers=3):
    f32 = jnp.float32
    ps = tuple((jax.ShapeDtypeStruct((64, 128), f32), jax.ShapeDtypeStruct((128, 64), f32)) for _ in range(layers))
    return ps, jax.ShapeDtypeStruct((32, 64), f32)


def test_top_level_gradients_feed_the_update():
    args = _unrolled_args()
    closed = jax.make_jaxpr(_sgd_step)(*args)
    names = [f"in{i}" for i in range(len(jax.tree.leaves(args)))]
    g = build_graph(closed, names, apply_rule)
    weight_grads = [d.out for d in g.dots if g.tensors[d.out].shape in ((64, 128), (128, 64))
                    and g.tensors[d.out].name.startswith("transpose")]
    assert len(weight_grads) == 6
    assert all(feeds_update(g, t) for t in weight_grads)
    # Activations (forward and backward) feed further dots, not only the update.
    acts = [d.out for d in g.dots if g.tensors[d.out].shape == (32, 64)]
    assert acts and not any(feeds_update(g, t) for t in acts)


def test_xla_merges_the_top_level_gradient_reductions():
    """What feeds_update relies on: data-parallel gradient reductions of an unrolled step are
    merged into one collective (a tuple-shaped all-reduce), not one per weight."""
    mesh = make_jax_mesh(("data",), (8,))
    params, x = _unrolled_args()
    rep = jax.tree.map(lambda _: NamedSharding(mesh, P()), params)
    f = jax.jit(_sgd_step, in_shardings=(rep, NamedSharding(mesh, P("data"))), out_shardings=rep)
    comms = collectives(f.lower(params, x).compile().as_text(), mesh)
    reductions = [c for c in comms if c.kind in ("all-reduce", "reduce-scatter")]
    assert sum(c.nbytes for c in reductions) >= 6 * 64 * 128 * 4
    assert len({c.name for c in reductions}) <= 2     # 6 weight gradients, at most two merged ops


def _chain(x, w):
    y = jnp.tanh(jnp.sin(x) * 2.0 + 1.0) * x        # four elementwise results, all fused in XLA
    return jnp.sum(y @ w)


def test_fused_elementwise_results_are_not_stored():
    """Liveness counts only what XLA stores: an elementwise chain's intermediates are computed
    inside the kernel of their reader, so the fullest point holds the chain's input and result,
    not every intermediate."""
    args = (jax.ShapeDtypeStruct((512, 512), jnp.float32), jax.ShapeDtypeStruct((512, 8), jnp.float32))
    g = build_graph(jax.make_jaxpr(_chain)(*args), ["x", "w"], apply_rule)
    big = 512 * 512 * 4
    peak = max(sum(g.tensors[t].nbytes for t in point) for point in g.points)
    assert peak <= big + 64 * 1024       # y (stored: a dot reads it), never sin/mul/add/tanh too
    compiled = jax.jit(_chain).lower(*args).compile().memory_analysis()
    assert compiled.temp_size_in_bytes <= 1.15 * peak


def test_scan_outputs_are_counted_once():
    """A scan writes each trip's stacked output into the result in place: the body's outputs
    are not counted again on top of the stacked result."""
    def f(x):
        def body(c, _):
            c = jnp.tanh(c @ c)
            return c, c
        return jax.lax.scan(body, x, None, length=8)[1]
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    g = build_graph(jax.make_jaxpr(f)(x), ["x"], apply_rule)
    peak = max(sum(g.tensors[t].nbytes for t in point) for point in g.points)
    stacked = 8 * 256 * 256 * 4
    assert stacked <= peak <= stacked + 3 * 256 * 256 * 4


def _stack_loss(params, x, remat):
    def body(h, p):
        w1, b1, w2 = p
        return h + jnp.tanh(h @ w1 + b1) @ w2, None
    if remat:
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)
    h, _ = jax.lax.scan(body, x, params)
    return jnp.sum(h ** 2)


def test_rematerialised_layers_keep_only_their_inputs():
    """Under jax.checkpoint (nothing saveable) the forward scan stacks only each layer's input for
    the backward pass, which recomputes the rest: the fullest point holds one stacked (L, 512, 64)
    tensor instead of three residual stacks, and XLA's compiled memory agrees in both cases."""
    params, _ = _args()
    x = jax.ShapeDtypeStruct((512, 64), jnp.float32)
    peaks = {}
    for remat in (False, True):
        step = jax.grad(lambda p, x, remat=remat: _stack_loss(p, x, remat))
        g = build_graph(jax.make_jaxpr(step)(params, x), ["w1", "b1", "w2", "x"], apply_rule)
        point = max(g.points, key=lambda pt: sum(g.tensors[t].nbytes for t in pt))
        peaks[remat] = sum(g.tensors[t].nbytes for t in point)
        stacks = sorted(g.tensors[t].shape for t in point if g.tensors[t].shape[:2] == (LAYERS, 512))
        assert stacks == ([(LAYERS, 512, 64)] if remat else [(LAYERS, 512, 64), (LAYERS, 512, 128), (LAYERS, 512, 128)])
        m = jax.jit(step).lower(params, x).compile().memory_analysis()
        assert abs(m.temp_size_in_bytes + m.output_size_in_bytes - peaks[remat]) <= 0.15 * peaks[remat]
    assert peaks[True] < 0.5 * peaks[False]


@pytest.mark.parametrize("shape_in, shape_out, out_spec, need", [
    # a batch of 32 rows over ('data', 'model') read from (2, 1, 16) rows: data on the 2, model on the 16
    ((2, 1, 16, 6), (32, 6), (("data", "model"), ()), (("data",), (), ("model",), ())),
    # the same mesh axes over (4, 8) rows: model's 4 would straddle the 4's last 2 and the 8: gathered
    ((4, 8, 6), (32, 6), (("data", "model"), ()), (("data",), (), ())),
    # heads merged: (4, 3, 16) -> 192 over model (4) on the heads
    ((4, 3, 16), (192,), (("model",),), (("model",), (), ())),
    # ... over data and model (8) does not fit the 4 heads whole: model is gathered
    ((4, 3, 16), (192,), (("data", "model"),), (("data",), (), ())),
])
def test_a_reshape_needs_each_mesh_axis_where_its_factor_fits(shape_in, shape_out, out_spec, need):
    """A reshape's operand keeps each mesh axis of a merged output dim on the input dim its factor
    fits in, major to minor. The GPT-3 175B pipeline's outputs, (16, 1, 64, ...) row groups read
    back as a batch of 1024 over ('data', 'model') (16 x 8), were once required with all 128
    shards on the 16: XLA could only reach that by replicating first ("Involuntary full
    rematerialization": a 6 GiB all-gather and all-reduce). With the operand at the spec the
    rule gives, XLA reshapes locally: no collective."""
    from shardplan.compiler.cost import to_partition_spec
    from shardplan.sharding.rules import _reshape_rule
    sizes = {"data": 2, "model": 4}
    assert _reshape_rule(shape_in, shape_out)(out_spec, sizes) == need
    mesh = make_jax_mesh(("data", "model"), (2, 4))
    if sum(map(len, need)) == sum(map(len, out_spec)):       # every axis kept: a local reshape
        f = jax.jit(lambda x: x.reshape(shape_out), in_shardings=NamedSharding(mesh, to_partition_spec(need)),
                    out_shardings=NamedSharding(mesh, to_partition_spec(out_spec)))
        text = f.lower(jax.ShapeDtypeStruct(shape_in, jnp.float32)).compile().as_text()
        assert not collectives(text, mesh), text
