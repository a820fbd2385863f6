"""Predicted against measured on one real device.

    python benchmarks/device_check.py [--out device_check.json] [--models gpt2-small:16,...] [--corpus N]
        [--budget-s 300]

Each part runs in a process of its own (JAX preallocates most of a GPU's memory per process, and
each model's peak is read from a fresh allocator):

1. ``facts``: what the device reports (its kind, the memory the runtime and JAX's allocator offer,
   and, where PyTorch is installed, the multiprocessor count, L2 and shared memory) beside what the
   preset and the deviceless target config (:mod:`shardplan.compiler.targets`) assume.
2. ``calibrate``: matmul FLOP/s per dtype and memory bandwidth (:mod:`shardplan.devices.calibrate`)
   against the preset's peaks.
3. One part per model (``name:batch`` or ``name:batch:field=value``): plans the train step on a
   one-device mesh priced with the calibrated figures, runs it in a donated loop and reads
   predicted against measured step time; the memory the plan predicts, the device's own compile
   (``memory_analysis``), the deviceless compile of the same plan for this device kind, and the
   allocator's peak while it ran; and the losses of its first steps against ``jax.jit`` of the
   same step from the same state.

Writes everything to ``--out`` (JSON) as it goes, so a run cut short still leaves its numbers.
Made for a lent GPU (``benchmarks/device_check.sh``); it also runs on CPU, where the numbers only
check that the script works.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

if not __package__:   # run as a script from a checkout: import the checkout's shardplan
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_MODELS = "llama-tiny:8,gpt2-small:16,llama3-8b:1:n_layers=4,gpt3-1.3b:8"
MARK = "RESULT "


def corpus_models(n: int) -> list[str]:
    """The first ``n`` decoders of the GPU corpus's fixed set (:mod:`shardplan.benchmarks.fidelity`,
    seeds 0, 1, ...; its CNNs left out), each as a ``name:batch:field=value...`` item for one
    device: the batch one data-parallel row of its mesh holds."""
    from shardplan.benchmarks.fidelity import BASE, draw
    items, seed = [], 0
    while len(items) < n and seed < 10 * n + 10:
        d = draw(seed, "gpu")
        seed += 1
        if d.kind == "cnn":
            continue
        rows = 1
        for axis, size in d.axes:
            rows *= size if axis != "model" else 1
        fields = "".join(f":{k}={v}" for k, v in d.overrides)
        items.append(f"{BASE[d.kind]}:{max(1, d.batch // rows)}{fields}")
    return items


def _write(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def _base(device_kind: str, platform: str) -> str:
    """This device's preset (:func:`shardplan.devices.hardware.preset_for_kind`), else the platform's."""
    from shardplan.devices.hardware import preset_for_kind
    return preset_for_kind(device_kind) or {"gpu": "h100-8", "tpu": "tpu-v5e-256"}.get(platform, "cpu-8")


def _one_device(base: str, calibration: dict | None):
    """``base``'s device on a one-device mesh, with the calibrated peaks where given."""
    import shardplan
    preset = shardplan.load_mesh(base)
    device = preset.device
    if calibration:
        device = dataclasses.replace(device, peak_flops=dict(calibration["peak_flops_measured"]),
                                     hbm_bandwidth=calibration["hbm_bandwidth_measured"])
    return dataclasses.replace(preset, name=f"{base}-1", device=device,
                               axes=(dataclasses.replace(preset.axes[0], size=1),), devices_per_node=1)


def part_facts(args) -> dict:
    import jax

    import shardplan
    from shardplan.compiler import targets
    dev = jax.devices()[0]
    kind = str(getattr(dev, "device_kind", dev.platform))
    base = args.base or _base(kind, dev.platform)
    preset = shardplan.load_mesh(base)
    out = {"platform": dev.platform, "device_kind": kind, "jax": jax.__version__, "base": base,
           "XLA_PYTHON_CLIENT_MEM_FRACTION": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
           "preset": {"hbm_bytes": preset.device.hbm_bytes, "usable_bytes": preset.device.usable_bytes,
                      "allocator_fraction": preset.device.allocator_fraction,
                      "default_budget_bytes": preset.device.budget_bytes}}
    for k in ("core_count", "compute_capability"):
        if hasattr(dev, k):
            out[k] = str(getattr(dev, k))
    try:
        stats = dev.memory_stats() or {}
        out["memory_stats"] = {k: stats[k] for k in ("bytes_limit", "bytes_reservable_limit", "bytes_in_use")
                               if k in stats}
    except Exception as e:
        out["memory_stats"] = f"{type(e).__name__}: {e}"
    family = targets.gpu_family(preset)
    if family:
        out["target_config"] = dict(targets._GPU_FAMILIES[family])
    try:
        import torch
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            free, total = torch.cuda.mem_get_info(0)
            out["torch"] = {"name": p.name, "total_memory": p.total_memory, "mem_get_info_total": total,
                            **{k: getattr(p, k, None) for k in (
                                "multi_processor_count", "L2_cache_size", "shared_memory_per_block_optin",
                                "shared_memory_per_multiprocessor", "shared_memory_per_block",
                                "regs_per_multiprocessor", "max_threads_per_multi_processor", "major", "minor")}}
    except Exception as e:      # no PyTorch here: the JAX figures stand alone
        out["torch"] = f"{type(e).__name__}: {e}"
    return out


def part_calibrate(args) -> dict:
    import jax

    import shardplan
    from shardplan.devices.calibrate import calibrate
    dev = jax.devices()[0]
    base = args.base or _base(str(getattr(dev, "device_kind", "")), dev.platform)
    preset = shardplan.load_mesh(base, axes={"data": shardplan.load_mesh(base).num_devices})
    big = dev.platform != "cpu"
    mesh = calibrate(base=preset, axes={}, matmul_sizes=(1024, 4096, 8192) if big else (256, 512),
                     copy_bytes=(1 << 30) if big else (64 << 20), repeats=10 if big else 3)
    return {"peak_flops_measured": dict(mesh.device.peak_flops), "peak_flops_preset": dict(preset.device.peak_flops),
            "hbm_bandwidth_measured": mesh.device.hbm_bandwidth, "hbm_bandwidth_preset": preset.device.hbm_bandwidth,
            "offload_bandwidth_measured": mesh.device.offload_bandwidth,
            "offload_bandwidth_preset": preset.device.offload_bandwidth}


def parse_item(item: str) -> tuple[str, int, dict, dict]:
    """``name:batch:field=value:@flag=value...`` -> (name, batch, config overrides, flags): the
    flags ``@remat`` (this model's remat setting), ``@profile`` (then this many steps under the
    profiler: each kernel's time), ``@loop`` (then this many more donated calls, against as many
    under jax.jit)."""
    from shardplan.models.train import MODEL_CONFIGS
    name, batch, *fields = item.split(":")
    overrides, flags = {}, {}
    for f in fields:
        k, _, v = f.partition("=")
        if k.startswith("@"):
            flags[k[1:]] = v
        else:
            overrides[k] = type(getattr(MODEL_CONFIGS[name], k))(v)
    return name, int(batch), overrides, flags


def part_model(args) -> dict:
    import gc

    import jax
    import numpy as np

    import shardplan
    from shardplan.compiler import targets
    from shardplan.compiler.footprint import compiled_host_memory, compiled_memory
    from shardplan.models.train import reference
    name, batch, overrides, flags = parse_item(args.model)
    remat, loop, profile = flags.get("remat", args.remat), int(flags.get("loop", 0)), int(flags.get("profile", 0))
    dev = jax.devices()[0]
    base = args.base or _base(str(getattr(dev, "device_kind", "")), dev.platform)
    mesh = _one_device(base, json.loads(args.calibration) if args.calibration else None)
    ref = reference(name, scan=True, **overrides)
    row: dict = {"model": name, "batch": int(batch), "overrides": overrides, "mesh": mesh.name, "remat_setting": remat,
                 "budget": mesh.device.budget_bytes}
    data = ref.batch(int(batch))
    state = ref.init(jax.random.key(0))
    t = time.perf_counter()
    step = shardplan.auto(ref.train_step, mesh=mesh, donate_argnums=(0,), time_limit=20, remat=remat)
    state, metrics = step(state, data)
    losses = [float(metrics["loss"])]
    row["plan_and_compile_s"] = time.perf_counter() - t
    state, metrics = step(state, data)          # a second call must not recompile
    losses.append(float(metrics["loss"]))
    jax.block_until_ready(metrics)
    t = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = step(state, data)
    jax.block_until_ready(metrics)
    measured = (time.perf_counter() - t) / args.steps
    c = step.plan.cost
    row.update(predicted_s=c.step_s, predicted_compute_s=c.compute_s, predicted_comm_s=c.comm_s,
               predicted_offload_s=c.offload_s, measured_s=measured, time_ratio=measured / c.step_s,
               remat=str(step.plan.remat), memory_predicted=c.memory_bytes, host_memory_predicted=c.offload_bytes,
               fit_attempts=[str(a) for a in step.fit_attempts])
    try:
        row["memory_peak_in_use"] = dev.memory_stats()["peak_bytes_in_use"]
    except Exception as e:
        row["memory_peak_in_use"] = f"{type(e).__name__}: {e}"
    compiled, _, compiler = step.compile_for("cpu", state, data)     # the program that ran
    if profile:
        row["kernels"], row["hlo_file"], state = _profile(step, state, data, profile, compiled, args)
    m = compiled.memory_analysis()
    row["here"] = {"compiler": compiler, "memory": compiled_memory(compiled),
                   "host_memory": compiled_host_memory(compiled),
                   **{k: getattr(m, k) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                                 "temp_size_in_bytes", "alias_size_in_bytes")}}
    kind = targets.compiler_kind(mesh)
    if kind != "cpu" and not args.quick:
        try:
            t = time.perf_counter()
            a = step.audit_for(kind, state, data)
            dl, _, dl_compiler = step.compile_for(kind, state, data)
            m = dl.memory_analysis()
            row["deviceless"] = {"compiler": dl_compiler, "memory": a.memory.compiled_bytes,
                                 "host_memory": compiled_host_memory(dl),
                                 "collective_bytes": a.comm_bytes[1], "compile_s": time.perf_counter() - t,
                                 **{k: getattr(m, k) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                                               "temp_size_in_bytes", "alias_size_in_bytes")}}
        except Exception as e:
            row["deviceless"] = f"{type(e).__name__}: {str(e)[:400]}"
    # Parity: the same steps under plain jax.jit from the same initial state. jax.jit does not
    # recompute, so a plan that recomputes may be one jax.jit cannot fit: compared where it does not.
    policies = {s["policy"] for s in (step.plan.remat or {}).get("sites", [])}
    if args.quick:
        return row
    if policies - {"none"} and c.memory_bytes > 0.3 * mesh.device.budget_bytes:
        row["losses"], row["jit_losses"] = losses, f"not run: the plan recomputes ({', '.join(sorted(policies))})"
        return row
    del state, metrics
    gc.collect()
    jit_state = ref.init(jax.random.key(0))
    jitted = jax.jit(ref.train_step, donate_argnums=(0,))
    jit_losses = []
    for _ in range(len(losses)):
        jit_state, jm = jitted(jit_state, data)
        jit_losses.append(float(jm["loss"]))
    if loop:
        # The planned step called in a donated loop (its state in, its state out) against jax.jit.
        del jit_state
        gc.collect()
        state, jit_state = ref.init(jax.random.key(0)), ref.init(jax.random.key(0))
        t = time.perf_counter()
        for _ in range(loop):
            state, metrics = step(state, data)
        row["loop_s"] = time.perf_counter() - t
        for _ in range(loop):
            jit_state, jm = jitted(jit_state, data)
        row["loop"], row["loop_loss"], row["loop_jit_loss"] = loop, float(metrics["loss"]), float(jm["loss"])
    row["losses"], row["jit_losses"] = losses, jit_losses
    row["loss_max_rel_diff"] = float(np.max(np.abs(np.array(losses) - np.array(jit_losses))
                                            / np.maximum(np.abs(jit_losses), 1e-9)))
    return row


def _profile(step, state, data, steps: int, compiled, args) -> tuple[dict, str, object]:
    """Each kernel's device time per step over ``steps`` profiled steps, by kernel name (a
    fusion's kernel bears its name), with the profiler's statistics of its first event; and
    the compiled program's text written gzipped beside ``--out`` (the kernels are its fusions);
    and the state the steps leave (the step donates it)."""
    import glob
    import gzip
    import shutil
    import tempfile

    import jax
    from jax.profiler import ProfileData
    where = tempfile.mkdtemp()
    state, metrics = step(state, data)
    jax.block_until_ready(metrics)
    with jax.profiler.trace(where):
        for _ in range(steps):
            state, metrics = step(state, data)
        jax.block_until_ready(metrics)
    kernels: dict = {}
    for path in glob.glob(os.path.join(where, "**", "*.xplane.pb"), recursive=True):
        for plane in ProfileData.from_file(path).planes:
            if not plane.name.startswith(os.environ.get("DEVICE_CHECK_PLANE", "/device:")):
                continue
            for line in plane.lines:
                for e in line.events:
                    try:
                        stats = {str(n): str(v)[:200] for n, v in e.stats}
                    except Exception as err:      # the stats API differs across jax versions
                        stats = {"error": str(err)[:200]}
                    # Keyed by kernel name: a fusion's kernel is named after it; kernels inside a
                    # CUDA graph all carry the graph's command buffer as their hlo_op.
                    where_ = "" if line.name.startswith("Stream") else "@" + line.name
                    k = kernels.setdefault(e.name + where_, {"ns": 0.0, "n": 0, "line": line.name, "stats": stats})
                    k["ns"] += e.duration_ns / steps
                    k["n"] += 1
    shutil.rmtree(where, ignore_errors=True)
    name = f"hlo_{args.model.replace(':', '_').replace('=', '-').replace('@', '')}.txt.gz"
    with gzip.open(os.path.join(os.path.dirname(os.path.abspath(args.out)), name), "wt") as f:
        f.write(compiled.as_text())
    return kernels, name, state


def _run_part(argv: list[str], timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *argv]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-400:] if isinstance(e.stderr, bytes) else (e.stderr or "")[-400:]
        return {"error": f"timed out after {timeout:.0f} s", "stderr_tail": str(tail)}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    return {"error": f"exit {p.returncode}", "stderr_tail": p.stderr[-1500:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="device_check.json")
    ap.add_argument("--models", default=DEFAULT_MODELS,
                    help="name:batch[:field=value],... (run in order until --budget-s is spent)")
    ap.add_argument("--base", default=None, help="preset of this device (default: by its kind)")
    ap.add_argument("--corpus", type=int, default=0,
                    help="also run the first N decoders of the GPU corpus's fixed set (benchmarks/fidelity.py)")
    ap.add_argument("--budget-s", type=float, default=330.0, help="start no new part after this")
    ap.add_argument("--part-timeout-s", type=float, default=200.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-calibrate", action="store_true", help="price on the preset's peaks")
    ap.add_argument("--calibrated", help="a calibration's JSON (this script's 'calibration') instead of measuring")
    ap.add_argument("--remat", default="auto", help="shardplan.auto's remat (default: auto, the planner's choice)")
    ap.add_argument("--quick", action="store_true",
                    help="time and memory only: no deviceless compile, no jax.jit parity")
    ap.add_argument("--part", choices=("facts", "calibrate", "model"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--calibration", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part:
        result = {"facts": part_facts, "calibrate": part_calibrate, "model": part_model}[args.part](args)
        print(MARK + json.dumps(result), flush=True)
        return
    start = time.perf_counter()
    common = ["--out", args.out, *(["--base", args.base] if args.base else []), "--steps", str(args.steps),
              "--remat", args.remat, *(["--quick"] if args.quick else [])]
    result: dict = {"facts": _run_part(["--part", "facts", *common], args.part_timeout_s)}
    print(json.dumps(result["facts"], indent=1), flush=True)
    _write(args.out, result)
    calibration = None
    if args.calibrated:
        result["calibration"] = calibration = json.loads(args.calibrated)
    elif not args.no_calibrate:
        result["calibration"] = calibration = _run_part(["--part", "calibrate", *common], args.part_timeout_s)
        print(json.dumps(calibration, indent=1), flush=True)
        if "error" in calibration:
            calibration = None
        _write(args.out, result)
    rows = result["models"] = []
    for item in [m for m in args.models.split(",") if m] + corpus_models(args.corpus):
        left = args.budget_s - (time.perf_counter() - start)
        if left <= 0:
            rows.append({"model": item, "skipped": "time budget spent"})
            continue
        extra = ["--calibration", json.dumps(calibration)] if calibration else []
        row = _run_part(["--part", "model", "--model", item, *common, *extra], min(args.part_timeout_s, left + 60))
        row.setdefault("model", item)
        rows.append(row)
        _write(args.out, result)
        print(json.dumps(row), flush=True)
    result["wall_s"] = time.perf_counter() - start
    _write(args.out, result)


if __name__ == "__main__":
    main()
