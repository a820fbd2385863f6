import numpy as np
import pytest

import shardplan
from shardplan.compiler import targets
from shardplan.compiler.cost import CostModel
from shardplan.compiler.layout import HEAP_ALIGN, heap_bytes, tiled, tpu_bytes

needs_tpu = pytest.mark.skipif(not targets.available("tpu"), reason="libtpu is not installed "
                               "(pip install 'shardplan[aot]')")


@pytest.mark.parametrize("shape, itemsize, expected", [
    ((7,), 4, 512),                  # 128 lanes
    ((129,), 4, 1024),               # a tile of 256
    ((3000,), 2, 6144),              # tiles of 1024
    ((1, 64), 4, 512),               # one row of 128 lanes
    ((3, 64), 4, 2048),              # 4 rows
    ((9, 64), 2, 4096),              # 16 rows (a multiple of 8)
    ((64, 5), 4, 4096),              # laid out {0,1}: 5 rows of 64 lanes, not 64 rows of 5
    ((4, 5, 6), 4, 10240),           # the 4 as rows: 5 x 4 x 128
    ((32, 1, 64), 2, 8192),          # bf16: the 1 is not the second-minor (2 rows at least)
    ((3, 3, 128, 256), 1, 294912),   # dense: nothing padded
])
def test_tile_padding_matches_what_libtpu_lays_out(shape, itemsize, expected):
    # Values read off libtpu's v5e compile (argument_size_in_bytes, one parameter each).
    assert tpu_bytes(shape, itemsize) == expected


def test_tiled_devices_and_memory_bytes_on_a_tpu_mesh():
    assert tiled("TPU v5e") and tiled("TPU v5p") and not tiled("NVIDIA H100 80GB") and not tiled("cpu")
    tpu = CostModel(shardplan.load_mesh("tpu-v5e-256", axes={"data": 16, "model": 16}))
    gpu = CostModel(shardplan.load_mesh("h100-8", axes={"data": 2, "model": 4}))
    spec = (("data",), ("model",))
    # [256, 512] f32 over 16 x 16: [16, 32] a device, the 32 lanes padded to 128.
    assert tpu.per_device_bytes((256, 512), 4, spec) == 16 * 32 * 4
    assert tpu.memory_bytes((256, 512), 4, spec) == 16 * 128 * 4
    assert gpu.memory_bytes((256, 512), 4, spec) == gpu.per_device_bytes((256, 512), 4, spec)


@needs_tpu
def test_tile_padding_matches_libtpu_on_random_shapes():
    import jax
    import jax.numpy as jnp
    devices = targets._topology("tpu", "", "v5e:16x16").devices
    mesh = jax.sharding.Mesh(np.array(devices[:1]), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    rng = np.random.default_rng(0)
    sizes = [1, 2, 3, 5, 8, 9, 17, 64, 100, 128, 129, 300, 1000]
    shapes = [tuple(int(rng.choice(sizes)) for _ in range(rng.integers(1, 5))) for _ in range(12)]
    for dtype in (jnp.float32, jnp.bfloat16, jnp.int8):
        args = [jax.ShapeDtypeStruct(s, dtype, sharding=sharding) for s in shapes]
        compiled = jax.jit(lambda *xs: sum(x.astype(jnp.float32).sum() for x in xs)).lower(*args).compile()
        expected = sum(tpu_bytes(s, jnp.dtype(dtype).itemsize) for s in shapes)
        assert compiled.memory_analysis().argument_size_in_bytes == expected, (dtype, shapes)


def _attention(q, k, v):
    import jax
    import jax.numpy as jnp
    p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest"), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest")


def test_a_batched_matmul_tiles_its_own_dimensions():
    import jax
    import jax.numpy as jnp

    from shardplan.compiler.layout import minor_dims
    from shardplan.sharding.rules import apply_rule
    from shardplan.tracing.walk import build_graph
    q = jax.ShapeDtypeStruct((256, 32, 4, 16), jnp.float32)
    closed = jax.make_jaxpr(_attention)(q, q, q)
    g = build_graph(closed, ["q", "k", "v"], apply_rule)
    minor = minor_dims(g)
    scores = [d.out for d in g.dots if g.tensors[d.out].shape == (256, 4, 32, 32)]
    assert len(scores) == 1 and minor[scores[0]] == (2, 3)
    assert minor.get(g.inputs[0]) == (1, 3)          # q: its positions and head dimension, not batch or heads
    # Free, libtpu would lay the scores out with the batch as lanes (4 MiB); tiled as the matmul
    # keeps them, the 32 keys are padded to 128 lanes.
    assert tpu_bytes((256, 4, 32, 32), 4) == 4 * 2**20
    assert tpu_bytes((256, 4, 32, 32), 4, minor=(2, 3)) == 16 * 2**20


@needs_tpu
def test_libtpu_holds_a_batched_matmuls_result_in_its_own_tiles():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardplan.compiler import footprint
    topo = targets._topology("tpu", "", "v5e:2x2")
    mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("d",))
    q = jax.ShapeDtypeStruct((256, 32, 4, 16), jnp.float32, sharding=NamedSharding(mesh, P()))
    compiled = footprint.compile(jax.jit(_attention).lower(q, q, q), targets.HBM_ONLY_OPTIONS["tpu"], platform="tpu")
    heap = footprint.compiled_temp(compiled) - compiled.memory_analysis().output_size_in_bytes
    # The scores and their softmax: two 16 MiB buffers, not two of 4 MiB.
    assert heap == pytest.approx(2 * tpu_bytes((256, 4, 32, 32), 4, minor=(2, 3)), rel=0.02)


def test_heap_bytes_round_a_tpu_temporary_up_to_the_heaps_alignment():
    assert heap_bytes(512, True) == HEAP_ALIGN and heap_bytes(HEAP_ALIGN + 1, True) == 2 * HEAP_ALIGN
    assert heap_bytes(512, False) == 512 and heap_bytes(0, True) == 0


@needs_tpu
def test_libtpu_starts_every_heap_temporary_at_the_alignment(tmp_path):
    """The premise of :data:`shardplan.compiler.layout.HEAP_ALIGN`: a scanned step's many small
    temporaries each start at a multiple of it in libtpu's heap (the buffer assignment it dumps)."""
    import re

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def loss(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w) + h, None), x, ws)
        return jnp.sum(h ** 2)

    topo = targets._topology("tpu", "", "v5e:2x2")
    s = NamedSharding(jax.sharding.Mesh(np.array(topo.devices[:1]), ("d",)), P())
    lowered = jax.jit(jax.grad(loss)).lower(jax.ShapeDtypeStruct((4, 64, 64), jnp.float32, sharding=s),
                                            jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=s))
    lowered.compile(compiler_options={"xla_dump_to": str(tmp_path)})
    text = "".join(p.read_text() for p in tmp_path.glob("*buffer-assignment.txt"))
    block = text[text.index(", preallocated-temp:"):]
    block = block[:block.find("\nallocation ")] if "\nallocation " in block else block
    values = [(int(size), int(offset)) for size, offset in re.findall(r"\(size=(\d+),offset=(\d+)\)", block)]
    assert sum(size < HEAP_ALIGN for size, _ in values) >= 5, values
    assert all(offset % HEAP_ALIGN == 0 for _, offset in values), values


# (lhs shape, rhs shape, (contracted dims), (batch dims)): which operands XLA's CPU compiler
# copies into another order before its matmul (cpu_dot_copies), against its compiled program.
_DOTS = [
    ((384, 256), (384, 640), ((0,), (0,)), ((), ())),                  # one of each: transposed in place
    ((4, 96, 256), (4, 96, 640), ((0, 1), (0, 1)), ((), ())),          # a weight gradient: the lhs copied
    ((256, 4, 96), (4, 96, 640), ((1, 2), (0, 1)), ((), ())),
    ((4, 96, 256), (640, 4, 96), ((0, 1), (1, 2)), ((), ())),          # both
    ((256, 4, 96), (640, 4, 96), ((1, 2), (1, 2)), ((), ())),          # the rhs
    ((8, 96, 256), (8, 96, 640), ((1,), (1,)), ((0,), (0,))),
    ((256, 8, 96), (8, 96, 640), ((2,), (1,)), ((1,), (0,))),          # a batch dimension not leading
    ((4, 96, 256), (256, 640), ((2,), (0,)), ((), ())),                # x @ w
    ((4, 96, 640), (256, 640), ((2,), (1,)), ((), ())),                # dy @ w.T
    ((4, 96, 8, 32), (256, 8, 32), ((2, 3), (1, 2)), ((), ())),        # heads into d_model: the rhs
    ((4, 96, 8, 32), (8, 32, 256), ((2, 3), (0, 1)), ((), ())),
    ((4, 96, 8, 32), (4, 96, 8, 32), ((3,), (3,)), ((0, 2), (0, 2))),  # attention scores: both
]


def _dims(lhs, rhs, contracted, batch):
    (lc, rc), (lb, rb) = contracted, batch
    out = [(x, y, k) for k, (x, y) in enumerate(zip(lb, rb))]
    out += [(i, None, None) for i in range(len(lhs)) if i not in lc and i not in lb]
    out += [(None, i, None) for i in range(len(rhs)) if i not in rc and i not in rb]
    out = [(x, y, k if z is None else z) for k, (x, y, z) in enumerate(out)]
    return tuple(out) + tuple((x, y, None) for x, y in zip(lc, rc))


@pytest.mark.parametrize("lhs, rhs, contracted, batch", _DOTS)
def test_which_matmul_operands_the_cpu_compiler_copies_into_its_order(lhs, rhs, contracted, batch):
    import jax
    import jax.numpy as jnp

    from shardplan.compiler.layout import cpu_dot_copies
    f = jax.jit(lambda a, b: (jax.lax.dot_general(a, b, (contracted, batch)), jnp.tanh(a), jnp.tanh(b)))
    compiled = f.lower(jax.ShapeDtypeStruct(lhs, jnp.float32), jax.ShapeDtypeStruct(rhs, jnp.float32)).compile()
    # Operands, results and the tanh's are not temporaries: what is, is the copies.
    copied = cpu_dot_copies(_dims(lhs, rhs, contracted, batch), lhs, rhs)
    expected = sum(int(np.prod(s)) * 4 for s, c in zip((lhs, rhs), copied) if c)
    assert compiled.memory_analysis().temp_size_in_bytes == pytest.approx(expected, abs=4096), copied
