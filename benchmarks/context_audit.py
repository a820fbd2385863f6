"""Context-parallel plans held against their compiled programs: memory and collective bytes.

    python benchmarks/context_audit.py [--batch 2] [--seq 2048] [--heads 8] [--embed 128]
        [--dtype float32|bfloat16] [--target cpu,gpu] [--strategies off,allgather,ulysses,ring,ring-heads]
        [--model llama-tiny-cp [--scan]]

The step is ``tests/parallel/test_sequence.py``'s: one attention layer (q, k, v, o projections of width
``--embed``, ``shardplan.attention(causal=True)``), a mean-square loss, plain SGD, the weights
donated. It is planned on ``h100-8`` as ``{data: 2, seq: 4}`` once per strategy (``off``: no
split, ``jax.nn.dot_product_attention``; ``allgather`` / ``ulysses`` / ``ring`` (zig-zag): sequence
over ``seq``, batch over ``data``; ``ring-heads``: the ring with the heads over ``data``), and each
plan is compiled by the CPU compiler (8 fake devices) and by the GPU compiler (deviceless H100s,
``[aot]``), never run. Per row: the predicted peak memory per device against ``memory_analysis``
(argument + output + temp - alias), and the predicted collective bytes against the HLO's.
``--model llama-tiny-cp`` plans that reference model's train step (AdamW, ``--batch`` rows of its
256 tokens; ``--scan``: its layers in a ``lax.scan``) instead of the one-layer step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if not __package__:   # run as a script from a checkout: import the checkout's shardplan
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import shardplan  # noqa: E402
from shardplan.compiler import targets  # noqa: E402
from shardplan.parallel.sequence import ContextConfig  # noqa: E402
from shardplan.util.sizes import format_bytes  # noqa: E402

COMMON = dict(seq_axes=("seq",), batch_axes=("data",))
CONFIGS = {
    "off": None,
    "allgather": ContextConfig("allgather", **COMMON),
    "ulysses": ContextConfig("ulysses", **COMMON),
    "ring": ContextConfig("ring", **COMMON, load_balance="zigzag"),
    "ring-heads": ContextConfig("ring", seq_axes=("seq",), head_axes=("data",)),
}


def attention_step(batch: int, seq: int, heads: int, embed: int):
    """One attention layer's SGD step on ``(weights, x)``: tests/parallel/test_sequence.py's."""
    def loss(w, x):
        q, k, v = ((x @ w[n]).reshape(batch, seq, heads, embed // heads) for n in "qkv")
        o = shardplan.attention(q, k, v, causal=True)
        return jnp.mean(((x + o.reshape(batch, seq, embed) @ w["o"]) ** 2).astype(jnp.float32))

    def step(w, x):
        value, grads = jax.value_and_grad(loss)(w, x)
        return jax.tree.map(lambda a, g: a - 0.1 * g, w, grads), value
    return step


def abstract_args(batch: int, seq: int, embed: int, dtype):
    w = {n: jax.ShapeDtypeStruct((embed, embed), dtype) for n in "qkvo"}
    return w, jax.ShapeDtypeStruct((batch, seq, embed), dtype)


def reference_step(name: str, batch: int, scan: bool):
    """A reference model's train step and abstract (state, batch)."""
    from shardplan.models.train import reference
    ref = reference(name, scan=scan)
    return ref.train_step, (jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(batch, abstract=True))


def planned(step, args, config, mesh="h100-8", axes=(("data", 2), ("seq", 4))):
    """``step`` planned for ``args`` on the preset ``mesh`` as ``axes`` with the attention run as
    ``config`` (``None``: not split)."""
    spec = shardplan.load_mesh(mesh, axes=dict(axes))
    f = shardplan.auto(step, mesh=spec, donate_argnums=(0,), context=config if config is not None else "off",
                       cache=False)
    f.make_plan(*args)
    return f


def measure(f, args, target: str) -> dict:
    """Predicted and compiled memory and collective bytes of ``f``'s plan compiled for ``target``."""
    a = f.audit_for(target, *args)
    compiled, _, _ = f.compile_for(target, *args)
    m = compiled.memory_analysis()
    p, c = a.comm_bytes
    return dict(predicted=a.memory.predicted_bytes, compiled=a.memory.compiled_bytes, error=a.memory_error(),
                args=m.argument_size_in_bytes, out=m.output_size_in_bytes, temp=m.temp_size_in_bytes,
                alias=m.alias_size_in_bytes, comm_p=p, comm_c=c, comm_error=a.comm_error())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--embed", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--target", default="cpu,gpu", help="comma-separated: cpu, gpu")
    ap.add_argument("--strategies", default=",".join(CONFIGS), help=f"comma-separated of {', '.join(CONFIGS)}")
    ap.add_argument("--model", default=None, help="a reference model written with shardplan.attention")
    ap.add_argument("--scan", action="store_true", help="the reference model's layers in a lax.scan")
    args = ap.parse_args()
    wanted = [t for t in args.target.split(",") if t == "cpu" or targets.available(t)]
    if args.model:
        step, inputs = reference_step(args.model, args.batch, args.scan)
        what = f"{args.model}{' (scanned)' if args.scan else ''}, batch {args.batch}"
    else:
        step = attention_step(args.batch, args.seq, args.heads, args.embed)
        inputs = abstract_args(args.batch, args.seq, args.embed, jnp.dtype(args.dtype))
        what = f"batch {args.batch} x seq {args.seq}, {args.heads} heads, embed {args.embed}, {args.dtype}"
    print(f"{what}; h100-8 as {{data: 2, seq: 4}}; targets {', '.join(wanted)}")
    print("| strategy | compiler | predicted memory | compiled memory | error | compiled args + out + temp - alias "
          "| predicted collectives | compiled collectives | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.strategies.split(","):
        start = time.perf_counter()
        try:
            f = planned(step, inputs, CONFIGS[name])
        except shardplan.ShardplanError as e:      # e.g. Ulysses where the heads do not divide
            print(f"| {name} | - | not planned: {str(e).splitlines()[0][:120]} |||||||", flush=True)
            continue
        for target in wanted:
            r = measure(f, inputs, target)
            parts = " + ".join(format_bytes(r[k]) for k in ("args", "out", "temp")) + f" - {format_bytes(r['alias'])}"
            print(f"| {name} | {target} | {format_bytes(r['predicted'])} | {format_bytes(r['compiled'])} | "
                  f"{r['error']:+.1%} | {parts} | {format_bytes(r['comm_p'])} | {format_bytes(r['comm_c'])} | "
                  f"{r['comm_error']:+.1%} |", flush=True)
        config = f.plan.context_config()
        print(f"<!-- {name}: {config.describe() if config else 'no split'}, predicted step "
              f"{f.plan.cost.step_s * 1e3:.3f} ms; {time.perf_counter() - start:.1f} s -->", flush=True)


if __name__ == "__main__":
    main()
