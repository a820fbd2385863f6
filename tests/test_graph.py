"""The step graph: scan bodies, and which per-layer gradient reductions XLA merges into one collective."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from shardplan.graph import build_graph
from shardplan.hlo import collectives
from shardplan.mesh import make_jax_mesh
from shardplan.rules import apply_rule

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
            feeds.setdefault(g.tensors[d.out].shape, set()).add(g.feeds_stacked_output(d.out))
    # Weight gradients are stacked into the scan's output and read by nothing else in the body.
    assert feeds[(64, 128)] == feeds[(128, 64)] == {True}
    # Activation gradients (32, 64) feed the next trip.
    assert feeds[(32, 64)] == {False}
    assert not any(g.feeds_stacked_output(t) for t in g.inputs)


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
