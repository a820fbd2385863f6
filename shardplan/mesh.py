"""Hardware meshes: the devices, the links between them and the logical mesh axes laid over them.

A :class:`MeshSpec` is what a plan is priced for. It may differ from the devices the plan is
lowered on: planning for ``h100-8`` while lowering on 8 fake CPU devices is the normal way to test.

>>> spec = load_mesh("h100-8", axes={"data": 2, "model": 4})
>>> spec.axis_names, spec.axis_sizes
(('data', 'model'), (2, 4))
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import os
import tomllib
from collections.abc import Mapping
from typing import Any

import jax

from shardplan.errors import DeviceCountError, MeshConfigError


@dataclasses.dataclass(frozen=True)
class Link:
    """One kind of interconnect: bandwidth in bytes/s per device per direction, latency in s."""

    name: str
    bandwidth: float
    latency: float


DEFAULT_HEAP_OVERHEAD = 0.10


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator: peak FLOP/s per dtype name, HBM capacity (bytes) and bandwidth (bytes/s).

    ``heap_overhead``: the fraction XLA's heap adds to the bytes of live temporaries. XLA lays
    every temporary of a program out in one heap, with in-place updates and loop-carried buffers
    pinned to shared offsets, so the heap (``memory_analysis().temp_size_in_bytes``) is larger than
    the peak of bytes live at once (llama-tiny, one device's share of batch 128: 85.6 MiB live at
    XLA's own peak, a 99.7 MiB heap). Heap / predicted live temporaries on issue 3's reference
    matrix (CPU backend): 1.07 (MLP), 1.12-1.14 (GPT), 1.21-1.24 (Llama); 0.10 by default.
    ``shardplan audit`` prints the value a compile implies; set it for your own devices.
    """

    name: str
    peak_flops: Mapping[str, float]
    hbm_bytes: int
    hbm_bandwidth: float
    heap_overhead: float = DEFAULT_HEAP_OVERHEAD

    def flops_for(self, dtype_name: str) -> float:
        """Peak FLOP/s for matmuls in ``dtype_name``; unknown dtypes use the float32 rate."""
        return self.peak_flops.get(dtype_name, self.peak_flops["float32"])


@dataclasses.dataclass(frozen=True)
class Axis:
    """A logical mesh axis and the link its collectives travel over."""

    name: str
    size: int
    link: Link


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """A device mesh as the cost model sees it. Frozen; build it with :func:`load_mesh`."""

    name: str
    device: Device
    axes: tuple[Axis, ...]
    devices_per_node: int
    intra_node_link: Link
    inter_node_link: Link
    source: str = ""
    calibration: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)  # how it was measured

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        return tuple(a.size for a in self.axes)

    @property
    def num_devices(self) -> int:
        return math.prod(self.axis_sizes)

    def axis(self, name: str) -> Axis:
        for a in self.axes:
            if a.name == name:
                return a
        raise KeyError(f"mesh {self.name!r} has no axis {name!r}; its axes are {self.axis_names}")

    def with_axes(self, axes: Mapping[str, int]) -> MeshSpec:
        """The same hardware with other logical axes, laid major to minor over the devices.

        An axis whose span of devices goes past one node is priced at the inter-node link, as
        ``mesh_utils.create_hybrid_device_mesh`` would lay it.
        """
        names, sizes = list(axes), [int(v) for v in axes.values()]
        if math.prod(sizes) != self.num_devices:
            raise MeshConfigError(
                f"axis sizes {dict(axes)} multiply to {math.prod(sizes)}, but mesh {self.name!r} has "
                f"{self.num_devices} devices; make the sizes multiply to {self.num_devices}", key="axes")
        built, stride = [], 1
        for name, size in reversed(list(zip(names, sizes))):
            crosses = size > 1 and stride * size > self.devices_per_node
            built.append(Axis(name, size, self.inter_node_link if crosses else self.intra_node_link))
            stride *= size
        return dataclasses.replace(self, axes=tuple(reversed(built)))

    def to_jax_mesh(self, devices: list | None = None) -> jax.sharding.Mesh:
        """A ``jax.sharding.Mesh`` with ``AxisType.Auto`` axes over the first devices of ``jax.devices()``."""
        return make_jax_mesh(self.axis_names, self.axis_sizes, devices, name=self.name)


def make_jax_mesh(axis_names, axis_sizes, devices: list | None = None, *, name: str = "mesh") -> jax.sharding.Mesh:
    """``jax.make_mesh`` with explicit ``AxisType.Auto`` axes, or a clear error when devices are too few."""
    devices = list(jax.devices()) if devices is None else list(devices)
    n = math.prod(axis_sizes)
    if len(devices) < n:
        raise DeviceCountError(
            f"mesh {name!r} {dict(zip(axis_names, axis_sizes))} needs {n} devices but "
            f"jax.devices() has {len(devices)}; on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before importing jax")
    auto = (jax.sharding.AxisType.Auto,) * len(axis_names)
    return jax.make_mesh(tuple(axis_sizes), tuple(axis_names), axis_types=auto, devices=devices[:n])


_TOP_KEYS = {"name", "source", "description", "device", "links", "topology", "axes", "calibration"}
_DEVICE_KEYS = {"name", "peak_flops", "hbm_bytes", "hbm_bandwidth", "heap_overhead"}
_OPTIONAL_DEVICE_KEYS = {"heap_overhead"}
_LINK_KEYS = {"bandwidth", "latency"}
_TOPOLOGY_KEYS = {"devices_per_node", "nodes", "intra_node_link", "inter_node_link"}
_AXIS_KEYS = {"name", "size", "bandwidth", "latency"}   # bandwidth/latency: measured, override the link


def _positive(value: Any, key: str, source: str, kind=float) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise MeshConfigError(f"must be a positive number, got {value!r}", source=source, key=key)
    if kind is int and (not float(value).is_integer()):
        raise MeshConfigError(f"must be a positive integer, got {value!r}", source=source, key=key)
    return kind(value)


def _fraction(value: Any, key: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise MeshConfigError(f"must be a fraction from 0 to 1 (0.10 adds 10% to the temporaries), got {value!r}",
                              source=source, key=key)
    return float(value)


def _check_keys(table: Any, allowed: set[str], key: str, source: str) -> None:
    if not isinstance(table, dict):
        raise MeshConfigError(f"must be a table, got {type(table).__name__}", source=source, key=key)
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise MeshConfigError(f"unknown key {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}",
                              source=source, key=key or "top level")


def mesh_from_dict(data: Mapping[str, Any], *, source: str = "<dict>",
                   axes: Mapping[str, int] | None = None) -> MeshSpec:
    """Validate a parsed mesh file and build the :class:`MeshSpec`; ``axes`` overrides its logical axes."""
    _check_keys(data, _TOP_KEYS, "", source)
    for required in ("name", "device", "links", "topology", "axes"):
        if required not in data:
            raise MeshConfigError(f"missing section or key {required!r}", source=source, key=required)
    dev = data["device"]
    _check_keys(dev, _DEVICE_KEYS, "device", source)
    for k in _DEVICE_KEYS - _OPTIONAL_DEVICE_KEYS:
        if k not in dev:
            raise MeshConfigError("missing key", source=source, key=f"device.{k}")
    flops = dev["peak_flops"]
    if not isinstance(flops, dict) or "float32" not in flops:
        raise MeshConfigError("must be a table of FLOP/s per dtype with at least 'float32'",
                              source=source, key="device.peak_flops")
    device = Device(
        name=str(dev["name"]),
        peak_flops={k: _positive(v, f"device.peak_flops.{k}", source) for k, v in flops.items()},
        hbm_bytes=_positive(dev["hbm_bytes"], "device.hbm_bytes", source, int),
        hbm_bandwidth=_positive(dev["hbm_bandwidth"], "device.hbm_bandwidth", source),
        heap_overhead=_fraction(dev.get("heap_overhead", DEFAULT_HEAP_OVERHEAD), "device.heap_overhead", source))

    links_raw = data["links"]
    if not isinstance(links_raw, dict) or not links_raw:
        raise MeshConfigError("must define at least one link", source=source, key="links")
    links = {}
    for lname, ldata in links_raw.items():
        _check_keys(ldata, _LINK_KEYS, f"links.{lname}", source)
        for k in _LINK_KEYS:
            if k not in ldata:
                raise MeshConfigError("missing key", source=source, key=f"links.{lname}.{k}")
        latency = ldata["latency"]
        if isinstance(latency, bool) or not isinstance(latency, (int, float)) or latency < 0:
            raise MeshConfigError(f"must be a non-negative number, got {latency!r}",
                                  source=source, key=f"links.{lname}.latency")
        links[lname] = Link(lname, _positive(ldata["bandwidth"], f"links.{lname}.bandwidth", source),
                            float(latency))

    topo = data["topology"]
    _check_keys(topo, _TOPOLOGY_KEYS, "topology", source)
    for k in _TOPOLOGY_KEYS:
        if k not in topo:
            raise MeshConfigError("missing key", source=source, key=f"topology.{k}")
    per_node = _positive(topo["devices_per_node"], "topology.devices_per_node", source, int)
    nodes = _positive(topo["nodes"], "topology.nodes", source, int)
    link_of = {}
    for k in ("intra_node_link", "inter_node_link"):
        if not isinstance(topo[k], str) or topo[k] not in links:
            raise MeshConfigError(f"names link {topo[k]!r}, which is not under [links]; "
                                  f"defined: {', '.join(links)}", source=source, key=f"topology.{k}")
        link_of[k] = links[topo[k]]

    raw_axes = data["axes"]
    if axes is not None:
        raw_axes = [{"name": k, "size": v} for k, v in axes.items()]
    if not isinstance(raw_axes, list) or not raw_axes:
        raise MeshConfigError("must be a non-empty list of {name, size}", source=source, key="axes")
    names, sizes, measured = [], [], {}
    for i, a in enumerate(raw_axes):
        _check_keys(a, _AXIS_KEYS, f"axes[{i}]", source)
        if "name" not in a or "size" not in a:
            raise MeshConfigError("needs both 'name' and 'size'", source=source, key=f"axes[{i}]")
        if not isinstance(a["name"], str) or not a["name"].isidentifier():
            raise MeshConfigError(f"axis name must be an identifier, got {a['name']!r}",
                                  source=source, key=f"axes[{i}].name")
        if a["name"] in names:
            raise MeshConfigError(f"axis {a['name']!r} is named twice", source=source, key=f"axes[{i}].name")
        names.append(a["name"])
        sizes.append(_positive(a["size"], f"axes[{i}].size", source, int))
        if ("bandwidth" in a) != ("latency" in a):
            raise MeshConfigError("a measured axis needs both 'bandwidth' and 'latency'", source=source, key=f"axes[{i}]")
        if "bandwidth" in a:
            lat = a["latency"]
            if isinstance(lat, bool) or not isinstance(lat, (int, float)) or lat < 0:
                raise MeshConfigError(f"must be a non-negative number, got {lat!r}", source=source,
                                      key=f"axes[{i}].latency")
            measured[a["name"]] = Link(f"measured-{a['name']}",
                                       _positive(a["bandwidth"], f"axes[{i}].bandwidth", source), float(lat))
    total = per_node * nodes
    if math.prod(sizes) != total:
        raise MeshConfigError(
            f"axis sizes {dict(zip(names, sizes))} multiply to {math.prod(sizes)}, but the topology has "
            f"{nodes} node(s) x {per_node} devices = {total}; make the sizes multiply to {total}",
            source=source, key="axes")
    flat = tuple(Axis(f"_d{i}", n, link_of["intra_node_link"]) for i, n in enumerate((nodes, per_node)))
    calibration = data.get("calibration", {})
    if not isinstance(calibration, dict):
        raise MeshConfigError("must be a table", source=source, key="calibration")
    base = MeshSpec(name=str(data["name"]), device=device, axes=flat, devices_per_node=per_node,
                    intra_node_link=link_of["intra_node_link"], inter_node_link=link_of["inter_node_link"],
                    source=str(data.get("source", "")), calibration=dict(calibration))
    spec = base.with_axes(dict(zip(names, sizes)))
    if measured and axes is None:     # measured links belong to the file's own axes
        spec = dataclasses.replace(spec, axes=tuple(dataclasses.replace(a, link=measured.get(a.name, a.link))
                                                    for a in spec.axes))
    return spec


def _preset_dir():
    """The presets: the ``shardplan.meshes`` package (the top-level ``meshes/`` folder)."""
    return importlib.resources.files("shardplan.meshes")


def preset_names() -> list[str]:
    """Names of the mesh presets shipped with the package."""
    return sorted(p.name[:-5] for p in _preset_dir().iterdir() if p.name.endswith(".toml"))


def load_mesh(name_or_path: str | os.PathLike | MeshSpec, axes: Mapping[str, int] | None = None) -> MeshSpec:
    """Load a preset by name or a mesh file by path; ``axes`` overrides its logical mesh axes.

    >>> load_mesh("a100-128x8").axis_sizes
    (128, 8)
    """
    if isinstance(name_or_path, MeshSpec):
        if axes is None:
            return name_or_path
        raise MeshConfigError("pass a preset name or a path to override axes, not a MeshSpec")
    text_source = str(name_or_path)
    if os.path.exists(text_source):
        try:
            with open(text_source, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise MeshConfigError(f"is not valid TOML: {e}", source=text_source) from None
        except OSError as e:
            raise MeshConfigError(f"cannot be read: {e.strerror}", source=text_source) from None
        return mesh_from_dict(data, source=text_source, axes=axes)
    names = preset_names()
    if text_source not in names:
        raise MeshConfigError(f"is neither a mesh file nor a preset; presets: {', '.join(names)}",
                              source=repr(text_source))
    resource = _preset_dir() / f"{text_source}.toml"
    data = tomllib.loads(resource.read_text())
    return mesh_from_dict(data, source=f"preset {text_source}", axes=axes)


def _toml_value(v: Any) -> str:
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, float):
        return repr(v)
    return str(v)


def to_toml(spec: MeshSpec) -> str:
    """A mesh file (the schema of meshes/README.md, a comment on every key) for ``spec``."""
    d = spec.device
    links = {spec.intra_node_link.name: spec.intra_node_link, spec.inter_node_link.name: spec.inter_node_link}
    nodes = spec.num_devices // spec.devices_per_node
    lines = [f"# {spec.name}: {spec.num_devices} x {d.name}",
             f"name = {_toml_value(spec.name)}",
             f"source = {_toml_value(spec.source)}", "",
             "[device]",
             f"name = {_toml_value(d.name)}",
             "peak_flops = { " + ", ".join(f"{k} = {float(v)!r}" for k, v in d.peak_flops.items())
             + " }  # FLOP/s per dtype, dense matmul",
             f"hbm_bytes = {int(d.hbm_bytes)}  # bytes of HBM per device",
             f"hbm_bandwidth = {float(d.hbm_bandwidth)!r}  # bytes/s",
             f"heap_overhead = {float(d.heap_overhead)!r}  # fraction XLA's heap adds to live temporaries", ""]
    for name, link in links.items():
        lines += [f"[links.{name}]",
                  f"bandwidth = {float(link.bandwidth)!r}  # bytes/s per device per direction",
                  f"latency = {float(link.latency)!r}  # seconds per ring step", ""]
    lines += ["[topology]",
              f"devices_per_node = {spec.devices_per_node}  # devices joined by the intra-node link",
              f"nodes = {nodes}  # nodes joined by the inter-node link",
              f"intra_node_link = {_toml_value(spec.intra_node_link.name)}  # link of axes inside a node",
              f"inter_node_link = {_toml_value(spec.inter_node_link.name)}  # link of axes that cross nodes", ""]
    for a in spec.axes:
        lines += ["[[axes]]  # a logical mesh axis; axes are listed major to minor",
                  f"name = {_toml_value(a.name)}", f"size = {a.size}"]
        if a.link not in (spec.intra_node_link, spec.inter_node_link):
            lines += [f"bandwidth = {float(a.link.bandwidth)!r}  # measured, bytes/s per device per direction",
                      f"latency = {float(a.link.latency)!r}  # measured, seconds per ring step"]
        lines.append("")
    if spec.calibration:
        lines.append("[calibration]  # how the measured figures were obtained")
        lines += [f"{k} = {_toml_value(v)}" for k, v in spec.calibration.items()]
        lines.append("")
    return "\n".join(lines)


def write_mesh(spec: MeshSpec, path: str | os.PathLike) -> None:
    """Write ``spec`` as a mesh file; it is validated by loading it back, and replaces ``path`` only then."""
    text = to_toml(spec)
    mesh_from_dict(tomllib.loads(text), source=str(path))
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def hybrid_axes(ici: Mapping[str, int], dcn: Mapping[str, int], devices_per_node: int,
                nodes: int) -> dict[str, int]:
    """MaxText-style ``ici_*``/``dcn_*`` parallelism to logical axes, as ``create_hybrid_device_mesh`` lays them.

    Each axis gets size dcn x ici, its DCN (inter-node) part major. One ``-1`` among the ICI sizes
    is filled from the devices per node, one among the DCN sizes from the node count.
    """
    def fill(sizes: Mapping[str, int], total: int, what: str) -> dict[str, int]:
        sizes = dict(sizes)
        unknown = [k for k, v in sizes.items() if v == -1]
        if len(unknown) > 1:
            raise MeshConfigError(f"only one {what} size may be -1, got {', '.join(unknown)}", key=what)
        bad = [k for k, v in sizes.items() if v != -1 and v < 1]
        if bad:
            raise MeshConfigError(f"{what} size of axis {bad[0]!r} must be a positive integer or -1", key=what)
        known = math.prod(v for v in sizes.values() if v != -1)
        if unknown:
            if total % known:
                raise MeshConfigError(f"{what} sizes {sizes} cannot fill {total}: {known} does not divide it", key=what)
            sizes[unknown[0]] = total // known
        if math.prod(sizes.values()) != total:
            raise MeshConfigError(f"{what} sizes {sizes} multiply to {math.prod(sizes.values())}, but there are "
                                  f"{total}; make them multiply to {total} (or use -1 for one)", key=what)
        return sizes
    ici = fill(ici, devices_per_node, "ici")
    dcn = fill(dcn, nodes, "dcn")
    names = list(dict.fromkeys([*dcn, *ici]))
    # Axes with an inter-node part first (major), so every ICI-only axis stays inside a node.
    names.sort(key=lambda a: 0 if dcn.get(a, 1) > 1 else 1)
    return {a: dcn.get(a, 1) * ici.get(a, 1) for a in names}


def mesh_from_jax(mesh: jax.sharding.Mesh, hardware: str | MeshSpec = "cpu-8") -> MeshSpec:
    """Price a ``jax.sharding.Mesh`` on the hardware of a preset (default ``cpu-8``), keeping its axes."""
    base = hardware if isinstance(hardware, MeshSpec) else load_mesh(hardware)
    return base.with_axes(dict(mesh.shape))
