import jax
import pytest
from jax.sharding import PartitionSpec as P

from shardplan.benchmarks.baselines import hand_plan
from shardplan.models.train import reference


@pytest.fixture(scope="module")
def gpt():
    ref = reference("gpt-tiny", scan=True)
    return jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(8, abstract=True)


def _params(specs):
    return {jax.tree_util.keystr(p).replace(".value", ""): s for p, s in jax.tree_util.tree_leaves_with_path(
        specs["params"], is_leaf=lambda x: isinstance(x, P))}


def test_megatron_is_column_then_row_with_data_parallel_batch(gpt):
    state, batch = gpt
    specs, batch_specs = hand_plan("megatron", state, batch, {"data": 2, "model": 4}, stacked=True)
    params = _params(specs)
    assert params["['layers']['blocks']['fc']['kernel']"] == P(None, None, "model")
    assert params["['layers']['blocks']['out']['kernel']"] == P(None, "model")
    assert params["['wte']['embedding']"] == P("model")
    assert params["['layers']['blocks']['ln1']['scale']"] == P()
    assert batch_specs["inputs"] == P("data")


def test_fsdp_shards_largest_dim_over_all_axes_and_dp_replicates(gpt):
    state, batch = gpt
    specs, batch_specs = hand_plan("fsdp", state, batch, {"data": 2, "model": 4}, stacked=True)
    assert _params(specs)["['layers']['blocks']['fc']['kernel']"] == P(None, None, ("data", "model"))
    assert batch_specs["inputs"] == P(("data", "model"))
    specs, _ = hand_plan("dp", state, batch, {"data": 2, "model": 4}, stacked=True)
    assert set(_params(specs).values()) == {P()}


def test_unknown_baseline_is_named():
    with pytest.raises(ValueError, match="unknown baseline 'zero'; choose one of"):
        hand_plan("zero", {}, {}, {"data": 8}, stacked=False)


def test_megatron_baseline_is_sequence_parallel_and_trains_like_unsharded():
    """The Megatron baseline splits the residual stream along the sequence over `model`: its
    compiled step all-gathers and reduce-scatters where plain tensor parallelism all-reduces,
    and computes the unsharded step's loss."""
    import numpy as np
    from jax.sharding import NamedSharding

    from shardplan.benchmarks.baselines import activation_rules
    from shardplan.compiler.hlo import collectives
    from shardplan.devices.mesh import make_jax_mesh
    from shardplan.models.layers import activation_sharding
    ref = reference("gpt-tiny", scan=True)
    axes = {"data": 2, "model": 4}
    mesh = make_jax_mesh(tuple(axes), tuple(axes.values()))
    state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(8, abstract=True)
    specs = hand_plan("megatron", state, batch, axes, stacked=True)
    sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))

    def kinds(rules):
        f = jax.jit(lambda s, b: ref.train_step(s, b), in_shardings=sh, out_shardings=(sh[0], None))
        if rules is None:
            return {c.kind for c in collectives(f.lower(state, batch).compile().as_text(), mesh)}
        with activation_sharding(mesh, rules):
            return {c.kind for c in collectives(f.lower(state, batch).compile().as_text(), mesh)}
    assert kinds(None) == {"all-reduce"}
    assert {"all-gather", "reduce-scatter"} <= kinds(activation_rules("megatron", axes))

    concrete = ref.init(jax.random.key(0)), ref.batch(8)
    want = jax.jit(ref.train_step)(*concrete)[1]["loss"]
    with activation_sharding(mesh, activation_rules("megatron", axes)):
        f = jax.jit(lambda s, b: ref.train_step(s, b), in_shardings=sh, out_shardings=(sh[0], None))
        got = f(*jax.device_put(concrete, sh))[1]["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_activation_rule_naming_a_missing_mesh_axis_is_a_clear_error():
    from shardplan.devices.mesh import make_jax_mesh
    from shardplan.models.layers import activation_sharding
    mesh = make_jax_mesh(("data", "model"), (2, 4))
    with pytest.raises(ValueError, match="'seq' names mesh axis 'tensor'.*axes: data, model"):
        with activation_sharding(mesh, {"batch": "data", "seq": "tensor"}):
            pass


def test_expert_parallel_baseline_splits_experts_and_trains_like_unsharded():
    """MaxText's expert parallelism: each MoE layer's experts over `expert`, their embed
    dimension over `data`; XLA dispatches the tokens by all-to-all; the loss is the unsharded one."""
    import numpy as np
    from jax.sharding import NamedSharding

    from shardplan.benchmarks.baselines import activation_rules
    from shardplan.compiler.hlo import collectives
    from shardplan.devices.mesh import make_jax_mesh
    from shardplan.models.layers import activation_sharding
    ref = reference("mixtral-tiny", scan=True)
    axes = {"data": 2, "expert": 4}
    mesh = make_jax_mesh(tuple(axes), tuple(axes.values()))
    state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(8, abstract=True)
    specs = hand_plan("ep", state, batch, axes, stacked=True)
    params = _params(specs[0])
    assert params["['layers']['blocks']['moe']['wi_0']"] == P(None, "expert", "data", None)
    assert params["['layers']['blocks']['moe']['wo']"] == P(None, "expert", None, "data")
    assert specs[1]["inputs"] == P(("data", "expert"))
    sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    concrete = ref.init(jax.random.key(0)), ref.batch(8)
    want = jax.jit(ref.train_step)(*concrete)[1]["loss"]
    with activation_sharding(mesh, activation_rules("ep", axes)):      # tokens in expert slots pinned
        f = jax.jit(lambda s, b: ref.train_step(s, b), in_shardings=sh, out_shardings=(sh[0], None))
        assert "all-to-all" in {c.kind for c in collectives(f.lower(state, batch).compile().as_text(), mesh)}
        np.testing.assert_allclose(f(*jax.device_put(concrete, sh))[1]["loss"], want, rtol=1e-5)


def test_fsdp_baseline_keeps_activations_split_as_the_batch():
    """FSDP as one writes it: the residual stream split as the batch is, so the compiled step
    gathers weights, never a layer's whole activation. Left to XLA's propagation (no rules), the
    weights' layout spread into the activations and the step gathered them whole (GPT-3 175B on
    1024 GPUs: 52 TiB a step, 975 GiB with the rules; RESULTS.md, session 23)."""
    import contextlib
    import re

    from jax.sharding import NamedSharding

    from shardplan.benchmarks.baselines import activation_rules
    from shardplan.devices.mesh import make_jax_mesh
    from shardplan.models.layers import activation_sharding
    ref = reference("gpt-tiny", scan=True)
    axes = {"data": 2, "model": 4}
    mesh = make_jax_mesh(tuple(axes), tuple(axes.values()))
    state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(8, abstract=True)
    sh = jax.tree.map(lambda s: NamedSharding(mesh, s), hand_plan("fsdp", state, batch, axes, stacked=True),
                      is_leaf=lambda x: isinstance(x, P))

    def activation_gathers(rules):
        f = jax.jit(lambda s, b: ref.train_step(s, b), in_shardings=sh, out_shardings=(sh[0], None))
        with activation_sharding(mesh, rules) if rules else contextlib.nullcontext():
            text = f.lower(state, batch).compile().as_text()
        return [s for s in re.findall(r"= \w+\[([\d,]+)\]\{[^}]*\} all-gather\(", text) if s.startswith("8,32")]
    assert activation_rules("fsdp", axes) == {"batch": ("data", "model")}
    assert activation_gathers(None), "XLA no longer spreads the weights' layout into activations: say so"
    assert activation_gathers(activation_rules("fsdp", axes)) == []
