"""Train steps for the reference models: a pure ``train_step(state, batch) -> (state, metrics)``.

>>> ref = reference("gpt-tiny", scan=True)
>>> state = ref.init(jax.random.key(0))                      # concrete, on one device
>>> abstract_state = jax.eval_shape(ref.init, jax.random.key(0))  # nothing allocated
>>> state, metrics = ref.train_step(state, ref.batch(8))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from shardplan.models import gpt, linen_mlp, llama, moe, resnet, vit

MODEL_CONFIGS: dict[str, Any] = {**gpt.CONFIGS, **llama.CONFIGS, **linen_mlp.CONFIGS, **resnet.CONFIGS,
                                  **vit.CONFIGS, **moe.CONFIGS}
_IMAGE_CONFIGS = (resnet.ResNetConfig, vit.ViTConfig)


@dataclasses.dataclass(frozen=True)
class Reference:
    """A reference model with its ``init(rng) -> state``, ``train_step`` and batch maker."""

    name: str
    config: Any
    init: Callable[[jax.Array], Any]
    train_step: Callable[[Any, Any], Any]

    def batch(self, batch_size: int, seed: int = 0, abstract: bool = False):
        """Token models: ``inputs`` and ``targets`` of [batch, seq_len] token ids; image models:
        ``inputs`` [batch, height, width, channels] float32 and ``targets`` [batch] class ids."""
        if isinstance(self.config, _IMAGE_CONFIGS):
            c = self.config
            shape = (batch_size, c.image_size, c.image_size, c.channels)
            if abstract:
                return {"inputs": jax.ShapeDtypeStruct(shape, jnp.float32),
                        "targets": jax.ShapeDtypeStruct((batch_size,), jnp.int32)}
            k1, k2 = jax.random.split(jax.random.key(seed))
            return {"inputs": jax.random.normal(k1, shape),
                    "targets": jax.random.randint(k2, (batch_size,), 0, c.classes)}
        shape = (batch_size, self.config.seq_len)
        if abstract:
            spec = jax.ShapeDtypeStruct(shape, jnp.int32)
            return {"inputs": spec, "targets": spec}
        k1, k2 = jax.random.split(jax.random.key(seed))
        return {"inputs": jax.random.randint(k1, shape, 0, self.config.vocab),
                "targets": jax.random.randint(k2, shape, 0, self.config.vocab)}


def _loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def reference(name: str, *, scan: bool = False, optimizer: optax.GradientTransformation | None = None,
              **overrides) -> Reference:
    """Build a reference model by config name (see ``MODEL_CONFIGS``); ``overrides`` replace config fields."""
    if name not in MODEL_CONFIGS:
        raise KeyError(f"unknown model {name!r}; choose one of {', '.join(sorted(MODEL_CONFIGS))}")
    cfg = dataclasses.replace(MODEL_CONFIGS[name], scan=scan, **overrides)
    tx = optimizer if optimizer is not None else optax.adamw(1e-3, weight_decay=0.1)

    if isinstance(cfg, (linen_mlp.MLPConfig, vit.ViTConfig)):
        module = linen_mlp.MLPStack(cfg) if isinstance(cfg, linen_mlp.MLPConfig) else vit.ViT(cfg)
        example = jnp.zeros((1, cfg.seq_len), jnp.int32) if isinstance(cfg, linen_mlp.MLPConfig) else \
            jnp.zeros((1, cfg.image_size, cfg.image_size, cfg.channels))

        def init_params(rng):
            return module.init(rng, example)["params"]

        def apply(params, tokens):
            return module.apply({"params": params}, tokens)
    else:
        ctor = {gpt.GPTConfig: gpt.GPT, llama.LlamaConfig: llama.Llama, resnet.ResNetConfig: resnet.ResNet,
                moe.MoEConfig: moe.MoEDecoder}[type(cfg)]
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: ctor(cfg, rngs=nnx.Rngs(0))))

        def init_params(rng):
            return nnx.state(ctor(cfg, rngs=nnx.Rngs(rng)))

        def apply(params, tokens):
            return nnx.merge(graphdef, params)(tokens)

    def init(rng):
        params = init_params(rng)
        return {"params": params, "opt_state": tx.init(params)}

    def train_step(state, batch):
        def loss_fn(params):
            out = apply(params, batch["inputs"])
            if isinstance(cfg, moe.MoEConfig):          # (logits, load-balancing loss)
                return _loss(out[0], batch["targets"]) + cfg.aux_loss_coef * out[1]
            return _loss(out, batch["targets"])

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state}, {"loss": loss}

    return Reference(name=name, config=cfg, init=init, train_step=train_step)
