"""A scanned weight gathered along a dimension that is not its slice's major one: the GPU compiler
lays the whole stacked weight out again before the loop (a copy the memory model does not
hold), so the planner prices the copy's HBM traffic and prefers the major dimension."""

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardplan
from shardplan.compiler import footprint, targets
from shardplan.compiler.cost import CostModel
from shardplan.compiler.tables import _relayout_seconds

L, D, F, B = 4, 512, 2048, 64


def _step(mesh):
    def step(ws, x):
        def body(h, w):
            w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))     # gathered, as FSDP does
            return h * jnp.tanh(h @ w).mean(-1, keepdims=True), None
        return jax.lax.scan(body, x, ws)[0].sum()
    return step


@pytest.mark.skipif(not targets.available("gpu"), reason="needs the GPU compiler: pip install 'shardplan[aot]'")
@pytest.mark.parametrize("gathered,copied", [(2, True), (1, False)])
def test_the_gpu_compiler_copies_a_stacked_weight_gathered_along_a_minor_dimension(gathered, copied):
    mesh = targets.target_mesh(shardplan.load_mesh("h100-8", axes={"data": 8}), "gpu")[0]
    spec = [None, None, None]
    spec[gathered] = "data"
    ws = jax.ShapeDtypeStruct((L, D, F), jnp.bfloat16, sharding=NamedSharding(mesh, P(*spec)))
    x = jax.ShapeDtypeStruct((B, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    with tempfile.TemporaryDirectory() as folder:
        jax.jit(jax.grad(_step(mesh))).lower(ws, x).compile(compiler_options={"xla_dump_to": folder})
        heap = footprint.dumped_heap(folder)
    shard = L * D * F * 2 // 8          # the stacked weight's bytes on one device
    held = [L, D, F]
    held[gathered] //= 8                # its shape there, as the step holds it
    as_held = f"bf16[{','.join(map(str, held))}]{{2,1,0}}"
    laid_again = [b for b in heap.buffers if b[0] == shard and b[3].startswith("bf16[") and b[3] != as_held]
    assert bool(laid_again) == copied, sorted((b[0], b[3]) for b in heap.buffers)[-8:]


def test_the_relayout_is_priced_only_where_the_gather_is_along_a_minor_dimension():
    class Enum:     # what _relayout_seconds reads of an Enumerator
        class g:
            tensors = {0: type("T", (), {"shape": (L, D, F), "dtype": np.dtype("float32")})}
        m = CostModel(shardplan.load_mesh("h100-8", axes={"data": 8}))

    haves = [((), ("data",)), (("data",), ()), ((), ())]
    wants = [((), ())]
    seconds = _relayout_seconds(Enum, 0, (D, F), haves, wants)
    assert seconds.shape == (1, 3)
    assert seconds[0, 0] > 0 and seconds[0, 1] == 0 and seconds[0, 2] == 0
    device = Enum.m.mesh.device
    assert np.isclose(seconds[0, 0], 2 * L * D * F * 4 / 8 / device.hbm_bandwidth)
