"""A mixture-of-experts decoder in Flax NNX: Llama's attention (RMSNorm, RoPE, grouped-query
attention, untied head) with every layer's MLP a mixture of SwiGLU experts.

Routing. A dense [embed, experts] gate, a softmax over the experts and the top ``top_k`` of them
per token (their weights renormalised to sum to one where ``norm_topk``, as Mixtral does;
DeepSeek-V2 keeps the raw probabilities). Tokens are routed within their own sequence (a group,
as MaxText's per-batch-row capacity): nothing couples the examples of a batch, so the layer is
data-parallel and pipelines in microbatches like the dense models.

* ``capacity_factor=cf`` (token dropping, GShard / MaxText style): each expert takes at most
  ``ceil(cf * seq * top_k / experts)`` tokens of a sequence; every token's first choice is served
  before any token's second choice, then in sequence order, and what does not fit is dropped
  (that choice adds nothing; the residual carries the token on). Dispatch and combine are one-hot
  [batch, seq, experts, capacity] tensors applied by einsums.
* ``capacity_factor=None`` (dropless): the same dispatch with capacity = seq, which no expert can
  exceed (a token picks an expert at most once), so every routed token is computed, exactly and
  differentiably. It costs ``experts / top_k`` times the expert compute of a sorted (ragged)
  dispatch, and its dispatch tensors are quadratic in the sequence: meant for small models and
  for planning, not for speed.

The expert weights are stacked with a leading expert dimension (``wi_0``/``wi_1`` [experts,
embed, mlp], ``wo`` [experts, mlp, embed]), so a plan can shard the experts over a mesh axis.
``shared_experts`` (DeepSeek style) adds a dense SwiGLU MLP of ``shared_experts * d_ff`` hidden
units (the sum of that many shared experts) to the routed output of every token.

Auxiliary load-balancing loss (Switch Transformer / Mixtral): per sequence and layer
``experts * sum_e f_e * P_e`` with ``f_e`` the fraction of the sequence's routed choices that
picked expert ``e`` (before dropping) and ``P_e`` the mean router probability of ``e``; 1 when
balanced. The model returns it averaged over sequences and layers next to the logits; the train
step adds ``aux_loss_coef`` times it to the cross-entropy (shardplan.models.train).

``deepseek-v2-lite`` keeps DeepSeek-V2-Lite's shapes as far as this architecture has them: its
multi-head latent attention (MLA) is replaced by standard multi-head attention (16 heads of 128),
and all 27 layers are MoE layers (the real model's first layer is a dense MLP of 10944), so it
has ~16.3B parameters against the real model's 15.7B. ``mixtral-8x7b`` is Mixtral's shapes
(~46.7B parameters), routed with capacity factor 1.25 where the real model is dropless
(``capacity_factor=None`` as an override gives that, at ``experts / top_k`` times the compute).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from shardplan.models.layers import LayerStack, constrain
from shardplan.models.llama import Attention


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    vocab: int
    seq_len: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    n_layers: int
    d_ff: int                         # hidden units of one expert (and of one shared expert)
    n_experts: int
    top_k: int
    capacity_factor: float | None = 1.25   # None: dropless
    shared_experts: int = 0           # dense SwiGLU experts every token goes through (DeepSeek)
    norm_topk: bool = True            # renormalise the top-k router weights to sum to one (Mixtral)
    aux_loss_coef: float = 0.01       # weight of the load-balancing loss in the training loss
    scan: bool = False
    dtype: str = "float32"
    remat: str = "none"               # activation recomputation per layer: shardplan.models.layers.REMAT_POLICIES
    rope_theta: float = 1000000.0
    attention: str = "einsum"         # as LlamaConfig.attention: "einsum" or "shardplan"

    def __post_init__(self):
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k}: a token is routed to 1 to n_experts={self.n_experts} experts; "
                             f"give top_k between 1 and {self.n_experts}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor={self.capacity_factor!r}: give a positive factor (1.25 is usual), "
                             "or None for dropless routing")
        if self.shared_experts < 0:
            raise ValueError(f"shared_experts={self.shared_experts}: give 0 or more")


def expert_capacity(cfg: MoEConfig, tokens: int) -> int:
    """Tokens one expert takes from a group of ``tokens``: ``ceil(cf * tokens * top_k / experts)``,
    at most ``tokens`` (all of them: dropless, ``capacity_factor=None``)."""
    if cfg.capacity_factor is None:
        return tokens
    wanted = math.ceil(round(cfg.capacity_factor * tokens * cfg.top_k / cfg.n_experts, 6))
    return max(1, min(tokens, wanted))


def route(probs: jax.Array, top_k: int, capacity: int, norm_topk: bool = True):
    """Top-``top_k`` routing of router probabilities ``probs`` [batch, seq, experts] with at most
    ``capacity`` tokens per expert and sequence. Returns ``dispatch`` [batch, seq, experts,
    capacity] (1 where a token takes a slot of an expert), ``combine`` (the same, weighted by the
    token's router weight) and the load-balancing loss per sequence [batch]."""
    b, s, e = probs.shape
    weights, index = jax.lax.top_k(probs, top_k)                        # [b, s, k]
    if norm_topk:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    chosen = jax.nn.one_hot(index, e, dtype=jnp.int32)                  # [b, s, k, e]
    # Slot of each choice in its expert: every token's first choice before any second choice, then
    # in sequence order (GShard's priority).
    by_rank = jnp.swapaxes(chosen, 1, 2).reshape(b, top_k * s, e)
    before = jnp.swapaxes((jnp.cumsum(by_rank, axis=1) - by_rank).reshape(b, top_k, s, e), 1, 2)
    slot = jnp.sum(before * chosen, axis=-1)                            # [b, s, k]
    # A slot past the capacity one-hot encodes to zeros: that choice is dropped.
    in_slot = jax.nn.one_hot(slot, capacity, dtype=probs.dtype)        # [b, s, k, c]
    chosen_f = chosen.astype(probs.dtype)
    dispatch = jnp.einsum("bske,bskc->bsec", chosen_f, in_slot)
    combine = jnp.einsum("bske,bskc,bsk->bsec", chosen_f, in_slot, weights)
    routed = jnp.sum(chosen_f, axis=(1, 2)) / (s * top_k)               # f_e [b, e]
    balance = e * jnp.sum(routed * jnp.mean(probs, axis=1), axis=-1)    # [b]
    return dispatch, combine, balance


class SwiGLU(nnx.Module):
    """A dense SwiGLU MLP (the shared experts)."""

    def __init__(self, d_model: int, hidden: int, dtype, rngs: nnx.Rngs):
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, param_dtype=dtype, dtype=dtype, rngs=rngs)
        self.wi_0 = linear(d_model, hidden)
        self.wi_1 = linear(d_model, hidden)
        self.wo = linear(hidden, d_model)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.wo(jax.nn.silu(self.wi_0(x)) * self.wi_1(x))


class MoEMLP(nnx.Module):
    """Router and stacked SwiGLU experts (plus the shared experts, if any)."""

    def __init__(self, cfg: MoEConfig, rngs: nnx.Rngs):
        d, f, e, dt = cfg.d_model, cfg.d_ff, cfg.n_experts, jnp.dtype(cfg.dtype)
        self.cfg = cfg
        self.gate = nnx.Linear(d, e, use_bias=False, param_dtype=dt, dtype=dt, rngs=rngs)
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.wi_0 = nnx.Param(init(rngs.params(), (e, d, f), dt))
        self.wi_1 = nnx.Param(init(rngs.params(), (e, d, f), dt))
        self.wo = nnx.Param(init(rngs.params(), (e, f, d), dt))
        self.shared = SwiGLU(d, cfg.shared_experts * f, dt, rngs) if cfg.shared_experts else None

    def route(self, x: jax.Array):
        """``route``'s dispatch, combine and load balance for ``x`` [batch, seq, embed]."""
        cfg = self.cfg
        probs = jax.nn.softmax(self.gate(x).astype(jnp.float32), axis=-1)
        return route(probs, cfg.top_k, expert_capacity(cfg, x.shape[1]), cfg.norm_topk)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The MoE output for ``x`` [batch, seq, embed] and the load-balancing loss per sequence."""
        dispatch, combine, balance = self.route(x)
        # Tokens in expert slots, named for a hand plan's rules (expert parallelism: experts over
        # one mesh axis, the rows over another; the move from the rows' split is the all-to-all).
        slots = ("exp_batch", "exp", "capacity", "embed")
        xe = constrain(jnp.einsum("bsd,bsec->becd", x, dispatch.astype(x.dtype)), slots)
        h = jax.nn.silu(jnp.einsum("becd,edf->becf", xe, self.wi_0[...])) * \
            jnp.einsum("becd,edf->becf", xe, self.wi_1[...])
        ye = constrain(jnp.einsum("becf,efd->becd", h, self.wo[...]), slots)
        y = jnp.einsum("becd,bsec->bsd", ye, combine.astype(x.dtype))
        if self.shared is not None:
            y = y + self.shared(x)
        return y, balance


class Block(Attention):
    """Llama's attention, then the MoE MLP; carries (residual stream, load-balancing sum [batch])."""

    def __init__(self, cfg: MoEConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        self.moe = MoEMLP(cfg, rngs)

    def __call__(self, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        x, balance = carry
        x = self.attend(x)
        y, layer_balance = self.moe(self.mlp_norm(x))
        return x + y, balance + layer_balance


class MoEDecoder(nnx.Module):
    """Returns ``(logits, load-balancing loss)``, the loss averaged over sequences and layers."""

    def __init__(self, cfg: MoEConfig, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.n_layers = cfg.n_layers
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, param_dtype=dt, dtype=dt, rngs=rngs)
        self.layers = LayerStack(lambda r: Block(cfg, r), cfg.n_layers, scan=cfg.scan, rngs=rngs,
                                 remat=cfg.remat)
        self.norm = nnx.RMSNorm(cfg.d_model, param_dtype=dt, dtype=dt, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, param_dtype=dt, dtype=dt, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        # The balance sum rides in the layers' carry with the batch leading (as a pipeline needs).
        x, balance = self.layers((self.embed(tokens), jnp.zeros(tokens.shape[:1], jnp.float32)))
        return self.head(self.norm(x)), jnp.mean(balance) / self.n_layers


def parameter_count(cfg: MoEConfig) -> int:
    """The parameters the shapes say: embedding, head, final norm, and per layer attention, two
    norms, router, routed and shared experts."""
    d, hd = cfg.d_model, cfg.d_model // cfg.n_heads
    attention = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2
    experts = (cfg.n_experts + cfg.shared_experts) * 3 * d * cfg.d_ff
    layer = attention + 2 * d + d * cfg.n_experts + experts
    return 2 * cfg.vocab * d + d + cfg.n_layers * layer


_TINY = dict(vocab=256, seq_len=32, d_model=64, n_heads=4, n_layers=2)
CONFIGS = {
    "mixtral-tiny": MoEConfig(**_TINY, n_kv_heads=2, d_ff=128, n_experts=8, top_k=2, capacity_factor=1.25),
    "mixtral-tiny-dropless": MoEConfig(**_TINY, n_kv_heads=2, d_ff=128, n_experts=8, top_k=2, capacity_factor=None),
    "deepseek-tiny": MoEConfig(**_TINY, n_kv_heads=4, d_ff=32, n_experts=16, top_k=4, capacity_factor=1.25,
                               shared_experts=1, norm_topk=False, rope_theta=10000.0),
    "mixtral-8x7b": MoEConfig(vocab=32000, seq_len=4096, d_model=4096, n_heads=32, n_kv_heads=8, n_layers=32,
                              d_ff=14336, n_experts=8, top_k=2, capacity_factor=1.25, dtype="bfloat16"),
    "deepseek-v2-lite": MoEConfig(vocab=102400, seq_len=4096, d_model=2048, n_heads=16, n_kv_heads=16,
                                  n_layers=27, d_ff=1408, n_experts=64, top_k=6, capacity_factor=1.25,
                                  shared_experts=2, norm_topk=False, aux_loss_coef=0.001, rope_theta=10000.0,
                                  dtype="bfloat16"),
}
