"""The prepared accelerator check runs end to end on CPU and writes its numbers."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def test_profiled_model_records_kernels_and_its_program(tmp_path):
    """``@profile=N``: each kernel's time per step (the host's XLA ops stand in for a device's
    kernels here) and the compiled program beside the JSON, which kernel_split reads."""
    out = tmp_path / "dc.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["DEVICE_CHECK_PLANE"] = "/host:CPU"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "device_check.py"), "--out", str(out),
                        "--models", "gpt-tiny:4:@profile=2", "--steps", "2", "--quick", "--no-calibrate"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    [row] = json.loads(out.read_text())["models"]
    assert row["kernels"] and all(k["ns"] >= 0 and k["n"] > 0 for k in row["kernels"].values())
    assert (tmp_path / row["hlo_file"]).stat().st_size > 0
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernel_split.py"), str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "gpt-tiny" in r.stdout, r.stderr[-2000:]


def test_the_h200_profile_splits_into_matmuls_other_kernels_and_copies():
    """The profile taken on the lent H200 (session 21): the kernels add up to the measured step,
    and keeping every residual (``none``) spends more on copies than recomputing does."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gzip

    import kernel_split
    results = os.path.join(ROOT, "benchmarks", "results")
    with open(os.path.join(results, "device_check_h200_5.json")) as f:
        rows = json.load(f)["models"]
    split = {}
    for row in rows:
        with gzip.open(os.path.join(results, "h200_profile", row["hlo_file"]), "rt") as f:
            parts = kernel_split.split(row, f.read())
        assert parts["unmatched"] == 0
        assert abs(sum(parts.values()) - row["measured_s"] * 1e3) < 0.03 * row["measured_s"] * 1e3
        split[(row["model"], row["remat_setting"])] = parts
    for model in ("gpt2-small", "llama3-8b"):
        assert split[(model, "none")]["copies"] > 3 * split[(model, "dots")]["copies"]


def test_the_corpus_models_are_items_the_check_builds():
    """``--corpus N``: the first N decoders of the GPU corpus's fixed set, each as an item whose
    fields build the corpus's model, with one data-parallel row's batch."""
    import jax

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from device_check import corpus_models, parse_item

    from shardplan.benchmarks.fidelity import BASE, draw
    from shardplan.models.train import reference
    items = corpus_models(6)
    assert len(items) == 6
    decoders = [d for d in (draw(s, "gpu") for s in range(20)) if d.kind != "cnn"][:6]
    for item, d in zip(items, decoders):
        name, batch, overrides, flags = parse_item(item)
        assert name == BASE[d.kind] and overrides == dict(d.overrides) and not flags
        assert 1 <= batch <= d.batch
        ref = reference(name, scan=True, **overrides)
        jax.eval_shape(ref.init, jax.random.key(0))
