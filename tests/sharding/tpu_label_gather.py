"""Compiles ``test_loop_ties.step`` (vocabulary 4096, two layers, batch 256 of 64 tokens) for 256
v5e chips (16, 16) with libtpu, deviceless, and prints the entry computation's loops and label
gathers in the compiled schedule's order, as JSON. ``free``: without the emitter's ties. Run by
``tests/sharding/test_loop_ties.py`` in a process of its own (256 CPU devices to plan on)."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=256"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from test_loop_ties import sequence, step  # noqa: E402

import shardplan  # noqa: E402
from shardplan import api  # noqa: E402

if sys.argv[1] == "free":
    api._tied_state = lambda traced, graph: None
VOCAB, D = 4096, 128
params = {"embed": jax.ShapeDtypeStruct((VOCAB, D), jnp.float32),
          "layers": jax.ShapeDtypeStruct((2, D, D), jnp.float32),
          "head": jax.ShapeDtypeStruct((D, VOCAB), jnp.float32)}
tokens = jax.ShapeDtypeStruct((256, 64), jnp.int32)
planned = shardplan.auto(step, mesh=shardplan.load_mesh("tpu-v5e-256", axes={"data": 16, "model": 16}),
                         donate_argnums=(0,), cache=False)
compiled, _, _ = planned.compile_for("tpu", params, tokens, tokens)
print(json.dumps(sequence(compiled.as_text())))
