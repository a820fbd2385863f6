import jax
import pytest
from jax.sharding import PartitionSpec as P

from benchmarks.baselines import hand_plan
from models.train import reference


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
