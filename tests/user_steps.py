"""A corpus of ordinary Flax/JAX train steps, written the way a user would write them.

None of these come from ``models/``: each is what one finds in the Flax and JAX docs, examples
and tutorials (``TrainState`` with dropout, functional NNX with ``nnx.split``/``nnx.merge``,
mixed precision, a ResNet, a ViT, a top-k MoE, keyword/static/donated arguments, gradient
accumulation with ``fori_loop``). Every builder returns a :class:`UserStep`: the step function,
concrete arguments (``args[0]`` is the state the step returns updated), keyword arguments and
the ``jax.jit`` options it needs. Each is small (well under 1M parameters) and every batch's
leading dimension is divisible by 8.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state


@dataclasses.dataclass
class UserStep:
    name: str
    fn: Callable                      # step(state, ...) -> (new_state, metrics with "loss")
    args: tuple                       # concrete positional args; args[0] is the state
    kwargs: dict = dataclasses.field(default_factory=dict)
    jit: dict = dataclasses.field(default_factory=dict)  # static_argnums/static_argnames/donate_argnums/donate_argnames
    params_of: Callable[[Any], Any] = lambda state: state.params   # the trained parameters in a state
    # Compare the final parameters too, not only the losses. Only for SGD steps: Adam's update
    # lr * m / (sqrt(v) + eps) turns a 1e-10 rounding difference in a zero gradient (a unit dropped
    # out) into a 1e-5 change of the parameter, so a correctly sharded Adam step's parameters
    # differ from the unsharded ones by more than 1e-5 of their scale.
    check_params: bool = False

    def call(self, f, state):
        """One step of ``f`` (jitted or planned) from ``state``: ``state, metrics = f(state, ...)``."""
        return f(state, *self.args[1:], **self.kwargs)

    def loop(self, f, steps: int):
        """``state, metrics = f(state, ...)`` ``steps`` times from the builder's state (donated
        where ``f`` donates it): ``(final state, losses)``."""
        state, losses = self.args[0], []
        for _ in range(steps):
            state, metrics = self.call(f, state)
            losses.append(float(metrics["loss"]))
        return state, np.array(losses)

    def num_params(self) -> int:
        return sum(math.prod(np.shape(x)) for x in jax.tree.leaves(self.params_of(self.args[0])))


def _classification_batch(seed, n, shape, classes):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *shape)).astype(np.float32)
    y = rng.integers(0, classes, size=(n,)).astype(np.int32)
    return {"image": jnp.asarray(x), "label": jnp.asarray(y)}


# ---------------------------------------------------------------------------------------------
# 1. Linen MLP with dropout in a flax TrainState; the dropout key lives in the state and is
#    folded with the step count (the Flax "dropout" guide's pattern). TrainState.step is the
#    Python int 0 that TrainState.create puts there.
# ---------------------------------------------------------------------------------------------
class DropoutMLP(nn.Module):
    hidden: int = 128
    classes: int = 10

    @nn.compact
    def __call__(self, x, *, training: bool):
        x = x.reshape((x.shape[0], -1))
        x = nn.Dense(self.hidden)(x)
        x = nn.relu(x)
        x = nn.Dropout(rate=0.2, deterministic=not training)(x)
        x = nn.Dense(self.hidden)(x)
        x = nn.relu(x)
        x = nn.Dropout(rate=0.2, deterministic=not training)(x)
        return nn.Dense(self.classes)(x)


class TrainStateWithKey(train_state.TrainState):
    key: jax.Array


def linen_dropout_trainstate(batch_size: int = 32) -> UserStep:
    model = DropoutMLP()
    root = jax.random.key(0)
    params_key, dropout_key = jax.random.split(root)
    batch = _classification_batch(1, batch_size, (8, 8, 1), 10)
    variables = model.init(params_key, batch["image"], training=False)
    state = TrainStateWithKey.create(apply_fn=model.apply, params=variables["params"],
                                     tx=optax.sgd(0.1, momentum=0.9), key=dropout_key)

    def train_step(state, batch):
        dropout_train_key = jax.random.fold_in(key=state.key, data=state.step)

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["image"], training=True,
                                    rngs={"dropout": dropout_train_key})
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
            return loss, logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        state = state.apply_gradients(grads=grads)
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
        return state, {"loss": loss, "accuracy": accuracy}

    return UserStep("linen_dropout_trainstate", train_step, (state, batch), jit={"donate_argnums": 0},
                    check_params=True)


# ---------------------------------------------------------------------------------------------
# 2. Flax NNX with nnx.Rngs and nnx.Dropout, functional style: graphdef, state = nnx.split(model);
#    the step merges, takes nnx.value_and_grad, splits again and returns the new state (the RNG
#    counts included); optax on the nnx.Param state.
# ---------------------------------------------------------------------------------------------
class NNXDropoutMLP(nnx.Module):
    def __init__(self, din, dhidden, dout, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dhidden, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.norm = nnx.LayerNorm(dhidden, rngs=rngs)
        self.linear2 = nnx.Linear(dhidden, dhidden, rngs=rngs)
        self.linear3 = nnx.Linear(dhidden, dout, rngs=rngs)

    def __call__(self, x):
        x = nnx.gelu(self.linear1(x))
        x = self.dropout(x)
        x = self.norm(x)
        x = nnx.gelu(self.linear2(x))
        x = self.dropout(x)
        return self.linear3(x)


def nnx_rngs_dropout(batch_size: int = 32) -> UserStep:
    model = NNXDropoutMLP(24, 96, 24, rngs=nnx.Rngs(params=0, dropout=1))
    model.train()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adamw(3e-3, weight_decay=1e-4)
    state = {"params": params, "rest": rest, "opt_state": tx.init(params)}
    rng = np.random.default_rng(2)
    x = rng.standard_normal((batch_size, 24)).astype(np.float32)
    batch = {"x": jnp.asarray(x), "y": jnp.asarray(np.sin(x))}

    def train_step(state, batch):
        model = nnx.merge(graphdef, state["params"], state["rest"])

        def loss_fn(model):
            pred = model(batch["x"])
            return jnp.mean(optax.l2_loss(pred, batch["y"]))

        loss, grads = nnx.value_and_grad(loss_fn)(model)        # grads: an nnx.State of the Params
        _, params, rest = nnx.split(model, nnx.Param, ...)       # rest: the advanced RNG counts
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        params = optax.apply_updates(params, updates)
        return {"params": params, "rest": rest, "opt_state": opt_state}, {"loss": loss}

    return UserStep("nnx_rngs_dropout", train_step, (state, batch), jit={"donate_argnums": (0,)},
                    params_of=lambda s: s["params"])


# ---------------------------------------------------------------------------------------------
# 3. Mixed precision: fp32 master weights and optimizer state, forward in bf16 (params cast
#    inside the step), loss in fp32. The dropout key is split each step and the new one returned.
# ---------------------------------------------------------------------------------------------
class BF16MLP(nn.Module):
    hidden: int = 256
    classes: int = 16

    @nn.compact
    def __call__(self, x, *, training: bool):
        x = nn.Dense(self.hidden, dtype=jnp.bfloat16)(x)
        x = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        x = nn.gelu(x)
        x = nn.Dropout(0.1, deterministic=not training)(x)
        x = nn.Dense(self.hidden, dtype=jnp.bfloat16)(x)
        x = nn.gelu(x)
        return nn.Dense(self.classes, dtype=jnp.bfloat16)(x)


class MPTrainState(train_state.TrainState):
    rng: jax.Array


def mixed_precision_bf16(batch_size: int = 32) -> UserStep:
    model = BF16MLP()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((batch_size, 64)).astype(np.float32)
    batch = {"x": jnp.asarray(x), "label": jnp.asarray(rng.integers(0, 16, size=(batch_size,)), dtype=jnp.int32)}
    params = model.init(jax.random.PRNGKey(0), batch["x"], training=False)["params"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    state = MPTrainState.create(apply_fn=model.apply, params=params, tx=tx, rng=jax.random.PRNGKey(42))

    def train_step(state, batch):
        rng, dropout_rng = jax.random.split(state.rng)

        def loss_fn(params):
            half = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
            logits = state.apply_fn({"params": half}, batch["x"].astype(jnp.bfloat16), training=True,
                                    rngs={"dropout": dropout_rng})
            logits = logits.astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)   # fp32 grads of the fp32 master weights
        state = state.apply_gradients(grads=grads, rng=rng)
        return state, {"loss": loss}

    return UserStep("mixed_precision_bf16", train_step, (state, batch), jit={"donate_argnums": (0,)})


# ---------------------------------------------------------------------------------------------
# 4. A small ResNet in NNX: nnx.Conv, nnx.BatchNorm, max pooling, residual blocks, NHWC images;
#    nnx.Optimizer, and (model, optimizer) split into one state.
# ---------------------------------------------------------------------------------------------
class ResidualBlock(nnx.Module):
    def __init__(self, cin, cout, stride, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(cin, cout, (3, 3), strides=stride, padding="SAME", use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(cout, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(cout, cout, (3, 3), padding="SAME", use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(cout, momentum=0.9, rngs=rngs)
        if stride != 1 or cin != cout:
            self.proj = nnx.Conv(cin, cout, (1, 1), strides=stride, use_bias=False, rngs=rngs)
        else:
            self.proj = None

    def __call__(self, x):
        residual = x if self.proj is None else self.proj(x)
        y = nnx.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return nnx.relu(y + residual)


class ResNet(nnx.Module):
    def __init__(self, num_classes=10, width=16, *, rngs: nnx.Rngs):
        self.stem = nnx.Conv(3, width, (3, 3), padding="SAME", use_bias=False, rngs=rngs)
        self.stem_bn = nnx.BatchNorm(width, rngs=rngs)
        self.blocks = nnx.List([ResidualBlock(width, width, 1, rngs=rngs),
                                ResidualBlock(width, 2 * width, 2, rngs=rngs),
                                ResidualBlock(2 * width, 2 * width, 1, rngs=rngs)])
        self.head = nnx.Linear(2 * width, num_classes, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.stem_bn(self.stem(x)))
        x = nnx.max_pool(x, window_shape=(3, 3), strides=(2, 2), padding="SAME")
        for block in self.blocks:
            x = block(x)
        x = jnp.mean(x, axis=(1, 2))          # global average pool
        return self.head(x)


def nnx_resnet(batch_size: int = 16, image_size: int = 16, abstract: bool = False) -> UserStep:
    def create():
        model = ResNet(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)
        return model, optimizer

    if abstract:
        model, optimizer = nnx.eval_shape(create)
    else:
        model, optimizer = create()
    graphdef, state = nnx.split((model, optimizer))
    if abstract:
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        batch = {"image": jax.ShapeDtypeStruct((batch_size, image_size, image_size, 3), jnp.float32),
                 "label": jax.ShapeDtypeStruct((batch_size,), jnp.int32)}
    else:
        batch = _classification_batch(4, batch_size, (image_size, image_size, 3), 10)

    def train_step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        model.train()

        def loss_fn(model):
            logits = model(batch["image"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        _, state = nnx.split((model, optimizer))
        return state, {"loss": loss}

    return UserStep("nnx_resnet", train_step, (state, batch), jit={"donate_argnums": (0,)},
                    params_of=lambda s: nnx.filter_state(s[0], nnx.Param))


# ---------------------------------------------------------------------------------------------
# 5. A small ViT in Linen: strided-conv patch embedding, class token, learned position embedding,
#    pre-norm blocks with jax.nn.dot_product_attention; AdamW with a warmup-cosine schedule.
# ---------------------------------------------------------------------------------------------
class ViTBlock(nn.Module):
    dim: int
    heads: int

    @nn.compact
    def __call__(self, x):
        b, t, _ = x.shape
        h = nn.LayerNorm()(x)
        qkv = nn.Dense(3 * self.dim, use_bias=False)(h)
        q, k, v = jnp.split(qkv.reshape(b, t, 3, self.heads, self.dim // self.heads), 3, axis=2)
        attn = jax.nn.dot_product_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0])
        x = x + nn.Dense(self.dim)(attn.reshape(b, t, self.dim))
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * self.dim)(h)
        h = nn.gelu(h)
        return x + nn.Dense(self.dim)(h)


class ViT(nn.Module):
    patch: int = 4
    dim: int = 64
    depth: int = 2
    heads: int = 4
    classes: int = 10

    @nn.compact
    def __call__(self, images):
        x = nn.Conv(self.dim, (self.patch, self.patch), strides=(self.patch, self.patch), padding="VALID",
                    name="patch_embed")(images)
        b, h, w, c = x.shape
        x = x.reshape(b, h * w, c)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
        x = jnp.concatenate([jnp.tile(cls, (b, 1, 1)), x], axis=1)
        x = x + self.param("pos_embedding", nn.initializers.normal(0.02), (1, x.shape[1], c))
        for _ in range(self.depth):
            x = ViTBlock(self.dim, self.heads)(x)
        x = nn.LayerNorm()(x)
        return nn.Dense(self.classes, name="head")(x[:, 0])


def linen_vit(batch_size: int = 16) -> UserStep:
    model = ViT()
    batch = _classification_batch(5, batch_size, (16, 16, 3), 10)
    params = model.init(jax.random.PRNGKey(0), batch["image"])["params"]
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, warmup_steps=2, decay_steps=100)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.05))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def train_step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["image"])
            labels = optax.smooth_labels(jax.nn.one_hot(batch["label"], 10), 0.1)
            return optax.softmax_cross_entropy(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    return UserStep("linen_vit", train_step, (state, batch), jit={"donate_argnums": (0,)})


# ---------------------------------------------------------------------------------------------
# 6. A top-k routed mixture of experts (Linen): router logits, jax.lax.top_k gates, one-hot
#    dispatch/combine einsums, a load-balancing auxiliary loss.
# ---------------------------------------------------------------------------------------------
class MoE(nn.Module):
    num_experts: int = 4
    top_k: int = 2
    d_ff: int = 128

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        router_logits = nn.Dense(self.num_experts, use_bias=False, name="router")(tokens)
        probs = jax.nn.softmax(router_logits, axis=-1)
        gates, expert_index = jax.lax.top_k(probs, self.top_k)                 # (T, k)
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        dispatch = jax.nn.one_hot(expert_index, self.num_experts, dtype=x.dtype)   # (T, k, E)
        combine = jnp.einsum("tk,tke->te", gates, dispatch)                    # (T, E)
        w_in = self.param("w_in", nn.initializers.lecun_normal(), (self.num_experts, d, self.d_ff))
        w_out = self.param("w_out", nn.initializers.lecun_normal(), (self.num_experts, self.d_ff, d))
        expert_in = jnp.einsum("te,td->etd", (combine > 0).astype(x.dtype), tokens)   # (E, T, d)
        hidden = nn.gelu(jnp.einsum("etd,edf->etf", expert_in, w_in))
        expert_out = jnp.einsum("etf,efd->etd", hidden, w_out)
        out = jnp.einsum("te,etd->td", combine, expert_out)
        # Switch-style load balancing: fraction of tokens routed to each expert times its mean prob.
        density = jnp.mean(dispatch.sum(axis=1), axis=0)
        aux = self.num_experts * jnp.sum(density * jnp.mean(probs, axis=0)) / self.top_k
        return out.reshape(b, t, d), aux


class MoEModel(nn.Module):
    d_model: int = 32
    vocab: int = 64

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(self.vocab, self.d_model)(ids)
        y, aux = MoE()(nn.LayerNorm()(x))
        x = x + y
        return nn.Dense(self.vocab)(nn.LayerNorm()(x)), aux


def linen_moe_topk(batch_size: int = 16, seq: int = 8) -> UserStep:
    model = MoEModel()
    rng = np.random.default_rng(6)
    ids = jnp.asarray(rng.integers(0, 64, size=(batch_size, seq + 1)), dtype=jnp.int32)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:]}
    params = model.init(jax.random.PRNGKey(0), batch["inputs"])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))

    def train_step(state, batch):
        def loss_fn(params):
            logits, aux = state.apply_fn({"params": params}, batch["inputs"])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
            return ce + 0.01 * aux, (ce, aux)

        (loss, (ce, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss, "ce": ce, "aux": aux}

    return UserStep("linen_moe_topk", train_step, (state, batch), jit={"donate_argnums": (0,)})


# ---------------------------------------------------------------------------------------------
# 7. Keyword arguments, static arguments by name (a frozen schedule config and `train: bool`) and
#    a donated argument by name; a plain dict state, the dropout key in the batch (raw uint32).
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LRSchedule:
    peak: float = 1e-2
    warmup: int = 3

    def __call__(self, step):
        return self.peak * jnp.minimum(1.0, (step + 1) / self.warmup)


class KwMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.Dense(64)(x))
        x = nn.Dropout(0.25, deterministic=not train)(x)
        return nn.Dense(4)(x)


def kwargs_static_donate(batch_size: int = 16) -> UserStep:
    model = KwMLP()
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((batch_size, 20)), dtype=jnp.float32)
    batch = {"x": x, "y": jnp.asarray(rng.integers(0, 4, size=(batch_size,)), dtype=jnp.int32),
             "dropout_key": jax.random.PRNGKey(7)}
    params = model.init(jax.random.PRNGKey(1), x, train=False)["params"]
    tx = optax.scale_by_adam()
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    def train_step(state, batch, *, schedule: LRSchedule, train: bool = True):
        key = jax.random.fold_in(batch["dropout_key"], state["step"])

        def loss_fn(params):
            logits = model.apply({"params": params}, batch["x"], train=train, rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"])
        lr = schedule(state["step"])
        params = jax.tree.map(lambda p, u: p - lr * u, state["params"], updates)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, {"loss": loss, "lr": lr}

    return UserStep("kwargs_static_donate", train_step, (state,),
                    kwargs={"batch": batch, "schedule": LRSchedule(), "train": True},
                    jit={"static_argnames": ("schedule", "train"), "donate_argnames": ("state",)},
                    params_of=lambda s: s["params"])


# ---------------------------------------------------------------------------------------------
# 8. Gradient accumulation over microbatches with jax.lax.fori_loop; the number of microbatches
#    is a static positional argument.
# ---------------------------------------------------------------------------------------------
class AccumMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(128)(x))
        x = nn.tanh(nn.Dense(128)(x))
        return nn.Dense(1)(x)


def fori_grad_accum(batch_size: int = 32) -> UserStep:
    model = AccumMLP()
    rng = np.random.default_rng(8)
    x = rng.standard_normal((batch_size, 16)).astype(np.float32)
    y = (x[:, :1] * x[:, 1:2] + np.sin(x[:, 2:3])).astype(np.float32)
    batch = {"x": jnp.asarray(x), "y": jnp.asarray(y)}
    params = model.init(jax.random.PRNGKey(2), batch["x"])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.05, momentum=0.9))

    def train_step(state, batch, num_microbatches):
        micro = jax.tree.map(lambda a: a.reshape(num_microbatches, -1, *a.shape[1:]), batch)

        def loss_fn(params, mb):
            pred = state.apply_fn({"params": params}, mb["x"])
            return jnp.mean((pred - mb["y"]) ** 2)

        def body(i, carry):
            grads, loss = carry
            mb = jax.tree.map(lambda a: a[i], micro)
            l, g = jax.value_and_grad(loss_fn)(state.params, mb)
            return jax.tree.map(jnp.add, grads, g), loss + l

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        grads, loss = jax.lax.fori_loop(0, num_microbatches, body, (zeros, jnp.zeros((), jnp.float32)))
        grads = jax.tree.map(lambda g: g / num_microbatches, grads)
        return state.apply_gradients(grads=grads), {"loss": loss / num_microbatches}

    return UserStep("fori_grad_accum", train_step, (state, batch, 4),
                    jit={"static_argnums": (2,), "donate_argnums": (0,)}, check_params=True)


BUILDERS: dict[str, Callable[[], UserStep]] = {
    "linen_dropout_trainstate": linen_dropout_trainstate,
    "nnx_rngs_dropout": nnx_rngs_dropout,
    "mixed_precision_bf16": mixed_precision_bf16,
    "nnx_resnet": nnx_resnet,
    "linen_vit": linen_vit,
    "linen_moe_topk": linen_moe_topk,
    "kwargs_static_donate": kwargs_static_donate,
    "fori_grad_accum": fori_grad_accum,
}


@functools.cache
def _cached(name: str) -> UserStep:
    return BUILDERS[name]()


def build(name: str) -> UserStep:
    """A fresh copy of the corpus step ``name`` (its arrays copied, so a donating call may consume them)."""
    us = _cached(name)
    copy = lambda x: x.copy() if isinstance(x, jax.Array) else x
    return dataclasses.replace(us, args=jax.tree.map(copy, us.args), kwargs=jax.tree.map(copy, us.kwargs))
