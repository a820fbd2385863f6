"""Two processes x 4 CPU devices under jax.distributed (gloo): one plan, made once, run by both."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

import shardplan
from shardplan.models.train import reference

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # tests/: the worker script
MESH = shardplan.load_mesh("cpu-8", axes={"data": 2, "model": 4})


def _port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_two(tmp_path, modes, timeout=420):
    port = _port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    outs = [str(tmp_path / f"out{i}.json") for i in range(2)]
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_worker.py"), str(i), str(port),
                               modes[i], outs[i]], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a process of the 2-process run hung")
    wall = time.perf_counter() - start
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [json.loads(Path(o).read_text()) for o in outs], wall, logs


@pytest.fixture(scope="module")
def single():
    """The same step on one process with 8 devices: the plan and three losses."""
    ref = reference("gpt-tiny", scan=True)
    f = shardplan.auto(ref.train_step, mesh=MESH, donate_argnums=(0,), cache=False)
    state, batch, losses = ref.init(jax.random.key(0)), ref.batch(8), []
    for _ in range(3):
        state, m = f(state, batch)
        losses.append(float(m["loss"]))
    return f.plan, losses


def test_one_plan_reaches_both_processes_and_matches_one_process(single, tmp_path):
    plan, losses = single
    results, _, _ = _run_two(tmp_path, ["plan", "plan"])
    for r in results:
        assert "error" not in r, r
        assert r["digest"] == plan.digest()          # planned once, on process 0; the same plan everywhere
        assert r["losses"] == pytest.approx(losses, rel=1e-6)
    # Each process loaded only its share of the batch (the batch's data axis crosses processes).
    assert results[0]["local_rows"] != results[1]["local_rows"]


def test_a_pipelined_plan_reaches_both_processes_and_matches_one_process(single, tmp_path):
    _, losses = single
    results, _, _ = _run_two(tmp_path, ["pipeline", "pipeline"])
    for r in results:
        assert "error" not in r, r
        assert r["losses"] == pytest.approx(losses, rel=1e-5)     # the unpipelined step's losses
    assert results[0]["digest"] == results[1]["digest"]


def test_different_plans_on_two_processes_fail_fast(single, tmp_path):
    plan, _ = single
    a, b = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    plan.save(a)
    row = next(i for i, r in enumerate(plan.activations) if any(r.spec))
    acts = list(plan.activations)
    acts[row] = dataclasses.replace(acts[row], spec=((),) * len(acts[row].shape))
    dataclasses.replace(plan, activations=tuple(acts)).save(b)
    results, wall, _ = _run_two(tmp_path, [f"given:{a}", f"given:{b}"], timeout=120)
    for r in results:
        assert "plans differ between processes" in r.get("error", ""), r
    assert wall < 60


def test_a_step_that_differs_on_one_process_fails_on_both_in_seconds(tmp_path):
    """Process 1 traces another batch size than process 0 planned for: it cannot use the plan,
    and process 0 stops too instead of waiting in the step's first collective."""
    results, wall, _ = _run_two(tmp_path, ["plan", "plan-batch:4"], timeout=120)
    assert "does not match this step" in results[1].get("error", ""), results[1]
    assert "could not use the plan" in results[0].get("error", ""), results[0]
    assert wall < 60


def test_calibration_under_two_processes_writes_one_file_from_process_0(tmp_path):
    """Each process times its own device; the axis across processes is measured between them."""
    import tomllib
    port = _port()
    out = tmp_path / "calibrated.toml"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    procs = [subprocess.Popen([sys.executable, "-m", "shardplan.cli", "mesh", "calibrate", "--quick", "--out", str(out),
                               "--axes", "data=2,model=4", "--cpu-devices", "4", "--coordinator", f"localhost:{port}",
                               "--num-processes", "2", "--process-id", str(i)], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    runs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, runs):
        assert p.returncode == 0, err[-3000:]
    assert "wrote" in runs[0][1] and "wrote" not in runs[1][1]          # process 0 writes and says so
    assert sorted(os.listdir(tmp_path)) == ["calibrated.toml"]          # one file, nothing half-written
    data = tomllib.loads(out.read_text())
    cal = data["calibration"]
    assert cal["processes"] == 2 and cal["devices"] == 8
    assert cal["axes_across_processes"] == "data"
    assert data["topology"]["devices_per_node"] == 4 and data["topology"]["nodes"] == 2
    spec = shardplan.load_mesh(str(out))
    assert spec.num_devices == 8
    # Both axes carry their own measured figures (the fit of their all-reduce times), data's over
    # the link between the two processes.
    for axis in spec.axes:
        raw = next(a for a in data["axes"] if a["name"] == axis.name)
        assert axis.link.bandwidth == raw["bandwidth"] > 0 and axis.link.latency == raw["latency"] >= 0
        assert f"{axis.name}_seconds" in cal
