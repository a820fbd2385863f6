"""A Llama-style decoder in Flax NNX: RMSNorm, RoPE, SwiGLU, grouped-query attention, untied head."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

import shardplan
from shardplan.models.layers import LayerStack, causal_attention, constrain


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab: int
    seq_len: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    n_layers: int
    d_ff: int
    scan: bool = False
    dtype: str = "float32"
    remat: str = "none"               # activation recomputation per layer: shardplan.models.layers.REMAT_POLICIES
    rope_theta: float = 500000.0
    # "einsum": models.layers.causal_attention; "shardplan": shardplan.attention, which the
    # planner may split over the sequence (context="auto": all-gather, Ulysses or ring attention)
    attention: str = "einsum"


def rope(x: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding on [batch, seq, heads, head_dim] (rotate-half form)."""
    seq, dim = x.shape[1], x.shape[-1]
    freqs = 1.0 / theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]
    cos = jnp.cos(angles)[None, :, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[None, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nnx.Module):
    """The attention half of a layer (pre-norm, RoPE, grouped-query attention, residual) and the
    norm before its MLP: what a Llama layer and an MoE layer (:mod:`shardplan.models.moe`) share.
    ``cfg`` needs ``d_model``, ``n_heads``, ``n_kv_heads``, ``dtype``, ``rope_theta`` and ``attention``."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        d, dt, hd = cfg.d_model, jnp.dtype(cfg.dtype), cfg.d_model // cfg.n_heads
        self.cfg = cfg
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, param_dtype=dt, dtype=dt, rngs=rngs)
        self.attn_norm = nnx.RMSNorm(d, param_dtype=dt, dtype=dt, rngs=rngs)
        self.wq = linear(d, cfg.n_heads * hd)
        self.wk = linear(d, cfg.n_kv_heads * hd)
        self.wv = linear(d, cfg.n_kv_heads * hd)
        self.wo = linear(cfg.n_heads * hd, d)
        self.mlp_norm = nnx.RMSNorm(d, param_dtype=dt, dtype=dt, rngs=rngs)

    def attend(self, x: jax.Array) -> jax.Array:
        """``x`` [batch, seq, embed] plus its attention (the residual stream pinned by name)."""
        b, s, d = x.shape
        cfg, hd = self.cfg, d // self.cfg.n_heads
        x = constrain(x, ("batch", "seq", "embed"))     # the residual stream (sequence-parallel under Megatron-SP)
        h = self.attn_norm(x)
        q = rope(self.wq(h).reshape(b, s, cfg.n_heads, hd), cfg.rope_theta)
        k = rope(self.wk(h).reshape(b, s, cfg.n_kv_heads, hd), cfg.rope_theta)
        v = self.wv(h).reshape(b, s, cfg.n_kv_heads, hd)
        attend = causal_attention if cfg.attention == "einsum" else \
            functools.partial(shardplan.attention, causal=True)
        return constrain(x + self.wo(attend(q, k, v).reshape(b, s, d)), ("batch", "seq", "embed"))


class Block(Attention):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        d, dt = cfg.d_model, jnp.dtype(cfg.dtype)
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, param_dtype=dt, dtype=dt, rngs=rngs)
        self.w_gate = linear(d, cfg.d_ff)
        self.w_up = linear(d, cfg.d_ff)
        self.w_down = linear(cfg.d_ff, d)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.attend(x)
        h = self.mlp_norm(x)
        return x + self.w_down(jax.nn.silu(self.w_gate(h)) * self.w_up(h))


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, param_dtype=dt, dtype=dt, rngs=rngs)
        self.layers = LayerStack(lambda r: Block(cfg, r), cfg.n_layers, scan=cfg.scan, rngs=rngs,
                                 remat=cfg.remat)
        self.norm = nnx.RMSNorm(cfg.d_model, param_dtype=dt, dtype=dt, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, param_dtype=dt, dtype=dt, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.head(self.norm(self.layers(self.embed(tokens))))


CONFIGS = {
    "llama-tiny": LlamaConfig(vocab=256, seq_len=32, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=192),
    "llama3-8b": LlamaConfig(vocab=128256, seq_len=8192, d_model=4096, n_heads=32, n_kv_heads=8, n_layers=32,
                             d_ff=14336, dtype="bfloat16"),
    # Llama-3-8B at a 128K context (the long-context stage of its training recipe), with attention
    # the planner may split over the sequence (issue 14's cell).
    "llama3-8b-128k": LlamaConfig(vocab=128256, seq_len=131072, d_model=4096, n_heads=32, n_kv_heads=8, n_layers=32,
                                  d_ff=14336, dtype="bfloat16", attention="shardplan"),
    "llama-tiny-cp": LlamaConfig(vocab=256, seq_len=256, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=192,
                                 attention="shardplan"),
    "llama3-70b": LlamaConfig(vocab=128256, seq_len=8192, d_model=8192, n_heads=64, n_kv_heads=8, n_layers=80,
                              d_ff=28672, dtype="bfloat16"),
}
