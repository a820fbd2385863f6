"""How many bytes an array takes in a device's memory once the compiler lays it out.

A GPU (and XLA's CPU backend) stores an array densely: its bytes are its elements times its
item size. A TPU stores every array in tiles: the minor dimension padded to 128 lanes, the
second-minor to a tile of 1, 2, 4 or 8 rows (by its size; 16-bit types take at least 2, 8-bit at
least 4: they pack rows into one 32-bit row), a 1-D array to 128-1024 elements, and nothing
below 512 bytes. libtpu permutes the layout's dimension order to pad least (a ``[64, 5]`` array
is laid out ``{0,1:T(8,128)}``: 5 rows of 64 lanes, not 64 rows of 5). Found by compiling
parameters of 216 shapes (f32, bf16, s32, s8) on libtpu's deviceless v5e compiler and reading
``argument_size_in_bytes`` and the layouts of ``as_text()``: the rule matches all of them and
the entry parameters of the TPU audit cells (benchmarks/RESULTS.md, session 10).

On full-size models the padding is a rounding; on small arrays (a head dimension of 64, a
per-device batch of 1 as the second-minor dimension) it is up to 2x per array and 100x for
vectors, which is what made the TPU audit of the tiny reference models read 26-49% low.

>>> tpu_bytes((64, 5), 4)          # 5 rows padded to 8, 64 lanes to 128
4096
>>> tpu_bytes((1000,), 2)          # 1024 elements
2048
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

LANES = 128
MAX_ROWS = 8
MIN_BYTES = 512
# libtpu starts every temporary of its heap at a multiple of 16 KiB: each live one takes its
# bytes rounded up to that (every offset of the heaps of gpt-tiny and gpt2-small on 256 v5e
# chips; benchmarks/RESULTS.md, session 27). Arguments are allocations of their own. Each tuple
# result (a loop's state, a kernel's several results) has a slot of that size of its own, never
# shared (session 28): :attr:`shardplan.ir.graph.Graph.tuple_results`.
HEAP_ALIGN = 16384
_VECTOR_TILE = 1024


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def tpu_bytes(shape: Sequence[int], itemsize: int, minor: Sequence[int] | None = None) -> int:
    """Bytes of an array of ``shape`` and ``itemsize`` in TPU memory, padded to its tiles;
    ``minor``: the dimensions its two minor (tiled) dimensions are chosen from (:func:`minor_dims`),
    where libtpu does not choose among all of them."""
    shape = tuple(int(d) for d in shape)
    if any(d == 0 for d in shape):
        return 0
    if not shape:
        return max(itemsize, MIN_BYTES)
    pack = max(1, 4 // itemsize)            # rows packed into one 32-bit row
    if len(shape) == 1:
        n = shape[0]
        tile = min(_VECTOR_TILE, max(LANES * pack, _pow2_at_least(n)))
        return max(_round_up(n, tile) * itemsize, MIN_BYTES)
    best = None
    among = [d for d in (minor if minor is not None else range(len(shape))) if d < len(shape)]
    if len(among) < 2:
        among = list(range(len(shape)))
    for lanes in among:
        for second in among:
            if second == lanes:
                continue
            rows = shape[second]
            tile_rows = min(MAX_ROWS, max(pack, _pow2_at_least(rows)))
            rest = math.prod(d for k, d in enumerate(shape) if k not in (lanes, second))
            n = rest * _round_up(rows, tile_rows) * _round_up(shape[lanes], LANES) * itemsize
            best = n if best is None else min(best, n)
    return max(best, MIN_BYTES)


def heap_bytes(nbytes, tiled_device: bool):
    """What temporaries of ``nbytes`` (laid out; a number or an array) take in the heap: on a TPU,
    rounded up to :data:`HEAP_ALIGN`; elsewhere their bytes (a GPU's 256-byte alignment is lost
    in the noise)."""
    if not tiled_device:
        return nbytes
    rounded = np.ceil(np.asarray(nbytes, dtype=float) / HEAP_ALIGN) * HEAP_ALIGN
    return float(rounded) if rounded.ndim == 0 else rounded


def tiled(device_name: str) -> bool:
    """Whether arrays on this device are laid out in TPU tiles (every TPU generation is)."""
    return device_name.strip().upper().startswith("TPU")


def minor_dims(graph) -> dict[int, tuple[int, ...]]:
    """Per tensor, the dimensions libtpu lays out minor (tiled) where it does not pick the least
    padded two: an operand or result of a batched matmul keeps its batch dimensions major and
    tiles two of its others (the matmul's rows, columns or contraction), and a layer scan stacks
    it so (its stacking dimension major). On the llama-tiny cell (256 chips, data parallel)
    attention's scores ``f32[256,4,32,32]`` take 16 MiB a device, not 4, and the stacked heads
    ``bf16[2,256,32,4,16]`` 8 MiB, not 2 (their 32 positions as lanes): benchmarks/RESULTS.md,
    session 22. A matmul with no batch dimension, and a convolution, lay out freely. A tensor
    several batched matmuls read is tiled as the first one (in the step's order) has it."""
    out: dict[int, tuple[int, ...]] = {}
    for dot in graph.dots:
        if dot.fixed or dot.sizes is not None:
            continue
        batch = [k for k, (l, r, o) in enumerate(dot.dims) if l is not None and r is not None and o is not None]
        if not batch:
            continue
        for side, t in enumerate((dot.lhs, dot.rhs, dot.out)):
            dims = tuple(sorted(d[side] for k, d in enumerate(dot.dims) if k not in batch and d[side] is not None))
            if len(dims) >= 2:
                out.setdefault(t, dims)
    for t, dims in list(out.items()):
        stack = graph.stacked_into.get(t)
        while stack is not None and stack not in out:
            dims = tuple(d + 1 for d in dims)
            out[stack] = dims
            stack = graph.stacked_into.get(stack)
    return out




def cpu_dot_copies(dims, lhs_shape: Sequence[int], rhs_shape: Sequence[int]) -> tuple[bool, bool]:
    """Whether XLA's CPU compiler copies a matmul's (lhs, rhs) into another order before it
    runs. Its matmul reads each operand as a row-major ``[batch..., rows, columns]``: the batch
    dimensions must lead, and an operand whose contracted or free dimensions are several must
    have them in the order that collapses them into one by a bitcast (the lhs ``[free...,
    contracted...]``, the rhs ``[contracted..., free...]``); with one of each, either order
    does (the kernel transposes). Otherwise the operand is transposed into a buffer of its own
    while the matmul runs: a weight gradient ``einsum('bsd,bsf->df')`` copies its ``[b, s, d]``
    lhs to ``[d, b*s]`` (the CPU compiler's programs: tests/compiler/test_layout.py).
    ``dims``: :attr:`~shardplan.ir.graph.DotOp.dims`; dimensions of size 1 do not count."""
    def copied(side: int, shape: Sequence[int], canonical: str) -> bool:
        kinds = {}
        for d in dims:
            if d[side] is not None and shape[d[side]] > 1:
                kinds[d[side]] = "b" if None not in d else ("f" if d[2] is not None else "k")
        order = "".join(kinds[i] for i in sorted(kinds))
        rest = order.lstrip("b")
        if "b" in rest:
            return True
        return (rest.count("k") > 1 or rest.count("f") > 1) and re.fullmatch(canonical, rest) is None

    return copied(0, lhs_shape, "f*k*"), copied(1, rhs_shape, "k*f*")
