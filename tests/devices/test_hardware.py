"""Pricing a jax.sharding.Mesh: device figures from device_kind, slow links where devices live apart."""

import os
import subprocess
import sys
import textwrap
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardplan
from shardplan.devices import hardware


@pytest.mark.parametrize("kind, preset", [
    ("NVIDIA H100 80GB HBM3", "h100-8"), ("NVIDIA H200", "h200-8"), ("NVIDIA A100-SXM4-80GB", "a100-8"),
    ("TPU v5 lite", "tpu-v5e-256"), ("TPU v5e", "tpu-v5e-256"), ("TPU v5", "tpu-v5p-2x512"),
    ("TPU v5p", "tpu-v5p-2x512"), ("cpu", "cpu-8"), ("Some Accelerator 9000", None)])
def test_device_kinds_map_to_presets(kind, preset):
    assert hardware.preset_for_kind(kind) == preset


def _fake_mesh(kind, platform, shape, names, process_of):
    devices = np.empty(shape, dtype=object)
    for k, idx in enumerate(np.ndindex(*shape)):
        devices[idx] = types.SimpleNamespace(id=k, platform=platform, device_kind=kind,
                                             process_index=process_of(idx), slice_index=process_of(idx))
    return types.SimpleNamespace(devices=devices, axis_names=names, shape=dict(zip(names, shape)))


def test_axes_across_hosts_ride_the_inter_node_link():
    # 4 hosts of 8 H100s: "data" spans hosts, "model" stays inside one.
    mesh = _fake_mesh("NVIDIA H100 80GB HBM3", "gpu", (4, 8), ("data", "model"), lambda idx: idx[0])
    spec = hardware.spec_for_mesh(mesh)
    h100 = shardplan.load_mesh("h100-8")
    assert spec.device == h100.device
    assert spec.axis("data").link == h100.inter_node_link
    assert spec.axis("model").link == h100.intra_node_link
    assert spec.devices_per_node == 8 and spec.num_devices == 32


def test_the_default_budget_is_what_the_allocator_hands_out(monkeypatch):
    h100 = shardplan.load_mesh("h100-8").device
    # CUDA reports 84,929,347,584 bytes of an H100 80GB; JAX's allocator takes 75% unless told.
    assert h100.usable_bytes == 84929347584 < h100.hbm_bytes
    assert h100.budget_bytes == int(84929347584 * 0.75)
    assert shardplan.load_mesh("cpu-8").device.budget_bytes == shardplan.load_mesh("cpu-8").device.hbm_bytes
    mesh = _fake_mesh("NVIDIA H100 80GB HBM3", "gpu", (8,), ("data",), lambda idx: 0)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert hardware.spec_for_mesh(mesh).device.budget_bytes == h100.budget_bytes
    # This process's allocator share is the one its plan runs under.
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".95")
    assert hardware.spec_for_mesh(mesh).device.budget_bytes == int(84929347584 * 0.95)
    tpu = _fake_mesh("TPU v5 lite", "tpu", (8,), ("data",), lambda idx: 0)
    assert hardware.spec_for_mesh(tpu).device.allocator_fraction == 1.0      # a GPU allocator's variable
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "1.5")
    with pytest.raises(ValueError, match=r"XLA_PYTHON_CLIENT_MEM_FRACTION='1.5' is not a fraction"):
        hardware.spec_for_mesh(mesh)


def test_tpu_axes_cross_slices_not_hosts():
    mesh = _fake_mesh("TPU v5 lite", "tpu", (2, 16), ("dcn", "ici"), lambda idx: idx[0])
    spec = hardware.spec_for_mesh(mesh)
    v5e = shardplan.load_mesh("tpu-v5e-256")
    assert spec.axis("dcn").link == v5e.inter_node_link and spec.axis("ici").link == v5e.intra_node_link


def test_unknown_device_kind_warns_once_and_says_how_to_calibrate():
    hardware._warned.discard("Mystery NPU")
    mesh = _fake_mesh("Mystery NPU", "npu", (2,), ("data",), lambda idx: 0)
    with pytest.warns(UserWarning, match=r"no preset describes device kind 'Mystery NPU'.*shardplan mesh calibrate"):
        spec = hardware.spec_for_mesh(mesh)
    assert spec.device == shardplan.load_mesh("cpu-8").device
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hardware.spec_for_mesh(mesh)          # the second time: silent


def test_hardware_override_prices_the_mesh_on_the_given_preset():
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    spec = hardware.spec_for_mesh(mesh, "h100-8")
    assert spec.device == shardplan.load_mesh("h100-8").device and spec.axis_sizes == (2, 2)


def test_hardware_needs_a_jax_mesh():
    with pytest.raises(TypeError, match="hardware= prices a jax.sharding.Mesh"):
        shardplan.auto(lambda x: x, mesh="cpu-8", hardware="h100-8")


def _step(state, x):
    loss = jnp.mean((x @ state["w"]) ** 2)
    g = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(state["w"])
    return {"w": state["w"] - 0.1 * g}, loss


def test_a_mesh_of_four_devices_plans_and_runs():
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    state, x = {"w": jnp.ones((16, 8)) * 0.1}, jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16) / 1000
    plain, expected = state, []
    for _ in range(3):
        plain, loss = jax.jit(_step)(plain, x)
        expected.append(float(loss))
    f = shardplan.auto(_step, mesh=mesh, donate_argnums=0, time_limit=2)
    losses = []
    for _ in range(3):
        state, loss = f(state, x)
        losses.append(float(loss))
    assert losses == pytest.approx(expected, rel=1e-6)
    assert f.mesh_spec.num_devices == 4 and f.mesh_spec.device == shardplan.load_mesh("cpu-8").device
    assert f._last.mesh is mesh


def test_a_mesh_of_sixteen_devices_plans_and_runs(tmp_path):
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np, shardplan
        def step(state, x):
            g = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(state["w"])
            return {"w": state["w"] - 0.1 * g}, jnp.mean((x @ state["w"]) ** 2)
        mesh = jax.make_mesh((4, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        state, x = {"w": jnp.ones((32, 16)) * 0.1}, jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) / 1e3
        ref_state, want = state, []
        for _ in range(3):
            ref_state, loss = jax.jit(step)(ref_state, x)
            want.append(float(loss))
        f = shardplan.auto(step, mesh=mesh, donate_argnums=0, time_limit=2)
        got = []
        for _ in range(3):
            state, loss = f(state, x)
            got.append(float(loss))
        np.testing.assert_allclose(got, want, rtol=1e-5)
        assert f.mesh_spec.num_devices == 16
        print("ok", f.mesh_spec.name)
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=16", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ok cpu-8-as-16" in out.stdout
