import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.compiler.hlo import collectives, dot_flops, replica_groups
from shardplan.devices.mesh import make_jax_mesh


@pytest.mark.parametrize("text, expected", [
    ("replica_groups={{0,1},{2,3}}, x", [[0, 1], [2, 3]]),
    ("replica_groups=[2,4]<=[8], x", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=[4,2]<=[2,4]T(1,0), x", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['a'=2,'b'=4] {'a'}, x", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['a'=2,'b'=4] {'b'}, x", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}, x", [[0, 1, 2, 3], [4, 5, 6, 7]]),
])
def test_replica_group_notations(text, expected):
    assert sorted(map(sorted, replica_groups(text, 8))) == sorted(map(sorted, expected))


def test_contracting_split_gives_all_reduce_over_its_axis():
    mesh = make_jax_mesh(("data", "model"), (2, 4))
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    f = jax.jit(lambda x, w: x @ w,
                in_shardings=(NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P("model"))),
                out_shardings=NamedSharding(mesh, P("data")))
    text = f.lower(x, w).compile().as_text()
    [c] = collectives(text, mesh)
    assert (c.kind, c.axes, c.nbytes, c.emitted) == ("all-reduce", ("model",), 8 * 32 * 4, "")
    assert dot_flops(text)["f32"] == pytest.approx(2 * 8 * 16 * 32)


def test_collectives_inside_scan_count_trip_times():
    mesh = make_jax_mesh(("data", "model"), (2, 4))

    def f(ws, x):
        def body(h, w):
            return jax.lax.with_sharding_constraint(h @ w, NamedSharding(mesh, P("data"))), None
        return jax.lax.scan(body, x, ws)[0]

    ws = jax.ShapeDtypeStruct((5, 64, 64), jnp.float32)
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    compiled = jax.jit(f, in_shardings=(NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P("data")))
                       ).lower(ws, x).compile()
    # Rows split over data (8 of 16), contraction over model (16 of 64): a partial sum per layer,
    # summed by an all-reduce that the next layer only slices: what GPUs emit as a reduce-scatter.
    [c] = collectives(compiled.as_text(), mesh)
    assert ((c.kind, c.emitted, c.axes, c.count, c.nbytes)
            == ("reduce-scatter", "all-reduce", ("model",), 5.0, 8 * 64 * 4))
    [c] = collectives(compiled.as_text(), mesh, read_cpu_reduce_scatter=False)
    assert (c.kind, c.emitted) == ("all-reduce", "")
    assert dot_flops(compiled.as_text())["f32"] == 5 * 2 * 8 * 16 * 64
    # libtpu gives no known_trip_count: the trips are read off the loop's condition (i < 5).
    text = re.sub(r'"known_trip_count":\{"n":"\d+"\},?', "", compiled.as_text())
    assert "known_trip_count" not in text
    [c] = collectives(text, mesh)
    assert c.count == 5.0
    assert dot_flops(text)["f32"] == 5 * 2 * 8 * 16 * 64


WINDOWED = """\
HloModule m

%body (p: (f32[256], u32[])) -> (f32[256], u32[]) {
  %p = (f32[256], u32[]) parameter(0)
  %acc = f32[256] get-tuple-element(%p), index=0
  %i = u32[] get-tuple-element(%p), index=1
  %two = u32[] constant(2)
  %next = u32[] add(%i, %two)
  %cp.0 = f32[256] collective-permute(%acc), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cp.1 = f32[256] collective-permute(%cp.0), channel_id=2, source_target_pairs={{0,3},{1,0},{2,1},{3,2}}
  ROOT %t = (f32[256], u32[]) tuple(%cp.1, /*index=1*/%next)
}

%cond (q: (f32[256], u32[])) -> pred[] {
  %bound = u32[] constant(8)
  %q = (f32[256], u32[]) parameter(0)
  %j = u32[] get-tuple-element(%q), index=1
  ROOT %lt = pred[] compare(%j, %bound), direction=LT
}

ENTRY %main (x: f32[256]) -> (f32[256], u32[]) {
  %x = f32[256] parameter(0)
  %zero = u32[] constant(0)
  %init = (f32[256], u32[]) tuple(%x, %zero)
  ROOT %w = (f32[256], u32[]) while(%init), condition=%cond, body=%body
}
"""


def test_a_windowed_einsum_loop_counts_its_trips_by_its_counters_step():
    # libtpu's windowed einsum (a matmul whose result is reduce-scattered, done as a ring of
    # collective-permutes) counts an unsigned i < N and adds 2 a trip (mixtral on a v5p: read as one
    # trip, its permutes were a third of what the program moves; RESULTS.md, session 30).
    mesh = make_jax_mesh(("x",), (4,))
    found = collectives(WINDOWED, mesh)
    assert [(c.kind, c.count) for c in found] == [("collective-permute", 4.0)] * 2


def test_hbm_bytes_counts_fused_reads_and_writes_and_slices_only_what_they_keep():
    from shardplan.compiler.hlo import hbm_bytes
    x = jax.ShapeDtypeStruct((1024,), jnp.float32)
    assert hbm_bytes(jax.jit(lambda x: jnp.tanh(x * 2 + 1)).lower(x).compile().as_text()) == 2 * 4096

    def f(ws, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h * w), None), x, ws)[0]
    text = jax.jit(f).lower(jax.ShapeDtypeStruct((7, 1024), jnp.float32), x).compile().as_text()
    per_step = 3 * 4096            # read h and one row of ws, write h; not the whole ws each step
    assert 7 * per_step <= hbm_bytes(text) <= 7 * per_step + 2 * 4096 + 512   # + the copy of x in


def test_convolutions_count_their_flops_as_the_tpu_emits_matmuls_and_as_conv_layers():
    """The TPU compiler emits a matmul as a convolution (``dim_labels=bf_io->bf``); a conv layer is
    one with a window: 2 x output elements x input features x window."""
    text = """HloModule m

ENTRY %main (p0: bf16[1024,4096], p1: bf16[4096,256]) -> bf16[1024,256] {
  %p0 = bf16[1024,4096]{1,0:T(8,128)(2,1)} parameter(0)
  %p1 = bf16[4096,256]{1,0:T(8,128)(2,1)} parameter(1)
  ROOT %convolution.2 = bf16[1024,256]{1,0:T(8,128)(2,1)} convolution(%p0, %p1), dim_labels=bf_io->bf
}
"""
    assert dot_flops(text) == {"bf16": 2.0 * 1024 * 256 * 4096}
    x, w = jax.ShapeDtypeStruct((2, 8, 8, 3), jnp.float32), jax.ShapeDtypeStruct((3, 3, 3, 16), jnp.float32)
    conv = jax.jit(lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                                             dimension_numbers=("NHWC", "HWIO", "NHWC")))
    assert dot_flops(conv.lower(x, w).compile().as_text()) == {"f32": 2.0 * (2 * 8 * 8 * 16) * (3 * 3 * 3)}


@pytest.mark.parametrize("window, lhs, taps", [
    ("size=8 pad=7_7 rhs_reversal=1", "bf16[1,4,1]", 1),          # an outer product: one real input
    ("size=8 pad=7_7 lhs_dilate=8", "bf16[1,4,2]", 1),             # dilated as wide as the window
    ("size=8 pad=3_4", "bf16[1,4,64]", 8),                         # a conv layer's window: every tap
])
def test_a_convolution_counts_the_window_taps_that_meet_real_input(window, lhs, taps):
    """libtpu writes batched and outer-product matmuls as convolutions with a window over an input
    of size 1 (or dilated as wide as the window): each output position meets one real input, so
    they are not window-size times the FLOPs (Mixtral on a v5p slice read as 6x its matmuls)."""
    text = f"""HloModule m

ENTRY %main (p0: {lhs}, p1: bf16[4,16,8]) -> bf16[1,16,8] {{
  %p0 = {lhs}{{2,1,0}} parameter(0)
  %p1 = bf16[4,16,8]{{2,1,0}} parameter(1)
  ROOT %convolution.1 = bf16[1,16,8]{{2,1,0}} convolution(%p0, %p1), window={{{window}}}, dim_labels=bf0_io0->bf0
}}
"""
    assert dot_flops(text) == {"bf16": 2.0 * (1 * 16 * 8) * 4 * taps}


def test_hbm_bytes_of_a_fusion_that_updates_a_buffer_in_place_is_the_update():
    """A scan's stacked output written one layer a trip: the GPU fuses the layer's work into a
    fusion rooted at a dynamic-update-slice of the stacked buffer (named by what it fuses, not
    "update-slice"); XLA writes it in place, so each trip moves the layer's bytes, not the stack's."""
    from shardplan.compiler.hlo import hbm_bytes
    text = """HloModule m

%fused_dus (param_0: f32[12,1024], param_1: s32[], param_2: f32[1024]) -> f32[12,1024] {
  %param_0 = f32[12,1024]{1,0} parameter(0)
  %param_2 = f32[1024]{0} parameter(2)
  %tanh.1 = f32[1024]{0} tanh(%param_2)
  %bitcast.1 = f32[1,1024]{1,0} bitcast(%tanh.1)
  %param_1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  ROOT %dynamic-update-slice.1 = f32[12,1024]{1,0} dynamic-update-slice(%param_0, %bitcast.1, %param_1, %c0)
}

ENTRY %main (p0: f32[12,1024], p1: s32[], p2: f32[1024]) -> f32[12,1024] {
  %p0 = f32[12,1024]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = f32[1024]{0} parameter(2)
  ROOT %loop_select_fusion.3 = f32[12,1024]{1,0} fusion(%p0, %p1, %p2), kind=kLoop, calls=%fused_dus
}
"""
    assert hbm_bytes(text) == 4 + 4096 + 4096       # reads the index and the row, writes the row


def test_an_update_in_place_of_a_bitcast_parameter_is_the_update():
    """The buffer a fusion's dynamic-update-slice writes may be its parameter seen through a
    bitcast (ring attention's f32 dK/dV accumulators): the same bytes, updated in place."""
    from shardplan.compiler.hlo import hbm_bytes
    text = """HloModule m

%fused_dus (param_0: f32[12,1024], param_1: s32[], param_2: f32[1024]) -> f32[12,1,1024] {
  %param_0 = f32[12,1024]{1,0} parameter(0)
  %bitcast.0 = f32[12,1,1024]{2,1,0} bitcast(%param_0)
  %param_2 = f32[1024]{0} parameter(2)
  %tanh.1 = f32[1024]{0} tanh(%param_2)
  %bitcast.1 = f32[1,1,1024]{2,1,0} bitcast(%tanh.1)
  %param_1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  ROOT %dynamic-update-slice.1 = f32[12,1,1024]{2,1,0} dynamic-update-slice(%bitcast.0, %bitcast.1, %param_1, %c0, %c0)
}

ENTRY %main (p0: f32[12,1024], p1: s32[], p2: f32[1024]) -> f32[12,1,1024] {
  %p0 = f32[12,1024]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = f32[1024]{0} parameter(2)
  ROOT %loop_fusion.3 = f32[12,1,1024]{2,1,0} fusion(%p0, %p1, %p2), kind=kLoop, calls=%fused_dus
}
"""
    assert hbm_bytes(text) == 4 + 4096 + 4096


def test_a_conditional_runs_its_costliest_branch_once_a_call_not_every_branch():
    """``lax.switch`` in a loop: each trip runs one branch. The program is priced as its
    costliest branch every trip (the planner's bound for a shard_map body's conditional), not
    as the sum of the branches (a ring attention's three-way switch read as 3x its FLOPs)."""
    from shardplan.compiler.hlo import dot_flops, hbm_bytes
    n = 256

    def step(x, w):
        def body(c, i):
            branches = [lambda c: c, lambda c: jnp.tanh(c @ w), lambda c: jnp.tanh((c @ w) @ w)]
            return jax.lax.switch(i % 3, branches, c), None
        return jax.lax.scan(body, x, jnp.arange(6))[0]
    x = jax.ShapeDtypeStruct((n, n), jnp.float32)
    text = jax.jit(step).lower(x, x).compile().as_text()
    assert dot_flops(text)["f32"] == pytest.approx(6 * 2 * 2 * n ** 3)      # 6 trips of the two-dot branch
    assert hbm_bytes(text) > 6 * 2 * n * n * 4                                  # its reads and writes counted


def test_cpu_all_reduce_stored_as_a_slice_in_a_scan_reads_as_reduce_scatter():
    """A sharded stacked gradient: on CPU each trip all-reduces the layer's gradient and a fusion
    stores only this device's slice of it; a GPU compile emits a reduce-scatter there."""
    mesh = make_jax_mesh(("data",), (8,))

    def loss(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.sum(h ** 2)

    ws, x = jax.ShapeDtypeStruct((4, 64, 64), jnp.float32), jax.ShapeDtypeStruct((32, 64), jnp.float32)
    f = jax.jit(jax.grad(loss), in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))),
                out_shardings=NamedSharding(mesh, P(None, "data")))
    text = f.lower(ws, x).compile().as_text()
    grads = [c for c in collectives(text, mesh) if c.nbytes == 64 * 64 * 4]
    assert grads and all(c.kind == "reduce-scatter" for c in grads), grads
    assert sum(c.count for c in grads) == 4
    raw = [c for c in collectives(text, mesh, read_cpu_reduce_scatter=False) if c.nbytes == 64 * 64 * 4]
    assert raw and all(c.kind == "all-reduce" for c in raw)


def test_replica_groups_name_positions_in_the_mesh_not_device_ids():
    # A mesh over permuted devices (a TPU topology's ids follow its torus, not the mesh): the
    # groups of a psum over 'model' are mesh rows whatever the ids of their devices.
    devices = [jax.devices()[i] for i in (0, 4, 1, 5, 2, 6, 3, 7)]      # ids 0-3 in both rows
    mesh = make_jax_mesh(("data", "model"), (2, 4), devices)
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    f = jax.jit(lambda x, w: x @ w,
                in_shardings=(NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P("model"))),
                out_shardings=NamedSharding(mesh, P("data")))
    [c] = collectives(f.lower(x, w).compile().as_text(), mesh)
    assert (c.kind, c.axes) == ("all-reduce", ("model",))


_SPLIT_ALL_GATHER = """HloModule m

%async_collective_fusion.1 (p0: f32[1,8]) -> f32[4,8] {
  %p0 = f32[1,8]{1,0} parameter(0)
  ROOT %all-gather.2 = f32[4,8]{1,0} all-gather(%p0), channel_id=7, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
}

%async_collective_fusion.2 (p0: f32[1,8]) -> f32[4,8] {
  %p0 = f32[1,8]{1,0} parameter(0)
  ROOT %all-gather.3 = f32[4,8]{1,0} all-gather(%p0), channel_id=7, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
}

%fused_computation.9 (p0: f32[1,8]) -> f32[4,8] {
  %p0 = f32[1,8]{1,0} parameter(0)
  ROOT %all-gather.4 = f32[4,8]{1,0} all-gather(%p0), channel_id=7, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
}

%fused_computation.10 (p0: f32[1,8]) -> f32[4,8] {
  %p0 = f32[1,8]{1,0} parameter(0)
  ROOT %all-gather.5 = f32[4,8]{1,0} all-gather(%p0), channel_id=8, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
}

ENTRY %main (x: f32[1,8]) -> f32[4,8] {
  %x = f32[1,8]{1,0} parameter(0)
  %async-collective-start = f32[4,8]{1,0} fusion(%x), kind=kCustom, calls=%fused_computation.9
  %fusion.1 = f32[4,8]{1,0} fusion(%x), kind=kCustom, calls=%async_collective_fusion.1
  %fusion.2 = f32[4,8]{1,0} fusion(%x), kind=kCustom, calls=%async_collective_fusion.2
  ROOT %fusion.3 = f32[4,8]{1,0} fusion(%x), kind=kLoop, calls=%fused_computation.10
}
"""


def test_a_collective_libtpu_splits_over_async_fusions_counts_once():
    # libtpu runs an async collective as a start, continuations and a done, each a fusion with a
    # copy of the collective (one channel_id): one all-gather. Another channel is another one.
    mesh = make_jax_mesh(("data", "model"), (2, 4))
    found = collectives(_SPLIT_ALL_GATHER, mesh)
    assert [(c.kind, c.axes, c.nbytes, c.count) for c in found] == [("all-gather", ("model",), 128, 1.0)] * 2


def test_roofline_prices_each_op_at_the_longer_of_its_flops_and_bytes():
    """``roofline_seconds`` takes each top-level op at max(FLOP time, byte time): between the
    larger and the sum of the program's FLOP time and byte time, and each limit where the other
    is free."""
    import jax
    import jax.numpy as jnp

    from shardplan.compiler.hlo import dot_flops, hbm_bytes, roofline_seconds
    x = jax.ShapeDtypeStruct((512, 512), jnp.float32)
    text = jax.jit(lambda a, b: jnp.tanh(a @ b) + 1.0).lower(x, x).compile().as_text()
    flops, nbytes = sum(dot_flops(text).values()), hbm_bytes(text)
    assert flops == 2 * 512 ** 3 and nbytes >= 3 * 512 * 512 * 4
    for peak, bw in [(1e12, 1e11), (1e10, 1e12), (1e11, 1e11)]:
        r = roofline_seconds(text, lambda dtype: peak, bw)
        assert max(flops / peak, nbytes / bw) <= r * (1 + 1e-9) and r <= (flops / peak + nbytes / bw) * (1 + 1e-9)
    assert roofline_seconds(text, lambda dtype: 1e30, 1e11) == pytest.approx(nbytes / 1e11)
    assert roofline_seconds(text, lambda dtype: 1e9, 1e30) == pytest.approx(flops / 1e9)
    # The matmul compute-bound, the elementwise op after it bandwidth-bound: op by op is less than
    # the program's FLOP time plus its byte time (which counts the matmul's operands on top).
    peak, bw = 8e12, 1e11      # the matmul's FLOP time about its byte time: the sum counts both
    assert roofline_seconds(text, lambda dtype: peak, bw) < 0.8 * (flops / peak + nbytes / bw)



def test_cpu_compiler_moves_bfloat16_in_float32_and_a_reduce_scatter_reads_through_its_converts():
    """XLA's CPU compiler computes bfloat16 in float32: every collective of a bfloat16 step moves
    float32, a parameter's all-gather too, and a gradient it all-reduces is converted back to
    bfloat16 before a fusion stores this device's slice of it (read as the reduce-scatter a GPU
    emits, 4 bytes an element: what the plan prices on a CPU mesh)."""
    mesh = make_jax_mesh(("data",), (8,))

    def step(ws, x, v):
        loss = lambda ws: jnp.sum(jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0].astype(jnp.float32))
        return jax.grad(loss)(ws), v * 2

    ws, x = jax.ShapeDtypeStruct((4, 64, 64), jnp.bfloat16), jax.ShapeDtypeStruct((32, 64), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((64, 16), jnp.bfloat16)
    f = jax.jit(step, in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P("data")),
                                    NamedSharding(mesh, P("data"))),
                out_shardings=(NamedSharding(mesh, P(None, "data")), NamedSharding(mesh, P())))
    text = f.lower(ws, x, v).compile().as_text()
    moved = re.findall(r"= (\S+?)\[[\d,]*\]\S* (?:all-reduce|all-gather|reduce-scatter|all-to-all)\(", text)
    assert moved and set(moved) == {"f32"}, moved
    found = collectives(text, mesh)
    grads = [c for c in found if c.nbytes == 64 * 64 * 4]
    assert grads and all(c.kind == "reduce-scatter" for c in grads) and sum(c.count for c in grads) == 4, found
    assert [c.nbytes for c in found if c.kind == "all-gather"] == [64 * 16 * 4]
