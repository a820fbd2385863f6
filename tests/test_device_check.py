"""The prepared accelerator check runs end to end on CPU and writes its numbers."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_device_check_writes_predicted_and_measured(tmp_path):
    out = tmp_path / "dc.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}     # one device, as on a lent GPU
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "device_check.py"), "--out", str(out),
                        "--models", "gpt-tiny:4", "--steps", "2"], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["facts"]["platform"] == "cpu" and data["facts"]["base"] == "cpu-8"
    assert data["calibration"]["peak_flops_measured"]["float32"] > 0
    [row] = data["models"]
    assert "error" not in row, row
    assert row["measured_s"] > 0 and row["predicted_s"] > 0
    # The program that ran is the one read back, and the plan trains like jax.jit.
    assert row["here"]["memory"] > 0 and row["memory_predicted"] > 0
    assert row["loss_max_rel_diff"] < 1e-4, (row["losses"], row["jit_losses"])
