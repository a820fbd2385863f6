"""Pipeline parallelism (shardplan.parallel.pipeline): the reference decoders' scanned layer stacks run as
SPMD pipelines of 2 and 4 stages, GPipe and circular, alone and with data and tensor
parallelism, and compute what the unpipelined, unsharded step computes; bad settings are refused
naming the setting."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.models.train import reference
from shardplan.parallel.pipeline import PipelineConfig, PipelineError, Schedule, layer_scan, pipelined

STEPS = 3
BATCH = 16


def _mesh(axes: dict[str, int]) -> jax.sharding.Mesh:
    n = int(np.prod(list(axes.values())))
    devices = np.array(jax.devices()[:n]).reshape(tuple(axes.values()))
    return jax.sharding.Mesh(devices, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def _ref(model, optimizer):
    tx = optax.adamw(1e-2, weight_decay=0.1) if optimizer == "adamw" else optax.sgd(0.1)
    return reference(model, scan=True, n_layers=8, optimizer=tx)


@functools.cache
def _unpipelined(model, optimizer):
    ref = _ref(model, optimizer)
    state, losses = ref.init(jax.random.key(0)), []
    step = jax.jit(ref.train_step)
    for k in range(STEPS):
        state, metrics = step(state, ref.batch(BATCH, seed=k))
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.tree.map(np.asarray, state["params"])


def _shardings(state, mesh):
    """Hand shardings: stacked layer leaves on the stage axis (dim 0); with a "model" axis, the
    last dimension of every matrix over it (tensor parallelism)."""
    model = mesh.shape.get("model", 1)

    def spec(path, x):
        if not x.ndim:
            return NamedSharding(mesh, P())
        stacked = "layers" in jax.tree_util.keystr(path)
        entries = ["stage" if stacked else None] + [None] * (x.ndim - 1)
        if model > 1 and x.ndim >= 2 + stacked and x.shape[-1] % model == 0:
            entries[-1] = "model"
        return NamedSharding(mesh, P(*entries))
    return jax.tree_util.tree_map_with_path(spec, state)


def _pipelined_run(model, optimizer, axes, config):
    ref = _ref(model, optimizer)
    mesh = _mesh(axes)
    abstract = jax.eval_shape(ref.init, jax.random.key(0))
    state_sh = _shardings(abstract, mesh)
    batch_sh = NamedSharding(mesh, P("data" if "data" in axes else None))
    with pipelined(config, mesh):
        step = jax.jit(ref.train_step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None),
                       donate_argnums=(0,))
        state = jax.jit(ref.init, out_shardings=state_sh)(jax.random.key(0))
        compiled = step.lower(abstract, ref.batch(BATCH, abstract=True)).compile().as_text()
        losses = []
        for k in range(STEPS):
            state, metrics = step(state, ref.batch(BATCH, seed=k))
            losses.append(float(metrics["loss"]))
    return np.array(losses), state["params"], compiled


CASES = [
    ("gpt-tiny", {"stage": 2}, PipelineConfig(2, 4)),
    ("gpt-tiny", {"stage": 4, "data": 2}, PipelineConfig(4, 4)),
    ("gpt-tiny", {"stage": 2, "data": 2, "model": 2}, PipelineConfig(2, 2, Schedule.CIRCULAR, repeats=2)),
    ("llama-tiny", {"stage": 4}, PipelineConfig(4, 8)),
    ("llama-tiny", {"stage": 4, "data": 2}, PipelineConfig(4, 4, "circular", repeats=2)),
    ("llama-tiny", {"stage": 2, "data": 2, "model": 2}, PipelineConfig(2, 4)),
    ("gpt-tiny", {"stage": 2, "data": 2, "model": 2}, PipelineConfig(2, 4, batch_axes="data")),
    # Each data rank's row group with its own copy of the stage's weights, summed after the loop.
    ("gpt-tiny", {"stage": 2, "data": 4}, PipelineConfig(2, 4, batch_axes="data", replicas=4)),
    ("llama-tiny", {"stage": 2, "data": 2, "model": 2}, PipelineConfig(2, 2, "circular", repeats=2, replicas=2)),
    ("gpt-tiny", {"stage": 2, "data": 2}, PipelineConfig(2, 4, "circular", repeats=4)),
]


@pytest.mark.parametrize("model,axes,config", CASES,
                         ids=[f"{m}-{'x'.join(f'{k}{v}' for k, v in a.items())}-{c.schedule.value}{c.repeats}-mb"
                              f"{c.microbatches}" for m, a, c in CASES])
def test_pipelined_step_matches_the_unpipelined_step(model, axes, config):
    expected, _ = _unpipelined(model, "adamw")
    losses, _, compiled = _pipelined_run(model, "adamw", axes, config)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert "collective-permute" in compiled          # activations move stage to stage
    # GPipe's stages hold contiguous blocks of layers: the parameters never move between stages;
    # the circular schedule interleaves them (an all-to-all over the stage axis). (Tensor
    # parallelism brings all-to-alls of its own.)
    if config.schedule is Schedule.CIRCULAR:
        assert "all-to-all" in compiled
    elif "model" not in axes:
        assert "all-to-all" not in compiled


def test_the_circular_schedule_keeps_no_chunk_of_weights_per_trip():
    """Each stage's chunk of weights is a static slice where every stage is in one round; only the
    S - 1 trips after a round starts select chunks (kept for the backward loop). A loop picking the
    chunk by the trip's round kept one per trip: 33 here, more than the whole program holds now."""
    mesh = _mesh({"stage": 2})
    params, x = jax.ShapeDtypeStruct((8, 256, 256), jnp.float32), jax.ShapeDtypeStruct((16, 256), jnp.float32)
    config = PipelineConfig(2, 8, "circular", repeats=4)
    with pipelined(config, mesh):
        compiled = jax.jit(jax.grad(_toy_loss), in_shardings=(NamedSharding(mesh, P("stage")),
                                                              NamedSharding(mesh, P()))).lower(params, x).compile()
    chunk = 256 * 256 * 4                    # one layer a chunk (8 layers, 2 stages x 4 rounds), per device
    assert compiled.memory_analysis().temp_size_in_bytes < config.iterations * chunk


def test_the_circular_schedule_keeps_no_selected_chunk_or_mask_per_trip(tmp_path):
    """Where a new round starts, each stage runs round r's chunk of weights or round r - 1's by
    whether it is on the round yet. Each layer selects its weights inside a checkpoint that
    keeps only the two static chunks, so neither the selected chunk nor the select's predicate
    (broadcast to the weights' shape) is a residual of each of those S - 1 trips (GPT-3 175B on
    8 stages x 2 rounds: 7 trips' chunks and masks, 25 GiB a device)."""
    mesh = _mesh({"stage": 4})
    params, x = jax.ShapeDtypeStruct((8, 256, 256), jnp.float32), jax.ShapeDtypeStruct((16, 256), jnp.float32)
    with pipelined(PipelineConfig(4, 4, "circular", repeats=2), mesh):
        lowered = jax.jit(jax.grad(_toy_loss), in_shardings=(NamedSharding(mesh, P("stage")),
                                                             NamedSharding(mesh, P()))).lower(params, x)
    lowered.compile(compiler_options={"xla_dump_to": str(tmp_path)})
    text = "".join(p.read_text() for p in tmp_path.glob("*buffer-assignment.txt"))
    assert re.search(r"\): f32\[[0-9,]*256,256\]", text)         # the weights' buffers are read here
    assert not re.findall(r"\): pred\[[0-9,]*256,256\]", text)
    assert not re.findall(r"\): f32\[3,[0-9,]*256,256\]", text)      # 3 trips' chunks


def test_pipelined_sgd_parameters_match():
    _, expected = _unpipelined("gpt-tiny", "sgd")
    _, params, _ = _pipelined_run("gpt-tiny", "sgd", {"stage": 4, "data": 2}, PipelineConfig(4, 8))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(expected)):
        scale = float(np.max(np.abs(b))) or 1.0
        assert float(jnp.max(jnp.abs(np.asarray(a) - b))) <= 1e-5 * scale, jax.tree_util.keystr(path)


@pytest.mark.parametrize("replicas", [1, 2])
def test_each_microbatch_draws_its_own_dropout_masks(replicas):
    """Per-layer PRNG keys scanned with the weights: under a pipeline each microbatch (and row
    group) draws its own masks, as the rows of the whole batch do, not a copy of the first's."""
    layers, batch, width, M = 4, 16, 64, 4

    def step(w, keys):
        def body(h, xs):
            wl, k = xs
            return h * wl * jax.random.bernoulli(k, 0.5, h.shape), None
        return layer_scan(body, jnp.ones((batch, width)), (w, keys))[0]
    w, keys = jnp.ones((layers,)), jax.random.split(jax.random.key(0), layers)
    mesh = jax.make_mesh((2, 4), ("stage", "model"), axis_types=(AxisType.Auto,) * 2)
    with pipelined(PipelineConfig(2, M, replicas=replicas), mesh):
        out = np.asarray(jax.jit(step)(w, keys))
    rows = [out[m::M] for m in range(M)]                   # microbatch m: rows m, m + M, ...
    assert not any(np.array_equal(rows[0], r) for r in rows[1:])
    assert 0.02 < out.mean() < 0.12                        # four layers keeping half: 1/16 kept


def test_layer_scan_is_a_plain_scan_outside_a_pipeline():
    xs = jnp.arange(12.0).reshape(4, 3)
    body = lambda c, x: (c + x, c * x)
    got, want = layer_scan(body, jnp.ones(3), xs), jax.lax.scan(body, jnp.ones(3), xs)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)


def test_config_counts_the_loop_and_its_bubble():
    gpipe, circular = PipelineConfig(4, 8), PipelineConfig(4, 8, "circular", repeats=2)
    assert (gpipe.iterations, circular.iterations) == (11, 19)
    assert gpipe.bubble == pytest.approx(3 / 11) and circular.bubble == pytest.approx(3 / 19)
    assert circular.to_json() == {"stages": 4, "microbatches": 8, "schedule": "circular", "repeats": 2,
                                  "axis": "stage"}
    held = PipelineConfig(4, 8, batch_axes="data")
    assert held.batch_axes == ("data",) and PipelineConfig.from_json(held.to_json()) == held
    groups = PipelineConfig(4, 8, replicas=16)
    assert groups.to_json()["replicas"] == 16 and PipelineConfig.from_json(groups.to_json()) == groups
    assert "weight gradients summed over 16 row groups" in groups.describe()


@pytest.mark.parametrize("kwargs,match", [
    ({"stages": 0, "microbatches": 4}, r"stages=0 is not a positive whole number"),
    ({"stages": 2, "microbatches": 4, "schedule": "1f1b"}, r"schedule='1f1b' is not a pipeline schedule; .*gpipe"),
    ({"stages": 2, "microbatches": 4, "repeats": 2}, r"repeats=2 needs schedule='circular'"),
    ({"stages": 4, "microbatches": 2, "schedule": "circular", "repeats": 2},
     r"at least as many microbatches as stages: microbatches=2 < stages=4"),
    ({"stages": 2, "microbatches": 4, "batch_axes": ("data", "stage")},
     r"batch_axes=\('data', 'stage'\) holds the stage axis"),
])
def test_bad_configs_are_refused_naming_the_setting(kwargs, match):
    with pytest.raises(PipelineError, match=match):
        PipelineConfig(**kwargs)


def _toy_loss(params, x):
    h, _ = layer_scan(lambda c, p: (jnp.tanh(c @ p), None), x, params)
    return h.sum()


@pytest.mark.parametrize("layers,batch,axes,config,match", [
    (6, 8, {"stage": 4}, PipelineConfig(4, 2),
     r"6 layers do not split into 4 stages x 1 repeats; .*no number of repeats.* stages in \[2, 3, 6\]"),
    (8, 8, {"stage": 4}, PipelineConfig(4, 4, "circular", repeats=4),
     r"8 layers .* with the mesh's 4 stages use repeats in \[1, 2\]"),
    (4, 6, {"stage": 2}, PipelineConfig(2, 4), r"a batch of 6 does not split into 4 microbatches"),
    (4, 8, {"data": 2}, PipelineConfig(2, 4), r"stage axis 'stage' is not a mesh axis \(axes: data\)"),
    (4, 8, {"stage": 4}, PipelineConfig(2, 4), r"mesh axis 'stage' has 4 devices, the pipeline 2 stages"),
    (4, 8, {"stage": 2}, PipelineConfig(2, 4, batch_axes="data"), r"batch_axes \['data'\] are not mesh axes"),
    (4, 8, {"stage": 2}, PipelineConfig(2, 2, replicas=3), r"microbatches of 4 rows .* do not split into replicas=3"),
])
def test_bad_pipelines_are_refused_naming_the_setting(layers, batch, axes, config, match):
    params, x = jnp.ones((layers, 3, 3)), jnp.ones((batch, 3))
    with pytest.raises(PipelineError, match=match):
        with pipelined(config, _mesh(axes)):
            jax.jit(_toy_loss)(params, x)


def test_per_layer_outputs_are_refused_under_a_pipeline():
    with pytest.raises(PipelineError, match=r"must return \(carry, None\)"):
        with pipelined(PipelineConfig(2, 2), _mesh({"stage": 2})):
            jax.jit(lambda p, x: layer_scan(lambda c, w: (c @ w, c), x, p)[0].sum())(jnp.ones((2, 3, 3)),
                                                                                      jnp.ones((4, 3)))


def test_a_carry_leaf_without_the_batch_first_is_named():
    with pytest.raises(PipelineError, match=r"\[1\]: a scalar.*batch first"):
        with pipelined(PipelineConfig(2, 2), _mesh({"stage": 2})):
            jax.jit(lambda p, x: layer_scan(lambda c, w: ((c[0] @ w, c[1]), None), (x, jnp.float32(0)), p)[0][0]
                    .sum())(jnp.ones((2, 3, 3)), jnp.ones((4, 3)))


def test_a_mesh_without_automatic_axes_is_refused_with_the_fix():
    """jax.make_mesh makes Explicit axes in this JAX; the pipeline's sharding constraints need Auto."""
    mesh = jax.make_mesh((2,), ("stage",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    with pytest.raises(PipelineError, match=r"axis_types=\(jax.sharding.AxisType.Auto,\) \* 1"):
        with pipelined(PipelineConfig(2, 2), mesh):
            pass


def test_forward_mode_through_a_pipeline_and_an_auto_step_under_a_transform_say_what_to_do():
    import shardplan
    from shardplan import ShardplanError
    params, x = jnp.ones((4, 3, 3)), jnp.ones((8, 3))
    mesh = _mesh({"stage": 2, "data": 4})

    def jvp_step(p, x):
        return jax.jvp(lambda p: _toy_loss(p, x), (p,), (jnp.ones_like(p),))
    step = shardplan.auto(jvp_step, mesh=mesh, cache=False, time_limit=2)
    with pytest.raises(ShardplanError, match=r"forward-mode .*jax\.grad, jax\.vjp.*pipeline=None"):
        with pipelined(PipelineConfig(2, 2), mesh):
            step(params, x)
    plain = shardplan.auto(_toy_loss, mesh=mesh, cache=False, time_limit=2)
    with pytest.raises(ShardplanError, match=r"called on traced values.*transform inside the step"):
        jax.grad(lambda p: plain(p, x))(params)


@pytest.mark.parametrize("model,axes,config", [
    ("gpt-tiny", {"stage": 2, "data": 4}, PipelineConfig(2, 4)),
    ("llama-tiny", {"stage": 2, "data": 2, "model": 2}, PipelineConfig(2, 4, "circular", repeats=2)),
    ("gpt-tiny", {"stage": 2, "data": 4}, PipelineConfig(2, 4, replicas=4)),
])
def test_the_planner_plans_around_a_pipeline(model, axes, config):
    """``shardplan.auto`` on a step traced inside ``pipelined``: the pipeline's stage axis is held
    (its sharding constraints), the planner shards everything else, and the loop matches."""
    import shardplan
    expected, _ = _unpipelined(model, "adamw")
    ref = _ref(model, "adamw")
    mesh = _mesh(axes)
    step = shardplan.auto(ref.train_step, mesh=mesh, donate_argnums=(0,), cache=False, time_limit=2)
    state, losses = ref.init(jax.random.key(0)), []
    with pipelined(config, mesh):
        for k in range(STEPS):
            state, metrics = step(state, ref.batch(BATCH, seed=k))
            losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    plan = step.plan
    assert not plan.warnings, plan.warnings
    assert plan.pipeline is None and plan.stage_shifts
    assert "pipeline: the step's own (traced inside pipelined(...)), planned around" in plan.explain()
    if config.schedule is Schedule.GPIPE:     # each stage's layers where the stage runs them
        stacked = [r for r in plan.inputs if "['layers']" in r.name and r.role == "params"]
        assert stacked and all(tuple(r.spec[0]) == ("stage",) for r in stacked), [(r.name, r.spec) for r in stacked]


def _loop_gradient_reductions(hlo: str) -> int:
    """All-reduces of several buffers at once (XLA's combined weight-gradient reductions) outside
    the entry computation: inside the pipeline's loops."""
    count, entry = 0, False
    for line in hlo.splitlines():
        if line and not line.startswith(" "):
            entry = line.startswith("ENTRY")
        if not entry and re.search(r"= \([^)]*\)\S* all-reduce(-start)?\(", line):
            count += 1
    return count


def test_replicas_reduce_weight_gradients_once_a_step_not_once_a_microbatch():
    axes = {"stage": 2, "data": 4}
    *_, per_trip = _pipelined_run("gpt-tiny", "adamw", axes, PipelineConfig(2, 4, batch_axes="data"))
    *_, once = _pipelined_run("gpt-tiny", "adamw", axes, PipelineConfig(2, 4, batch_axes="data", replicas=4))
    assert _loop_gradient_reductions(per_trip) > 0
    assert _loop_gradient_reductions(once) == 0


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_the_stage_shift_is_one_collective_permute_each_way_and_the_audit_holds_it(target):
    """Four stages: each loop trip moves one stage's state on (a collective-permute of a stage's
    microbatch, its gradient one back), not an all-gather of every stage's; the plan predicts
    those bytes exactly, every collective within 5% and memory within 15% of the compiled program
    (the CPU compiler here, the GPU compiler with no GPU where ``shardplan[aot]`` is installed)."""
    import shardplan
    from shardplan.compiler import targets
    if not targets.available(target):
        pytest.skip(f"the {target} compiler is not installed (pip install 'shardplan[aot]')")
    ref = _ref("gpt-tiny", "adamw")
    mesh = shardplan.load_mesh("cpu-8" if target == "cpu" else "h100-8", axes={"data": 8})
    config = PipelineConfig(4, 8)
    step = shardplan.auto(ref.train_step, mesh=mesh, donate_argnums=(0,), cache=False, time_limit=2, pipeline=config)
    state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(BATCH, abstract=True)
    audit = step.audit_for(target, state, batch)
    by_kind = {r.name: r for r in audit.by_kind}
    permute = by_kind["collective-permute"]
    assert permute.compiled_bytes > 0 and permute.predicted_bytes == pytest.approx(permute.compiled_bytes, rel=1e-6)
    # One permute a trip of each loop (forward, backward), each of at most one microbatch's
    # state (rows split over the data axis, if the plan splits them): not every stage's.
    assert permute.compiled_count == 2 * config.iterations, audit.table()
    c = ref.config
    assert permute.compiled_bytes / permute.compiled_count <= BATCH // config.microbatches * c.seq_len * c.d_model * 4
    assert abs(audit.comm_error()) <= 0.05, audit.table()
    assert abs(audit.memory_error()) <= 0.15, audit.table()
    assert not audit.divergences(), audit.table()
