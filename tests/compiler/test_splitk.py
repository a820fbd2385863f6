"""XLA's split-K choice for GPU matmuls (shardplan.compiler.splitk) against the GPU compiler itself: the
partial sums it predicts are the ones in the compiled program."""

import math
import re

import jax
import jax.numpy as jnp
import pytest

import shardplan
from shardplan.compiler import splitk, targets


@pytest.mark.parametrize("preset, m, n, k", [
    ("h100-8", 2048, 128, 512),        # an attention chunk's p @ v: split 4
    ("h100-8", 128, 512, 2048),        # its dK: split 16
    ("h100-8", 768, 768, 32768),       # a small layer's weight gradient: split 4
    ("h100-8", 4096, 4096, 1024),      # a large matmul: not split
    ("a100-8", 128, 512, 2048),        # fewer SMs, other weights: split 8
    ("h100-8", 128, 512, (4, 512)),    # two contracting dims (heads, rows): merged, then split 16
])
def test_the_split_predicted_is_the_one_the_gpu_compiler_makes(preset, m, n, k):
    if not targets.available("gpu"):
        pytest.skip("the GPU compiler is not installed (pip install 'shardplan[aot]')")
    spec = shardplan.load_mesh(preset, axes={"data": 8})
    ks = k if isinstance(k, tuple) else (k,)
    s = splitk.split_k(1, m, n, math.prod(ks), splitk.gpu_of(spec.device.name))
    mesh, _ = targets.target_mesh(spec, "gpu")
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = (jax.ShapeDtypeStruct((m, *ks), jnp.bfloat16), jax.ShapeDtypeStruct((*ks, n), jnp.bfloat16))
    contract = tuple(range(1, 1 + len(ks)))
    dot = lambda a, b: jax.lax.dot_general(a, b, ((contract, tuple(range(len(ks)))), ((), ())))
    text = jax.jit(dot, in_shardings=(whole, whole), out_shardings=whole).lower(*args).compile().as_text()
    splits = {int(x) for x in re.findall(rf"f32\[(\d+),{m},{n}\]", text)}
    assert splits == ({s} if s > 1 else set()), (s, splits)


@pytest.mark.parametrize("dtype, m, n, k", [
    (jnp.float32, 256, 128, 50304),    # a head's input gradient over a 50304 vocabulary: padded
    (jnp.bfloat16, 256, 128, 50304),
    (jnp.float32, 256, 128, 32768),    # a multiple of every split's chunk: not padded
])
def test_a_split_matmuls_contraction_is_padded_to_whole_16_byte_chunks(dtype, m, n, k):
    """XLA pads the contraction of a split matmul to a multiple of ``split`` chunks of 16 bytes,
    with zero-padded copies of both operands (``splitk.padding_bytes``): the padded shapes are
    the ones in the compiled program."""
    if not targets.available("gpu"):
        pytest.skip("the GPU compiler is not installed (pip install 'shardplan[aot]')")
    spec = shardplan.load_mesh("h100-8", axes={"data": 8})
    bits = 8 * jnp.dtype(dtype).itemsize
    s = splitk.split_k(1, m, n, k, splitk.gpu_of(spec.device.name), lhs_bits=bits, rhs_bits=bits, out_bits=bits)
    assert s > 1
    kp = splitk.padded_k(k, s, bits, bits)
    mesh, _ = targets.target_mesh(spec, "gpu")
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = (jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, n), dtype))
    text = jax.jit(jnp.matmul, in_shardings=(whole, whole), out_shardings=whole).lower(*args).compile().as_text()
    pads = set(re.findall(r"= \w+\[([\d,]+)\]\{[\d,]*\} (?:pad|fusion)\(", text))
    padded = {f"{m},{kp}", f"{kp},{n}"} & pads or {f"{kp},{m}", f"{n},{kp}"} & pads
    if kp == k:
        assert splitk.padding_bytes(1, m, n, k, s, bits, bits) == 0
        assert not re.search(r" pad\(", text)
    else:
        assert kp > k and padded, (s, kp, sorted(pads))
        assert splitk.padding_bytes(1, m, n, k, s, bits, bits) == kp * (m + n) * bits / 8


def test_no_split_off_nvidia_gpus():
    assert splitk.gpu_of("host CPU (fake device)") is None and splitk.gpu_of("TPU v5e") is None
    assert splitk.split_k(1, 128, 512, 2048, None) == 1
    assert splitk.partial_bytes(1, 128, 512, 1) == 0 and splitk.partial_bytes(2, 128, 512, 16) == 4 * 16 * 2 * 128 * 512
    assert splitk.dims_of((8, 4, 2048, 512), (8, 512, 128), (((3,), (1,)), ((0,), (0,)))) == (8, 4 * 2048, 128, 512)


def test_bf16_and_f32_matmuls_alike_pay_their_partial_sums():
    """bfloat16 is a float to the split (numpy's issubdtype says it is not: the graph's bf16
    matmuls once went unpriced); integer matmuls are not split."""
    gpu = splitk.gpu_of("NVIDIA H100 SXM5 80GB")
    for dtype in (jnp.bfloat16, jnp.float32):
        assert splitk.partials(gpu, 1, 128, 512, 2048, dtype, dtype, dtype) > 0
    assert splitk.partials(gpu, 1, 128, 512, 2048, jnp.int8, jnp.int8, jnp.int32) == 0
    assert splitk.partials(None, 1, 128, 512, 2048, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16) == 0



def test_partial_sums_count_in_memory_while_their_matmul_runs():
    """The weight gradient of a 768 x 768 layer over 32768 tokens is split 4 ways on an H100
    unsharded: its float32 partial sums (4 x 768 x 768 floats, with the heap's allowance) are
    live at the points of the schedule where it runs, and nowhere else; on a CPU mesh, none.
    XLA sums them inside the kernel of the update ``w - 0.1 * g`` (checked below on the GPU
    compiler), which reads no other matmul, so nothing makes them wait for it."""
    from shardplan.compiler.cost import shared_model
    from shardplan.sharding.rules import apply_rule
    from shardplan.sharding.strategies import Enumerator
    from shardplan.tracing.walk import build_graph

    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
        return w - 0.1 * g, loss
    closed = jax.make_jaxpr(step)(jax.ShapeDtypeStruct((768, 768), jnp.float32),
                                  jax.ShapeDtypeStruct((32768, 768), jnp.float32))
    for preset, split in (("h100-8", 4), ("cpu-8", 1)):
        mesh = shardplan.load_mesh(preset)
        g = build_graph(closed, ["w", "x"], apply_rule, device=mesh.device.name, num_points=64)
        problem, _ = Enumerator(g, shared_model(mesh))._full_nodes()
        (k,) = [k for k, d in enumerate(g.dots) if g.tensors[d.out].shape == (768, 768)]     # x^T @ dy
        node = problem.nodes[problem.node_of_dot[k]]
        unsharded = node.options.index(((),) * len(node.options[0]))
        running = [p for p, ops in enumerate(g.running) if g.dots[k].out in ops]
        assert not any(g.dots[k].out in ops for ops in g.held)
        assert running and len(running) < len(g.points)
        assert splitk.split_k(1, 768, 768, 32768, splitk.gpu_of(mesh.device.name)) == split
        want = 4 * split * 768 * 768 * (1 + mesh.device.heap_overhead) if split > 1 else 0.0
        assert node.memory[running, unsharded] == pytest.approx([want] * len(running))
        assert not node.memory[[p for p in range(len(g.points)) if p not in running]].any()
    if targets.available("gpu"):
        spec = shardplan.load_mesh("h100-8", axes={"data": 8})
        whole = jax.sharding.NamedSharding(targets.target_mesh(spec, "gpu")[0], jax.sharding.PartitionSpec())
        text = jax.jit(step, in_shardings=(whole, whole), out_shardings=(whole, whole)).lower(
            *(jax.ShapeDtypeStruct(s, jnp.float32) for s in ((768, 768), (32768, 768)))).compile().as_text()
        assert [b for b in re.findall(r"\n%fused\S* .*?\n}\n", text, re.S)
                if "subtract(" in b and "f32[4,768,768]" in b and "reduce(" in b]


@pytest.mark.parametrize("m, n, k", [
    (512, 64, 192),       # split 4: both sets summed in the add's kernel, live together
    (64, 192, 512),       # split 8: the same
    (128, 512, 2048),     # split 16: each set reduced by a kernel of its own, one live at a time
])
def test_a_small_splits_partial_sums_wait_for_their_reader(m, n, k):
    """``a @ w1 + b @ w2`` on an H100: with a split of at most 8, XLA sums both matmuls' partial
    sums inside the add's kernel, so both sets are live when the second matmul runs (the compiled
    heap holds two); with a larger one, it reduces each set by a kernel of its own right after
    its matmul (one set). The model holds the first matmul's partial sums at the second's point
    exactly when XLA does."""
    from shardplan.compiler.cost import shared_model
    from shardplan.sharding.rules import apply_rule
    from shardplan.sharding.strategies import Enumerator
    from shardplan.tracing.walk import build_graph

    spec = shardplan.load_mesh("h100-8", axes={"data": 8})
    s = splitk.split_k(1, m, n, k, splitk.gpu_of(spec.device.name), lhs_bits=32, rhs_bits=32, out_bits=32)
    summed_in_reader = s <= splitk.SUMMED_IN_READER
    step = lambda a, b, w1, w2: a @ w1 + b @ w2
    args = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in ((m, k), (m, k), (k, n), (k, n))]

    g = build_graph(jax.make_jaxpr(step)(*args), list("abcd"), apply_rule, device=spec.device.name, num_points=64)
    problem, _ = Enumerator(g, shared_model(spec))._full_nodes()
    first, second = g.dots
    at_second = [p for p, ops in enumerate(g.running) if second.out in ops]
    node = problem.nodes[problem.node_of_dot[0]]
    unsharded = node.options.index(((),) * len(node.options[0]))
    held = [node.memory[p, unsharded] for p in at_second]
    want = 4.0 * s * m * n * (1 + spec.device.heap_overhead) if summed_in_reader else 0.0
    assert at_second and held == pytest.approx([want] * len(at_second))

    if not targets.available("gpu"):
        pytest.skip("the GPU compiler is not installed (pip install 'shardplan[aot]')")
    mesh, _ = targets.target_mesh(spec, "gpu")
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    compiled = jax.jit(step, in_shardings=(whole,) * 4, out_shardings=whole).lower(*args).compile()
    bodies = re.findall(r"\n%fused\S* .*?\n}\n", compiled.as_text(), re.S)
    reduces = sorted(n for n in (len(re.findall(r"reduce\(%param", b)) for b in bodies) if n)
    assert reduces == ([2] if summed_in_reader else [1, 1]), reduces
    partial_sums = 4 * s * m * n
    assert compiled.memory_analysis().temp_size_in_bytes == pytest.approx(
        (2 if summed_in_reader else 1) * partial_sums, rel=0.05)


def _scanned_data_parallel_step():
    """Two weight matrices per layer in a scan over 4 layers, the batch split over 8 devices: each
    layer's two weight gradients (64 x 192 over 512 tokens per device: split 8 on an H100 and an
    A100) are all-reduced over ``data`` in one combined collective per trip."""
    def step(ws, x):
        def loss(ws):
            def body(h, w):
                return jnp.tanh(h @ w[0]) @ w[1], None
            return jnp.mean(jax.lax.scan(body, x, ws)[0] ** 2)
        value, grads = jax.value_and_grad(loss)(ws)
        return jax.tree.map(lambda w, g: w - 0.1 * g, ws, grads), value
    args = ((jax.ShapeDtypeStruct((4, 64, 192), jnp.float32), jax.ShapeDtypeStruct((4, 192, 64), jnp.float32)),
            jax.ShapeDtypeStruct((4096, 64), jnp.float32))
    return step, args


@pytest.mark.parametrize("preset, together", [("h100-8", True), ("a100-8", False)])
def test_hoppers_scheduler_keeps_the_combined_gradients_partial_sums_together(preset, together, tmp_path):
    """On an H100 the GPU compiler runs a scan body's weight-gradient matmuls, then all their
    split-K reductions, then the one all-reduce of their concatenation: both layers' partial sums
    (f32[8,64,192] and f32[8,192,64]) are live at once. On an A100 each reduction follows its
    matmul. The model holds the first matmul's partial sums where the last one runs on the H100
    alone, and only for the options whose gradient is reduced (liveness.combined_matmuls)."""
    from shardplan.compiler.cost import shared_model
    from shardplan.compiler.pricing import dot_specs
    from shardplan.sharding.rules import apply_rule
    from shardplan.sharding.strategies import Enumerator
    from shardplan.tracing.walk import build_graph

    step, args = _scanned_data_parallel_step()
    spec = shardplan.load_mesh(preset, axes={"data": 8})
    s = splitk.split_k(1, 64, 192, 512, splitk.gpu_of(spec.device.name))
    assert s == 8
    g = build_graph(jax.make_jaxpr(step)(*args), ["w1", "w2", "x"], apply_rule, device=spec.device.name)
    grads = [k for k, d in enumerate(g.dots) if g.loop_of[d.out] and g.tensors[d.out].shape in ((64, 192), (192, 64))]
    assert len(grads) == 2
    waiting = [p for p, ops in enumerate(g.combining) if ops]
    if not together:
        assert not waiting
    else:
        (point,) = waiting
        first = [k for k in grads if g.dots[k].out in g.combining[point]]
        assert len(first) == 1 and g.dots[first[0]].out not in g.running[point]
        enumerator = Enumerator(g, shared_model(spec))
        problem, _ = enumerator._full_nodes()
        node = problem.nodes[problem.node_of_dot[first[0]]]
        for o, option in enumerate(node.options):
            reduced = bool(dot_specs(g.dots[first[0]], option)[3])
            split = enumerator.price.split_k(g.dots[first[0]], option)[-1]
            want = 4.0 * split * 64 * 192 * (1 + spec.device.heap_overhead) if reduced and split > 1 else 0.0
            assert node.memory[point, o] == pytest.approx(want), option

    if not targets.available("gpu"):
        pytest.skip("the GPU compiler is not installed (pip install 'shardplan[aot]')")
    mesh, _ = targets.target_mesh(spec, "gpu")
    rep, split_batch = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*p)) for p in ((), ("data",)))
    jax.jit(step, in_shardings=((rep, rep), split_batch), out_shardings=((rep, rep), rep)).lower(*args).compile(
        compiler_options={"xla_dump_to": str(tmp_path)})
    from shardplan.compiler import footprint
    partials = [b for b in footprint.dumped_heap(str(tmp_path)).buffers
                if re.match(r"f32\[8,(64,192|192,64)\]", b[3]) and any("gemm" in n for n in b[4])]
    assert len(partials) == 2, partials
    (_, s1, e1, *_), (_, s2, e2, *_) = partials
    assert (max(s1, s2) <= min(e1, e2)) == together, partials
