"""What a compiled program needs in device memory (:mod:`shardplan.compiler.footprint`).

On a TPU the figure is the one libtpu holds against the chip's HBM when it refuses a program
("the total memory required for HLO temporaries (X) exceeds available HBM (Y)"): argument +
output - alias + the heap of its buffer assignment. Neither ``memory_analysis`` sum nor its peak
is that figure; these tests put programs on both sides of a v5e's limit to show which is.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.compiler import footprint, targets
from shardplan.compiler.fit import compile_oom_bytes

needs_tpu = pytest.mark.skipif(not targets.available("tpu"), reason="libtpu is not installed "
                               "(pip install 'shardplan[aot]')")
GiB = 2**30


def test_heap_is_the_default_memory_space_preallocated_temp(tmp_path):
    (tmp_path / "module_0146.jit_run.after_optimizations-buffer-assignment.txt").write_text(
        "allocation 0: size 131072, parameter 44, shape |f32[2,64,192]| at ShapeIndex {}, maybe-live-out:\n"
        "allocation 160: size 1536, color 6, preallocated-temp:\n"
        " value: <1560 copy.168 @6> (size=512,offset=512): s32[]{:T(128)S(6)}\n"
        "allocation 161: size 3424768, preallocated-temp:\n"
        " value: <1066 lt.40 @0> (size=512,offset=1392640): pred[]{:T(512)}\n"
        "allocation 163: size 3035648, color 1, preallocated-temp:\n")
    assert footprint.heap_bytes(str(tmp_path)) == 3424768
    assert footprint.heap_bytes(str(tmp_path / "nothing dumped")) is None


def test_elsewhere_memory_analysis_gives_the_heap():
    # XLA's CPU (and GPU) memory_analysis: temp is the heap, no dump is read.
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("d",))
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(mesh, P()))
    compiled = footprint.compile(jax.jit(lambda a: jnp.tanh(a @ a) @ a).lower(x), platform="cpu")
    m = compiled.memory_analysis()
    assert m.temp_size_in_bytes > 0 and compiled not in footprint._HEAPS
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    assert footprint.compiled_memory(compiled) == max(total, m.peak_memory_in_bytes or 0)


def _one_v5e_chip():
    topo = targets._topology("tpu", "", "v5e:2x2")     # libtpu told it runs compile-only
    return jax.sharding.Mesh(np.array(topo.devices[:1]), ("d",))


def _scanned_step(layers: int, n: int = 8192):
    """A donated, scanned step: ``layers`` (n, n) float32 weights updated by their gradient."""
    def loss(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w) * 1.5 + h, None), x, ws)
        return jnp.sum(h)

    def step(ws, x):
        return ws - 0.1 * jax.grad(loss)(ws, x)

    s = NamedSharding(_one_v5e_chip(), P())
    return jax.jit(step, donate_argnums=(0,)).lower(jax.ShapeDtypeStruct((layers, n, n), jnp.float32, sharding=s),
                                                    jax.ShapeDtypeStruct((n, n), jnp.float32, sharding=s))


def _refused(lowered) -> tuple[float, float]:
    """libtpu's (required, available) bytes for a program it refuses."""
    with pytest.raises(Exception) as e:
        footprint.compile(lowered, platform="tpu")
    available = re.search(r"available HBM \(([0-9.]+)G\)", str(e.value))
    assert available, str(e.value)
    return compile_oom_bytes(e.value), float(available.group(1)) * GiB


def _sum(compiled) -> float:
    m = compiled.memory_analysis()
    return float(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


@pytest.mark.slow
@needs_tpu
def test_libtpu_holds_the_heap_against_hbm_not_the_memory_analysis_sum():
    # 10 and 11 layers of 256 MiB compile; 12 do not. The 11-layer program's memory_analysis
    # sum is over the chip's HBM, and libtpu compiles it: the sum is not what it needs.
    ten, eleven = (footprint.compile(_scanned_step(k), platform="tpu") for k in (10, 11))
    required, available = _refused(_scanned_step(12))
    assert _sum(eleven) > available >= footprint.compiled_memory(eleven)
    # One more layer needs what one more layer needed before, counted the footprint's way.
    step = footprint.compiled_memory(eleven) - footprint.compiled_memory(ten)
    assert footprint.compiled_memory(eleven) + step == pytest.approx(required, rel=0.005)
    assert _sum(eleven) + (_sum(eleven) - _sum(ten)) > 1.1 * required


@pytest.mark.slow
@needs_tpu
def test_libtpu_holds_the_heap_against_hbm_not_the_live_peak():
    # A small model's step at a large batch: small buffers fragment libtpu's heap, so its
    # reported peak (the live bytes) is under the heap it lays out. The step at 19456 sequences
    # is refused for the heap's bytes, with its peak under the limit.
    from shardplan.models.train import reference
    ref = reference("gpt-tiny", scan=True)
    s = NamedSharding(_one_v5e_chip(), P())
    placed = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree)  # noqa: E731
    state = placed(jax.eval_shape(ref.init, jax.random.key(0)))
    lowered = lambda batch: jax.jit(ref.train_step, donate_argnums=(0,)).lower(  # noqa: E731
        state, placed(ref.batch(batch, abstract=True)))
    compiled = footprint.compile(lowered(18432), platform="tpu")
    required, available = _refused(lowered(19456))
    scale = 19456 / 18432
    peak = compiled.memory_analysis().peak_memory_in_bytes
    assert peak * scale < available < required
    assert footprint.compiled_memory(compiled) * scale == pytest.approx(required, rel=0.005)


def test_the_dumped_heaps_live_peak_counts_the_loop_carried_buffers(tmp_path):
    """A scan's carry and stacked outputs are loop-carried values (``(phi)`` in the dump) that
    live across the loop: counted, the heap is its live peak (XLA's best fit packs this step
    tightly); left out, the peak would miss the stacked residuals, as a first reading of the GPU
    dumps did (RESULTS.md, session 27)."""
    def loss(w, xs):
        def body(c, x):
            return jnp.tanh(c @ w + x), c
        c, ys = jax.lax.scan(body, xs[0], xs)
        return jnp.sum(ys) + jnp.sum(c)

    lowered = jax.jit(jax.grad(loss)).lower(jnp.ones((64, 64)), jnp.ones((8, 16, 64)))
    compiled = lowered.compile(compiler_options={"xla_dump_to": str(tmp_path)})
    heap = footprint.dumped_heap(str(tmp_path))
    assert heap.heap == compiled.memory_analysis().temp_size_in_bytes
    assert 0.98 * heap.heap <= heap.live_peak <= heap.heap
    carried = [b for b in heap.at_peak if any(n.startswith("while") for n in b[4])]
    stacked = 8 * 16 * 64 * 4                                 # f32[8,16,64]: a stacked residual
    assert sum(b[0] for b in carried) >= 2 * stacked
    assert sum(b[0] for b in heap.at_peak) == heap.live_peak
    assert footprint.dumped_heap(str(tmp_path / "nothing dumped")) is None



@needs_tpu
def test_libtpu_gives_each_tuple_result_a_heap_slot_of_its_own(tmp_path):
    """libtpu lays a program's tuple-shaped values (a loop's state, a kernel's several results:
    tables of buffer addresses) out in slots of :data:`shardplan.compiler.layout.HEAP_ALIGN` bytes, each
    distinct one in its own slot, never shared over time: the heap is the arrays' live peak
    (each rounded to the alignment) plus a slot per tuple result. Seen here where the arrays are
    tiny: the heap is almost all slots."""
    from shardplan.compiler.layout import HEAP_ALIGN
    from shardplan.models.train import reference
    ref = reference("gpt-tiny", scan=True)
    s = NamedSharding(_one_v5e_chip(), P())
    placed = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree)  # noqa: E731
    state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(8, abstract=True)
    jax.jit(ref.train_step, donate_argnums=(0,)).lower(placed(state), placed(batch)).compile(
        compiler_options={"xla_dump_to": str(tmp_path)})
    heap = footprint.dumped_heap(str(tmp_path))
    text = next(tmp_path.glob("*after_optimizations-buffer-assignment.txt")).read_text()
    block = text[text.index(", preallocated-temp:"):]
    block = block[:block.find("\nallocation ")] if "\nallocation " in block else block
    values = re.findall(r"\(size=(\d+),offset=(\d+)\): (\S)", block)
    slots = {int(offset) for _, offset, first in values if first == "("}
    assert len(slots) == heap.tuple_slots >= 20
    assert all(offset % HEAP_ALIGN == 0 for offset in slots)
    assert heap.tuple_slots * HEAP_ALIGN <= heap.heap
    assert heap.tuple_slots * HEAP_ALIGN > 0.9 * heap.heap
