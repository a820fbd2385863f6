"""Which tensors the memory model holds live, against what XLA's GPU compiler stores."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

import shardplan
from shardplan import targets
from shardplan.models.train import reference
from shardplan.rules import apply_rule
from shardplan.walk import build_graph

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
    ("float32", "tpu", True),
    ("bfloat16", "gpu", True),     # not float32 or float16: expensive to the GPU compiler too
])
def test_exp_read_twice_is_stored_unless_the_gpu_recomputes_it(dtype, compiler, stored):
    def f(s, v):
        e = jnp.exp(s @ s)
        return (e.sum(-1, keepdims=True) * (e * 2.0)) @ v

    x = jax.ShapeDtypeStruct((N, N), jnp.dtype(dtype))
    live = _live(f, x, x, compiler=compiler)
    assert (((N, N), dtype, "exp") in live) == stored, live


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


@pytest.mark.parametrize("compiler,stored", [("gpu", "float32"), ("cpu", "bfloat16")])
def test_a_matmul_operands_convert_runs_inside_the_gpu_gemm(compiler, stored):
    # The GPU compiler converts a dot's operand inside the GEMM kernel (a Triton GEMM fusion): the
    # float32 tensor before the convert is stored. Other compilers store the converted one.
    def f(x, w):
        h = jnp.tanh(x @ x)                                  # float32, read only by the convert
        return (h.astype(jnp.bfloat16) @ w).sum()

    live = _live(f, jax.ShapeDtypeStruct((N, N), jnp.float32), jax.ShapeDtypeStruct((N, N), jnp.bfloat16),
                 compiler=compiler)
    names = {(dtype, name) for shape, dtype, name in live if shape == (N, N)}
    other = "bfloat16" if stored == "float32" else "float32"
    assert any(d == stored and n in ("tanh", "convert_element_type") for d, n in names), names
    assert not any(d == other and n in ("tanh", "convert_element_type") for d, n in names), names


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
    y = jnp.sin(x) * 2.0                       # stored: a matmul reads it
    a = y.T @ y                                # [N, N], read only by the transpose and the add
    z = jnp.tanh(x @ w)                        # the work between
    return (a.T + z.T @ z).sum()


@pytest.mark.parametrize("compiler", ["tpu", "gpu", "cpu"])
def test_a_matmul_read_only_by_an_add_runs_in_the_adds_kernel_on_a_tpu(compiler):
    # libtpu fuses a matmul into its elementwise consumer (a convolution fusion): the matmul's
    # result is never stored, and it runs where the add runs, so its operand y lives until then,
    # beside z. A tied embedding's head gradient does this across the whole backward loop
    # (RESULTS.md, session 29). Other compilers store the result and free y at the matmul.
    args = (jax.ShapeDtypeStruct((4 * N, N), jnp.float32), jax.ShapeDtypeStruct((N, N), jnp.float32))
    g = build_graph(jax.make_jaxpr(_tied_step)(*args), ["x", "w"], apply_rule, compiler=compiler, num_points=64)
    named = lambda p, name: any(g.tensors[t].name == name and g.tensors[t].shape == (4 * N, N) for t in p)  # noqa: E731
    together = any(named(p, "mul") and named(p, "tanh") for p in g.points)       # y beside z
    (a,) = [d.out for d in g.dots if [r for r, _ in g.readers.get(d.out, [])] == ["transpose"]]
    assert together == (compiler == "tpu")
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
