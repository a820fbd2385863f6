"""Attention written out (einsum-softmax-einsum) is recognised, with its causal mask and scale, in
the forms models write it, and replaced by a call that computes the same; what is not attention
as ``jax.nn.dot_product_attention`` computes it is left as written."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardplan.tracing import einsum_attention

B, T, N, D = 2, 16, 4, 8


def _qkv(kv_heads=N, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(keys[0], (B, T, N, D), dtype), jax.random.normal(keys[1], (B, T, kv_heads, D), dtype),
            jax.random.normal(keys[2], (B, T, kv_heads, D), dtype))


def _causal():
    return jnp.tril(jnp.ones((T, T), bool))


def einsum_where(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    s = jnp.where(_causal(), s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(q.dtype), v)


def heads_first_scaled_q(q, k, v):          # [b, h, t, d] operands, q scaled before the product
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    s = (q * 0.125) @ jnp.swapaxes(k, -1, -2)
    s = s + jnp.where(_causal(), 0.0, -1e9)         # an additive mask
    o = jax.nn.softmax(s) @ v
    return jnp.swapaxes(o, 1, 2)


def manual_softmax_unmasked(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.3
    e = jnp.exp(s - jax.lax.stop_gradient(s.max(-1, keepdims=True)))
    return jnp.einsum("bhqk,bkhd->bqhd", e / e.sum(-1, keepdims=True), v)


def grouped_query(q, k, v):                   # MaxText's layout: q [b, t, kv_heads, groups, d]
    q = q.reshape(B, T, k.shape[2], N // k.shape[2], D)
    s = jnp.einsum("btkgd,bskd->bkgts", q, k) / np.sqrt(D)
    s = jnp.where(_causal()[None, None, None], s, -0.7 * jnp.finfo(s.dtype).max)
    o = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s, axis=-1), v)
    return o.reshape(B, T, N, D)


def flax_nnx(q, k, v):
    return nnx.dot_product_attention(q, k, v, mask=nnx.make_causal_mask(jnp.ones((B, T))))


def flax_linen(q, k, v):
    return nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(jnp.ones((B, T))))


RECOGNISED = {einsum_where: True, heads_first_scaled_q: True, manual_softmax_unmasked: False,
              grouped_query: True, flax_nnx: True, flax_linen: True}


def _dpa(calls):
    def attention(q, k, v, *, causal, scale):
        calls.append((q.shape, k.shape, causal, scale))
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return attention


@pytest.mark.parametrize("fn", list(RECOGNISED), ids=lambda f: f.__name__)
def test_each_written_form_is_found_and_computes_the_same(fn):
    q, k, v = _qkv(kv_heads=2 if fn is grouped_query else N)
    calls = []

    def loss(q, k, v):
        return jnp.sum(jnp.sin(fn(q, k, v)))
    got_value, got_grads = jax.jit(jax.value_and_grad(einsum_attention.rewritten(loss, _dpa(calls)),
                                                      argnums=(0, 1, 2)))(q, k, v)
    want_value, want_grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert len(calls) == 1 and calls[0][2] is RECOGNISED[fn]
    assert calls[0][0] == (B, T, N, D)
    np.testing.assert_allclose(got_value, want_value, rtol=1e-5)
    for a, b in zip(got_grads, want_grads):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _sliding_window(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    s = jnp.where((i >= j) & (i - j < 4), s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def _data_mask(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    s = jnp.where((q.sum(-1) > 0).transpose(0, 2, 1)[..., None], s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def _alibi(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) - 0.5 * jnp.abs(jnp.arange(T)[:, None] - jnp.arange(T)[None, :])
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def _softmax_over_queries(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-2), v)


@pytest.mark.parametrize("fn", [_sliding_window, _data_mask, _alibi, _softmax_over_queries],
                         ids=lambda f: f.__name__)
def test_what_is_not_plain_attention_is_left_as_written(fn):
    q, k, v = _qkv()
    calls, seen = [], []
    f = einsum_attention.rewritten(fn, _dpa(calls), record=lambda *a: seen.append(a))
    np.testing.assert_array_equal(jax.jit(f)(q, k, v), jax.jit(fn)(q, k, v))
    assert calls == [] and seen == []


def test_a_long_sequences_mask_is_checked_without_building_it():
    # 131072 x 131072 booleans would be 16 GiB; the mask is sampled where it is computed
    t = 131072
    q = jax.ShapeDtypeStruct((1, t, 2, 8), jnp.bfloat16)
    seen = []

    def attend(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v).sum()
    jax.make_jaxpr(einsum_attention.rewritten(attend, None, record=lambda *a: seen.append(a)))(q, q, q)
    assert seen == [(((1, t, 2, 8), (1, t, 2, 8)), True)]


def test_attention_inside_a_scan_and_a_checkpoint_is_found():
    q, k, v = _qkv()
    calls = []

    def loss(q, k, v):
        def body(h, _):
            return jax.checkpoint(einsum_where)(h, k, v), None
        return jnp.sum(jax.lax.scan(body, q, None, length=3)[0])
    got = jax.jit(jax.grad(einsum_attention.rewritten(loss, _dpa(calls))))(q, k, v)
    np.testing.assert_allclose(got, jax.grad(loss)(q, k, v), rtol=1e-4, atol=1e-5)
    assert len(calls) == 1 and calls[0][2]


def test_keys_and_values_repeated_for_grouped_heads_are_attended_unrepeated():
    # models/layers.causal_attention's jnp.repeat: the strategies then move 2 heads of K/V, not 4
    q, k, v = _qkv(kv_heads=2)
    calls = []

    def repeated(q, k, v):
        return einsum_where(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2))

    def loss(q, k, v):
        return jnp.sum(jnp.sin(repeated(q, k, v)))
    got = jax.jit(jax.grad(einsum_attention.rewritten(loss, _dpa(calls)), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(got, jax.grad(loss, argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert calls[0][:2] == ((B, T, N, D), (B, T, 2, D))


def test_a_function_that_cannot_be_searched_runs_as_written_and_says_why(monkeypatch):
    def broken(*_):
        raise NotImplementedError("a primitive this does not know")
    monkeypatch.setattr(einsum_attention, "_search", broken)
    q, k, v = _qkv()
    calls = []
    with pytest.warns(UserWarning, match="could not be searched .NotImplementedError: a primitive this does not know"):
        got = einsum_attention.rewritten(einsum_where, _dpa(calls))(q, k, v)
    np.testing.assert_array_equal(got, einsum_where(q, k, v))
    assert calls == []
