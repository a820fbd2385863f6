"""A small Vision Transformer in Flax Linen: patch embedding by a strided convolution, a class
token, pre-norm blocks with ``jax.nn.dot_product_attention``, unrolled or with ``nn.scan``."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from shardplan.models.layers import checkpoint_policy


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    image_size: int
    channels: int
    classes: int
    patch: int
    d_model: int
    n_heads: int
    d_ff: int
    n_layers: int
    scan: bool = False
    remat: str = "none"               # activation recomputation per layer: shardplan.models.layers.REMAT_POLICIES
    dtype: str = "float32"


class EncoderBlock(nn.Module):
    cfg: ViTConfig

    @nn.compact
    def __call__(self, x, _=None):
        cfg = self.cfg
        b, s, d = x.shape
        h = nn.LayerNorm()(x)
        qkv = nn.DenseGeneral((3, cfg.n_heads, d // cfg.n_heads))(h)          # [b, s, 3, heads, head_dim]
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        att = jax.nn.dot_product_attention(q, k, v)                           # [b, s, heads, head_dim]
        x = x + nn.DenseGeneral(d, axis=(-2, -1))(att)
        h = nn.LayerNorm()(x)
        x = x + nn.Dense(d)(jax.nn.gelu(nn.Dense(cfg.d_ff)(h)))
        return x, None


class ViT(nn.Module):
    cfg: ViTConfig

    @nn.compact
    def __call__(self, images):
        cfg = self.cfg
        x = nn.Conv(cfg.d_model, (cfg.patch, cfg.patch), strides=(cfg.patch, cfg.patch), padding="VALID",
                    name="patches")(images)
        b = x.shape[0]
        x = x.reshape(b, -1, cfg.d_model)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, cfg.d_model))
        x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, cfg.d_model)), x], axis=1)
        x = x + self.param("pos", nn.initializers.normal(0.02), (1, x.shape[1], cfg.d_model))
        saveable = checkpoint_policy(cfg.remat)
        block = EncoderBlock if saveable is None else nn.remat(EncoderBlock, policy=saveable, prevent_cse=not cfg.scan)
        if cfg.scan:
            stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=cfg.n_layers)
            x, _ = stack(cfg, name="layers")(x, None)
        else:
            for i in range(cfg.n_layers):
                x, _ = block(cfg, name=f"layers_{i}")(x)
        x = nn.LayerNorm()(x[:, 0])
        return nn.Dense(cfg.classes, name="head")(x)


CONFIGS = {
    "vit-tiny": ViTConfig(image_size=32, channels=3, classes=10, patch=8, d_model=64, n_heads=4, d_ff=128,
                          n_layers=2),
    "vit-base": ViTConfig(image_size=224, channels=3, classes=1000, patch=16, d_model=768, n_heads=12, d_ff=3072,
                          n_layers=12),
}
