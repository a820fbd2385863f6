"""The planner chooses the pipeline (shardplan.parallel.pipeline_search): candidates and their meshes, the
choice moving the textbook way, the choice carried by the plan (JSON, explain) and run."""

import os
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import shardplan
from shardplan import PlanFileError
from shardplan.models.train import reference
from shardplan.parallel.pipeline import PipelineConfig, PipelineError, StackSite
from shardplan.parallel.pipeline_search import candidates, microbatch_counts, with_stage_axis

# Two nodes of four fake devices joined by a link 100x slower than the one inside a node.
TWO_NODES = """
name = "cpu-2x4-slow"
source = "test: two nodes of four fake devices joined by a slow link"
[device]
name = "host CPU (fake device)"
peak_flops = { float32 = 5e10, bfloat16 = 2.5e10 }
hbm_bytes = 4294967296
hbm_bandwidth = 1e10
[links.memcpy]
bandwidth = 5e9
latency = 2e-5
[links.slow]
bandwidth = 5e7
latency = 1e-4
[topology]
devices_per_node = 4
nodes = 2
intra_node_link = "memcpy"
inter_node_link = "slow"
[[axes]]
name = "data"
size = 2
[[axes]]
name = "model"
size = 4
"""


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    path = tmp_path_factory.mktemp("meshes") / "two_nodes.toml"
    path.write_text(TWO_NODES)
    return str(path)


def _plan(mesh, pipeline, budget=None, batch=16, **overrides):
    ref = reference("gpt-tiny", scan=True, n_layers=8, **overrides)
    return shardplan.plan(ref.train_step, jax.eval_shape(ref.init, jax.random.key(0)),
                          ref.batch(batch, abstract=True), mesh=mesh, pipeline=pipeline, memory_budget=budget,
                          cache=False, time_limit=2)


def test_the_stage_axis_is_split_off_the_outer_axis_on_the_link_it_crosses(two_nodes):
    mesh = shardplan.load_mesh(two_nodes)
    staged = with_stage_axis(mesh, 2)
    assert dict(zip(staged.axis_names, staged.axis_sizes)) == {"stage": 2, "model": 4}
    assert staged.axis("stage").link.name == "slow" and staged.axis("model").link.name == "memcpy"
    h100 = with_stage_axis(shardplan.load_mesh("h100-8x8"), 4)
    assert dict(zip(h100.axis_names, h100.axis_sizes)) == {"stage": 4, "data": 2, "model": 8}
    with pytest.raises(PipelineError, match=r"no axis of mesh .* splits into 3 stages"):
        with_stage_axis(mesh, 3)
    auto = candidates(shardplan.load_mesh("h100-8x8"), "auto")
    assert auto[0].config is None and {c.config.stages for c in auto[1:]} == {2, 4, 8}
    with pytest.raises(PipelineError, match=r"pipeline='sometimes': give 'auto', 'off', a number of stages"):
        candidates(mesh, "sometimes")


def test_microbatches_split_over_the_data_axes_and_gradients_are_summed_once():
    # GPT-3 175B's stack on 1024 A100s: 96 layers, batch 1536, 350 GB of bf16 weights.
    mesh = shardplan.load_mesh("a100-128x8")
    stack = StackSite(layers=96, batch=1536, nbytes=350 * 10**9)
    staged = with_stage_axis(mesh, 8)                          # {stage: 8, data: 16, model: 8}
    counts = microbatch_counts(staged, 8, 1536)
    assert counts and all(1536 % m == 0 and (1536 // m) % 16 == 0 for m in counts)
    assert 64 not in counts                                    # 24 rows do not split over 16 data ranks
    by_stages = {}
    for c in candidates(mesh, "auto", stack, budget_bytes=mesh.device.budget_bytes)[1:]:
        by_stages.setdefault(c.config.stages, []).append(c.config)
    assert sorted(by_stages) == [2, 4, 8, 16]
    eight = by_stages[8]
    assert [(c.microbatches, c.schedule.value, c.replicas) for c in eight] == \
        [(16, "gpipe", 1), (48, "gpipe", 16), (16, "circular", 16)]
    # Two stages: a stage's weights with their gradients (175 GB over 8 devices) are more than
    # half the budget, so no copy per data rank.
    assert all(c.replicas == 1 for c in by_stages[2])
    # Deeper pipelines, tried only where none of up to 16 stages fits: the 1T-parameter row of the
    # Megatron-LM study (128 layers on 384 nodes of 8) gets 32 and 64 stages.
    from shardplan.devices.cluster import cluster_mesh
    huge = cluster_mesh("a100-128x8", {"model": 8}, {"data": -1}, nodes=384)
    deep = candidates(huge, "auto", StackSite(128, 3072, 2 * 10**12), huge.device.budget_bytes, deep=True)
    assert {c.config.stages for c in deep} == {32, 64} and all(c.config is not None for c in deep)
    # Without the stack (no probe) the counts are the fixed 2S and 8S.
    assert [c.config.microbatches for c in candidates(mesh, 8)] == [16, 64, 16]


def test_no_pipeline_on_one_node_with_ample_memory():
    p = _plan(shardplan.load_mesh("cpu-8", axes={"data": 8}), "auto")
    assert p.pipeline is None and "pipeline: none" in p.explain()


def test_auto_says_why_it_tried_no_pipeline():
    ref = reference("gpt-tiny", scan=True, n_layers=7)
    p = shardplan.plan(ref.train_step, jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(16, abstract=True),
                       mesh=shardplan.load_mesh("cpu-8", axes={"data": 8}), pipeline="auto", cache=False,
                       time_limit=2)
    assert p.pipeline is None
    (why,) = [w for w in p.warnings if "pipeline='auto'" in w]
    assert "none of its stage counts [2, 4, 8] divides the 7 layers" in why and "pipeline=N" in why
    assert why in p.explain()


def test_a_pipeline_across_a_slow_link_when_memory_is_tight(two_nodes):
    ample = _plan(two_nodes, "auto", d_model=128, d_ff=512)
    assert ample.pipeline is None                 # everything fits inside a node: no bubble to pay
    tight_off = _plan(two_nodes, "off", "24MiB", d_model=128, d_ff=512)
    tight = _plan(two_nodes, "auto", "24MiB", d_model=128, d_ff=512)
    # Without a pipeline the state must be split over the slow link; a 2-stage pipeline across it
    # moves only activations there.
    assert tight.pipeline is not None and tight.pipeline["stages"] == 2, tight.explain()
    assert tight.cost.step_s < tight_off.cost.step_s and tight.cost.memory_bytes <= 24 * 2**20
    assert dict(zip(tight.axis_names, tight.axis_sizes)) == {"stage": 2, "model": 4}


def test_more_microbatches_where_the_bubble_dominates(two_nodes):
    # Short sequences of a wide model: each microbatch's fixed costs (the stage moves, the weight
    # gradients accumulated per microbatch) dominate, so few microbatches. Long sequences of a
    # narrow model: compute dominates, and the bubble with it, so many.
    few = _plan(two_nodes, 2, d_model=128, d_ff=512)
    many = _plan(two_nodes, 2, d_model=64, d_ff=256, seq_len=256, batch=64)
    assert few.pipeline["microbatches"] < many.pipeline["microbatches"], (few.pipeline, many.pipeline)


def test_a_step_without_layer_scan_has_nothing_to_pipeline():
    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: ((x @ w) ** 2).sum())(w), None
    w, x = jax.ShapeDtypeStruct((32, 32), np.float32), jax.ShapeDtypeStruct((16, 32), np.float32)
    mesh = shardplan.load_mesh("cpu-8", axes={"data": 8})
    assert shardplan.plan(step, w, x, mesh=mesh, pipeline="auto", cache=False).pipeline is None
    with pytest.raises(PipelineError, match=r"the step has no layer stack a pipeline can split \(a jax.lax.scan over "
                                            r"stacked layer weights"):
        shardplan.plan(step, w, x, mesh=mesh, pipeline=2, cache=False)


def test_a_pipelined_plan_runs_saves_and_loads(tmp_path):
    ref = reference("gpt-tiny", scan=True, n_layers=8, optimizer=optax.adamw(1e-2))
    state0 = ref.init(jax.random.key(0))
    plain, state, expected = jax.jit(ref.train_step), state0, []
    for k in range(3):
        state, metrics = plain(state, ref.batch(16, seed=k))
        expected.append(float(metrics["loss"]))
    mesh = shardplan.load_mesh("cpu-8", axes={"data": 8})
    step = shardplan.auto(ref.train_step, mesh=mesh, pipeline=PipelineConfig(4, 8), cache=False,
                          donate_argnums=(0,), time_limit=2)
    state, losses = jax.tree.map(lambda x: x.copy(), state0), []
    for k in range(3):
        state, metrics = step(state, ref.batch(16, seed=k))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    plan = step.plan
    assert plan.pipeline == {"stages": 4, "microbatches": 8, "schedule": "gpipe", "repeats": 1, "axis": "stage"}
    assert "pipeline: 4 stages over mesh axis 'stage', 8 microbatches, gpipe (bubble 27%)" in plan.explain()
    path = os.path.join(tmp_path, "p.json")
    plan.save(path)
    again = shardplan.auto(ref.train_step, plan=path, donate_argnums=(0,))
    state, metrics = again(jax.tree.map(lambda x: x.copy(), state0), ref.batch(16, seed=0))
    np.testing.assert_allclose(float(metrics["loss"]), expected[0], rtol=1e-5)
    # With the mesh it was planned on (no stage axis): the stage axis split off it as the planner did.
    for given in (mesh, mesh.to_jax_mesh()):
        on_mesh = shardplan.auto(ref.train_step, plan=path, mesh=given, donate_argnums=(0,))
        state, metrics = on_mesh(jax.tree.map(lambda x: x.copy(), state0), ref.batch(16, seed=0))
        np.testing.assert_allclose(float(metrics["loss"]), expected[0], rtol=1e-5)
    with pytest.raises(shardplan.PlanMismatchError, match="was made for mesh axes"):
        shardplan.auto(ref.train_step, plan=path,
                       mesh=shardplan.load_mesh("cpu-8", axes={"data": 2, "fsdp": 2, "model": 2}))
    edited = Path(path).read_text().replace('"stages": 4', '"stages": 3')
    with pytest.raises(PlanFileError, match=r"pipeline's 3 stages are not a mesh axis 'stage' of that size"):
        shardplan.Plan.from_json(edited, source="edited")


def test_the_plan_made_alongside_is_silent_and_hands_back_its_result_or_error(monkeypatch):
    from shardplan.planning.search import _on_thread
    from shardplan.util import progress

    class Tty:
        def isatty(self):
            return True
    monkeypatch.delenv("CI", raising=False)
    assert progress.wanted(Tty())             # a terminal: progress shown here
    assert _on_thread(lambda: (progress.wanted(Tty()), 7))() == (False, 7)    # not from the thread
    assert progress.wanted(Tty())

    def fails():
        raise shardplan.InfeasibleBudgetError("no plan fits", budget_bytes=1, min_feasible_bytes=2,
                                              largest_tensors=[])
    with pytest.raises(shardplan.InfeasibleBudgetError, match="no plan fits"):
        _on_thread(fails)()
