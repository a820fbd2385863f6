"""A Flax Linen model: a residual MLP stack over token embeddings, unrolled or with ``nn.scan``."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from shardplan.models.layers import checkpoint_policy


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    vocab: int
    seq_len: int
    d_model: int
    d_ff: int
    n_layers: int
    scan: bool = False
    remat: str = "none"               # activation recomputation per layer: shardplan.models.layers.REMAT_POLICIES
    dtype: str = "float32"


class ResidualMLP(nn.Module):
    d_model: int
    d_ff: int

    @nn.compact
    def __call__(self, x, _=None):
        h = nn.LayerNorm()(x)
        h = nn.Dense(self.d_ff)(h)
        x = x + nn.Dense(self.d_model)(jax.nn.gelu(h))
        return x, None


class MLPStack(nn.Module):
    cfg: MLPConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        x = nn.Embed(cfg.vocab, cfg.d_model, param_dtype=jnp.dtype(cfg.dtype))(tokens)
        saveable = checkpoint_policy(cfg.remat)
        block = ResidualMLP if saveable is None else nn.remat(ResidualMLP, policy=saveable, prevent_cse=not cfg.scan)
        if cfg.scan:
            stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=cfg.n_layers)
            x, _ = stack(cfg.d_model, cfg.d_ff, name="layers")(x, None)
        else:
            for i in range(cfg.n_layers):
                x, _ = block(cfg.d_model, cfg.d_ff, name=f"layers_{i}")(x)
        x = nn.LayerNorm()(x)
        return nn.Dense(cfg.vocab)(x)


CONFIGS = {
    "mlp-tiny": MLPConfig(vocab=256, seq_len=32, d_model=64, d_ff=256, n_layers=2),
}
