"""The audit holds a plan's predicted collectives and memory against the compiled HLO."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import shardplan
from shardplan.cli import main
from shardplan.compiler import targets
from shardplan.models.train import reference


@pytest.mark.slow
def test_a_gather_made_on_the_tables_split_takes_its_indices_as_that_result_needs_them():
    """Under a 2 MiB budget gpt-tiny's plan looks its tokens up in a table split on its columns
    over ``data``, the result made there and then moved: the token ids must come to that result's
    split too (pinned; they are small), else XLA gathers the whole table over ``data`` and moves
    the result again (64 KiB of all-gather and 16 KiB of all-to-all the plan did not price)."""
    ref = reference("gpt-tiny", scan=True)
    state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(16, abstract=True)
    f = shardplan.auto(ref.train_step, mesh=shardplan.load_mesh("cpu-8", axes={"data": 2, "model": 4}),
                       memory_budget="2MiB", donate_argnums=(0,), time_limit=30, cache=False)
    a = f.audit_for("cpu", state, batch)
    assert any(k.endswith("gather:0") for k in f.plan.result_pins), f.plan.result_pins   # the case covered
    kinds = {r.name: r for r in a.by_kind}
    for kind in ("all-gather", "all-to-all"):
        assert abs(kinds[kind].bytes_error()) <= 0.01, a.table()
    assert abs(a.comm_error()) <= 0.01, a.table()


def test_audit_matches_prediction_on_a_planned_step():
    ref = reference("gpt-tiny", scan=True)
    state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(8, abstract=True)
    f = shardplan.auto(ref.train_step, mesh=shardplan.load_mesh("cpu-8", axes={"data": 8}),
                       donate_argnums=(0,), time_limit=3)
    compiled = f.lower(state, batch).compile()
    a = f.plan.audit(compiled)
    predicted, got = a.comm_bytes
    assert abs(a.comm_error()) <= 0.05 and not a.divergences(), a.table()
    # The audit reads every collective of the compiled program and prices it on the plan's mesh.
    assert sum(c.nbytes * c.count for c in a.collectives) == got > 0
    assert [r.name for r in a.by_axis] == ["data"]
    assert abs(a.memory_error()) <= 0.15, a.table()
    assert "predicted" in a.table() and "memory per device" in a.table() and str(a) == a.table()
    # The audit says which heap allowance this compile implies, from the same figures.
    assert any("heap_overhead = " in n for n in a.notes), a.notes
    # A divergence is reported, not hidden: claim twice the bytes and the audit flags it.
    doubled = {k: 2 * v for k, v in f.plan.cost.comm_bytes_by_kind.items()}
    bad = dataclasses.replace(f.plan, cost=dataclasses.replace(f.plan.cost, comm_bytes_by_kind=doubled))
    assert any("collective bytes" in d for d in bad.audit(compiled).divergences())


@pytest.mark.skipif(not targets.available("gpu"), reason="needs the GPU compiler: pip install 'shardplan[aot]'")
def test_a_plan_audits_a_gpu_compile_as_one():
    """``Plan.audit`` of a program compiled for a GPU without one names the GPU, and has no
    note on the CPU compiler's float32 temporaries."""
    ref = reference("gpt-tiny", scan=True)
    state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(8, abstract=True)
    f = shardplan.auto(ref.train_step, mesh=shardplan.load_mesh("h100-8", axes={"data": 8}),
                       donate_argnums=(0,), time_limit=3)
    compiled, jax_mesh, compiler = f.compile_for("gpu", state, batch)
    a = f.plan.audit(compiled, jax_mesh=jax_mesh)
    assert a.platform == "gpu", (a.platform, compiler)
    assert not any("CPU compile" in n for n in a.notes), a.notes
    assert abs(a.comm_error()) <= 0.05, a.table()


def test_audit_command(capsys):
    rc = main(["audit", "--model", "gpt-tiny", "--mesh", "cpu-8", "--axes", "data=2,model=4", "--batch", "8",
               "--time-limit", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out      # no divergence: the tied embedding, gathered for the logits and for their
    assert "audit against the compiled program" in out and "all collectives" in out     # gradient, once


@pytest.mark.slow
def test_audit_command_audits_a_pipeline(capsys):
    """``--pipeline N`` audits the plan with its layer scan run as an N-stage pipeline: the stage
    axis's collectives are in the table, held against the compiled program."""
    rc = main(["audit", "--model", "gpt-tiny", "--mesh", "cpu-8", "--axes", "data=8", "--batch", "8",
               "--time-limit", "3", "--pipeline", "2"])
    captured = capsys.readouterr()
    assert rc == 0, captured.out
    assert "pipeline: 2 stages over mesh axis 'stage'" in captured.err
    assert "axis stage" in captured.out and "collective-permute" in captured.out


def test_gathers_scatters_and_broadcast_operands_are_priced_as_compiled():
    """On a (2,4) mesh the plan ZeRO-shards the embedding table over 'data': the lookup gathers
    in place and reshards its small result (XLA's gather partitioner), and the table's gradient
    scatter-adds into the local slice before its all-reduce. A sharded output bias is gathered
    before the broadcasting add (the plan pins the operand there, else XLA gathers the broadcast
    result); the bias stays replicated now that its gradient's reduce_sum is priced as XLA
    runs it (all-reduced whole, then sliced: sharding it saves nothing). Each collective kind's
    bytes are the compiled program's."""
    ref = reference("mlp-tiny", scan=True)
    state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(8, abstract=True)
    f = shardplan.auto(ref.train_step, mesh=shardplan.load_mesh("cpu-8", axes={"data": 2, "model": 4}),
                       donate_argnums=(0,), time_limit=30)
    compiled = f.lower(state, batch).compile()
    a = f.plan.audit(compiled)
    rows = {r.name: r for r in a.by_kind}
    for kind in ("all-gather", "all-reduce"):
        assert rows[kind].predicted_bytes == pytest.approx(rows[kind].compiled_bytes, rel=0.01), a.table()
    [bias] = [r for r in f.plan.inputs if r.name == "[0]['params']['Dense_0']['bias']"]
    # Pinned: the scatter-add's updates (moved to the table's split before it, as priced), and
    # the bias only where it is sharded.
    scatter_pins = {k for k in f.plan.operand_pins if "scatter" in k[1]}
    assert bool(set(f.plan.operand_pins) - scatter_pins) == any(bias.spec)


@pytest.mark.slow
def test_cpu_compile_of_a_bf16_model_is_named_not_comparable():
    ref = reference("gpt-tiny", scan=True, dtype="bfloat16")
    state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(8, abstract=True)
    f = shardplan.auto(ref.train_step, mesh=shardplan.load_mesh("cpu-8", axes={"data": 8}), donate_argnums=(0,),
                       time_limit=2)
    compiled = f.lower(state, batch).compile()
    notes = f.plan.audit(compiled).notes
    assert any("bf16 is computed in f32" in n and "temporaries" in n for n in notes), notes


def test_a_loss_summed_to_a_scalar_has_its_all_reduce_priced():
    """The mean of a tensor split over the batch is a sum of partial sums: an all-reduce of one
    scalar over the batch's mesh axes (a latency each step). It is priced with the tensor's spec
    (``Graph.to_scalar``), so the prediction's all-reduce seconds are the compiled program's."""
    import jax.numpy as jnp

    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.1 * g, loss

    w, x = jax.ShapeDtypeStruct((512, 512), jnp.float32), jax.ShapeDtypeStruct((16384, 512), jnp.float32)
    f = shardplan.auto(step, mesh=shardplan.load_mesh("cpu-8", axes={"data": 8}), donate_argnums=(0,),
                       time_limit=5, cache=False)
    plan = f.make_plan(w, x)
    assert plan.inputs[1].spec[0] == ("data",), plan.explain()      # the case covered: the batch split
    a = f.audit_for("cpu", w, x)
    reduced = {r.name: r for r in a.by_kind}["all-reduce"]
    scalar = [c for c in a.collectives if c.kind == "all-reduce" and c.nbytes == 4]
    assert scalar, a.table()
    assert reduced.predicted_s == pytest.approx(reduced.compiled_s, rel=1e-6), a.table()


def test_a_bf16_plan_for_the_cpu_compiler_prices_collectives_and_temporaries_as_the_f32_it_runs():
    """On a CPU mesh the plan holds what XLA's CPU compiler does with bfloat16 (it computes it in
    float32): the collectives move 4 bytes an element, and the values the step makes are held as
    float32 (the arguments and results keep bfloat16). Priced at 2 bytes, the all-reduces and
    reduce-scatters came out at half the compiled bytes, and memory 40% under."""
    mesh = shardplan.load_mesh("cpu-8", axes={"data": 2, "model": 4})

    def step(params, x):
        def loss(p):
            return jnp.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"]).astype(jnp.float32) ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    params = {"w1": jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16),
              "w2": jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16)}
    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    f = shardplan.auto(step, mesh=mesh, donate_argnums=0, cache=False, time_limit=2)
    compiled = f.lower(params, x).compile()
    a = f.plan.audit(compiled)
    kinds = {r.name: r for r in a.by_kind if r.compiled_bytes}
    assert {"all-reduce", "reduce-scatter"} <= set(kinds), a.table()
    for r in kinds.values():
        assert abs(r.bytes_error()) <= 0.01, a.table()
    assert abs(a.memory_error()) <= 0.15, a.table()
    assert any("prices its bf16 collectives as f32" in n for n in a.notes), a.notes
