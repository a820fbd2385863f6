"""Train steps written the way users write them (not the reference models), whose attention is
written out: recognised while the planner traces with ``context=``, split as asked, and trained
for 3 donated steps against ``jax.jit(step)``. Steps whose attention must be left as written
(a mask from the data, a sliding window, dropout on the weights, cross-attention, softmax's
``where=``, a ``from jax import value_and_grad`` taken before) plan as written and match too."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax import value_and_grad as imported_value_and_grad

import shardplan
from shardplan.devices.mesh import make_jax_mesh
from shardplan.parallel.sequence import ContextConfig

RING = ContextConfig("ring", seq_axes=("seq",), batch_axes=("data",), load_balance="zigzag")
ALLGATHER = ContextConfig("allgather", seq_axes=("seq",), batch_axes=("data",))
ULYSSES = ContextConfig("ulysses", seq_axes=("seq",), batch_axes=("data",))
AXES = dict(axis_names=("data", "seq"), axis_sizes=(2, 4))


def _recognised(step, args, config):
    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "seq"))
    with shardplan.parallel.sequence.context_parallel(config, mesh) as use:
        traced = str(jax.make_jaxpr(step)(*args))
    return "shard_map" in traced, use.sites


def _trains_like_jit(step, args, config, rtol=1e-5, steps=3):
    state, rest = args[0], args[1:]
    want, s = [], state
    for _ in range(steps):
        s, loss = jax.jit(step)(s, *rest)
        want.append(float(loss))
    f = shardplan.auto(step, mesh=make_jax_mesh(**AXES), hardware="h100-8", context=config, donate_argnums=(0,))
    got, s = [], jax.tree.map(jnp.copy, state)
    for _ in range(steps):                 # the state donated and fed back, as a training loop does
        s, loss = f(s, *rest)
        got.append(float(loss))
    np.testing.assert_allclose(got, want, rtol=rtol)
    return f


# ---------------------------------------------------------------------------------------------
# Recognised

def linen_train_state():
    # nn.MultiHeadDotProductAttention (no dropout) with nn.make_causal_mask, a flax TrainState
    B, T, E = 4, 256, 64

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=4, dropout_rate=0.0, deterministic=True)(h, h, mask=mask)
            return x + nn.Dense(E)(nn.gelu(nn.Dense(2 * E)(nn.LayerNorm()(x))))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(E)(Block()(Block()(x)))

    model = Model()
    x, y = (jax.random.normal(jax.random.key(i), (B, T, E)) for i in (1, 2))
    state = train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), x)["params"],
                                          tx=optax.adamw(1e-3))

    def step(state, batch):
        def loss_fn(p):
            return jnp.mean((state.apply_fn({"params": p}, batch["x"]) - batch["y"]) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss
    return step, (state, {"x": x, "y": y}), [((B, T, 4, 16), (B, T, 4, 16), True)] * 2


def nnx_scan_remat():
    # NNX layers stacked by nnx.vmap, run by nnx.scan(nnx.remat(...)); heads-first einsums
    B, T, E, H, L = 4, 512, 64, 4, 2

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.qkv = nnx.Linear(E, 3 * E, use_bias=False, rngs=rngs)
            self.o = nnx.Linear(E, E, rngs=rngs)
            self.ln = nnx.LayerNorm(E, rngs=rngs)

        def __call__(self, x):
            b, t, _ = x.shape
            q, k, v = (a.reshape(b, t, H, E // H).transpose(0, 2, 1, 3) for a in jnp.split(self.qkv(self.ln(x)), 3, -1))
            s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * (E // H) ** -0.5
            s = jnp.where(jnp.arange(t)[:, None] >= jnp.arange(t)[None, :], s, jnp.finfo(jnp.float32).min)
            o = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)
            return x + self.o(o.transpose(0, 2, 1, 3).reshape(b, t, E))

    class Model(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=L)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Block(rngs)
            self.layers = make(rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            @nnx.remat
            def body(x, layer):
                return layer(x)
            return body(x, self.layers)

    graphdef, params = nnx.split(Model(nnx.Rngs(0)), nnx.Param)
    tx = optax.sgd(1e-2, momentum=0.9)
    x = jax.random.normal(jax.random.key(1), (B, T, E))

    def step(state, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - x) ** 2))(nnx.merge(graphdef, state["params"]))
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss
    return step, ({"params": params, "opt": tx.init(params)}, x), [((B, T, H, E // H), (B, T, H, E // H), True)]


def bf16_f32_softmax():
    # bf16 weights and activations, scores cast to f32 for the softmax, an additive triu(-1e9)
    # bias, `@` with [b, h, t, d]; loss in f32
    B, T, E, H = 2, 512, 128, 8
    D = E // H
    bias = jnp.triu(jnp.full((T, T), -1e9, jnp.float32), k=1)

    def loss_fn(params, x):
        h = x
        for w in params:
            q, k, v = ((h @ w[n]).reshape(B, T, H, D).transpose(0, 2, 1, 3) for n in "qkv")
            s = (q @ k.transpose(0, 1, 3, 2)).astype(jnp.float32) / jnp.sqrt(jnp.float32(D))
            p = jax.nn.softmax(s + bias, axis=-1).astype(jnp.bfloat16)
            h = h + (p @ v).transpose(0, 2, 1, 3).reshape(B, T, E) @ w["o"]
        return jnp.mean(jnp.square((h - x).astype(jnp.float32)))

    keys = iter(jax.random.split(jax.random.key(0), 16))
    params = [{n: (jax.random.normal(next(keys), (E, E)) * 0.05).astype(jnp.bfloat16) for n in "qkvo"}
              for _ in range(2)]
    tx = optax.adam(1e-3)

    def step(state, x):
        params, opt = state
        loss, g = jax.value_and_grad(loss_fn)(params, x)
        u, opt = tx.update(g, opt, params)
        return (optax.apply_updates(params, u), opt), loss
    x = jax.random.normal(next(keys), (B, T, E)).astype(jnp.bfloat16)
    return step, ((params, tx.init(params)), x), [((B, T, H, D), (B, T, H, D), True)] * 2


def maxtext_gqa_rope():
    # q reshaped [b, t, kv, g, d], RoPE on q and k, the scale folded into q, an iota causal mask
    # with MaxText's -0.7 * finfo.max fill
    B, T, E, NQ, NKV = 2, 512, 128, 8, 2
    D, G = E // NQ, NQ // NKV

    def rope(x):
        half = D // 2
        ang = jnp.arange(T, dtype=jnp.float32)[:, None] / (10000 ** (jnp.arange(half) / half))[None, :]
        ang = ang.reshape((1, T) + (1,) * (x.ndim - 3) + (half,))
        x1, x2 = x[..., :half], x[..., half:]
        return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang), x2 * jnp.cos(ang) + x1 * jnp.sin(ang)], -1)

    def loss_fn(p, x):
        h = x
        for w in p:
            q = rope((h @ w["q"]).reshape(B, T, NKV, G, D)) * D ** -0.5
            k, v = rope((h @ w["k"]).reshape(B, T, NKV, D)), (h @ w["v"]).reshape(B, T, NKV, D)
            s = jnp.einsum("btkgd,bskd->bkgts", q, k)
            row, col = (jax.lax.broadcasted_iota(jnp.int32, (T, T), d) for d in (0, 1))
            s = jnp.where((row >= col)[None, None, None], s, -0.7 * jnp.finfo(s.dtype).max)
            h = h + jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s, axis=-1), v).reshape(B, T, E) @ w["o"]
        return jnp.mean((h[:, :-1] - x[:, 1:]) ** 2)

    def init(key):
        ks = jax.random.split(key, 4)
        return {n: jax.random.normal(k, (E, E if n in "qo" else NKV * D)) * 0.05 for n, k in zip("qkvo", ks)}
    params = [init(k) for k in jax.random.split(jax.random.key(0), 2)]
    tx = optax.adamw(1e-3)

    def step(state, x):
        loss, g = jax.value_and_grad(loss_fn)(state["p"], x)
        u, o = tx.update(g, state["o"], state["p"])
        return {"p": optax.apply_updates(state["p"], u), "o": o}, loss
    x = jax.random.normal(jax.random.key(3), (B, T, E))
    return step, ({"p": params, "o": tx.init(params)}, x), [((B, T, NQ, D), (B, T, NKV, D), True)] * 2


def linen_scan_broadcast_mask():
    # the causal mask built once outside a Linen nn.scan and passed in as an nn.broadcast argument
    B, T, E, H = 4, 256, 64, 4

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            q, k, v = (nn.DenseGeneral((H, E // H), name=n)(x) for n in "qkv")
            return x + nn.DenseGeneral(E, axis=(-2, -1))(nn.dot_product_attention(q, k, v, mask=mask)), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
            layers = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=nn.broadcast,
                             length=2)
            return layers()(x, mask)[0]

    model = Stack()
    x = jax.random.normal(jax.random.key(1), (B, T, E))
    params = model.init(jax.random.key(0), x)["params"]
    tx = optax.adam(1e-3)

    def step(state, x):
        p, o = state
        loss, g = jax.value_and_grad(lambda p: jnp.mean((model.apply({"params": p}, x) - x) ** 2))(p)
        u, o = tx.update(g, o, p)
        return (optax.apply_updates(p, u), o), loss
    return step, ((params, tx.init(params)), x), [((B, T, H, E // H), (B, T, H, E // H), True)]


E, H = 64, 4


def _attend(w, x):
    b, t, _ = x.shape
    q, k, v = ((x @ w[n]).reshape(b, t, H, E // H) for n in "qkv")
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(E // H), -1e9)
    return x + jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).reshape(b, t, E) @ w["o"]


def _loss_aux(w, x):
    h = _attend(w, x)
    return jnp.mean((h - x) ** 2), {"h2": jnp.mean(h ** 2)}


def _weights():
    return {n: jax.random.normal(k, (E, E)) * 0.1 for n, k in zip("qkvo", jax.random.split(jax.random.key(0), 4))}


def _sgd(w, g, lr=0.1):
    return jax.tree.map(lambda a, b: a - lr * b, w, g)


def grad_has_aux():
    def step(w, x):
        g, aux = jax.grad(_loss_aux, has_aux=True)(w, x)
        return _sgd(w, g), aux["h2"]
    return step, (_weights(), jax.random.normal(jax.random.key(7), (4, 512, E))), [((4, 512, H, 16),) * 2 + (True,)]


def vjp_directly():
    def step(w, x):
        out, pull = jax.vjp(lambda w: _attend(w, x), w)
        (g,) = pull(2 * (out - x) / out.size)
        return _sgd(w, g), jnp.mean((out - x) ** 2)
    return step, (_weights(), jax.random.normal(jax.random.key(7), (4, 512, E))), [((4, 512, H, 16),) * 2 + (True,)]


def accumulated_in_fori_loop():
    def step(w, x):
        def body(i, carry):
            xb = jax.lax.dynamic_slice_in_dim(x, i * 2, 2, axis=0)
            (loss, _), g = jax.value_and_grad(_loss_aux, has_aux=True)(w, xb)
            return jax.tree.map(jnp.add, carry[0], g), carry[1] + loss
        g, loss = jax.lax.fori_loop(0, 4, body, (jax.tree.map(jnp.zeros_like, w), jnp.float32(0)))
        return _sgd(w, jax.tree.map(lambda a: a / 4, g)), loss / 4
    return step, (_weights(), jax.random.normal(jax.random.key(7), (8, 512, E))), [((2, 512, H, 16),) * 2 + (True,)]


def dot_product_attention_with_mask_argument():
    # a mask= argument is not a routed call, but jax.nn.dot_product_attention's XLA
    # implementation writes einsum-softmax-einsum, which is recognised
    B, T, E8, H8 = 4, 512, 128, 8

    def loss_fn(w, x):
        q, k, v = ((x @ w[n]).reshape(B, T, H8, E8 // H8) for n in "qkv")
        o = jax.nn.dot_product_attention(q, k, v, mask=jnp.tril(jnp.ones((T, T), bool))[None, None])
        return jnp.mean((o.reshape(B, T, E8) @ w["o"]) ** 2)

    def step(w, x):
        loss, g = jax.value_and_grad(loss_fn)(w, x)
        return _sgd(w, g), loss
    w = {n: jax.random.normal(k, (E8, E8)) * 0.1 for n, k in zip("qkvo", jax.random.split(jax.random.key(0), 4))}
    return step, (w, jax.random.normal(jax.random.key(4), (B, T, E8))), [((B, T, H8, 16),) * 2 + (True,)]


CASES = [(linen_train_state, RING, 1e-5), (nnx_scan_remat, RING, 1e-5), (bf16_f32_softmax, RING, 2e-2),
         (maxtext_gqa_rope, ALLGATHER, 1e-5), (linen_scan_broadcast_mask, RING, 1e-5), (grad_has_aux, RING, 1e-5),
         (vjp_directly, RING, 1e-5), (accumulated_in_fori_loop, RING, 1e-5),
         (dot_product_attention_with_mask_argument, ULYSSES, 1e-5)]


@pytest.mark.parametrize("make,config,rtol", CASES, ids=[c[0].__name__ for c in CASES])
def test_a_users_written_attention_is_split_and_trains_like_jit(make, config, rtol):
    step, args, sites = make()
    f = _trains_like_jit(step, args, config, rtol=rtol)
    assert f.plan.context_config() == config
    if make is vjp_directly:             # the planned program itself rotates K/V blocks
        assert "collective-permute" in f.lower(*args).compile().as_text()
    split, found = _recognised(step, args, config)
    assert split and found == sites


# ---------------------------------------------------------------------------------------------
# Left as written

T = 256
CAUSAL = jnp.tril(jnp.ones((T, T), bool))


def _scores(w, x, y=None):
    y = x if y is None else y
    q = (x @ w["q"]).reshape(*x.shape[:2], H, E // H)
    k, v = ((y @ w[n]).reshape(*y.shape[:2], H, E // H) for n in "kv")
    return jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(E // H), v


def _out(w, p, v, x):
    return x + jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(x.shape) @ w["o"]


def padding_from_the_batch(w, batch):
    s, v = _scores(w, batch["x"])
    return _out(w, jax.nn.softmax(jnp.where(CAUSAL & batch["valid"][:, None, None, :], s, -1e9)), v, batch["x"])


def sliding_window(w, batch):
    s, v = _scores(w, batch["x"])
    i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    return _out(w, jax.nn.softmax(jnp.where((i >= j) & (i - j < 64), s, -1e9)), v, batch["x"])


def dropout_on_the_weights(w, batch):
    s, v = _scores(w, batch["x"])
    p = jax.nn.softmax(jnp.where(CAUSAL, s, -1e9))
    return _out(w, jnp.where(jax.random.bernoulli(batch["key"], 0.9, p.shape), p / 0.9, 0.0), v, batch["x"])


def cross_attention(w, batch):
    s, v = _scores(w, batch["x"], batch["memory"])
    return _out(w, jax.nn.softmax(s), v, batch["x"])


def softmax_where(w, batch):
    s, v = _scores(w, batch["x"])
    return _out(w, jax.nn.softmax(s, where=CAUSAL), v, batch["x"])


def _batch():
    ks = jax.random.split(jax.random.key(1), 3)
    return {"x": jax.random.normal(ks[0], (4, T, E)), "memory": jax.random.normal(ks[1], (4, T // 2, E)),
            "valid": jnp.arange(T)[None] < jnp.array([T, T - 17, T // 2, 40])[:, None], "key": ks[2]}


@pytest.mark.parametrize("attend", [padding_from_the_batch, sliding_window, dropout_on_the_weights, cross_attention,
                                    softmax_where, "imported value_and_grad"],
                         ids=lambda a: a if isinstance(a, str) else a.__name__)
def test_attention_that_is_not_plain_is_left_as_written_and_trains_like_jit(attend):
    if attend == "imported value_and_grad":      # taken before the planner could route it: not seen
        def step(w, batch):
            loss, g = imported_value_and_grad(lambda w: jnp.mean((_attend(w, batch["x"]) - batch["x"]) ** 2))(w)
            return _sgd(w, g), loss
    else:
        def step(w, batch):
            loss, g = jax.value_and_grad(lambda w: jnp.mean((attend(w, batch) - batch["x"]) ** 2))(w)
            return _sgd(w, g), loss
    args = (_weights(), _batch())
    f = _trains_like_jit(step, args, RING)
    assert _recognised(step, args, RING) == (False, [])
    # the ring asked for, nothing to split: the plan says so rather than claim a split
    assert f.plan.context is None and any("no attention the planner can split" in w for w in f.plan.warnings)
