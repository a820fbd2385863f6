"""The hardware behind a ``jax.sharding.Mesh``: device figures from ``device_kind``, links from where devices live.

A user's mesh says which devices carry which mesh axis, not what they cost. The device kind
(``"NVIDIA H100 80GB HBM3"``, ``"TPU v5 lite"``, ``"cpu"``) picks the preset whose figures price
it; a mesh axis whose devices sit in different processes (GPU and CPU hosts) or different slices
(TPU pods) rides the slow inter-node link, every other axis the fast one. ``hardware=`` (a preset
name, a mesh file or a :class:`~shardplan.devices.mesh.MeshSpec`) overrides the figures.

>>> spec = spec_for_mesh(jax.make_mesh((8,), ("data",)))      # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings

import jax
import numpy as np

from shardplan.devices.mesh import Axis, MeshSpec, load_mesh

# device_kind (lower case, as the runtime reports it) -> the preset whose device figures match.
_KINDS = (
    (re.compile(r"h200"), "h200-8"),
    (re.compile(r"h100"), "h100-8"),
    (re.compile(r"a100"), "a100-8"),
    (re.compile(r"tpu v5 ?lite|tpu v5e"), "tpu-v5e-256"),
    (re.compile(r"tpu v5p?$|tpu v5p"), "tpu-v5p-2x512"),
    (re.compile(r"^cpu$"), "cpu-8"),
)
_warned: set[str] = set()      # device kinds already warned about (once per process)


def preset_for_kind(kind: str) -> str | None:
    """The preset name for a ``device_kind``, or ``None`` when no preset describes it."""
    low = kind.strip().lower()
    for pattern, preset in _KINDS:
        if pattern.search(low):
            return preset
    return None


def _crossing(mesh: jax.sharding.Mesh, platform: str) -> list[bool]:
    """Per mesh axis: whether moving along it reaches a device in another host (or TPU slice)."""
    devices = np.asarray(mesh.devices)
    if platform == "tpu":
        where = np.vectorize(lambda d: getattr(d, "slice_index", 0) or 0)(devices)
    else:
        where = np.vectorize(lambda d: d.process_index)(devices)
    out = []
    for k in range(devices.ndim):
        first = np.take(where, [0], axis=k)
        out.append(bool((where != first).any()))
    return out


def spec_for_mesh(mesh: jax.sharding.Mesh, hardware=None) -> MeshSpec:
    """The :class:`MeshSpec` that prices ``mesh``: its axes, its devices' figures, its links.

    ``hardware`` (preset name, mesh file path or ``MeshSpec``) gives the figures; by default
    they come from the devices' ``device_kind``. An unknown kind is priced as a CPU, with a
    warning (once per kind) that says how to measure the real figures.
    """
    devices = list(np.asarray(mesh.devices).flat)
    platform = devices[0].platform
    kind = getattr(devices[0], "device_kind", platform)
    if hardware is None:
        preset = preset_for_kind(kind)
        if preset is None:
            preset = "cpu-8"
            if kind not in _warned and jax.process_index() == 0:     # said once, by process 0
                _warned.add(kind)
                warnings.warn(f"shardplan: no preset describes device kind {kind!r}; pricing it as a CPU. "
                              "Measure it with `shardplan mesh calibrate --out mine.toml` and pass "
                              "hardware='mine.toml'", stacklevel=3)
        base = load_mesh(preset)
    else:
        base = load_mesh(hardware)
    names, sizes = tuple(mesh.axis_names), tuple(int(mesh.shape[a]) for a in mesh.axis_names)
    per_process = sum(1 for d in devices if d.process_index == devices[0].process_index)
    processes = len({d.process_index for d in devices})
    if processes > 1 or platform == "tpu":
        crosses = _crossing(mesh, platform)
        per_node = per_process
    else:
        # One process: lay the axes over the hardware's nodes major to minor, as the preset would.
        per_node = min(base.devices_per_node, len(devices))
        crosses, stride = [False] * len(names), 1
        for k in reversed(range(len(names))):
            crosses[k] = sizes[k] > 1 and stride * sizes[k] > per_node
            stride *= sizes[k]
    axes = tuple(Axis(n, s, base.inter_node_link if c else base.intra_node_link)
                 for n, s, c in zip(names, sizes, crosses))
    name = base.name if base.num_devices == len(devices) else f"{base.name}-as-{len(devices)}"
    device = base.device
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if platform == "gpu" and fraction:
        # This process's allocator hands out that share of each device: the default budget follows.
        try:
            share = float(fraction)
        except ValueError:
            share = 0.0
        if not 0 < share <= 1:
            raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction!r} is not a fraction above 0 and at most 1")
        device = dataclasses.replace(device, allocator_fraction=share)
    return dataclasses.replace(base, name=name, axes=axes, devices_per_node=per_node, device=device)


def runs_on(spec: MeshSpec, mesh: jax.sharding.Mesh) -> bool:
    """Whether ``mesh``'s devices are the hardware ``spec`` prices, so that compiling on them
    gives the target's own program (its memory and collectives): the device kind matches the
    figures' device, directly or through its preset. An H100 plan lowered on fake CPU devices
    (how the tests run) does not."""
    device = np.asarray(mesh.devices).flat[0]
    kind = getattr(device, "device_kind", device.platform)
    preset = preset_for_kind(kind)
    return spec.device.name == kind or (preset is not None and load_mesh(preset).device.name == spec.device.name)
