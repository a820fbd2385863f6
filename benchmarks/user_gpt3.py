"""Planner wall time on a GPT-3 175B train step written as a stranger would, not from `models/`.

    python benchmarks/user_gpt3.py [--attention einsum|dpa] [--batch 256] [--mesh a100-128x8]

Pure JAX: parameters in a dict, bf16, the 96 layers a `jax.lax.scan` over stacked weights with
each layer under `jax.checkpoint`, pre-norm RMSNorm, attention either as einsums with a causal
mask and a softmax (`einsum`: per-head q/k/v weights, a query bias) or `jax.nn.dot_product_attention`
(`dpa`: one fused qkv weight), GELU MLP, tied embedding, rows of S + 1 tokens (inputs and
shifted targets), optax AdamW. Nothing is allocated: the
arguments are `ShapeDtypeStruct`s. Prints one markdown row (the issue's bar: 10 s on this machine).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax

import shardplan

L, D, H, F, S, V = 96, 12288, 96, 49152, 2048, 51200
DT = jnp.bfloat16


def abstract_params(attention: str) -> dict:
    f = lambda *shape: jax.ShapeDtypeStruct(shape, DT)      # noqa: E731
    if attention == "einsum":
        attn = {"wq": f(L, D, H, D // H), "wk": f(L, D, H, D // H), "wv": f(L, D, H, D // H),
                "bq": f(L, H, D // H), "wo": f(L, H, D // H, D)}
    else:
        attn = {"wqkv": f(L, D, 3 * D), "wo": f(L, D, D)}
    return {"wte": f(V, D), "wpe": f(S, D), "lnf": f(D),
            "blocks": {"ln1": f(L, D), "ln2": f(L, D), "w1": f(L, D, F), "b1": f(L, F), "w2": f(L, F, D),
                       "b2": f(L, D), **attn}}


def norm(x, g):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 ** 2, -1, keepdims=True) + 1e-6)).astype(DT) * g


def attend(h, p):
    if "wq" in p:
        q = jnp.einsum("bsd,dhk->bshk", h, p["wq"]) + p["bq"]
        k = jnp.einsum("bsd,dhk->bshk", h, p["wk"])
        v = jnp.einsum("bsd,dhk->bshk", h, p["wv"])
        scores = jnp.einsum("bqhk,bthk->bhqt", q, k).astype(jnp.float32) / (D // H) ** 0.5
        scores = jnp.where(jnp.tril(jnp.ones((S, S), bool)), scores, -1e9)
        a = jnp.einsum("bhqt,bthk->bqhk", jax.nn.softmax(scores, -1).astype(DT), v)
        return jnp.einsum("bshk,hkd->bsd", a, p["wo"])
    q, k, v = jnp.split(h @ p["wqkv"], 3, -1)
    heads = lambda t: t.reshape(t.shape[0], S, H, D // H)     # noqa: E731
    return jax.nn.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True).reshape(h.shape) @ p["wo"]


def block(x, p):
    x = x + attend(norm(x, p["ln1"]), p)
    h = norm(x, p["ln2"])
    return x + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"], None


def loss_fn(params, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]        # S + 1 tokens a row: S predicted
    x = params["wte"][inputs] + params["wpe"]
    x, _ = jax.lax.scan(jax.checkpoint(block), x, params["blocks"])
    logits = (norm(x, params["lnf"]) @ params["wte"].T).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


OPT = optax.adamw(1e-4)


def train_step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attention", choices=("einsum", "dpa"), default="einsum")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--mesh", default="a100-128x8")
    args = ap.parse_args()
    params = abstract_params(args.attention)
    opt_state = jax.eval_shape(OPT.init, params)
    tokens = jax.ShapeDtypeStruct((args.batch, S + 1), jnp.int32)
    start = time.perf_counter()
    p = shardplan.plan(train_step, params, opt_state, tokens, mesh=args.mesh, donate_argnums=(0, 1), cache=False)
    wall = time.perf_counter() - start
    s = p.solver
    print("| attention | batch | mesh | planner wall s | ILP s | status | gap | variables | predicted step s | "
          "memory/device GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.attention} | {args.batch} | {args.mesh} | {wall:.1f} | {s.wall_time:.1f} | {s.status} | "
          f"{s.gap:.2%} | {s.num_variables} | {p.cost.step_s:.3f} | {p.cost.memory_bytes / 2**30:.2f} |")


if __name__ == "__main__":
    main()
