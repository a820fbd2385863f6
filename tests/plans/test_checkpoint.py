"""orbax checkpoints of a planned train state: saved under one plan and mesh, restored under another."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import shardplan
from shardplan.models.train import reference
from shardplan.plans import checkpoint

ONE_DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _planned_step(ref, axes):
    return shardplan.auto(ref.train_step, mesh=shardplan.load_mesh("cpu-8", axes=axes), donate_argnums=(0,),
                          time_limit=2)


def _small_state():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    w = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, PartitionSpec("data", "model")))
    return {"w": w, "b": jnp.ones(8), "step": 3, "none": None, "table": np.arange(3, dtype=np.int32)}


@pytest.mark.slow
def test_save_on_2x4_restore_on_4x2_under_another_plan_continues_the_run(tmp_path):
    ref = reference("gpt-tiny", scan=True)
    key = jax.random.key(0)
    abstract_state, abstract_batch = jax.eval_shape(ref.init, key), ref.batch(16, abstract=True)
    batches = [ref.batch(16, seed=i) for i in range(3)]

    step_a = _planned_step(ref, {"data": 2, "model": 4})
    state = ref.init(key)
    for batch in batches[:2]:
        state, _ = step_a(state, batch)
    saved = jax.tree.map(np.asarray, state)
    checkpoint.save(tmp_path / "run", state, step=2)      # before the next call donates the state
    state, metrics = step_a(state, batches[2])
    loss_a = float(metrics["loss"])                       # the uninterrupted run

    step_b = _planned_step(ref, {"data": 4, "model": 2})
    plan_a, plan_b = step_a.plan, step_b.make_plan(abstract_state, abstract_batch)
    specs_a = [r.partition_spec for r in plan_a.inputs if r.name.startswith("[0]")]
    specs_b = [r.partition_spec for r in plan_b.inputs if r.name.startswith("[0]")]
    assert len(specs_a) == len(specs_b) and specs_a != specs_b       # another plan, not only another mesh
    shardings = plan_b.in_shardings()[0]

    assert checkpoint.latest_step(tmp_path / "run") == 2
    restored = checkpoint.restore(tmp_path / "run", abstract_state, shardings)
    assert jax.tree.structure(restored) == jax.tree.structure(abstract_state)
    for got, want, sh in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), jax.tree.leaves(shardings)):
        assert got.sharding == sh
        np.testing.assert_array_equal(np.asarray(got), want)

    _, metrics = step_b(restored, batches[2])
    loss_b = float(metrics["loss"])
    # The checkpoint loses nothing: the same state put on plan b's shardings directly gives this loss
    # bit for bit. Against the uninterrupted run on (2, 4), the other mesh sums its partial results in
    # another order: float32 rounding (here 1 ulp), well within 1e-6.
    _, metrics = step_b(jax.device_put(saved, shardings), batches[2])
    assert float(metrics["loss"]) == loss_b
    np.testing.assert_allclose(loss_b, loss_a, rtol=1e-6)


def test_non_array_leaves_round_trip(tmp_path):
    state = _small_state()
    checkpoint.save(tmp_path / "ckpt", state)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    replicated = NamedSharding(mesh, PartitionSpec())
    # A concrete state as the target: Python scalars, None and numpy arrays come back as they are.
    got = checkpoint.restore(tmp_path / "ckpt", state, replicated)
    assert got["step"] == 3 and type(got["step"]) is int and got["none"] is None
    assert isinstance(got["table"], np.ndarray) and got["table"].tolist() == [0, 1, 2]
    assert got["w"].sharding == replicated and got["b"].sharding == replicated
    np.testing.assert_array_equal(np.asarray(got["w"]), np.arange(64.0).reshape(8, 8))
    # An abstract target (jax.eval_shape's): the saved int restores as an array on its sharding.
    abstract = jax.eval_shape(_small_state)
    got = checkpoint.restore(tmp_path / "ckpt", abstract, replicated)
    assert isinstance(got["step"], jax.Array) and int(got["step"]) == 3 and got["step"].sharding == replicated


def test_no_checkpoint_at_the_path_is_a_clear_error(tmp_path):
    abstract = jax.eval_shape(_small_state)
    for where in (tmp_path / "nothing", tmp_path):          # missing; a directory with no checkpoint
        with pytest.raises(checkpoint.CheckpointNotFoundError, match="no checkpoint at|no finished") as e:
            checkpoint.restore(where, abstract, ONE_DEVICE)
        assert isinstance(e.value, shardplan.ShardplanError) and str(where) in str(e.value)
    checkpoint.save(tmp_path / "run", _small_state(), step=5)
    with pytest.raises(checkpoint.CheckpointNotFoundError, match=r"no finished step 4 .*\[5\]"):
        checkpoint.restore(tmp_path / "run", abstract, ONE_DEVICE, step=4)


def test_a_structure_mismatch_names_the_first_differing_leaf(tmp_path):
    checkpoint.save(tmp_path / "ckpt", _small_state())
    sh = ONE_DEVICE
    abstract = jax.eval_shape(_small_state)
    renamed = {**{k: v for k, v in abstract.items() if k != "b"}, "bias": abstract["b"]}
    with pytest.raises(checkpoint.CheckpointMismatchError, match="has no leaf bias") as e:
        checkpoint.restore(tmp_path / "ckpt", renamed, sh)
    assert e.value.leaf == "bias"
    fewer = {k: v for k, v in abstract.items() if k != "b"}
    with pytest.raises(checkpoint.CheckpointMismatchError, match="has a leaf b the target does not"):
        checkpoint.restore(tmp_path / "ckpt", fewer, sh)
    reshaped = {**abstract, "w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
    with pytest.raises(checkpoint.CheckpointMismatchError, match=r"w: .* shape \(8, 8\), the target \(8, 4\)"):
        checkpoint.restore(tmp_path / "ckpt", reshaped, sh)
    recast = {**abstract, "w": jax.ShapeDtypeStruct((8, 8), jnp.bfloat16)}
    with pytest.raises(checkpoint.CheckpointMismatchError, match="w: .* dtype float32, the target bfloat16"):
        checkpoint.restore(tmp_path / "ckpt", recast, sh)
    with pytest.raises(checkpoint.CheckpointMismatchError, match="no sharding for b"):
        checkpoint.restore(tmp_path / "ckpt", abstract)
    partial = {k: sh for k, sh in jax.tree.map(lambda _: sh, abstract).items() if k != "table"}
    with pytest.raises(checkpoint.CheckpointMismatchError, match="shardings do not mirror .* at table"):
        checkpoint.restore(tmp_path / "ckpt", abstract, partial)


def test_save_never_overwrites_nor_leaves_a_half_written_checkpoint(tmp_path):
    state = _small_state()
    checkpoint.save(tmp_path / "ckpt", state)
    with pytest.raises(checkpoint.CheckpointExistsError):
        checkpoint.save(tmp_path / "ckpt", state)
    checkpoint.save(tmp_path / "run", state, step=1)
    with pytest.raises(checkpoint.CheckpointExistsError, match="step 1"):
        checkpoint.save(tmp_path / "run", state, step=1)
    # A failed save raises, and nothing at the path reads as a checkpoint.
    with pytest.raises(ValueError, match="Unsupported type"):
        checkpoint.save(tmp_path / "bad", {**state, "x": object()})
    with pytest.raises(checkpoint.CheckpointNotFoundError):
        checkpoint.restore(tmp_path / "bad", jax.eval_shape(_small_state), ONE_DEVICE)
    # A donated (deleted) array is caught before orbax sees it.
    donated = dict(state, w=jnp.ones(3))
    donated["w"].delete()
    with pytest.raises(checkpoint.CheckpointError, match="cannot save w: the array was deleted"):
        checkpoint.save(tmp_path / "late", donated)
