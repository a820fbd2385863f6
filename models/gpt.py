"""A GPT-2-style decoder in Flax NNX: learned positions, LayerNorm, GELU MLP, tied embeddings."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from shardplan.models.layers import LayerStack, causal_attention, constrain


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int
    seq_len: int
    d_model: int
    n_heads: int
    n_layers: int
    d_ff: int
    scan: bool = False
    dtype: str = "float32"
    remat: str = "none"               # activation recomputation per layer: shardplan.models.layers.REMAT_POLICIES


class Block(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d, dt = cfg.d_model, jnp.dtype(cfg.dtype)
        self.n_heads = cfg.n_heads
        self.ln1 = nnx.LayerNorm(d, param_dtype=dt, dtype=dt, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, param_dtype=dt, dtype=dt, rngs=rngs)
        self.proj = nnx.Linear(d, d, param_dtype=dt, dtype=dt, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, param_dtype=dt, dtype=dt, rngs=rngs)
        self.fc = nnx.Linear(d, cfg.d_ff, param_dtype=dt, dtype=dt, rngs=rngs)
        self.out = nnx.Linear(cfg.d_ff, d, param_dtype=dt, dtype=dt, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, d = x.shape
        x = constrain(x, ("batch", "seq", "embed"))     # the residual stream (sequence-parallel under Megatron-SP)
        # Megatron's fused-QKV layout: the 3*d outputs are head-major ([heads, q|k|v, head_dim]),
        # so splitting the fused kernel's columns over devices gives each device whole heads.
        qkv = self.qkv(self.ln1(x)).reshape(b, s, self.n_heads, 3, d // self.n_heads)
        q, k, v = (jnp.squeeze(t, 3) for t in jnp.split(qkv, 3, axis=3))
        x = constrain(x + self.proj(causal_attention(q, k, v).reshape(b, s, d)), ("batch", "seq", "embed"))
        return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.wte = nnx.Embed(cfg.vocab, cfg.d_model, param_dtype=dt, dtype=dt, rngs=rngs)
        self.wpe = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.seq_len, cfg.d_model), dt))
        self.layers = LayerStack(lambda r: Block(cfg, r), cfg.n_layers, scan=cfg.scan, rngs=rngs,
                                 remat=cfg.remat)
        self.ln_f = nnx.LayerNorm(cfg.d_model, param_dtype=dt, dtype=dt, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.wte(tokens) + self.wpe[: tokens.shape[1]]
        x = self.ln_f(self.layers(x))
        return self.wte.attend(x)  # tied embeddings


CONFIGS = {
    "gpt-tiny": GPTConfig(vocab=256, seq_len=32, d_model=64, n_heads=4, n_layers=2, d_ff=256),
    "gpt2-small": GPTConfig(vocab=50304, seq_len=1024, d_model=768, n_heads=12, n_layers=12, d_ff=3072),
    "gpt3-1.3b": GPTConfig(vocab=50304, seq_len=2048, d_model=2048, n_heads=16, n_layers=24, d_ff=8192),
    "gpt3-175b": GPTConfig(vocab=50304, seq_len=2048, d_model=12288, n_heads=96, n_layers=96, d_ff=49152,
                           dtype="bfloat16"),
}
