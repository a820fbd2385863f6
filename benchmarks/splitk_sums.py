"""Where XLA's GPU compiler sums a split-K matmul's partial sums (:mod:`shardplan.compiler.splitk`).

    python benchmarks/splitk_sums.py [--preset h100-8]      # 10 s here; needs the [aot] extra

Compiles ``a @ w1 + b @ w2`` (float32, unsharded) for the preset's GPU with no device present,
for shapes whose matmuls XLA splits 4 to 32 ways, and prints the split the model predicts, one
set of partial sums' bytes, the compiled temporaries, and how many sums each fused kernel
holds: a kernel holding two sums (the add's) keeps both sets live at once
(:func:`shardplan.compiler.liveness.summing_kernels`).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
if not __package__:   # run as a script from a checkout: import the checkout's shardplan
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import shardplan  # noqa: E402
from shardplan.compiler import splitk, targets  # noqa: E402

SHAPES = [(512, 64, 192), (1024, 64, 512), (512, 64, 1024), (64, 192, 512), (64, 1024, 2048),
          (512, 64, 4096), (64, 64, 512), (128, 512, 2048), (256, 256, 4096), (128, 128, 2048)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="h100-8")
    args = ap.parse_args()
    if not targets.available("gpu"):
        sys.exit("the GPU compiler is not installed: pip install 'shardplan[aot]'")
    spec = shardplan.load_mesh(args.preset)
    mesh, compiler = targets.target_mesh(spec, "gpu")
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    gpu = splitk.gpu_of(spec.device.name)
    print(f"compiled by {compiler}; a split of at most {splitk.SUMMED_IN_READER} is predicted summed in the reader")
    print("| m, n, k | split | one set of partial sums | compiled temporaries | sums per fused kernel |")
    print("|---|---|---|---|---|")
    for m, n, k in SHAPES:
        s = splitk.split_k(1, m, n, k, gpu, lhs_bits=32, rhs_bits=32, out_bits=32)
        shapes = ((m, k), (m, k), (k, n), (k, n))
        compiled = jax.jit(lambda a, b, w1, w2: a @ w1 + b @ w2, in_shardings=(whole,) * 4, out_shardings=whole) \
            .lower(*(jax.ShapeDtypeStruct(x, jnp.float32) for x in shapes)).compile()
        bodies = re.findall(r"\n%fused\S* .*?\n}\n", compiled.as_text(), re.S)
        sums = sorted(c for c in (len(re.findall(r"reduce\(%param", b)) for b in bodies) if c)
        temp = compiled.memory_analysis().temp_size_in_bytes
        print(f"| {m}, {n}, {k} | {s} | {splitk.partial_bytes(1, m, n, s) / 1024:.0f} KiB | {temp / 1024:.0f} KiB | "
              f"{sums} |")


if __name__ == "__main__":
    main()
