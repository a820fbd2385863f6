"""XLA's split-K rewrite of GPU matmuls, priced.

On NVIDIA GPUs from Ampere on (Triton GEMMs on, XLA's default), XLA's ``SplitkRewriter``
(``xla/backends/gpu/transforms/splitk_rewriter.cc``, ``ChooseSplitK`` /
``EstimateGemmCostAfterSplitK``) rewrites a matmul with little ``M x N`` parallelism and a long
contraction into ``split_k`` partial matmuls: it writes float32 partial sums ``[batch, split_k,
M, N]`` and reduces them in a second kernel. The choice depends on shapes, bit widths, the
GPU's SM count and its architecture only, not on autotuning, so a deviceless compile makes it as
a real GPU does. This module is that choice, written from the formula (its weights as compiled
into jaxlib 0.10.2's CUDA plugin), so the planner prices the partial sums' bytes: attention's
per-chunk matmuls (``[2048, 128]`` results over 512 keys: split 4 on an H100) and the weight
gradients of small layers (``[768, 768]`` over 32768 tokens: split 4) are such matmuls.

Checked against the GPU compiler by ``tests/compiler/test_splitk.py`` (the partial sums' shapes in the
compiled program); :func:`split_k` returns 1 (no split) on any other device.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

# (weight of compute, of memory, of the reduction, fixed cost of a split) per architecture.
_WEIGHTS = {
    "ampere": (100.0, 0.0666955, 467.815, 5.65307e7),
    "hopper": (100.0, 0.194136, 193.1384, 4.36e7),
    "blackwell": (100.0, 0.0848863, 189.711, 1.21563e8),
}
_ARCH = {8: "ampere", 9: "hopper", 10: "blackwell"}
_SPLITS = tuple(2 ** i for i in range(12))          # 1 .. 2048
_TILE = 128
# The largest split whose partial sums XLA adds up inside the kernel of the matmul result's reader
# (an elementwise fusion), as an elementwise reduce of a few values; a larger split is reduced by
# a kernel of its own right after the matmul. Checked on the H100 compiler over ten shapes,
# splits 4 to 32 (``tests/compiler/test_splitk.py``). Where that kernel reads two matmuls, the first's
# partial sums are live while the second runs (:func:`shardplan.compiler.liveness.summing_kernels`).
SUMMED_IN_READER = 8


@dataclasses.dataclass(frozen=True)
class Gpu:
    """What the split-K choice reads of a GPU: its SM count and architecture."""

    cores: int
    arch: str


def gpu_of(device_name: str) -> Gpu | None:
    """The GPU a device name names (one of :mod:`shardplan.compiler.targets`' GPU families, Ampere or
    newer), else ``None``: no split-K."""
    from shardplan.compiler.targets import GPU_FAMILIES
    name = device_name.lower()
    family = next((f for f in GPU_FAMILIES if f in name), None)
    if family is None:
        return None
    f = GPU_FAMILIES[family]
    arch = _ARCH.get(f["major"])
    return Gpu(f["core_count"], arch) if arch else None


def _cost(batch: int, m: int, n: int, k: int, s: int, gpu: Gpu, lhs_bits: int, rhs_bits: int, out_bits: int) -> float:
    w_compute, w_memory, w_reduce, fixed = _WEIGHTS[gpu.arch]
    ek, eb = -(-k // s), batch * s
    mt, nt = min(m, _TILE), min(n, _TILE)
    waves = max(1.0, eb * -(-m // _TILE) * -(-n // _TILE) / (gpu.cores * (_TILE * _TILE) / (mt * nt)))
    compute = 2 * mt * nt * ek * waves * w_compute
    memory = (batch * k * (m * lhs_bits + n * rhs_bits) / 8 + m * n * eb * (32 if s > 1 else out_bits) / 8) * w_memory
    cost = max(compute, memory)
    if s > 1:
        cost += fixed + (eb * m * n * 32 / 8 + batch * m * n * out_bits / 8) * w_reduce
    return cost


def split_k(batch: int, m: int, n: int, k: int, gpu: Gpu | None, *, lhs_bits: int = 16, rhs_bits: int = 16,
            out_bits: int = 16) -> int:
    """The number of partial sums XLA splits a ``[batch, m, k] x [batch, k, n]`` matmul into on
    ``gpu`` (1: none). ``m``, ``n`` and ``k`` are products over a ``dot_general``'s free and
    contracting dimensions: XLA merges several into one before it splits (checked). The caller
    leaves out integer matmuls, which are not split."""
    if gpu is None or min(batch, m, n, k) <= 0:
        return 1
    costs = [_cost(batch, m, n, k, s, gpu, lhs_bits, rhs_bits, out_bits) for s in _SPLITS]
    return _SPLITS[costs.index(min(costs))]           # the first of equals: the smaller split


def partial_bytes(batch: int, m: int, n: int, s: int) -> float:
    """Bytes of the float32 partial sums of a matmul split ``s`` ways (0 unsplit)."""
    return 0.0 if s <= 1 else 4.0 * s * batch * m * n


def padded_k(k: int, s: int, lhs_bits: int, rhs_bits: int) -> int:
    """The contraction XLA pads a matmul split ``s`` ways to: a multiple of ``s`` chunks of 16
    bytes of the narrower operand (``GetPaddedK`` in XLA's split-K rewriter)."""
    multiple = s * 128 // min(128, lhs_bits, rhs_bits)
    return -(-k // multiple) * multiple


def padding_bytes(batch: int, m: int, n: int, k: int, s: int, lhs_bits: int, rhs_bits: int) -> float:
    """Bytes of the zero-padded copies of both operands XLA makes where a matmul split ``s`` ways
    has a contraction that is not a multiple of :func:`padded_k`'s (0 where it is, or unsplit):
    a vocabulary of 50304 contracted in a head's input gradient, split 64 ways in float32, is
    padded to 50432 (``tests/compiler/test_splitk.py``). They live while the matmul runs."""
    if s <= 1:
        return 0.0
    kp = padded_k(k, s, lhs_bits, rhs_bits)
    return 0.0 if kp == k else batch * kp * (m * lhs_bits + n * rhs_bits) / 8.0


def partials_live(split: list[tuple], reduced: list[bool], points: int, running: list[int], held: list[int],
                  combining: list[int], heap: float, bits: tuple[int, int] | None = None) -> np.ndarray:
    """A GPU matmul's float32 partial sums live at each of ``points`` checkpoints, per option
    (``split``: each option's ``(batch, m, n, k, split)``; ``reduced``: whether its result is
    reduced over mesh axes). They are live while the matmul runs (``running``); a small split's
    also wait while another matmul that the kernel summing them reads runs (``held``:
    liveness.summing_kernels), and on a Hopper GPU any split's wait for the last matmul of those
    whose reductions feed one combined collective, where the option's result is reduced
    (``combining``: liveness.combined_matmuls). ``bits``: the operands' bit widths, for the
    zero-padded copies of them (:func:`padding_bytes`) that live while it runs (None: none)."""
    memory = np.zeros((points, len(split)))
    partial = np.array([partial_bytes(b, m, n, s) for b, m, n, _, s in split]) * heap
    padded = np.array([padding_bytes(*o, *bits) for o in split]) if bits is not None else 0.0
    memory[running] = (partial + padded * heap)[None, :]
    memory[held] = np.where([s <= SUMMED_IN_READER for *_, s in split], partial, 0.0)[None, :]
    memory[combining] = np.maximum(memory[combining], np.where(reduced, partial, 0.0)[None, :])
    return memory


def splits(gpu: Gpu | None, batch: int, m: int, n: int, k: int, lhs_dtype, rhs_dtype, out_dtype) -> int:
    """The number of float32 partial sums XLA splits a ``[batch, m, k] x [batch, k, n]`` matmul of
    these dtypes into on ``gpu`` (1: not split, on any other device and for integer operands)."""
    if gpu is None or not all(jnp.issubdtype(d, jnp.floating) for d in (lhs_dtype, rhs_dtype)):
        return 1
    bits = [8 * jnp.dtype(d).itemsize for d in (lhs_dtype, rhs_dtype, out_dtype)]
    return split_k(batch, m, n, k, gpu, lhs_bits=bits[0], rhs_bits=bits[1], out_bits=bits[2])


def partials(gpu: Gpu | None, batch: int, m: int, n: int, k: int, lhs_dtype, rhs_dtype, out_dtype) -> float:
    """Bytes of the float32 partial sums XLA splits a ``[batch, m, k] x [batch, k, n]`` matmul of
    these dtypes into on ``gpu`` (0: not split, on any other device and for integer operands)."""
    return partial_bytes(batch, m, n, splits(gpu, batch, m, n, k, lhs_dtype, rhs_dtype, out_dtype))


def matmul_dims(dims, sizes) -> tuple[int, int, int, int]:
    """``(batch, m, n, k)`` of a graph matmul (:class:`shardplan.ir.graph.DotOp`'s ``dims``: ``(lhs
    dim, rhs dim, out dim)`` each, None where absent) whose dims have these sizes."""
    batch = m = n = k = 1
    for (l, r, o), size in zip(dims, sizes):
        if o is None:
            k *= size
        elif l is not None and r is not None:
            batch *= size
        elif l is not None:
            m *= size
        else:
            n *= size
    return batch, m, n, k


def dims_of(lhs_shape, rhs_shape, dimension_numbers) -> tuple[int, int, int, int]:
    """``(batch, m, n, k)`` of a ``dot_general``."""
    (lc, rc), (lb, rb) = dimension_numbers
    batch = math.prod(lhs_shape[d] for d in lb)
    k = math.prod(lhs_shape[d] for d in lc)
    m = math.prod(s for d, s in enumerate(lhs_shape) if d not in lc and d not in lb)
    n = math.prod(s for d, s in enumerate(rhs_shape) if d not in rc and d not in rb)
    return batch, m, n, k
