"""Measure the devices ``jax.devices()`` sees and write what the cost model should believe.

``shardplan mesh calibrate`` runs three microbenchmarks and fits the figures the cost model uses:

* matmuls per dtype at a few sizes: achieved FLOP/s (the best size) -> ``device.peak_flops``;
* a large elementwise pass: bytes read and written per second -> ``device.hbm_bandwidth``;
* a copy to the host's pinned memory and back, where the device has one: bytes per second each
  way -> ``device.offload_bandwidth`` (the price of host offload);
* an all-reduce per mesh axis at several buffer sizes, fitted by least squares to the ring
  formula ``t = 2(n-1) * latency + 2(n-1)/n * bytes / bandwidth`` -> that axis's measured
  ``bandwidth`` and ``latency``, which override the topology's link for that axis.

The result is a :class:`MeshSpec` on the hardware description of a base preset (memory size,
topology), with the measured figures and a ``[calibration]`` table saying how they were taken.

Under ``jax.distributed`` every process runs it: each times its own local device, the
collectives run over the global mesh (so an axis whose devices sit on several processes is
measured on the link between them, and a node is one process's devices), and the figures are
agreed: the slowest process's compute and memory figures, the slowest process's collective
times. Every process returns the same :class:`MeshSpec`; only process 0 should write it.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable, Mapping

import numpy as np

from shardplan.devices.mesh import Device, Link, MeshSpec, load_mesh
from shardplan.util.progress import Progress


def _best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()                                    # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        getattr(out, "block_until_ready", lambda: None)()
        best = min(best, time.perf_counter() - t)
    return best


def fit_ring(sizes: np.ndarray, seconds: np.ndarray, n: int) -> tuple[float, float]:
    """(bandwidth, latency) of the ring all-reduce ``t = 2(n-1) lat + 2(n-1)/n * bytes / bw`` by least squares.

    Both are kept physical: a non-positive slope means the sizes were too small to see the
    bandwidth (it is then set from the largest size alone); a negative intercept becomes zero.
    """
    steps = 2 * (n - 1)
    a = np.stack([np.full_like(sizes, steps, dtype=float), steps / n * sizes.astype(float)], axis=1)
    (latency, inv_bw), *_ = np.linalg.lstsq(a, seconds.astype(float), rcond=None)
    if inv_bw <= 0:
        inv_bw = seconds[-1] / (steps / n * sizes[-1])
        latency = 0.0
    return float(1.0 / inv_bw), float(max(latency, 0.0))


def calibrate(*, base: str | MeshSpec = "cpu-8", axes: Mapping[str, int] | None = None, name: str | None = None,
              matmul_sizes=(256, 512, 1024), dtypes=("float32", "bfloat16"), copy_bytes: int = 64 * 2**20,
              collective_bytes=(2**12, 2**16, 2**20, 2**22), repeats: int = 5, progress: bool = True) -> MeshSpec:
    """Measure ``jax.devices()`` and return the calibrated :class:`MeshSpec` (see the module doc)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    many = jax.process_count() > 1
    spec = base if isinstance(base, MeshSpec) else load_mesh(base)
    if many:        # a node is one process's devices: axes that cross processes ride the inter-node link
        spec = dataclasses.replace(spec, devices_per_node=jax.local_device_count())
    axes = dict(axes) if axes else dict(zip(spec.axis_names, spec.axis_sizes))
    if int(np.prod(list(axes.values()))) != len(devices):
        axes = {"data": len(devices)} if len(devices) > 1 else {}
    if axes and int(np.prod(list(axes.values()))) != spec.num_devices and not many:
        nodes = max(1, len(devices) // spec.devices_per_node)
        per_node = len(devices) // nodes
        spec = dataclasses.replace(spec, devices_per_node=per_node)
    steps = len(dtypes) * len(matmul_sizes) + 2 + len(axes) * len(collective_bytes)
    bar = Progress(steps, "calibrate") if progress and jax.process_index() == 0 else None
    dev = jax.local_devices()[0]       # this process's own device (jax.devices()[0] is process 0's)

    peak = {}
    for dtype in dtypes:
        best = 0.0
        for n in matmul_sizes:
            x = jax.device_put(jnp.ones((n, n), dtype), dev)
            f = jax.jit(lambda a: a @ a)
            best = max(best, 2 * n ** 3 / _best_time(lambda: f(x), repeats))
            if bar:
                bar.step(f"matmul {dtype} {n}x{n}")
        peak[dtype] = _agreed(best, min)

    elems = copy_bytes // 4
    x = jax.device_put(jnp.ones((elems,), jnp.float32), dev)
    g = jax.jit(lambda a: a * 1.0001 + 1.0)
    hbm_bandwidth = _agreed(2 * copy_bytes / _best_time(lambda: g(x), repeats), min)     # read + write
    if bar:
        bar.step(f"memory pass {copy_bytes >> 20} MiB")
    offload_bandwidth, fits = spec.device.offload_bandwidth, {}
    if "pinned_host" in {m.kind for m in dev.addressable_memories()}:
        host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        on_host = jax.device_put(x, host)
        there = _best_time(lambda: jax.device_put(x, host), repeats)
        back = _best_time(lambda: jax.device_put(on_host, jax.sharding.SingleDeviceSharding(dev)), repeats)
        offload_bandwidth = _agreed(2 * copy_bytes / (there + back), min)
        fits["offload_seconds"] = f"to host {there:.3e}, back {back:.3e} for {copy_bytes}B"
    if bar:
        bar.step("copy to pinned host memory and back")

    measured: dict[str, Link] = {}
    if axes:
        mesh = jax.make_mesh(tuple(axes.values()), tuple(axes), devices=devices,
                             axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
        for axis, size in axes.items():
            if size == 1:
                for _ in collective_bytes:
                    bar and bar.step(f"all-reduce over {axis} (size 1, skipped)")
                continue
            times = []
            for nbytes in collective_bytes:
                per_device = max(1, nbytes // 4)
                ones = np.ones((len(devices) * per_device,), np.float32)
                arr = jax.make_array_from_callback(ones.shape, NamedSharding(mesh, P(tuple(axes))),
                                                   lambda index: ones[index])
                f = jax.jit(jax.shard_map(lambda a, axis=axis: jax.lax.psum(a, axis), mesh=mesh,
                                          in_specs=P(tuple(axes)), out_specs=P(tuple(axes))))
                times.append(_agreed(_best_time(lambda: f(arr), repeats), max))
                if bar:
                    bar.step(f"all-reduce over {axis} {nbytes >> 10} KiB")
            bw, lat = fit_ring(np.array([max(1, b // 4) * 4 for b in collective_bytes]), np.array(times), size)
            measured[axis] = Link(f"measured-{axis}", bw, lat)
            fits[f"{axis}_seconds"] = ", ".join(f"{b}B:{t:.3e}" for b, t in zip(collective_bytes, times))
        if many:
            fits["axes_across_processes"] = ", ".join(_across_processes(mesh)) or "none"

    device = Device(name=str(getattr(dev, "device_kind", dev.platform)),
                    peak_flops={k: float(v) for k, v in peak.items()},
                    hbm_bytes=spec.device.hbm_bytes, hbm_bandwidth=float(hbm_bandwidth),
                    heap_overhead=spec.device.heap_overhead, host_bandwidth=spec.device.host_bandwidth,
                    offload_bandwidth=float(offload_bandwidth), usable_bytes=spec.device.usable_bytes,
                    allocator_fraction=spec.device.allocator_fraction)
    out = dataclasses.replace(spec, name=name or f"calibrated-{dev.platform}-{len(devices)}", device=device,
                              source=f"measured by shardplan mesh calibrate on {len(devices)} x {device.name}; "
                                     f"memory size and topology from {spec.name}")
    if axes:
        out = out.with_axes(axes)
        out = dataclasses.replace(out, axes=tuple(dataclasses.replace(a, link=measured.get(a.name, a.link))
                                                  for a in out.axes))
    out = dataclasses.replace(out, calibration={
        "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "platform": dev.platform, "devices": len(devices), "processes": jax.process_count(),
        "jax_version": jax.__version__,
        "matmul_sizes": ", ".join(map(str, matmul_sizes)), "repeats": repeats, **fits})
    return out


def _agreed(value: float, pick) -> float:
    """One figure for every process: ``pick`` (``min`` or ``max``) of what each measured."""
    import jax
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils
    every = np.asarray(multihost_utils.process_allgather(np.array([value], dtype=np.float64)))
    return float(pick(every.ravel()))


def _across_processes(mesh) -> list[str]:
    """The mesh axes along which devices belong to more than one process."""
    procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
    out = []
    for k, name in enumerate(mesh.axis_names):
        moved = np.moveaxis(procs, k, 0)
        if (moved != moved[:1]).any():
            out.append(name)
    return out
