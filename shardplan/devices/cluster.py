"""Meshes of many nodes from MaxText-style ``ici_*`` / ``dcn_*`` parallelism sizes: what
``shardplan mesh new`` writes."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from shardplan.devices.mesh import Axis, MeshSpec, load_mesh
from shardplan.errors import MeshConfigError


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


def cluster_mesh(hardware: str | MeshSpec, ici: Mapping[str, int], dcn: Mapping[str, int], *,
                 nodes: int | None = None, devices_per_node: int | None = None, name: str = "custom") -> MeshSpec:
    """A mesh of ``nodes`` nodes of ``hardware``'s device and links (a preset name or a
    :class:`MeshSpec`; by default its own node count and size), with the logical axes
    :func:`hybrid_axes` lays from MaxText-style ``ici`` and ``dcn`` sizes: what ``shardplan mesh
    new`` writes. ``cluster_mesh("a100-128x8", {"model": 8}, {"data": -1}, nodes=240)`` is 1920
    A100s as {data: 240, model: 8}."""
    base = hardware if isinstance(hardware, MeshSpec) else load_mesh(hardware)
    nodes = nodes if nodes is not None else base.num_devices // base.devices_per_node
    per_node = devices_per_node or base.devices_per_node
    axes = hybrid_axes(ici, dcn, per_node, nodes)
    flat = (Axis("_nodes", nodes, base.inter_node_link), Axis("_local", per_node, base.intra_node_link))
    return dataclasses.replace(base, name=name, devices_per_node=per_node, axes=flat,
                               source=f"hardware of preset {base.name}: {base.source}").with_axes(axes)
