"""Hardware meshes: the devices, the links between them and the logical mesh axes laid over them.

A :class:`MeshSpec` is what a plan is priced for. It may differ from the devices the plan is
lowered on: planning for ``h100-8`` while lowering on 8 fake CPU devices is the normal way to test.

>>> spec = load_mesh("h100-8", axes={"data": 2, "model": 4})
>>> spec.axis_names, spec.axis_sizes
(('data', 'model'), (2, 4))
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import math
import os
import tomllib
import warnings
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
# Bytes/s one host feeds its accelerators with each step's input (reading, decoding, copying
# over PCIe): a conservative figure for a training host's input pipeline.
DEFAULT_HOST_BANDWIDTH = 10e9
# Bytes/s one device moves to or from its host's pinned memory (host offload of activations), per
# direction, where a mesh file does not say: PCIe Gen4 x8's 16 GB/s, below what a GPU or TPU host
# link gives, so that offload is not chosen on figures the hardware may not reach.
DEFAULT_OFFLOAD_BANDWIDTH = 16e9


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator: peak FLOP/s per dtype name, HBM capacity (bytes) and bandwidth (bytes/s).

    ``heap_overhead``: an allowance on the bytes of live temporaries the model predicts, for what
    XLA's heap (``memory_analysis().temp_size_in_bytes``) holds beyond them. The heap itself is
    laid out at its live peak, loop-carried buffers counted: within 0.2% on XLA's GPU compiler
    (llama-tiny, GPT-3 175B) and 2% on libtpu's for gpt2-small, whose 16 KiB placement the model
    prices (:func:`shardplan.compiler.layout.heap_bytes`), with a slot of its own per tuple result
    (:func:`shardplan.compiler.liveness.multi_output_kernels`, session 28). What the allowance covers is
    liveness the model does not see, chiefly the order XLA schedules a loop body in
    (benchmarks/RESULTS.md). Heap / predicted live temporaries on issue 3's reference matrix (CPU
    backend): 1.07 (MLP), 1.12-1.14 (GPT), 1.21-1.24 (Llama); 0.10 by default. ``shardplan audit``
    prints the value a compile implies, and on a TPU the heap's live peak; set it for your own
    devices.

    ``host_bandwidth``: bytes/s one host's input pipeline delivers to its devices; each host loads
    its share of every step's input (the batch) at that rate (see
    :meth:`MeshSpec.node_shards`).

    ``offload_bandwidth``: bytes/s one device moves to or from its host's pinned memory, per
    direction (its PCIe link): the price of host offload (``remat="offload"``, a
    ``jax.checkpoint`` policy that offloads to ``pinned_host``).

    ``usable_bytes``: the memory the runtime reports for the device (below ``hbm_bytes``: the
    driver keeps some; an H100 80GB reports 84,929,347,584 of 85,899,345,920 bytes);
    ``allocator_fraction``: the share of it the framework's allocator hands to programs (JAX on
    GPUs: ``XLA_PYTHON_CLIENT_MEM_FRACTION``, 0.75 unless set). The default per-device budget is
    their product, :attr:`budget_bytes`.
    """

    name: str
    peak_flops: Mapping[str, float]
    hbm_bytes: int
    hbm_bandwidth: float
    heap_overhead: float = DEFAULT_HEAP_OVERHEAD
    host_bandwidth: float = DEFAULT_HOST_BANDWIDTH
    offload_bandwidth: float = DEFAULT_OFFLOAD_BANDWIDTH
    usable_bytes: int | None = None
    allocator_fraction: float = 1.0

    @property
    def budget_bytes(self) -> int:
        """The default memory budget: what a program may really allocate on one device."""
        return int((self.usable_bytes or self.hbm_bytes) * self.allocator_fraction)

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

    @property
    def nodes(self) -> int:
        return max(1, self.num_devices // self.devices_per_node)

    def node_shards(self, axes) -> int:
        """Into how many per-node shares an array split over mesh ``axes`` falls: the product of
        those axes' spans across nodes (an axis within a node: 1). Each node loads one share."""
        if self.nodes == 1:
            return 1
        n, stride = 1, 1
        spans = {}
        for a in reversed(self.axes):
            inner = max(1, self.devices_per_node // stride)      # how much of the axis fits in a node
            spans[a.name] = max(1, a.size // inner) if stride * a.size > self.devices_per_node else 1
            stride *= a.size
        for a in axes:
            n *= spans.get(a, 1)
        return n

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


def auto_axes(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """``mesh`` with every axis ``AxisType.Auto``: the same devices in the same order.

    ``jax.make_mesh`` makes ``Explicit`` axes unless told otherwise, and JAX refuses a sharding
    constraint over an explicit axis; shardplan constrains every tensor of the step it plans, so
    it runs the plan over this view of the user's mesh."""
    auto = jax.sharding.AxisType.Auto
    if all(t == auto for t in mesh.axis_types):
        return mesh
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(auto,) * len(mesh.axis_names))


_TOP_KEYS = {"name", "source", "description", "device", "links", "topology", "axes", "calibration"}
_DEVICE_KEYS = {"name", "peak_flops", "hbm_bytes", "hbm_bandwidth", "heap_overhead", "host_bandwidth",
                "offload_bandwidth", "usable_bytes", "allocator_fraction"}
_REQUIRED_DEVICE_KEYS = ("name", "peak_flops", "hbm_bytes", "hbm_bandwidth")
_LINK_KEYS = {"bandwidth", "latency"}
_TOPOLOGY_KEYS = {"devices_per_node", "nodes", "intra_node_link", "inter_node_link"}
_REQUIRED_TOPOLOGY_KEYS = ("devices_per_node", "nodes", "intra_node_link", "inter_node_link")
_AXIS_KEYS = {"name", "size", "bandwidth", "latency"}   # bandwidth/latency: measured, override the link
_MAX_FILE_BYTES = 16 * 2**20     # a mesh file is a few KiB


class _Problems:
    """Every problem of one mesh file, in the order its keys are checked, raised as one MeshConfigError.

    The error's ``problems`` lists one line per problem (``shardplan mesh validate`` prints them);
    its message is the first, with a count of the others, so that it stays one line.
    """

    def __init__(self, source: str):
        self.source = source
        self.found: list[tuple[str | None, str]] = []     # (key, message)

    def add(self, key: str | None, message: str) -> None:
        self.found.append((key or None, message))

    def raise_any(self) -> None:
        if not self.found:
            return
        key, message = self.found[0]
        more = len(self.found) - 1
        if more:
            message += f" (and {more} more problem{'s' if more > 1 else ''}"
            message += "; `shardplan mesh validate` lists every one)" if os.path.isfile(self.source) else ")"
        error = MeshConfigError(message, source=self.source, key=key)
        error.problems = [str(MeshConfigError(m, source=self.source, key=k)) for k, m in self.found]
        raise error


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def _positive(value: Any, key: str, problems: _Problems, kind=float) -> Any:
    if not _is_number(value) or value <= 0:
        problems.add(key, f"must be a positive number, got {value!r}")
        return None
    if kind is int and isinstance(value, float) and not value.is_integer():
        problems.add(key, f"must be a positive integer, got {value!r}")
        return None
    return kind(value)


def _non_negative(value: Any, key: str, problems: _Problems) -> float | None:
    if not _is_number(value) or value < 0:
        problems.add(key, f"must be a non-negative number, got {value!r}")
        return None
    return float(value)


def _fraction(value: Any, key: str, problems: _Problems) -> float | None:
    if not _is_number(value) or not 0 <= value <= 1:
        problems.add(key, f"must be a fraction from 0 to 1 (0.10 adds 10% to the temporaries), got {value!r}")
        return None
    return float(value)


def _table(table: Any, allowed: set[str], key: str, problems: _Problems) -> bool:
    """Whether ``table`` is a table; each key of it outside ``allowed`` is a problem."""
    if not isinstance(table, Mapping):
        problems.add(key, f"must be a table, got {type(table).__name__}")
        return False
    for k in sorted((k for k in table if k not in allowed), key=str):
        close = difflib.get_close_matches(str(k), sorted(allowed), n=1, cutoff=0.8)
        hint = f"did you mean {close[0]!r}? " if close else ""
        problems.add(key or "top level", f"unknown key {k!r}; {hint}allowed: {', '.join(sorted(allowed))}")
    return True


def _missing(table: Mapping, keys: tuple[str, ...], prefix: str, problems: _Problems) -> bool:
    """Whether a key of ``keys`` is missing from ``table``; each missing one is a problem."""
    absent = [k for k in keys if k not in table]
    others = [str(k) for k in table if k not in keys]
    for k in absent:
        if not difflib.get_close_matches(k, others, n=1, cutoff=0.8):   # a misspelling is said once, above
            problems.add(prefix + k, "missing key")
    return bool(absent)


def _device(dev: Any, problems: _Problems) -> Device | None:
    if not _table(dev, _DEVICE_KEYS, "device", problems):
        return None
    incomplete = _missing(dev, _REQUIRED_DEVICE_KEYS, "device.", problems)
    peak = None
    if "peak_flops" in dev:
        flops = dev["peak_flops"]
        if not isinstance(flops, Mapping) or "float32" not in flops:
            problems.add("device.peak_flops", "must be a table of FLOP/s per dtype with at least 'float32'")
        if isinstance(flops, Mapping):
            peak = {k: _positive(v, f"device.peak_flops.{k}", problems) for k, v in flops.items()}
            if "float32" not in peak or None in peak.values():
                peak = None
    hbm_bytes = _positive(dev["hbm_bytes"], "device.hbm_bytes", problems, int) if "hbm_bytes" in dev else None
    hbm_bandwidth = _positive(dev["hbm_bandwidth"], "device.hbm_bandwidth", problems) \
        if "hbm_bandwidth" in dev else None
    heap = _fraction(dev.get("heap_overhead", DEFAULT_HEAP_OVERHEAD), "device.heap_overhead", problems)
    host = _positive(dev.get("host_bandwidth", DEFAULT_HOST_BANDWIDTH), "device.host_bandwidth", problems)
    offload = _positive(dev.get("offload_bandwidth", DEFAULT_OFFLOAD_BANDWIDTH), "device.offload_bandwidth",
                        problems)
    usable = _positive(dev["usable_bytes"], "device.usable_bytes", problems, int) if "usable_bytes" in dev else 0
    if usable and hbm_bytes and usable > hbm_bytes:
        problems.add("device.usable_bytes", f"must be at most device.hbm_bytes ({hbm_bytes}), got {usable}")
        usable = None
    fraction = dev.get("allocator_fraction", 1.0)
    if not _is_number(fraction) or not 0 < fraction <= 1:
        problems.add("device.allocator_fraction", "must be a fraction above 0 and at most 1 (JAX on GPUs: 0.75, "
                     f"its XLA_PYTHON_CLIENT_MEM_FRACTION default), got {fraction!r}")
        fraction = None
    if incomplete or None in (peak, hbm_bytes, hbm_bandwidth, heap, host, offload, usable, fraction):
        return None
    return Device(name=str(dev["name"]), peak_flops=peak, hbm_bytes=hbm_bytes, hbm_bandwidth=hbm_bandwidth,
                  heap_overhead=heap, host_bandwidth=host, offload_bandwidth=offload, usable_bytes=usable or None,
                  allocator_fraction=float(fraction))


def _links(raw: Any, problems: _Problems) -> tuple[dict[str, Link], list | None]:
    """The valid links, and the names ``[links]`` defines (None when it is no table of links)."""
    if not isinstance(raw, Mapping) or not raw:
        problems.add("links", "must define at least one link")
        return {}, None
    links = {}
    for lname, ldata in raw.items():
        if not _table(ldata, _LINK_KEYS, f"links.{lname}", problems):
            continue
        incomplete = _missing(ldata, ("bandwidth", "latency"), f"links.{lname}.", problems)
        bandwidth = _positive(ldata["bandwidth"], f"links.{lname}.bandwidth", problems) \
            if "bandwidth" in ldata else None
        latency = _non_negative(ldata["latency"], f"links.{lname}.latency", problems) if "latency" in ldata else None
        if not incomplete and bandwidth is not None and latency is not None:
            links[lname] = Link(lname, bandwidth, latency)
    return links, list(raw)


def _topology(topo: Any, links: dict[str, Link], defined: list | None, problems: _Problems):
    """``(devices_per_node, nodes, {"intra_node_link": Link, ...})``, None for each part that is wrong."""
    if not _table(topo, _TOPOLOGY_KEYS, "topology", problems):
        return None, None, None
    incomplete = _missing(topo, _REQUIRED_TOPOLOGY_KEYS, "topology.", problems)
    per_node = _positive(topo["devices_per_node"], "topology.devices_per_node", problems, int) \
        if "devices_per_node" in topo else None
    nodes = _positive(topo["nodes"], "topology.nodes", problems, int) if "nodes" in topo else None
    link_of = {}
    for k in ("intra_node_link", "inter_node_link"):
        if k not in topo:
            continue
        name = topo[k]
        if not isinstance(name, str) or (defined is not None and name not in defined):
            problems.add(f"topology.{k}", f"names link {name!r}, which is not under [links]; "
                                          f"defined: {', '.join(map(str, defined or ()))}")
        elif name in links:
            link_of[k] = links[name]
    return per_node, nodes, (None if incomplete or len(link_of) < 2 else link_of)


def _axes(raw_axes: Any, problems: _Problems):
    """``(names, sizes, measured links)`` of the axes: a name None where it is wrong, sizes None when one is."""
    if not isinstance(raw_axes, list) or not raw_axes:
        problems.add("axes", "must be a non-empty list of {name, size}")
        return [], None, {}
    names, sizes, measured = [], [], {}
    for i, a in enumerate(raw_axes):
        if not _table(a, _AXIS_KEYS, f"axes[{i}]", problems):
            names.append(None)
            sizes.append(None)
            continue
        if "name" not in a or "size" not in a:
            problems.add(f"axes[{i}]", "needs both 'name' and 'size'")
        name = a.get("name")
        if "name" not in a:
            pass         # said above
        elif not isinstance(name, str) or not name.isidentifier():
            problems.add(f"axes[{i}].name", f"axis name must be an identifier, got {name!r}")
            name = None
        elif name in names:
            problems.add(f"axes[{i}].name", f"axis {name!r} is named twice")
            name = None
        names.append(name)
        sizes.append(_positive(a["size"], f"axes[{i}].size", problems, int) if "size" in a else None)
        if ("bandwidth" in a) != ("latency" in a):
            problems.add(f"axes[{i}]", "a measured axis needs both 'bandwidth' and 'latency'")
        elif "bandwidth" in a:
            bandwidth = _positive(a["bandwidth"], f"axes[{i}].bandwidth", problems)
            latency = _non_negative(a["latency"], f"axes[{i}].latency", problems)
            if name is not None and bandwidth is not None and latency is not None:
                measured[name] = Link(f"measured-{name}", bandwidth, latency)
    return names, (None if None in sizes else sizes), measured


def mesh_from_dict(data: Mapping[str, Any], *, source: str = "<dict>",
                   axes: Mapping[str, int] | None = None) -> MeshSpec:
    """Validate a parsed mesh file and build the :class:`MeshSpec`; ``axes`` overrides its logical axes.

    Every problem of the file is found: the :class:`MeshConfigError` raised says the first and how
    many more there are, and its ``problems`` lists each on its own line.
    """
    problems = _Problems(source)
    if not _table(data, _TOP_KEYS, "", problems):
        problems.raise_any()
    for required in ("name", "device", "links", "topology", "axes"):
        if required not in data:
            problems.add(required, f"missing section or key {required!r}")
    device = _device(data["device"], problems) if "device" in data else None
    links, defined = _links(data["links"], problems) if "links" in data else ({}, None)
    per_node, nodes, link_of = _topology(data["topology"], links, defined, problems) \
        if "topology" in data else (None, None, None)
    names, sizes, measured = [], None, {}
    if "axes" in data:
        raw_axes = data["axes"] if axes is None else [{"name": k, "size": v} for k, v in axes.items()]
        names, sizes, measured = _axes(raw_axes, problems)
        if axes is not None:
            _warn_misspelt_axes(names, data["axes"], source)
    if sizes is not None and per_node is not None and nodes is not None:
        total = per_node * nodes
        if math.prod(sizes) != total:
            labels = [f"axes[{i}]" if n is None else n for i, n in enumerate(names)]
            shown = "{" + ", ".join(f"{n!r}: {s}" for n, s in zip(labels, sizes)) + "}"
            problems.add("axes", f"axis sizes {shown} multiply to {math.prod(sizes)}, but the topology has "
                                 f"{nodes} node(s) x {per_node} devices = {total}; make the sizes multiply to {total}")
    calibration = data.get("calibration", {})
    if not isinstance(calibration, Mapping):
        problems.add("calibration", "must be a table")
    problems.raise_any()

    flat = tuple(Axis(f"_d{i}", n, link_of["intra_node_link"]) for i, n in enumerate((nodes, per_node)))
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


def _read_toml(path: str) -> dict[str, Any]:
    """The parsed mesh file at ``path``; one MeshConfigError line naming the file when it cannot be read as TOML."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_FILE_BYTES + 1)
    except OSError as e:
        raise MeshConfigError(f"cannot be read: {e.strerror or e}", source=path) from None
    if len(raw) > _MAX_FILE_BYTES:
        raise MeshConfigError(f"is larger than {_MAX_FILE_BYTES // 2**20} MiB; a mesh file is a small TOML file "
                              "(meshes/README.md)", source=path)
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise MeshConfigError(f"is not UTF-8 text (byte {e.start} is {raw[e.start]:#04x}: {e.reason}); a mesh file "
                              "is TOML (meshes/README.md)", source=path) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise MeshConfigError(f"is not valid TOML: {' '.join(str(e).split())}", source=path) from None
    except RecursionError:
        raise MeshConfigError("is not valid TOML: its arrays or tables nest too deeply", source=path) from None


def _warn_misspelt_axes(names, own_axes, source: str) -> None:
    """An overriding axis name that is not the mesh file's but nearly one of them (``modle``):
    axis names are the user's to choose, so it is warned about, not refused."""
    own = [a["name"] for a in own_axes if isinstance(a, Mapping) and isinstance(a.get("name"), str)] \
        if isinstance(own_axes, list) else []
    for name in names:
        close = difflib.get_close_matches(str(name), [a for a in own if a not in names], n=1, cutoff=0.75)
        if name not in own and close:
            warnings.warn(f"{source}: axis {name!r} is not one of its axes ({', '.join(own)}); "
                          f"did you mean {close[0]!r}?", stacklevel=4)


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
        return mesh_from_dict(_read_toml(text_source), source=text_source, axes=axes)
    names = preset_names()
    if text_source not in names:
        if text_source.endswith(".toml") or os.sep in text_source:
            raise MeshConfigError("no such mesh file: `shardplan mesh new --hardware PRESET --out FILE` writes "
                                  f"one; presets: {', '.join(names)}", source=repr(text_source))
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
             f"heap_overhead = {float(d.heap_overhead)!r}  # fraction XLA's heap adds to live temporaries",
             f"host_bandwidth = {float(d.host_bandwidth)!r}  # bytes/s a host's input pipeline feeds its devices",
             f"offload_bandwidth = {float(d.offload_bandwidth)!r}  # bytes/s a device moves to/from pinned host memory",
             *([f"usable_bytes = {int(d.usable_bytes)}  # bytes the runtime reports for one device"]
               if d.usable_bytes else []),
             f"allocator_fraction = {float(d.allocator_fraction)!r}  # share of them the allocator hands out",
             ""]
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
