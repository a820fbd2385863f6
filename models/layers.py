"""Building blocks shared by the reference decoders: attention, a layer stack run unrolled or scanned."""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shardplan.parallel import recompute
from shardplan.parallel.pipeline import layer_scan
from shardplan.parallel.recompute import layer_remat

# Logical activation names -> mesh axes, set by a hand-written plan (benchmarks/baselines.py,
# Megatron's sequence parallelism); unset, ``constrain`` is the identity and the traced step has
# no constraints (the planner decides activations itself).
_ACTIVATION_RULES: contextvars.ContextVar = contextvars.ContextVar("activation_rules", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: jax.sharding.Mesh, rules: dict[str, str | tuple[str, ...] | None]):
    """Within this context (while tracing), ``constrain`` pins activations by logical name."""
    for name, axes in rules.items():
        for a in (axes,) if isinstance(axes, str) else axes or ():
            if a not in mesh.axis_names:
                raise ValueError(f"activation rule {name!r} names mesh axis {a!r}, which the mesh does not have "
                                 f"(axes: {', '.join(mesh.axis_names)}); use one of them or None")
    token = _ACTIVATION_RULES.set((mesh, dict(rules)))
    try:
        yield
    finally:
        _ACTIVATION_RULES.reset(token)


def constrain(x: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """Pin ``x`` (dimensions named ``names``, e.g. ("batch", "seq", "embed")) if rules are set; a
    name the rules do not mention is left to XLA (``None`` in the rules: replicated)."""
    active = _ACTIVATION_RULES.get()
    if active is None:
        return x
    mesh, rules = active
    spec = PartitionSpec(*(rules.get(n, PartitionSpec.UNCONSTRAINED) for n in names))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


# Activation recomputation (rematerialisation) of each layer: what the forward pass keeps for the
# backward pass. "none" keeps every residual; "dots" keeps the matmul results (MaxText's
# "minimal"); "offload" keeps them in the host's pinned memory (MaxText's "minimal_offloaded");
# "full" keeps only each layer's input and recomputes the rest in the backward pass.
REMAT_POLICIES = ("none", "dots", "offload", "full")


def checkpoint_policy(policy: str):
    """The ``jax.checkpoint_policies`` function of a named policy; ``None`` for "none" (no remat)."""
    if policy not in REMAT_POLICIES:
        raise ValueError(f"remat={policy!r} is not a policy; choose one of {', '.join(REMAT_POLICIES)}")
    return recompute.checkpoint_policy(policy)


def remat(fn, policy: str, *, in_scan: bool):
    """``fn`` under ``jax.checkpoint`` with the named policy (``REMAT_POLICIES``); "none": ``fn`` itself."""
    saveable = checkpoint_policy(policy)
    if saveable is None:
        return fn
    # In a scan body CSE across trips cannot undo the recomputation, so prevent_cse is not needed.
    return jax.checkpoint(fn, policy=saveable, prevent_cse=not in_scan)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Softmax attention over [batch, seq, heads, head_dim]; ``k``/``v`` may have fewer heads (GQA)."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k = jnp.repeat(k, groups, axis=2)
        v = jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bshd,bthd->bhst", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    seq = q.shape[1]
    mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
    return jnp.einsum("bhst,bthd->bshd", probs, v)


class LayerStack(nnx.Module):
    """``n`` copies of a block, applied in order: a Python list (unrolled) or stacked params under ``jax.lax.scan``."""

    def __init__(self, make_block, n: int, *, scan: bool, rngs: nnx.Rngs, remat: str = "none"):
        checkpoint_policy(remat)          # a bad name fails here, naming the policies
        self.scan = scan
        self.remat = remat
        if scan:
            @nnx.split_rngs(splits=n)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make_stacked(rngs):
                return make_block(rngs)
            self.blocks = make_stacked(rngs)
        else:
            self.blocks = nnx.List([make_block(rngs) for _ in range(n)])

    def __call__(self, x: jax.Array) -> jax.Array:
        if not self.scan:
            for block in self.blocks:
                graphdef, state = nnx.split(block)
                # layer_remat: the planner may choose this layer class's recomputation (remat="auto").
                x = layer_remat(remat(lambda h, s, g=graphdef: nnx.merge(g, s)(h), self.remat, in_scan=False))(x, state)
            return x
        graphdef, state = nnx.split(self.blocks)

        def body(h, layer_state):
            return nnx.merge(graphdef, layer_state)(h), None

        # layer_scan is jax.lax.scan unless a pipeline is active (shardplan.parallel.pipeline).
        x, _ = layer_scan(remat(body, self.remat, in_scan=True), x, state)
        return x
