"""A small ResNet in Flax NNX: a strided convolution stem, residual blocks of 3x3 convolutions,
max pooling between stages, global average pooling and a linear head. Images are NHWC."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from shardplan.models.layers import LayerStack


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    image_size: int                   # height = width
    channels: int                     # input channels
    classes: int
    widths: tuple[int, ...]           # feature width of each stage
    blocks: int                       # residual blocks per stage
    scan: bool = False                # the blocks of a stage under jax.lax.scan
    remat: str = "none"               # activation recomputation per block: shardplan.models.layers.REMAT_POLICIES
    dtype: str = "float32"


class Block(nnx.Module):
    def __init__(self, width: int, dtype, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(width, width, (3, 3), param_dtype=dtype, dtype=dtype, rngs=rngs)
        self.conv2 = nnx.Conv(width, width, (3, 3), param_dtype=dtype, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.conv2(nnx.relu(self.conv1(x)))


class ResNet(nnx.Module):
    def __init__(self, cfg: ResNetConfig, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.stem = nnx.Conv(cfg.channels, cfg.widths[0], (3, 3), strides=(2, 2), param_dtype=dt, dtype=dt,
                             rngs=rngs)
        self.stages = nnx.List([LayerStack(lambda r, w=w: Block(w, dt, r), cfg.blocks, scan=cfg.scan, rngs=rngs,
                                           remat=cfg.remat) for w in cfg.widths])
        # a 1x1 convolution widens the features between stages
        self.widen = nnx.List([nnx.Conv(a, b, (1, 1), param_dtype=dt, dtype=dt, rngs=rngs)
                               for a, b in zip(cfg.widths, cfg.widths[1:])])
        self.head = nnx.Linear(cfg.widths[-1], cfg.classes, param_dtype=dt, dtype=dt, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = nnx.relu(self.stem(images))
        for k, stage in enumerate(self.stages):
            x = stage(x)
            if k < len(self.widen):
                x = nnx.max_pool(x, (2, 2), strides=(2, 2))
                x = self.widen[k](x)
        x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
        return self.head(x.mean(axis=(1, 2)))


CONFIGS = {
    "resnet-tiny": ResNetConfig(image_size=32, channels=3, classes=10, widths=(16, 32), blocks=2),
    "resnet-small": ResNetConfig(image_size=64, channels=3, classes=100, widths=(64, 128, 256), blocks=2),
}
