"""Which tensors the memory model holds live, against what XLA's GPU compiler stores."""

import dataclasses
import re
import tempfile

import jax
import jax.numpy as jnp
import pytest

import shardplan
from shardplan.compiler import targets
from shardplan.models.train import reference
from shardplan.sharding.rules import apply_rule
from shardplan.tracing.walk import build_graph

N = 512


def _live(f, *args, compiler="cpu"):
    """(shape, dtype, name) of the tensors live at the fullest points of ``f``'s schedule."""
    g = build_graph(jax.make_jaxpr(f)(*args), [f"a{k}" for k in range(len(args))], apply_rule, compiler=compiler)
    return {(tuple(g.tensors[t].shape), str(g.tensors[t].dtype), g.tensors[t].name) for p in g.points for t in p}


def test_an_operand_an_inlined_call_never_reads_holds_no_memory():
    # jnp.where's transpose passes the unselected branch to a jit call that never reads it.
    @jax.jit
    def inner(a, unused):
        return jnp.tanh(a @ a)

    def f(x):
        big = jnp.zeros((4 * N, 4 * N)) + x[0, 0]     # stored: its only reader is the call
        return inner(x, big).sum()

    live = _live(f, jax.ShapeDtypeStruct((N, N), jnp.float32))
    assert all(shape != (4 * N, 4 * N) for shape, _, _ in live), live


@pytest.mark.parametrize("dtype,compiler,stored", [
    ("float32", "gpu", False),     # one instruction on a GPU: computed again in each reader
    ("float32", "cpu", True),
    # libtpu computes it again in each reader (the test of the TPU's matmul prologues below); the
    # product is stored instead (the compiled program stores the exp in the product's matmul
    # kernel: the same bytes)
    ("float32", "tpu", False),
    ("bfloat16", "gpu", True),     # not float32 or float16: expensive to the GPU compiler too
])
def test_exp_read_twice_is_stored_unless_the_gpu_recomputes_it(dtype, compiler, stored):
    def f(s, v):
        e = jnp.exp(s @ s)
        return (e.sum(-1, keepdims=True) * (e * 2.0)) @ v

    x = jax.ShapeDtypeStruct((N, N), jnp.dtype(dtype))
    live = _live(f, x, x, compiler=compiler)
    assert (((N, N), dtype, "exp") in live) == stored, live


@pytest.mark.slow
@pytest.mark.skipif(not targets.available("gpu"), reason="needs the GPU compiler: pip install 'shardplan[aot]'")
def test_recomputed_softmax_memory_against_the_gpu_compiler():
    # Attention saved by dots_all: the backward pass recomputes the softmax's exp, which the GPU
    # compiler fuses into each of its readers (was predicted stored: +25.9%, now -9.9%).
    ref = reference("llama-tiny", scan=True, seq_len=2048)
    base = shardplan.load_mesh("h200-8")
    mesh = dataclasses.replace(base, name="h200-1", axes=(dataclasses.replace(base.axes[0], size=1),),
                               devices_per_node=1)
    state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(4, abstract=True)
    step = shardplan.auto(ref.train_step, mesh=mesh, donate_argnums=(0,), remat="dots_all")
    audit = step.audit_for("gpu", state, batch)
    assert abs(audit.memory_error()) < 0.15, audit.table()


@pytest.mark.parametrize("compiler,stored", [("gpu", "bfloat16"), ("cpu", "float32")])
def test_a_matmul_operands_widening_convert_runs_inside_the_gpu_gemm(compiler, stored):
    # The GPU compiler converts a dot's operand inside the GEMM kernel (a Triton GEMM fusion) when
    # the convert widens it: the bfloat16 tensor before the convert is stored. Other compilers
    # store the converted one.
    def f(x, w):
        h = jnp.tanh(x @ x)                                  # bfloat16, read only by the convert
        return (h.astype(jnp.float32) @ w).sum()

    live = _live(f, jax.ShapeDtypeStruct((N, N), jnp.bfloat16), jax.ShapeDtypeStruct((N, N), jnp.float32),
                 compiler=compiler)
    names = {(dtype, name) for shape, dtype, name in live if shape == (N, N)}
    other = "bfloat16" if stored == "float32" else "float32"
    assert any(d == stored and n in ("tanh", "convert_element_type") for d, n in names), names
    assert not any(d == other and n in ("tanh", "convert_element_type") for d, n in names), names


@pytest.mark.parametrize("compiler", ["gpu", "cpu"])
def test_a_narrowing_convert_is_stored_converted_on_every_compiler(compiler):
    # XLA's GPU compiler keeps a narrowing convert (float32 to bfloat16) out of the GEMM
    # ("Narrowing conversion"): the producer's kernel writes the bfloat16 result, as XLA stores a
    # softmax's probabilities (llama3-8b on an H200: bf16[2,32,8192,8192], not float32).
    def f(s, v):
        e = jnp.exp(s @ s)
        probs = e / e.sum(-1, keepdims=True)                  # float32, read only by the convert
        return (probs.astype(jnp.bfloat16) @ v).sum()

    live = _live(f, jax.ShapeDtypeStruct((N, N), jnp.float32), jax.ShapeDtypeStruct((N, N), jnp.bfloat16),
                 compiler=compiler)
    names = {(dtype, name) for shape, dtype, name in live if shape == (N, N)}
    assert ("bfloat16", "convert_element_type") in names, names
    assert ("float32", "div") not in names, names


@pytest.mark.skipif(not targets.available("gpu"), reason="needs the GPU compiler: pip install 'shardplan[aot]'")
def test_the_gpu_compiler_keeps_a_narrowing_convert_out_of_the_gemm():
    """What the two tests above model, on XLA's GPU compiler: a float32 softmax converted to
    bfloat16 for a matmul is stored as bfloat16; a bfloat16 operand widened for a float32 matmul
    is read by the GEMM unconverted."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardplan.compiler import footprint
    mesh = targets.target_mesh(shardplan.load_mesh("h200-8"), "gpu")[0]

    def stored(f, a, b):
        args = [jax.ShapeDtypeStruct(shape, jnp.dtype(d), sharding=NamedSharding(mesh, P()))
                for shape, d in (((4 * N, 4 * N), a), ((4 * N, N), b))]
        with tempfile.TemporaryDirectory() as folder:
            jax.jit(f).lower(*args).compile(compiler_options={"xla_dump_to": folder})
            heap = footprint.dumped_heap(folder)
        return {shape.split("[")[0] for _, _, _, shape, _ in heap.at_peak if f"[{4 * N},{4 * N}]" in shape}

    def narrowing(s, v):
        e = jnp.exp(s @ s)
        return ((e / e.sum(-1, keepdims=True)).astype(jnp.bfloat16) @ v).sum()

    def widening(x, w):
        return (jnp.tanh(x @ x).astype(jnp.float32) @ w).sum()

    # the float32 product s @ s (read by the sum and the division) and the bfloat16 probabilities
    assert stored(narrowing, "float32", "bfloat16") == {"f32", "bf16"}
    assert stored(widening, "bfloat16", "float32") == {"bf16"}


@pytest.mark.parametrize("compiler,together", [("gpu", 2), ("cpu", 1)])
def test_a_softmax_kernel_shares_no_buffer_on_a_gpu(compiler, together):
    # A result computed from a tensor and a row reduction of it (a softmax) takes over that
    # tensor's buffer where it dies, except on a GPU: XLA's GPU compiler runs the diamond in one
    # Triton kernel, which reads the tensor while it writes the result (test_sequence's attention).
    def f(x, w):
        y = x @ x
        e = jnp.exp(y - y.max(-1, keepdims=True))
        return ((e / e.sum(-1, keepdims=True)) @ w).sum()

    x, w = jax.ShapeDtypeStruct((N, N), jnp.float32), jax.ShapeDtypeStruct((N, 1), jnp.float32)
    g = build_graph(jax.make_jaxpr(f)(x, w), ["x", "w"], apply_rule, compiler=compiler)
    most = max(sum(g.tensors[t].shape == (N, N) and g.tensors[t].name != "x" for t in p) for p in g.points)
    assert most == together, [[g.tensors[t].name for t in p] for p in g.points]


def test_a_loops_result_takes_over_its_carrys_initial_buffer():
    """A ``scan`` runs in its carry's initial buffer when nothing reads it after the loop: the
    initial value and the result are one buffer, not two (XLA's buffer assignment puts a
    pipeline's weight-gradient accumulator, its zeros and the loop's result in one slot: GPT-3
    175B on 1024 A100s, RESULTS.md, sessions 25 and 27). Read after the loop, it is copied."""
    def f(x, kept):
        acc = jnp.zeros((4 * N, 4 * N)) + x[0, 0]            # made here, dies at the loop
        out, _ = jax.lax.scan(lambda a, w: (a + jnp.tanh(w[0, 0]), None), acc, x[None].repeat(3, 0))
        return out.sum() + (acc.sum() if kept else 0.0)

    x = jax.ShapeDtypeStruct((N, N), jnp.float32)
    for kept, buffers in ((False, 1), (True, 2)):
        g = build_graph(jax.make_jaxpr(lambda x: f(x, kept))(x), ["x"], apply_rule)
        big = [t for t in g.points[0] if g.tensors[t].shape == (4 * N, 4 * N)]
        assert len(big) == buffers, (kept, [g.tensors[t].name for t in big])

    def unread(x):
        """The carry feeds the loop's other result but its own is never read (a backward loop's
        cotangent of an input not differentiated): its buffer still lives through the loop."""
        acc = jnp.zeros((4 * N, 4 * N)) + x[0, 0]

        def body(c, w):
            held = c[0] @ c[0]                              # a temporary of the body, as large
            return (c[0] * w[0, 0], c[1] + held.sum()), None
        (_, total), _ = jax.lax.scan(body, (acc, 0.0), x[None].repeat(3, 0))
        return total

    g = build_graph(jax.make_jaxpr(unread)(x), ["x"], apply_rule)
    big = [t for t in g.points[0] if g.tensors[t].shape == (4 * N, 4 * N)]
    assert len(big) == 2, [g.tensors[t].name for t in big]          # the carry's buffer and the temporary


def _tuple_results(f, *args):
    g = build_graph(jax.make_jaxpr(f)(*args), [f"a{k}" for k in range(len(args))], apply_rule, compiler="tpu")
    return g.tuple_results


def test_the_walk_counts_the_kernels_xla_gives_several_results():
    x = jax.ShapeDtypeStruct((64, N), jnp.float32)

    def adam_like(p, g, m, v):      # new parameter and moments from one gradient: one kernel, three results
        m2, v2 = 0.9 * m + 0.1 * g, 0.99 * v + 0.01 * g * g
        return p - m2 / (jnp.sqrt(v2) + 1e-8), m2, v2

    assert _tuple_results(adam_like, x, x, x, x) == 1

    def norm_stats(a):              # mean and mean square of one tensor: sibling reductions, one kernel
        return a.mean(-1), (a * a).mean(-1)

    assert _tuple_results(norm_stats, x) == 1

    def dependent(a, w):            # the second sum waits on the first through a matmul: two kernels
        s = jnp.tanh(a).sum(-1, keepdims=True)
        return s, (a + (s * a) @ w).sum(-1)

    assert _tuple_results(dependent, x, jax.ShapeDtypeStruct((N, N), jnp.float32)) == 0

    def scanned(c, xs):             # a loop: one tuple of its state
        return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), c, xs)[0]

    assert _tuple_results(scanned, x, jax.ShapeDtypeStruct((3, N, N), jnp.float32)) == 1


def _tied_step(x, w):
    """A weight read twice, its two gradients added late: ``a`` is a matmul read only by the add
    (transposed on the way), computed long before the other term."""
    y = jnp.sort(x, axis=0)                    # stored: no kernel computes it inside another
    a = y.T @ y                                # [N, N], read only by the transpose and the add
    z = jnp.tanh(x @ w)                        # the work between
    return (a.T + z.T @ z).sum()


@pytest.mark.parametrize("compiler", ["tpu", "gpu", "cpu"])
def test_a_matmul_read_only_by_an_add_runs_in_the_adds_kernel_on_a_tpu(compiler):
    # libtpu fuses a matmul into its elementwise consumer (a convolution fusion): the matmul's
    # result is never stored, and it runs where the add runs, so its operand y lives until then,
    # beside z. A tied embedding's head gradient does this across the whole backward loop
    # (RESULTS.md, session 29). The GPU compiler's scheduler runs the matmul right before the add
    # (the test below): y lives until then too, the result is stored there. The CPU compiler
    # runs it where it is written, stores the result and frees y there.
    args = (jax.ShapeDtypeStruct((4 * N, N), jnp.float32), jax.ShapeDtypeStruct((N, N), jnp.float32))
    g = build_graph(jax.make_jaxpr(_tied_step)(*args), ["x", "w"], apply_rule, compiler=compiler, num_points=64)
    named = lambda p, name: any(g.tensors[t].name == name and g.tensors[t].shape == (4 * N, N) for t in p)  # noqa: E731
    # y beside z (on a TPU z's tanh runs inside the matmul reading it: x @ w is stored)
    together = any(named(p, "sort") and (named(p, "tanh") or named(p, "dot_general")) for p in g.points)
    (a,) = [d.out for d in g.dots if [r for r, _ in g.readers.get(d.out, [])] == ["transpose"]]
    assert together == (compiler in ("tpu", "gpu"))
    assert (a in g.fused) == (compiler == "tpu")

    if compiler == "tpu" and targets.available("tpu"):
        import numpy as np
        topo = targets._topology("tpu", "", "v5e:2x2")
        chip = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(topo.devices[:1]), ("d",)),
                                          jax.sharding.PartitionSpec())
        placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=chip) for a in args]
        text = jax.jit(_tied_step).lower(*placed).compile().as_text()
        bodies = re.findall(r"\n%fused\S* .*?\n}\n", text, re.S)
        assert any("convolution(" in b and " add(" in b for b in bodies)


def _cross_entropy_grad(h, w, labels, read_twice=False):
    """A cross entropy's gradient through bfloat16 logits converted to float32: the gather of the
    label logits transposes to a scatter-add into zeros, added to the softmax term (``read_twice``:
    the scatter's result is read by a sum too, as a hand-written log-softmax gradient does)."""
    def loss(h):
        logits = (h @ w).astype(jnp.float32)
        if read_twice:
            lp = jax.nn.log_softmax(logits)
            return -jnp.take_along_axis(lp, labels[:, None], axis=1).sum()
        import optax
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return jax.grad(loss)(h)


_CE_ARGS = (jax.ShapeDtypeStruct((N, 64), jnp.bfloat16), jax.ShapeDtypeStruct((64, 8 * N), jnp.bfloat16),
            jax.ShapeDtypeStruct((N,), jnp.int32))


@pytest.mark.parametrize("compiler", ["cpu", "gpu", "tpu"])
def test_a_cross_entropys_float32_logits_are_converted_inside_their_readers_kernels(compiler):
    # The float32 logits are read by the gather of the label logits, the row maximum and the
    # softmax: XLA converts them inside each of those kernels (a gather fuses its operand's
    # elementwise producer), so only the bfloat16 logits are stored. Was predicted stored:
    # +76% on a bf16 MoE of the seeded corpus (seed 25, GPU).
    # libtpu's gather is a kernel of its own: there they are stored for it (the test below).
    g = build_graph(jax.make_jaxpr(_cross_entropy_grad)(*_CE_ARGS), ["h", "w", "labels"], apply_rule,
                    compiler=compiler)
    (logits,) = [t for t, x in enumerate(g.tensors) if x.shape == (N, 8 * N) and g.readers.get(t)
                 and "gather" in [r for r, _ in g.readers[t]]]
    assert g.tensors[logits].name.endswith("convert_element_type")
    assert (logits in g.fused) == (compiler != "tpu")


@pytest.mark.parametrize("compiler", ["cpu", "gpu", "tpu"])
def test_a_scatter_add_into_zeros_runs_in_place_on_the_other_addend_of_its_one_add(compiler):
    # XLA's algebraic simplifier: add(scatter-add(zeros, I, U), A) -> scatter-add(A, I, U) on the
    # CPU and GPU compilers: neither the zeros nor the scatter's own result is stored, the add's
    # result (the scatter, in A's buffer) is. libtpu computes the scatter as a compare-select
    # inside the add's kernel, itself inside the matmuls that read the gradient: nothing stored.
    g = build_graph(jax.make_jaxpr(_cross_entropy_grad)(*_CE_ARGS), ["h", "w", "labels"], apply_rule,
                    compiler=compiler)
    big = {t: x for t, x in enumerate(g.tensors) if x.shape == (N, 8 * N)}
    (scatter,) = [t for t, x in big.items() if x.name.endswith("scatter-add")]
    (add,) = [t for t, x in big.items() if x.name.endswith("add_any")]
    assert scatter in g.fused
    assert (add in g.fused) == (compiler == "tpu")
    # A scatter-add read twice (a hand-written log-softmax gradient) is left as written.
    g = build_graph(jax.make_jaxpr(lambda *a: _cross_entropy_grad(*a, read_twice=True))(*_CE_ARGS),
                    ["h", "w", "labels"], apply_rule, compiler=compiler)
    (scatter,) = [t for t, x in enumerate(g.tensors) if x.name.endswith("scatter-add") and x.shape == (N, 8 * N)]
    assert scatter not in g.fused


def _tpu_heap(f, *args):
    """The [2048, 2048]-or-larger buffers of ``f``'s heap at its peak as libtpu lays it out for
    one v5e chip (HBM alone, :data:`targets.HBM_ONLY_OPTIONS`): ``{(dtype, bytes)}``."""
    import numpy as np

    from shardplan.compiler import footprint
    topo = targets._topology("tpu", "", "v5e:2x2")
    chip = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(topo.devices[:1]), ("d",)),
                                      jax.sharding.PartitionSpec())
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=chip) for a in args]
    with tempfile.TemporaryDirectory() as folder:
        jax.jit(f).lower(*placed).compile(compiler_options={**targets.HBM_ONLY_OPTIONS["tpu"], "xla_dump_to": folder})
        heap = footprint.dumped_heap(folder)
    return sorted((shape.split("[")[0], size) for size, _, _, shape, _ in heap.at_peak if size >= 8 * N * N)


def _softmax_into_matmul(s, v):
    e = jnp.exp(s @ s)
    return ((e / e.sum(-1, keepdims=True)).astype(jnp.bfloat16) @ v).sum()


def _tanh_into_matmul(x, w):
    return (jnp.tanh(x @ x).astype(jnp.float32) @ w).sum()


_BIG = (4 * N, 4 * N)
_PROLOGUES = [  # (step, its args, the big tensors of its heap's peak on a TPU: (dtype, bytes))
    (_softmax_into_matmul, (jax.ShapeDtypeStruct(_BIG, jnp.float32), jax.ShapeDtypeStruct((4 * N, N), jnp.bfloat16)),
     [("f32", 64 * N * N)]),
    (_tanh_into_matmul, (jax.ShapeDtypeStruct(_BIG, jnp.bfloat16), jax.ShapeDtypeStruct((4 * N, N), jnp.float32)),
     [("bf16", 32 * N * N)]),
]


@pytest.mark.parametrize("case", range(len(_PROLOGUES)))
def test_a_tpu_computes_a_matmul_operands_elementwise_chain_inside_the_matmul(case):
    # libtpu's convolution fusion takes a matmul operand's producers into the matmul's kernel:
    # a float32 softmax narrowed to bfloat16, a tanh widened to float32, the exp (expensive, read
    # by the row sum too) computed again there. Only the matmul's own result is stored (the
    # compiled heap's peak: one [2048, 2048] buffer; predicted before: two or three, +50-200%).
    f, args, heap = _PROLOGUES[case]
    g = build_graph(jax.make_jaxpr(f)(*args), ["a", "b"], apply_rule, compiler="tpu")
    most = max(sorted((str(g.tensors[t].dtype), g.tensors[t].nbytes) for t in p
                      if g.tensors[t].shape == _BIG and t >= len(args)) for p in g.points)
    assert [(d.replace("float32", "f32").replace("bfloat16", "bf16"), b) for d, b in most] == heap, most
    if targets.available("tpu"):
        assert _tpu_heap(f, *args) == heap


def test_a_tpu_computes_a_cross_entropys_gradient_inside_both_backward_matmuls():
    # The gradient of the logits (the softmax, the label's compare-select, the convert to
    # bfloat16) is computed inside the kernels of both matmuls that read it (the input's and the
    # weight's gradients): the bfloat16 logits are stored, and, the loss itself being returned
    # (as a train step does), the float32 logits for the label gather, a kernel of its own, from
    # the head's matmul to that gather only. Seed 43 of the TPU corpus: +76.7% before.
    def loss(h, w, labels):
        import optax
        return optax.softmax_cross_entropy_with_integer_labels((h @ w).astype(jnp.float32), labels).mean()

    def f(h, w, labels):
        return jax.value_and_grad(loss, argnums=(0, 1))(h, w, labels)

    args = (jax.ShapeDtypeStruct((4 * N, 64), jnp.bfloat16), jax.ShapeDtypeStruct((64, 4 * N), jnp.bfloat16),
            jax.ShapeDtypeStruct((4 * N,), jnp.int32))
    g = build_graph(jax.make_jaxpr(f)(*args), ["h", "w", "labels"], apply_rule, compiler="tpu")
    big = [sorted((str(g.tensors[t].dtype), g.tensors[t].name) for t in p if g.tensors[t].shape == _BIG)
           for p in g.points]
    assert max(big, key=len) == [("bfloat16", "jvp()/dot_general"), ("float32", "jvp()/convert_element_type")]
    if targets.available("tpu"):
        assert _tpu_heap(f, *args) == [("bf16", 32 * N * N), ("f32", 64 * N * N)]


def _zeros_stored(text: str) -> bool:
    """Whether a compiled program stores a zero-filled float32 [N, 8N]: a broadcast (or a kernel)
    of a constant or of nothing."""
    entry = text[text.index("\nENTRY"):]
    consts = set(re.findall(r"%(\S+) = f32\[\] constant\(0\)", entry))
    made = re.findall(rf"= f32\[{N},{8 * N}\]\S* (?:fusion|broadcast)\(%?([^,)]*)\)", entry)
    return any(not m or m in consts or m.startswith("constant") for m in made)


@pytest.mark.parametrize("compiler", ["cpu", "gpu"])
def test_the_compilers_scatter_into_the_softmax_term_not_into_zeros(compiler):
    """What the two tests above model, on the compilers: the program of the cross entropy's
    gradient stores no zero-filled [N, 8N] (the scatter runs in the softmax term's buffer), the
    one with the scatter read twice does."""
    if compiler == "gpu" and not targets.available("gpu"):
        pytest.skip("needs the GPU compiler: pip install 'shardplan[aot]'")
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    if compiler == "gpu":
        mesh = targets.target_mesh(shardplan.load_mesh("h100-8"), "gpu")[0]
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())) for a in _CE_ARGS]
    else:
        args = _CE_ARGS

    def text(read_twice):
        return jax.jit(lambda *a: _cross_entropy_grad(*a, read_twice=read_twice)).lower(*args).compile().as_text()
    assert not _zeros_stored(text(False))
    assert _zeros_stored(text(True))


def _added_after_a_loop(x, w, ws):
    """A matmul read only by an add after a loop, written before the loop."""
    a = x.T @ x                                                      # [N, N]
    z, _ = jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x @ w, ws)
    return (a.T + z.T @ z).sum()


@pytest.mark.parametrize("compiler", ["gpu", "cpu"])
def test_the_gpu_compiler_runs_a_matmul_read_by_a_later_add_right_before_the_add(compiler):
    """XLA's GPU scheduler places the matmul next to its one reader, after the loop; the CPU
    compiler runs it where it is written. The model (liveness._late_matmuls) and the compiled
    programs' buffers: the [N, N] result's first step against the loop's last."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardplan.compiler import footprint
    shapes = ((4 * N, N), (N, N), (3, N, N))
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    g = build_graph(jax.make_jaxpr(_added_after_a_loop)(*args), ["x", "w", "ws"], apply_rule, compiler=compiler,
                    num_points=64)
    (a,) = [d.out for d in g.dots if [r for r, _ in g.readers.get(d.out, [])] == ["transpose"]]
    carry = [t for t, x in enumerate(g.tensors) if x.shape == (4 * N, N) and x.name.endswith("scan")]
    held_through_the_loop = any(a in p and any(c in p for c in carry) for p in g.points)
    assert held_through_the_loop == (compiler == "cpu")
    if compiler == "gpu":
        if not targets.available("gpu"):
            pytest.skip("needs the GPU compiler: pip install 'shardplan[aot]'")
        mesh = targets.target_mesh(shardplan.load_mesh("h100-8"), "gpu")[0]
        args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, P())) for s in shapes]
    with tempfile.TemporaryDirectory() as folder:
        jax.jit(_added_after_a_loop).lower(*args).compile(compiler_options={"xla_dump_to": folder})
        heap = footprint.dumped_heap(folder)
    loop_end = max(last for _, _, last, shape, _ in heap.buffers if shape.startswith("(s32[]"))
    square = [first for _, first, _, shape, _ in heap.buffers if shape.startswith(f"f32[{N},{N}]")
              or shape.startswith(f"f32[8,{N},{N}]")]
    assert (min(square) > loop_end) == (compiler == "gpu"), (square, loop_end)
