"""Train steps whose layers are a plain loop, written as users write them: no shardplan call
inside the model.

* ``jax_scan_gpt``: a pure-JAX GPT, its blocks' weights stacked ``[layers, ...]`` and run by
  ``jax.lax.scan``, causal einsum attention, AdamW;
* ``linen_scan_dropout``: a Linen model whose blocks run under ``nn.scan`` (parameters and
  dropout keys split per layer), in a flax ``TrainState`` holding its dropout key;
* ``nnx_scan_dropout``: an NNX model whose blocks are built by ``nnx.vmap`` and run by
  ``nnx.scan``, with dropout drawn from ``nnx.Rngs``, split and merged in the step;
* ``fori_stack``: stacked weights read by index in a ``jax.lax.fori_loop`` over the layers;
* ``jax_unrolled_gpt``, ``linen_unrolled_dropout``, ``nnx_unrolled_dropout``: the same models
  with their layers unrolled in Python (``for block in blocks: h = block(h)``), each layer's
  weights its own arrays.

Each builder returns a :class:`user_steps.UserStep` (batch leading dimension divisible by 8).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

from user_steps import UserStep

LAYERS, WIDTH, HEADS, SEQ, VOCAB = 4, 32, 4, 16, 64


def _tokens(seed: int, batch: int):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, size=(batch, SEQ + 1)).astype(np.int32))


# -- 1. pure JAX, jax.lax.scan over a dict of stacked weights ---------------------------------

def gpt_params(key, layers=LAYERS, width=WIDTH, vocab=VOCAB, dtype=jnp.float32):
    k = jax.random.split(key, 6)
    n = lambda k, shape: (jax.random.normal(k, shape, jnp.float32) * 0.05).astype(dtype)
    return {"embed": n(k[0], (vocab, width)),
            "layers": {"qkv": n(k[1], (layers, width, 3 * width)), "out": n(k[2], (layers, width, width)),
                       "up": n(k[3], (layers, width, 4 * width)), "down": n(k[4], (layers, 4 * width, width)),
                       "scale": jnp.ones((layers, width), dtype)}}


def _norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def _block(h, w, heads=HEADS):
    b, t, d = h.shape
    q, k, v = jnp.split(_norm(h, w["scale"]) @ w["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / float(np.sqrt(d // heads))
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    h = h + jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, d) @ w["out"]
    return h + jax.nn.gelu(_norm(h, w["scale"]) @ w["up"]) @ w["down"], None


def gpt_step(heads=HEADS, optimizer=None, unrolled=False):
    """A pure-JAX GPT train step ``step((params, opt_state), tokens)``: its layers a
    ``jax.lax.scan`` over the stacked weights (``unrolled``: a Python loop over a list of
    per-layer weights), causal einsum attention, AdamW by default."""
    opt = optimizer or optax.adamw(1e-2)

    def loss_fn(params, tokens):
        h = params["embed"][tokens[:, :-1]]
        if unrolled:
            for w in params["layers"]:
                h, _ = _block(h, w, heads)
        else:
            h, _ = jax.lax.scan(functools.partial(_block, heads=heads), h, params["layers"])
        logits = (h @ params["embed"].T).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def step(state, tokens):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}
    return step, opt


def abstract_gpt(layers, width, heads, seq, vocab, batch, dtype=jnp.bfloat16):
    """``(step, (state, tokens))`` of a GPT of that size as ``jax.ShapeDtypeStruct`` (nothing allocated)."""
    step, opt = gpt_step(heads)
    params = jax.eval_shape(functools.partial(gpt_params, layers=layers, width=width, vocab=vocab, dtype=dtype),
                            jax.random.key(0))
    state = (params, jax.eval_shape(opt.init, params))
    return step, (state, jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32))


def jax_scan_gpt(batch_size: int = 16) -> UserStep:
    step, opt = gpt_step()
    params = gpt_params(jax.random.key(0))
    return UserStep("jax_scan_gpt", step, ((params, opt.init(params)), _tokens(1, batch_size)),
                    jit={"donate_argnums": 0}, params_of=lambda s: s[0])


# -- 2. Linen nn.scan, TrainState with a dropout key ------------------------------------------

class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        y = nn.Dense(4 * WIDTH)(nn.LayerNorm()(h))
        y = nn.Dropout(0.1, deterministic=False)(nn.gelu(y))
        return h + nn.Dense(WIDTH)(y), None


class LinenScanLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, WIDTH)
        h = embed(tokens)
        stack = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                        length=LAYERS)
        h, _ = stack()(h, None)
        return embed.attend(nn.LayerNorm()(h))


class KeyedState(train_state.TrainState):
    key: jax.Array


_LINEN, _LINEN_TX = LinenScanLM(), optax.sgd(0.1)      # one of each: the state's static fields compare equal


def _linen_step(name: str, model: nn.Module, seed: int, batch_size: int) -> UserStep:
    """``model``'s train step as Linen users write it: a ``TrainState`` holding its dropout key,
    folded with the step count, ``jax.value_and_grad``, ``apply_gradients``."""
    tokens = _tokens(seed, batch_size)
    params = model.init(jax.random.key(0), tokens[:, :-1])["params"]
    state = KeyedState.create(apply_fn=model.apply, params=params, tx=_LINEN_TX, key=jax.random.key(seed + 5))

    def step(state, tokens):
        key = jax.random.fold_in(state.key, state.step)

        def loss_fn(p):
            logits = state.apply_fn({"params": p}, tokens[:, :-1], rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    return UserStep(name, step, (state, tokens), jit={"donate_argnums": 0}, check_params=True)


def linen_scan_dropout(batch_size: int = 16) -> UserStep:
    return _linen_step("linen_scan_dropout", _LINEN, 2, batch_size)


# -- 3. NNX: nnx.vmap builds the stack, nnx.scan runs it, dropout from nnx.Rngs ---------------

class NNXBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
        self.down = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, h):
        return h + self.down(self.drop(nnx.gelu(self.up(h))))


class NNXScanLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return NNXBlock(rngs)
        self.blocks = make(rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(h, block):
            return block(h)
        return self.embed.attend(run(h, self.blocks))


def _nnx_step(name: str, model: nnx.Module, seed: int, batch_size: int) -> UserStep:
    """``model``'s train step as NNX users write it: merged from its state, ``nnx.value_and_grad``,
    split again (the rest: its advanced RNG counts), SGD."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = optax.sgd(0.1)

    def step(state, tokens):
        params, rest, opt_state = state
        model = nnx.merge(graphdef, params, rest)

        def loss_fn(model):
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        _, params, rest = nnx.split(model, nnx.Param, ...)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), rest, opt_state), {"loss": loss}

    return UserStep(name, step, ((params, rest, opt.init(params)), _tokens(seed, batch_size)),
                    jit={"donate_argnums": 0}, params_of=lambda s: s[0], check_params=True)


def nnx_scan_dropout(batch_size: int = 16) -> UserStep:
    return _nnx_step("nnx_scan_dropout", NNXScanLM(nnx.Rngs(0, dropout=1)), 3, batch_size)


# -- 4. jax.lax.fori_loop over stacked weights --------------------------------------------------

def fori_stack(batch_size: int = 16) -> UserStep:
    opt = optax.sgd(0.1)

    def loss_fn(params, tokens):
        h = params["embed"][tokens[:, :-1]]
        layers = params["layers"]
        h = jax.lax.fori_loop(0, LAYERS, lambda i, h: _block(h, jax.tree.map(lambda a: a[i], layers))[0], h)
        return optax.softmax_cross_entropy_with_integer_labels(h @ params["embed"].T, tokens[:, 1:]).mean()

    def step(state, tokens):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

    params = gpt_params(jax.random.key(4))
    return UserStep("fori_stack", step, ((params, opt.init(params)), _tokens(4, batch_size)),
                    jit={"donate_argnums": 0}, params_of=lambda s: s[0], check_params=True)


# -- 5. unrolled layers: a Python loop over per-layer weights ------------------------------------

def unrolled_params(key, layers=LAYERS, **kw):
    stacked = gpt_params(key, layers=layers, **kw)
    return {"embed": stacked["embed"],
            "layers": [jax.tree.map(lambda a, i=i: a[i], stacked["layers"]) for i in range(layers)]}


def abstract_unrolled_gpt(layers, width, heads, seq, vocab, batch, dtype=jnp.bfloat16):
    """:func:`abstract_gpt` with its layers unrolled."""
    step, opt = gpt_step(heads, unrolled=True)
    params = jax.eval_shape(functools.partial(unrolled_params, layers=layers, width=width, vocab=vocab, dtype=dtype),
                            jax.random.key(0))
    state = (params, jax.eval_shape(opt.init, params))
    return step, (state, jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32))


def jax_unrolled_gpt(batch_size: int = 16) -> UserStep:
    step, opt = gpt_step(unrolled=True)
    params = unrolled_params(jax.random.key(5))
    return UserStep("jax_unrolled_gpt", step, ((params, opt.init(params)), _tokens(5, batch_size)),
                    jit={"donate_argnums": 0}, params_of=lambda s: s[0])


class LinenUnrolledLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, WIDTH)
        h = embed(tokens)
        for _ in range(LAYERS):
            h, _ = LinenBlock()(h, None)
        return embed.attend(nn.LayerNorm()(h))


_LINEN_UNROLLED = LinenUnrolledLM()


def linen_unrolled_dropout(batch_size: int = 16) -> UserStep:
    return _linen_step("linen_unrolled_dropout", _LINEN_UNROLLED, 6, batch_size)


class NNXUnrolledLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(rngs) for _ in range(LAYERS)])

    def __call__(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.embed.attend(h)


def nnx_unrolled_dropout(batch_size: int = 16) -> UserStep:
    return _nnx_step("nnx_unrolled_dropout", NNXUnrolledLM(nnx.Rngs(0, dropout=1)), 7, batch_size)


BUILDERS = {f.__name__: f for f in (jax_scan_gpt, linen_scan_dropout, nnx_scan_dropout, fori_stack,
                                     jax_unrolled_gpt, linen_unrolled_dropout, nnx_unrolled_dropout)}


def build(name: str) -> UserStep:
    """A fresh step and state (a donated call deletes the arrays it was given)."""
    return BUILDERS[name]()
