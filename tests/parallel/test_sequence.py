"""The planner chooses how a step's attention is split over the sequence (``context=``): the
textbook answers, parity with ``jax.jit``, plans that keep their choice (8 fake CPU devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardplan
from shardplan.compiler import targets
from shardplan.devices.mesh import make_jax_mesh
from shardplan.parallel.sequence import ContextConfig, candidates

E = 128


def _step(batch, seq, heads, causal=True):
    def loss(w, x):
        q, k, v = ((x @ w[n]).reshape(batch, seq, heads, E // heads) for n in "qkv")
        o = shardplan.attention(q, k, v, causal=causal)
        return jnp.mean((x + o.reshape(batch, seq, E) @ w["o"]) ** 2)

    def step(w, x):
        value, grads = jax.value_and_grad(loss)(w, x)
        return jax.tree.map(lambda a, g: a - 0.1 * g, w, grads), value
    return step


def _args(batch, seq):
    keys = jax.random.split(jax.random.key(0), 5)
    w = {n: jax.random.normal(k, (E, E)) * 0.1 for n, k in zip("qkvo", keys)}
    return w, jax.random.normal(keys[4], (batch, seq, E))


MESH = dict(axis_names=("data", "seq"), axis_sizes=(2, 4))


def _run(step, args, steps=2, **kw):
    f = shardplan.auto(step, mesh=make_jax_mesh(**MESH), hardware="h100-8", donate_argnums=(0,), **kw)
    w, x = args
    got_w, want_w = jax.tree.map(jnp.copy, w), w
    for _ in range(steps):
        got_w, got = f(got_w, x)
        want_w, want = jax.jit(step)(want_w, x)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_w), jax.tree.leaves(want_w)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    return f


def test_outside_the_planner_attention_is_dot_product_attention():
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 16, 4, 8)) for i in range(3))
    np.testing.assert_array_equal(shardplan.attention(q, k, v, causal=True),
                                  jax.nn.dot_product_attention(q, k, v, is_causal=True))


def test_a_short_sequence_with_ample_memory_is_not_split():
    f = _run(_step(4, 256, 8), _args(4, 256), context="auto")
    assert f.plan.context is None
    assert "context parallelism: none" in f.plan.explain()


def test_a_sequence_too_long_for_any_unsplit_plan_gets_context_parallelism():
    step, args = _step(2, 2048, 8), _args(2, 2048)
    with pytest.raises(shardplan.InfeasibleBudgetError):
        shardplan.plan(step, *args, mesh=make_jax_mesh(**MESH), hardware="h100-8", memory_budget="48MiB",
                       context="off")
    f = _run(step, args, context="auto", memory_budget="48MiB")
    assert f.plan.context is not None and f.plan.cost.memory_bytes <= 48 * 2**20
    moved = {"allgather": "all-gather", "ulysses": "all-to-all", "ring": "collective-permute"}
    assert f.plan.cost.comm_bytes_by_kind[moved[f.plan.context_config().strategy.value]] > 0


def _planned(step, args, config, **kw):
    return shardplan.plan(step, *args, mesh=make_jax_mesh(**MESH), hardware="h100-8", context=config, **kw)


def test_with_heads_to_spare_ulysses_moves_less_than_the_ring():
    step, args = _step(2, 1024, 8), _args(2, 1024)
    common = dict(seq_axes=("seq",), batch_axes=("data",))
    ulysses = _planned(step, args, ContextConfig("ulysses", **common))
    ring = _planned(step, args, ContextConfig("ring", **common, load_balance="zigzag"))
    assert ulysses.cost.comm_s < ring.cost.comm_s and ulysses.cost.step_s < ring.cost.step_s
    assert ulysses.cost.comm_bytes_by_kind["all-to-all"] > 0 and ring.cost.comm_bytes_by_kind["all-to-all"] == 0


def test_with_fewer_heads_than_the_sequence_axis_ulysses_is_not_a_candidate():
    sizes = {"data": 2, "seq": 4}
    few = candidates([((2, 1024, 2, 64), (2, 1024, 2, 64), True)], sizes)
    assert {(c.strategy.value, c.seq_axes) for c in few} >= {("ring", ("seq",)), ("allgather", ("seq",))}
    assert ("ulysses", ("seq",)) not in {(c.strategy.value, c.seq_axes) for c in few}
    many = candidates([((2, 1024, 8, 16), (2, 1024, 8, 16), True)], sizes)
    assert ("ulysses", ("seq",)) in {(c.strategy.value, c.seq_axes) for c in many}
    # Heads over the other axis where it does not split the batch: LoongTrain's 2-D mix.
    mixed = candidates([((1, 1024, 8, 16), (1, 1024, 8, 16), True)], sizes)
    assert any(c.seq_axes == ("seq",) and c.head_axes == ("data",) for c in mixed)


def test_a_plan_keeps_its_attention_choice_through_a_file(tmp_path):
    step, args = _step(2, 512, 8), _args(2, 512)
    config = ContextConfig("ring", seq_axes=("seq",), batch_axes=("data",), load_balance="zigzag")
    made = _planned(step, args, config)
    assert made.context_config() == config and "ring attention, sequence over seq" in made.explain()
    made.save(tmp_path / "plan.json")
    loaded = shardplan.Plan.load(tmp_path / "plan.json")
    assert loaded.context == made.context
    f = _run(step, args, steps=1, plan=tmp_path / "plan.json")
    assert f.plan.context == made.context


def test_bad_context_settings_say_what_works():
    step, args = _step(2, 256, 8), _args(2, 256)
    with pytest.raises(shardplan.ShardplanError, match="context='sideways': give 'auto', 'off'"):
        _planned(step, args, "sideways")
    with pytest.raises(shardplan.ShardplanError, match="seq_axes is empty"):
        ContextConfig("ring", seq_axes=())
    with pytest.raises(shardplan.ShardplanError,
                       match="strategy='zigzag' is not one of 'allgather', 'ulysses', 'ring'"):
        ContextConfig("zigzag", seq_axes=("seq",))
    with pytest.raises(shardplan.ShardplanError, match="load_balance='zig' is not one of None, 'zigzag'"):
        ContextConfig("ring", seq_axes=("seq",), load_balance="zig")
    with pytest.raises(shardplan.ShardplanError, match="context='ring': give 'auto'"):
        shardplan.auto(step, mesh=make_jax_mesh(**MESH), context="ring")      # at once, not at the first call
    with pytest.raises(shardplan.ShardplanError, match="not planned together with a pipeline"):
        _planned(step, args, "auto", pipeline=2)


def test_a_step_without_attention_calls_says_so():
    def step(w, x):
        return w - 0.1 * jnp.mean(x @ w) * w, jnp.mean(x)
    args = jnp.ones((E, E)), jnp.ones((8, E))
    f = shardplan.plan(step, *args, mesh=make_jax_mesh(**MESH), hardware="h100-8", context="auto")
    assert f.context is None and any("no attention the planner can split" in w for w in f.warnings)
    # asked for by name: the plan does not claim a split that is not there
    ring = ContextConfig("ring", seq_axes=("seq",), batch_axes=("data",))
    f = shardplan.plan(step, *args, mesh=make_jax_mesh(**MESH), hardware="h100-8", context=ring)
    assert f.context is None and "context parallelism: none" in f.explain()
    assert any(w.startswith("context='ring attention") and "no attention the planner can split" in w
               for w in f.warnings), f.warnings
    # and when nothing fits, the error says that a sequence split could not help
    from shardplan.errors import InfeasibleBudgetError
    with pytest.raises(InfeasibleBudgetError, match="context='auto' could not help: the step has no attention"):
        shardplan.plan(step, *args, mesh=make_jax_mesh(**MESH), hardware="h100-8", context="auto",
                       memory_budget="1KiB")


@pytest.mark.parametrize("config", [
    ContextConfig("allgather", seq_axes=("seq",), batch_axes=("data",)),
    ContextConfig("ulysses", seq_axes=("seq",), batch_axes=("data",)),
    ContextConfig("ring", seq_axes=("seq",), batch_axes=("data",), load_balance="zigzag"),
    ContextConfig("ring", seq_axes=("seq",), head_axes=("data",)),
], ids=lambda c: c.describe())
def test_each_strategys_collectives_are_predicted_as_compiled(config):
    from shardplan.compiler.hlo import collectives
    mesh = make_jax_mesh(**MESH)
    step, (w, x) = _step(2, 512, 8), _args(2, 512)
    f = shardplan.auto(step, mesh=mesh, hardware="h100-8", context=config)
    compiled = {}
    for c in collectives(f.lower(w, x).compile().as_text(), mesh):
        compiled[c.kind] = compiled.get(c.kind, 0.0) + c.nbytes * c.count
    predicted = {k: v for k, v in f.plan.cost.comm_bytes_by_kind.items() if v}
    assert set(predicted) == set(compiled)
    for kind, nbytes in predicted.items():      # the loss's mean adds a few bytes of all-reduce
        assert compiled[kind] == pytest.approx(nbytes, rel=1e-4, abs=16), kind


SPLITS = [ContextConfig("allgather", seq_axes=("seq",), batch_axes=("data",)),
          ContextConfig("ulysses", seq_axes=("seq",), batch_axes=("data",)),
          ContextConfig("ring", seq_axes=("seq",), batch_axes=("data",), load_balance="zigzag"),
          ContextConfig("ring", seq_axes=("seq",), head_axes=("data",))]      # LoongTrain's 2-D mix


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("config", SPLITS, ids=lambda c: c.describe())
def test_the_reference_llama_with_split_attention_trains_like_its_einsum_twin(config, scan):
    # llama-tiny-cp is llama-tiny (sequence 256) with shardplan.attention: split over the sequence
    # each way, 3 AdamW steps match the einsum model's jit steps (the planner lays out the rest).
    from shardplan.models.train import reference
    cp, plain = reference("llama-tiny-cp", scan=scan), reference("llama-tiny-cp", scan=scan, attention="einsum")
    state, batch = cp.init(jax.random.key(0)), cp.batch(4)
    f = shardplan.auto(cp.train_step, mesh=make_jax_mesh(**MESH), hardware="h100-8", context=config)
    got, want = state, state
    for _ in range(3):
        got, got_metrics = f(got, batch)
        want, want_metrics = jax.jit(plain.train_step)(want, batch)
    assert f.plan.context_config() == config
    np.testing.assert_allclose(jax.tree.leaves(got_metrics), jax.tree.leaves(want_metrics), rtol=1e-5)


@pytest.mark.parametrize("config", [ContextConfig("allgather", seq_axes=("seq",)),
                                    ContextConfig("ring", seq_axes=("seq",), load_balance="zigzag")],
                         ids=lambda c: c.describe())
def test_the_sequence_split_alone_over_all_eight_devices_trains_like_jit(config):
    from shardplan.models.train import reference
    cp, plain = reference("llama-tiny-cp", scan=True), reference("llama-tiny-cp", scan=True, attention="einsum")
    state, batch = cp.init(jax.random.key(0)), cp.batch(4)
    f = shardplan.auto(cp.train_step, mesh=make_jax_mesh(axis_names=("seq",), axis_sizes=(8,)), hardware="h100-8",
                       context=config)
    got, want = state, state
    for _ in range(3):
        got, got_metrics = f(got, batch)
        want, want_metrics = jax.jit(plain.train_step)(want, batch)
    np.testing.assert_allclose(jax.tree.leaves(got_metrics), jax.tree.leaves(want_metrics), rtol=1e-5)


@pytest.mark.parametrize("scan,config", [(True, c) for c in SPLITS] + [(False, SPLITS[2])],
                         ids=lambda x: x.describe() if isinstance(x, ContextConfig) else f"scan={x}")
def test_the_reference_llama_written_with_einsum_attention_is_split_as_asked(config, scan):
    # The einsum model (jnp.repeat for its grouped heads, jnp.where with finfo.min, a softmax in
    # f32): its written-out attention is recognised and runs split; 3 AdamW steps match jit's.
    from shardplan.compiler.hlo import collectives
    from shardplan.models.train import reference
    plain = reference("llama-tiny-cp", scan=scan, attention="einsum")
    state, batch = plain.init(jax.random.key(0)), plain.batch(4)
    mesh = make_jax_mesh(**MESH)
    f = shardplan.auto(plain.train_step, mesh=mesh, hardware="h100-8", context=config)
    kinds = {c.kind for c in collectives(f.lower(state, batch).compile().as_text(), mesh)}
    with shardplan.parallel.sequence.context_parallel(config, mesh) as use:
        traced = str(jax.make_jaxpr(lambda s, b: plain.train_step(s, b))(state, batch))   # not jax's trace cache
    assert "shard_map" in traced and use.sites
    got, want = state, state
    for _ in range(3):
        got, got_metrics = f(got, batch)
        want, want_metrics = jax.jit(plain.train_step)(want, batch)
    assert f.plan.context_config() == config
    assert {"allgather": "all-gather", "ulysses": "all-to-all",
            "ring": "collective-permute"}[config.strategy.value] in kinds
    np.testing.assert_allclose(jax.tree.leaves(got_metrics), jax.tree.leaves(want_metrics), rtol=1e-5)


def _dot_product_attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def _einsum_softmax_einsum(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((q.shape[1],) * 2, bool)), s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


@pytest.mark.parametrize("attend", [_dot_product_attention, _einsum_softmax_einsum], ids=lambda f: f.__name__)
def test_a_step_written_without_shardplan_gets_the_same_choice(attend):
    # No shardplan import in the model: jax.nn.dot_product_attention is routed through
    # shardplan.attention while the planner traces, and attention written out is recognised.
    def loss(w, x):
        q, k, v = ((x @ w[n]).reshape(2, 2048, 8, E // 8) for n in "qkv")
        return jnp.mean((x + attend(q, k, v).reshape(2, 2048, E) @ w["o"]) ** 2)

    def step(w, x):
        value, grads = jax.value_and_grad(loss)(w, x)
        return jax.tree.map(lambda a, g: a - 0.1 * g, w, grads), value

    f = _run(step, _args(2, 2048), steps=1, context="auto", memory_budget="48MiB")
    written = _run(_step(2, 2048, 8), _args(2, 2048), steps=1, context="auto", memory_budget="48MiB")
    assert f.plan.context is not None and f.plan.context == written.plan.context
    assert jax.nn.dot_product_attention is shardplan.parallel.sequence._DOT_PRODUCT_ATTENTION       # left alone after
    assert jax.value_and_grad is shardplan.parallel.unrolled.ORIGINALS["value_and_grad"]         # jax's own again


def test_a_jitted_step_traced_before_is_split_and_runs_unsplit_after():
    # jax.jit's trace cache: the trace the user's own call left must not hide the attention from
    # the planner, and the planner's split trace must not serve the user's later calls.
    step, (w, x) = jax.jit(_step(2, 256, 8)), _args(2, 256)
    before = step(w, x)[1]
    config = ContextConfig("ring", seq_axes=("seq",), batch_axes=("data",), load_balance="zigzag")
    f = shardplan.auto(step, mesh=make_jax_mesh(**MESH), hardware="h100-8", context=config)
    assert "collective-permute" in f.lower(w, x).compile().as_text()
    assert "collective-permute" not in step.lower(w, x).compile().as_text()
    np.testing.assert_array_equal(step(w, x)[1], before)


def test_an_nnx_multi_head_attention_step_is_split_as_asked():
    # A stranger's NNX model: nnx.MultiHeadAttention with a causal mask (its own einsums),
    # nnx.value_and_grad, AdamW; ring attention asked for, 3 steps against jax.jit.
    import optax
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.attn = nnx.MultiHeadAttention(num_heads=4, in_features=64, decode=False, rngs=rngs)
            self.out = nnx.Linear(64, 64, rngs=rngs)

        def __call__(self, x):
            mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
            return self.out(x + self.attn(x, mask=mask))

    model = Block(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adamw(1e-3)
    state = {"params": params, "opt": tx.init(params)}
    x = jax.random.normal(jax.random.key(1), (4, 64, 64))

    def step(state, x):
        def loss_fn(m):
            return jnp.mean((m(x) - x) ** 2)
        loss, grads = nnx.value_and_grad(loss_fn)(nnx.merge(graphdef, state["params"]))
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    config = ContextConfig("ring", seq_axes=("seq",), batch_axes=("data",), load_balance="zigzag")
    mesh = make_jax_mesh(**MESH)
    f = shardplan.auto(step, mesh=mesh, hardware="h100-8", context=config)
    with shardplan.parallel.sequence.context_parallel(config, mesh) as use:
        assert "shard_map" in str(jax.make_jaxpr(lambda s, b: step(s, b))(state, x))
    assert use.sites == [((4, 64, 4, 16), (4, 64, 4, 16), True)]
    got, want = state, state
    for _ in range(3):
        got, got_loss = f(got, x)
        want, want_loss = jax.jit(step)(want, x)
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)


needs_gpu = pytest.mark.skipif(not targets.available("gpu"), reason="the CUDA compiler is not installed "
                               "(pip install 'shardplan[aot]')")
H100 = dict(axes={"data": 2, "seq": 4})


def _memory_error(step, args, config, target):
    f = shardplan.auto(step, mesh=shardplan.load_mesh("h100-8", **H100), donate_argnums=(0,), cache=False,
                       context="off" if config is None else config)
    return f.audit_for(target, *args).memory_error()


@needs_gpu
@pytest.mark.parametrize("config", [None] + SPLITS, ids=lambda c: "no split" if c is None else c.describe())
def test_each_strategys_memory_is_the_gpu_compiles_within_15_percent(config):
    # 2 x 2048 tokens in bf16, as a GPU trains: attention is most of the memory (chunks of scores
    # and the probabilities made from them, gathered or rotated K/V blocks, the loops' state).
    # The GPU compiler computes bf16 natively, so its memory is what a device holds; compiled
    # with no GPU present (never run).
    step = _step(2, 2048, 8)
    w = {n: jax.ShapeDtypeStruct((E, E), jnp.bfloat16) for n in "qkvo"}
    args = (w, jax.ShapeDtypeStruct((2, 2048, E), jnp.bfloat16))
    assert abs(_memory_error(step, args, config, "gpu")) <= 0.15


@pytest.mark.parametrize("config", [None] + SPLITS, ids=lambda c: "no split" if c is None else c.describe())
def test_the_reference_llamas_memory_is_the_cpu_compiles_within_15_percent(config):
    # llama-tiny-cp (sequence 256, layers scanned, AdamW) on the CPU compiler, fp32 (the CPU
    # computes bf16 in f32). XLA's CPU compiler fuses less than its GPU compiler (no
    # elementwise producer into a dot), so an attention-bound step compiles to more there.
    from shardplan.models.train import reference
    ref = reference("llama-tiny-cp", scan=True)
    args = (jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(4, abstract=True))
    assert abs(_memory_error(ref.train_step, args, config, "cpu")) <= 0.15
