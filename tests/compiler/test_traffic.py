"""HBM traffic as a plan is priced (shardplan.compiler.traffic.hbm_traffic): a scan's stacked residuals
and what XLA fuses away."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import pytest

import shardplan
from shardplan.compiler import targets
from shardplan.compiler.traffic import copied_slices, hbm_traffic
from shardplan.models.train import reference
from shardplan.sharding.rules import apply_rule
from shardplan.tracing.walk import build_graph

B, D, L = 256, 128, 4


def _graph(f, *args, compiler="cpu"):
    return build_graph(jax.make_jaxpr(f)(*args), [f"a{k}" for k in range(len(args))], apply_rule, compiler=compiler)


def _scanned_grad(policy=None, prevent_cse=True):
    def block(h, w):
        return h + jnp.tanh(h @ w), None

    if policy is not None:
        block = jax.checkpoint(block, policy=policy, prevent_cse=prevent_cse)

    def loss(ws, x):
        h, _ = jax.lax.scan(block, x, ws)
        return h.sum()
    return jax.grad(loss)


def _without_stacks(g, fused: bool):
    kept, g.stacked_into = g.stacked_into, {}
    try:
        return hbm_traffic(g, fused=fused)
    finally:
        g.stacked_into = kept


def _stacking(g):
    """Per tensor, what the stacked results add to its priced traffic (the map with them, less without)."""
    with_stacks, without = hbm_traffic(g, fused=True), _without_stacks(g, fused=True)
    return {t: with_stacks.get(t, 0) - without.get(t, 0) for t in set(with_stacks) | set(without)
            if with_stacks.get(t, 0) != without.get(t, 0)}


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.dots_saveable])
def test_a_stacked_residual_costs_a_zero_fill_and_a_matmuls_result_a_copy(policy):
    """XLA fills each stacked buffer from a buffer of zeros (read and written) before the loop and
    copies a matmul's result into it each layer; an elementwise result is written in place.
    jax.checkpoint passes what it saves through a reduce_precision that keeps every bit: still the
    matmul's result."""
    ws = jax.ShapeDtypeStruct((L, D, D), jnp.float32)
    x = jax.ShapeDtypeStruct((B, D), jnp.float32)
    g = _graph(_scanned_grad(policy), ws, x)
    dots = {d.out for d in g.dots}
    added = _stacking(g)
    residuals = {body: stacked for body, stacked in g.stacked_into.items() if g.tensors[stacked].shape == (L, B, D)}
    assert residuals, "the scan stacks no (layers, batch, width) residual"
    for body, stacked in residuals.items():
        assert added.get(stacked) == 2, (g.tensors[stacked].name, added.get(stacked))
    made = g.made_by
    kinds = []
    for body in residuals:
        source = body
        while source in made and made[source][0] == "reduce_precision":     # the checkpoint's
            source = made[source][1][0]
        kind = "matmul" if source in dots else "input" if source not in made else made[source][0]
        kinds.append((kind, added.get(body, 0)))
    # The carry (each layer's input) is kept by every policy; without one the forward keeps the
    # tanh and 1 - tanh**2 (its derivative), with dots_saveable the matmul's result.
    expected = [("input", 2), ("sub", 0), ("tanh", 0)] if policy is None else [("input", 2), ("matmul", 2)]
    assert sorted(kinds) == expected, kinds
    # The ILP's count has none of it: a stacked result is written and read once, like any tensor.
    ilp = hbm_traffic(g)
    assert all(ilp.get(stacked, 0) <= 2 for stacked in residuals.values())
    assert all(v == 2 for v in added.values())


def test_a_stacked_slice_an_op_without_operands_makes_is_not_the_loops_input():
    """A slice made in the body by an op with no operands (an iota) is written in place, like an
    elementwise one, not copied in as the loop's input is."""
    def f(x):
        def body(h, _):
            return h * 2.0, jax.lax.iota(jnp.float32, D)
        return jax.lax.scan(body, x, None, length=L)

    g = _graph(f, jax.ShapeDtypeStruct((D,), jnp.float32))
    (body, stacked), = [(b, s) for b, s in g.stacked_into.items()]
    assert g.made_by[body][0] == "iota"
    added = _stacking(g)
    assert added.get(stacked) == 2 and added.get(body, 0) == 0


@pytest.mark.parametrize("compiler,fused_away", [("gpu", True), ("cpu", False)])
def test_a_result_xla_fuses_into_its_readers_crosses_hbm_only_in_the_ilps_count(compiler, fused_away):
    """A float32 exp read twice: the GPU compiler computes it again in each reader and never
    stores it, so the priced count leaves it out; the CPU compiler stores it, read by two kernels.
    The ILP's count has it written and read once either way."""
    def f(s, v):
        e = jnp.exp(s @ s)
        return (e.sum(-1, keepdims=True) * (e * 2.0)) @ v

    x = jax.ShapeDtypeStruct((B, B), jnp.float32)
    g = _graph(f, x, x, compiler=compiler)
    (e,) = [t.id for t in g.tensors if t.name == "exp"]
    assert hbm_traffic(g)[e] == 2
    assert hbm_traffic(g, fused=True).get(e, 0) == (0 if fused_away else 1 + 2)


def test_the_plan_reports_what_the_ilp_minimised_beside_its_prediction():
    ref = reference("llama-tiny", scan=True)
    state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(8, abstract=True)
    p = shardplan.plan(ref.train_step, state, batch, mesh="h100-8", time_limit=2, cache=False)
    assert p.cost.searched_s == pytest.approx(p.solver.objective, rel=1e-9)
    assert p.cost.step_s != pytest.approx(p.cost.searched_s, rel=1e-3)
    assert "HBM traffic unfused" in p.explain()


def test_recomputing_is_priced_faster_than_keeping_where_it_saves_the_stacks():
    """gpt2-small, batch 16, on one H200 (the calibrated peaks): measured there in session 20
    and 21, ``dots`` and ``full`` ran 126 and 129 ms, ``none`` 145 ms. The fills and copies of
    ``none``'s stacked residuals put it last; the unfused count priced it first."""
    ref = reference("gpt2-small", scan=True)
    state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(16, abstract=True)
    base = shardplan.load_mesh("h200-8")
    device = dataclasses.replace(base.device, peak_flops={"float32": 380.6e12, "bfloat16": 769.8e12},
                                 hbm_bandwidth=3.267e12)
    one = dataclasses.replace(base, name="h200-1", device=device, axes=(dataclasses.replace(base.axes[0], size=1),),
                              devices_per_node=1)
    step = {r: shardplan.plan(ref.train_step, state, batch, mesh=one, remat=r, time_limit=5, cache=False).cost.step_s
            for r in ("none", "dots", "full")}
    assert step["none"] > max(step["dots"], step["full"]), step
    auto = shardplan.plan(ref.train_step, state, batch, mesh=one, remat="auto", time_limit=5, cache=False)
    assert auto.remat["sites"][0]["policy"] in ("dots", "full")


def _gpu_copies(step, *args) -> list[tuple[int, ...]]:
    """The slices the GPU compiler copies out of a scanned stack (a fused computation whose root
    copies a dynamic slice), each shape less its trip dimension."""
    mesh, _ = targets.target_mesh(shardplan.load_mesh("h100-8"), "gpu")
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    text = jax.jit(step, in_shardings=(rep,) * len(args)).lower(*args).compile().as_text()
    found = re.findall(r"ROOT %copy[.\w]* = bf16\[1,([\d,]+)\]\{[\d,]+\} copy\(%dynamic[-_]slice", text)
    return sorted(tuple(int(d) for d in f.split(",")) for f in found)


_WEIGHTS_AND_INPUT = sorted([(B, D), (D, D), (D, D)])   # the forward's and the backward's weight slice, the layer input


@pytest.mark.parametrize("policy,prevent_cse,copied_shapes", [
    (None, True, _WEIGHTS_AND_INPUT),
    (jax.checkpoint_policies.nothing_saveable, True, _WEIGHTS_AND_INPUT),
    # The matmul's saved result, which only tanh reads, is copied too: JAX lowers a differentiated
    # checkpoint with prevent_cse behind an optimization barrier, which needs its own buffer.
    (jax.checkpoint_policies.dots_saveable, True, sorted(_WEIGHTS_AND_INPUT + [(B, D)])),
    (jax.checkpoint_policies.dots_saveable, False, _WEIGHTS_AND_INPUT),
])
def test_a_scanned_slice_a_matmul_reads_is_copied_on_a_gpu_and_priced_so(policy, prevent_cse, copied_shapes):
    """The GPU compiler copies each trip's slice of a scanned operand out of its stack before a
    matmul reads it (a layer's weights; the backward loop's stacked layer input), read and
    written once a trip. Both traffic counts price the copy on a GPU mesh, neither on another;
    and the slices priced are the ones the compiler copies (compiled when the GPU compiler is
    installed)."""
    ws = jax.ShapeDtypeStruct((L, D, D), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((B, D), jnp.bfloat16)
    step = _scanned_grad(policy, prevent_cse)
    g = _graph(step, ws, x, compiler="gpu")
    copied = copied_slices(g)
    shapes = sorted(g.tensors[t].shape for t in copied)
    assert shapes == copied_shapes, shapes
    plain = _graph(step, ws, x, compiler="cpu")
    assert copied_slices(plain) == set()
    for fused in (False, True):
        on_gpu, elsewhere = hbm_traffic(g, fused=fused), hbm_traffic(plain, fused=fused)
        for t in copied:
            assert elsewhere.get(t, 0) == 0 and on_gpu[t] == 2, (g.tensors[t].path, fused)
    if not targets.available("gpu"):
        pytest.skip("the rule's compiled check needs the GPU compiler: pip install 'shardplan[aot]'")
    assert _gpu_copies(step, ws, x) == shapes


@pytest.mark.parametrize("read", ["transpose", "reshape", "broadcast"])
def test_a_slice_read_through_a_relabelling_op_is_copied_once(read):
    """A weight slice a matmul reads through a transpose, a reshape or an added size-1 dimension
    is one copy (XLA folds the op into it): priced as read and written once, whatever the op's
    own edge adds, in both counts; the op's result is not the slice."""
    def block(h, w):
        if read == "transpose":
            return h + jnp.tanh(h @ w.T), None
        if read == "reshape":
            return h + jnp.tanh(h @ w.reshape(D, D)), None
        return h + jnp.tanh((h[None] @ w[None])[0]), None        # a batched matmul of one

    def loss(ws, x):
        h, _ = jax.lax.scan(block, x, ws)
        return h.sum()
    ws = jax.ShapeDtypeStruct((L, D * D) if read == "reshape" else (L, D, D), jnp.bfloat16)
    g = _graph(jax.grad(loss), ws, jax.ShapeDtypeStruct((B, D), jnp.bfloat16), compiler="gpu")
    # the forward's slice and the backward's (the weights' slice again, or the relabelled weights
    # the forward stacked for it)
    weights = {t for t in copied_slices(g) if math.prod(g.tensors[t].shape) == D * D}
    assert len(weights) == 2, [g.tensors[t].shape for t in copied_slices(g)]
    for fused in (False, True):
        traffic = hbm_traffic(g, fused=fused)
        assert all(traffic[t] == 2 for t in weights), [(g.tensors[t].path, traffic[t]) for t in weights]
