"""Compile targets: a plan compiled by the real GPU or TPU compiler, with no GPU or TPU present.

XLA's CPU backend computes bf16 in f32 and has its own scheduler, so its memory figures are not a
GPU's. JAX compiles for NVIDIA GPUs and TPUs without a device: the CUDA plugin from a
``GpuTargetConfig`` (the device's published figures) and a ``slices x hosts x devices``
topology, libtpu from a topology name. The program is the real compiler's (its async
collectives, its reduce-scatters, its memory scheduler and rematerialisation pass), so its
``memory_analysis()`` and ``as_text()`` are what the device would run; it is never executed.

Install with ``pip install 'shardplan[aot]'`` (about 420 MB of wheels: the CUDA plugin, ``ptxas``
and libdevice from ``nvidia-cuda-nvcc-cu12``, libtpu). Set ``JAX_PLATFORMS=cpu`` (the CLI does)
before JAX starts, so that the CUDA plugin does not look for a driver.

>>> mesh, compiler = target_mesh(load_mesh("h100-8"), "gpu")      # doctest: +SKIP
"""

from __future__ import annotations

import functools
import importlib.util
import os

import numpy as np

from shardplan.devices.mesh import MeshSpec
from shardplan.errors import ShardplanError

TARGETS = ("auto", "cpu", "gpu", "tpu")

# Fixed figures of each GPU family for XLA's cost model and code generation, from NVIDIA's
# published specifications (CUDA C Programming Guide, "Compute capabilities"; the H100 and A100
# whitepapers): SMs, FP32 lanes per SM, shared memory per SM and per block (opt-in), L2, boost
# clock, compute capability. Memory size and bandwidth come from the preset (``usable_bytes``,
# ``hbm_bandwidth``). The H200's were checked against a lent H200's device properties (2026-12-04,
# ``benchmarks/device_check.py``): its L2 is 60 MiB, not the H100's 50; the rest as listed.
GPU_FAMILIES = {
    "h100": dict(core_count=132, fpus_per_core=128, shared_memory_per_core=233472, shared_memory_per_block_optin=232448,
                 l2_cache_size=52428800, clock_rate_ghz=1.98, major=9, minor=0,
                 description="NVIDIA H100 80GB HBM3"),
    "h200": dict(core_count=132, fpus_per_core=128, shared_memory_per_core=233472, shared_memory_per_block_optin=232448,
                 l2_cache_size=62914560, clock_rate_ghz=1.98, major=9, minor=0, description="NVIDIA H200"),
    "a100": dict(core_count=108, fpus_per_core=64, shared_memory_per_core=167936, shared_memory_per_block_optin=166912,
                 l2_cache_size=41943040, clock_rate_ghz=1.41, major=8, minor=0,
                 description="NVIDIA A100-SXM4-80GB"),
}

# TPU presets -> libtpu topology names by chips per slice (a preset's node): "v5e:16x16" is a 2D
# torus of 256 chips, "v5p:4x4x4" a 3D torus of 64 (Cloud's "v5p-128": it counts TensorCores, two
# a v5p chip). Each checked to give its chip count with libtpu's get_topology_desc; the smallest
# is one 4-chip host.
_TPU_TOPOLOGIES = {
    "TPU v5e": {4: "v5e:2x2", 8: "v5e:2x4", 16: "v5e:4x4", 32: "v5e:4x8", 64: "v5e:8x8", 128: "v5e:8x16",
                256: "v5e:16x16"},
    "TPU v5p": {4: "v5p:2x2x1", 8: "v5p:2x2x2", 16: "v5p:2x2x4", 32: "v5p:2x4x4", 64: "v5p:4x4x4",
                128: "v5p:4x4x8", 256: "v5p:4x8x8", 512: "v5p:8x8x8", 1024: "v5p:8x8x16"},
}


# Compile options under which a target's ``memory_analysis`` counts device memory (HBM) alone.
# libtpu places buffers in the TPU's on-chip VMEM (128 MiB on a v5e) where they fit; its
# ``temp_size_in_bytes`` then leaves them out and its ``peak_memory_in_bytes`` counts them in a
# way that is not an allocation sum (mlp-tiny on 256 v5e chips: a peak of 197.7 MiB over
# allocations of 124.5 MiB). With VMEM placement off, the peak is arguments + outputs - aliased +
# the live peak of the HBM temporaries: what the memory model predicts, and an upper bound on the
# HBM the program with VMEM uses. The audit compiles memory this way; the program that runs (and
# the compiled-budget loop) keeps VMEM placement.
HBM_ONLY_OPTIONS = {"tpu": {"xla_vf_vmem_memory_space_assignment": False}}


def gpu_family(spec: MeshSpec) -> str | None:
    name = spec.device.name.lower()
    return next((f for f in GPU_FAMILIES if f in name), None)


def gpu_target_config(spec: MeshSpec) -> str:
    """The ``GpuTargetConfig`` text proto for the preset's device."""
    family = gpu_family(spec)
    if family is None:
        raise ShardplanError(f"no GPU target config for device {spec.device.name!r}: the GPU targets are "
                             f"{', '.join(GPU_FAMILIES)}")
    f = GPU_FAMILIES[family]
    memory = spec.device.usable_bytes or spec.device.hbm_bytes
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {f['shared_memory_per_core']}
  threads_per_core_limit: 2048
  core_count: {f['core_count']}
  fpus_per_core: {f['fpus_per_core']}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(spec.device.hbm_bandwidth)}
  l2_cache_size: {f['l2_cache_size']}
  clock_rate_ghz: {f['clock_rate_ghz']}
  device_memory_size: {int(memory)}
  shared_memory_per_block_optin: {f['shared_memory_per_block_optin']}
  cuda_compute_capability {{ major: {f['major']} minor: {f['minor']} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{f['description']}"
"""


def available(target: str) -> bool:
    """Whether this machine can compile for ``target`` ("cpu" always)."""
    if target == "gpu":
        return any(_installed(f"jax_plugins.xla_cuda{v}") for v in (12, 13))
    if target == "tpu":
        return _installed("libtpu")
    return target == "cpu"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:         # its parent package (jax_plugins) is not installed either
        return False


def resolve(target: str, spec: MeshSpec) -> str:
    """``auto``: the preset's own kind of compiler where it is installed, else ``cpu``."""
    if target not in TARGETS:
        raise ShardplanError(f"unknown compile target {target!r}: one of {', '.join(TARGETS)}")
    if target != "auto":
        return target
    kind = compiler_kind(spec)
    return kind if available(kind) else "cpu"


def compiler_kind(spec: MeshSpec) -> str:
    """The kind of compiler the mesh's devices run programs through: "gpu", "tpu" or "cpu"."""
    return "gpu" if gpu_family(spec) else "tpu" if spec.device.name in _TPU_TOPOLOGIES else "cpu"


def tpu_topology(spec: MeshSpec) -> str:
    """The libtpu topology name of one slice of ``spec`` (a TPU preset's node is a slice)."""
    by_chips = _TPU_TOPOLOGIES.get(spec.device.name)
    if by_chips is None:
        raise ShardplanError(f"no TPU topology for device {spec.device.name!r}: the TPU targets are "
                             f"{', '.join(_TPU_TOPOLOGIES)}")
    chips = spec.devices_per_node
    if chips not in by_chips:
        raise ShardplanError(f"{spec.name}: no {spec.device.name} topology of {chips} chips per slice "
                             f"([topology] devices_per_node); the {spec.device.name} slices libtpu compiles for have "
                             f"{', '.join(map(str, by_chips))} chips")
    return by_chips[chips]


@functools.lru_cache(maxsize=8)
def _topology(platform: str, config: str, name: str, slices: int = 1):
    from jax.experimental import topologies
    if platform == "cuda":
        return topologies.get_topology_desc(platform="cuda", target_config=config, topology=name)
    # libtpu looks for the TPU VM it runs on: say it is a lone host (its warnings otherwise).
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-8")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # A compile-only libtpu holds no TPU: let other processes load theirs (its lockfile would
    # stop a second process, e.g. a CLI audit started by a program that compiled for a TPU).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "true")
    # Several slices joined by the data-center network (multislice): devices slice-major.
    extra = {"num_slices": slices} if slices > 1 else {}
    return topologies.get_topology_desc(topology_name=name, platform="tpu", **extra)


def target_mesh(spec: MeshSpec, target: str):
    """A ``jax.sharding.Mesh`` with ``spec``'s axes over compile-only devices of ``target``
    ("gpu" or "tpu"), and the name of the compiler that will compile for it."""
    import jax
    if not available(target):
        raise ShardplanError(f"the {target.upper()} compiler is not installed: pip install 'shardplan[aot]'")
    if target == "gpu":
        per_node = spec.devices_per_node
        if spec.num_devices % per_node:
            raise ShardplanError(f"{spec.name}: {spec.num_devices} devices do not fill nodes of {per_node}")
        topo = _topology("cuda", gpu_target_config(spec), f"1x{spec.num_devices // per_node}x{per_node}")
        compiler = f"XLA GPU (deviceless, {GPU_FAMILIES[gpu_family(spec)]['description']})"
    elif target == "tpu":
        name = tpu_topology(spec)
        # A TPU preset's node is a slice (meshes/README.md).
        topo = _topology("tpu", "", name, spec.nodes)
        compiler = f"XLA TPU (deviceless, libtpu, {name}" + (f" x {spec.nodes} slices)" if spec.nodes > 1 else ")")
    else:
        raise ShardplanError(f"target_mesh is for gpu and tpu targets, not {target!r}")
    devices = list(topo.devices)
    if len(devices) != spec.num_devices:
        raise ShardplanError(f"the {target} topology for {spec.name} has {len(devices)} devices, the mesh "
                             f"{spec.num_devices}: compile this mesh for the cpu target")
    shape = tuple(spec.axis_sizes)
    mesh = jax.sharding.Mesh(np.array(devices, dtype=object).reshape(shape), tuple(spec.axis_names),
                             axis_types=(jax.sharding.AxisType.Auto,) * len(shape))
    return mesh, compiler
