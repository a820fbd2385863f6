"""Unrolled repeated layers found in a traced forward program (shardplan.parallel.unrolled.find_layers):
where the repeats start, how many, which code runs them; what is not a layer stack."""

import jax
import jax.numpy as jnp
import pytest

import shardplan
from shardplan.compiler import targets
from shardplan.parallel import unrolled


def _block(w, x):
    h = jnp.tanh(x @ w["up"])
    return x + h @ w["down"]


def _weights(n, width=8, hidden=16, scale=1.0):
    return [{"up": jnp.full((width, hidden), 0.1 * scale), "down": jnp.full((hidden, width), 0.1)} for _ in range(n)]


def _jaxpr(f, *args):
    return jax.make_jaxpr(f)(*args).jaxpr


def test_layers_after_an_embedding_start_where_the_activation_alone_crosses():
    def loss(p, x):
        x = x + p["pos"]                    # an add, like the residual add that ends each layer
        for w in p["layers"]:
            x = _block(w, x)
        return jnp.mean(x ** 2)
    jaxpr = _jaxpr(loss, {"pos": jnp.ones((4, 8)), "layers": _weights(5)}, jnp.ones((4, 8)))
    (found,) = unrolled.find_layers(jaxpr)
    assert (found.start, found.period, found.count) == (1, 4, 5)
    assert [jaxpr.eqns[b.start].primitive.name for b in found.blocks()] == ["dot_general"] * 5
    assert unrolled.where(jaxpr, found).startswith("test_unrolled:")
    assert "(test_layers_after_an_embedding_start_where_the_activation_alone_crosses.<locals>.loss)" in \
        unrolled.where(jaxpr, found)


def test_an_encoder_and_a_decoder_are_two_classes():
    def loss(p, x):
        for w in p["enc"]:
            x = _block(w, x)
        y = x @ p["proj"]
        for w in p["dec"]:
            y = _block(w, y)
        return jnp.mean(y ** 2)
    p = {"enc": _weights(3), "proj": jnp.ones((8, 12)), "dec": _weights(4, width=12)}
    found = unrolled.find_layers(_jaxpr(loss, p, jnp.ones((4, 8))))
    assert sorted((f.count, f.period) for f in found) == [(3, 4), (4, 4)]


def test_side_by_side_copies_and_repeats_without_a_matmul_are_no_layers():
    def heads(p, x):                         # the same matmuls on the same input, summed: not a chain
        return jnp.mean(sum(jnp.tanh(x @ w["up"]) @ w["down"] for w in p))

    def elementwise(x):
        for _ in range(6):
            x = jnp.sin(x) * 2.0 + 1.0
        return jnp.mean(x)
    assert unrolled.find_layers(_jaxpr(heads, _weights(4), jnp.ones((4, 8)))) == []
    assert unrolled.find_layers(_jaxpr(elementwise, jnp.ones((4, 8)))) == []


def test_layers_checkpointed_whole_are_one_equation_each_and_still_found():
    block = jax.checkpoint(_block)

    def loss(w, x):
        for layer in w:
            x = block(layer, x)
        return jnp.mean(x ** 2)
    jaxpr = _jaxpr(loss, _weights(3), jnp.ones((4, 8)))
    (found,) = unrolled.find_layers(jaxpr)
    assert (found.period, found.count) == (1, 3) and jaxpr.eqns[found.start].primitive.name in ("checkpoint", "remat2")


def test_a_loop_in_the_differentiated_function_is_named_by_that_function():
    """JAX keeps only an equation's innermost frames: a two-line loop body shares no line, and
    the layers are named by the function they share, at its first line among them."""
    def loss(w, x):
        for layer in w:
            x = jnp.tanh(x @ layer["up"]) @ layer["down"]
            x = x * 2.0
        return jnp.mean(x ** 2)
    jaxpr = _jaxpr(loss, _weights(3), jnp.ones((4, 8)))
    (found,) = unrolled.find_layers(jaxpr)
    assert unrolled.where(jaxpr, found).endswith("(test_a_loop_in_the_differentiated_function_is_named_by_that_"
                                                 "function.<locals>.loss)")


def _checkpointed_step():
    block = jax.checkpoint(_block)

    def step(w, x):
        def loss(w):
            h = x
            for layer in w:
                h = block(layer, h)
            return jnp.mean(h ** 2)
        g = jax.grad(loss)(w)
        return jax.tree.map(lambda a, b: a - 0.1 * b, w, g)
    return step


def test_the_users_own_checkpoint_on_each_layer_is_kept_under_auto():
    p = shardplan.plan(_checkpointed_step(), _weights(3), jnp.ones((16, 8)), mesh="cpu-8", remat="auto",
                       cache=False)
    assert [(s["policy"], s["layers"]) for s in p.remat["sites"]] == [("user", 3)]


def test_a_class_key_the_step_does_not_have_is_an_error_naming_the_ones_it_has():
    step, args = _checkpointed_step(), (_weights(3), jnp.ones((16, 8)))
    key = shardplan.plan(step, *args, mesh="cpu-8", remat="auto", cache=False).remat["sites"][0]["key"]
    with pytest.raises(shardplan.RecomputeError, match=r"does not have: 'nope'; its classes are '.*#"):
        shardplan.plan(step, *args, mesh="cpu-8", remat={"nope": "full"}, cache=False)
    assert shardplan.plan(step, *args, mesh="cpu-8", remat={key: "full"}, cache=False).remat["sites"][0]["policy"] \
        == "full"


def test_outside_planning_the_routers_run_the_function_as_written():
    calls = []

    def loss(w, x):
        calls.append(1)
        for layer in w:
            x = _block(layer, x)
        return jnp.mean(x ** 2)
    g = jax.grad(unrolled.recognised(loss))(_weights(3), jnp.ones((4, 8)))
    assert len(calls) == 1 and len(g) == 3


# -- what the compilers do with unrolled recomputation --------------------------------------------

def _small_unrolled(budget, remat, mesh="cpu-8"):
    """4 unrolled layers of d 512, batch 32 x 256 tokens, float32: planned with ``remat``."""
    import scan_steps
    step, args = scan_steps.abstract_unrolled_gpt(4, 512, 8, 256, 8192, 32, dtype="float32")
    f = shardplan.auto(step, mesh=mesh, memory_budget=budget, remat=remat, donate_argnums=(0,), cache=False)
    return f, args


@pytest.mark.slow
def test_a_recomputed_layer_gathers_its_weights_again_behind_the_checkpoint_barrier():
    """Under a budget that shards the weights, each recomputed layer's weights are gathered again
    for the recomputation (its inputs reach it through jax.checkpoint's optimization barrier, so
    XLA's partitioner cannot reuse the forward pass's gather): the predicted collective bytes
    count those gathers, as the compiled program has them."""
    f, args = _small_unrolled("350MiB", "full")
    audit = f.audit_for("cpu", *args)
    gathers = {r.name: r for r in audit.by_kind}["all-gather"]
    assert gathers.compiled_bytes > 0
    assert gathers.predicted_bytes == pytest.approx(gathers.compiled_bytes, rel=1e-3)
    assert audit.comm_error() == pytest.approx(0, abs=1e-3)


@pytest.mark.slow
def test_the_cpu_compiler_holds_what_unrolled_layers_hold_without_recomputation():
    """XLA's CPU compiler runs an unrolled layer's recomputation in the forward pass: recomputed
    or not, the compiled program holds the same (shardplan.parallel.recompute.CPU_UNROLLED). The planner
    says so where asked for it on a CPU mesh, and does not choose it there by itself."""
    full, args = _small_unrolled("2GiB", "full")
    as_written, _ = _small_unrolled("2GiB", "off")
    held = [f.audit_for("cpu", *args).memory.compiled_bytes for f in (full, as_written)]
    assert held[0] == pytest.approx(held[1], rel=0.02)
    assert any("CPU compiler runs an unrolled layer's recomputation in the forward pass" in w
               for w in full.plan.warnings)
    auto = shardplan.plan(full.fn, *args, mesh="cpu-8", remat="auto", donate_argnums=(0,), cache=False)
    assert [s["policy"] for s in auto.remat["sites"]] == ["none"]


@pytest.mark.slow
@pytest.mark.skipif(not targets.available("gpu"), reason="needs the GPU compiler: pip install 'shardplan[aot]'")
def test_the_gpu_compiler_keeps_an_unrolled_recomputation_for_the_backward_pass():
    full, args = _small_unrolled(None, "full", mesh="h100-8")
    as_written, _ = _small_unrolled(None, "off", mesh="h100-8")
    held = [f.audit_for("gpu", *args).memory.compiled_bytes for f in (full, as_written)]
    assert held[0] < 0.9 * held[1]          # 370 against 432 MiB; the CPU compiler: equal
