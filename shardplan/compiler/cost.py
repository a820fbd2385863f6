"""The cost model: collectives, resharding and roofline compute on a :class:`MeshSpec`.

A *spec* here is the planner's internal form of a ``PartitionSpec``: a tuple with one entry per
array dimension, each entry the tuple of mesh axes (in mesh order) that shard that dimension.

>>> from shardplan.devices.mesh import load_mesh
>>> model = CostModel(load_mesh("h100-8"))
>>> [c.kind for c in model.reshard((4096, 1024), 4, (("model",), ()), ((), ()))]
['all-gather']
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from shardplan.compiler.layout import tiled, tpu_bytes
from shardplan.compiler.splitk import gpu_of
from shardplan.devices.mesh import MeshSpec

Spec = tuple[tuple[str, ...], ...]

ALL_GATHER = "all-gather"
ALL_REDUCE = "all-reduce"
REDUCE_SCATTER = "reduce-scatter"
ALL_TO_ALL = "all-to-all"
COLLECTIVE_PERMUTE = "collective-permute"
COLLECTIVE_KINDS = (ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, ALL_TO_ALL, COLLECTIVE_PERMUTE)

# ``groups`` of a partial sum made by a reduce op (reduce_sum, ...), not a dot: XLA's partitioner
# all-reduces it over every partial axis at its full size, then slices (see ``_reduce_partial``).
REDUCE_OP = "reduce"


def _groups_key(groups):
    return None if groups is None else groups if isinstance(groups, str) else tuple(map(tuple, groups))


@dataclasses.dataclass(frozen=True)
class Comm:
    """One collective: its kind, the mesh axes it runs over, and the bytes of its buffer per device.

    ``nbytes`` is the result size for all-gather, the operand size for reduce-scatter, and the
    buffer size for all-reduce and all-to-all: the sizes XLA prints on the HLO instruction.
    """

    kind: str
    axes: tuple[str, ...]
    nbytes: float


def replicated(rank: int) -> Spec:
    return ((),) * rank


def to_partition_spec(spec: Spec) -> PartitionSpec:
    """``((), ('data',), ('data', 'model'))`` -> ``PartitionSpec(None, 'data', ('data', 'model'))``."""
    entries = [None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def from_partition_spec(pspec: PartitionSpec, rank: int) -> Spec:
    out = []
    for i in range(rank):
        entry = pspec[i] if i < len(pspec) else None
        out.append(() if entry is None else (entry,) if isinstance(entry, str) else tuple(entry))
    return tuple(out)


def _moves(src: Spec, dst: Spec, order: Sequence[str]):
    """How ``src`` becomes ``dst``: the axes that stay in place (a shared leading run on their
    dimension), and of the others where each leaves from and arrives at, by dimension."""
    kept: dict[str, int] = {}
    for d, (s, t) in enumerate(zip(src, dst)):
        for a, b in zip(s, t):
            if a != b:
                break
            kept[a] = d
    leaving = {a: d for d, axes in enumerate(src) for a in axes if a not in kept}
    arriving = {a: d for d, axes in enumerate(dst) for a in axes if a not in kept}
    moving = [a for a in order if a in leaving and a in arriving and arriving[a] != leaving[a]]
    targets: dict[int, set[int]] = {}
    for a in moving:
        targets.setdefault(leaving[a], set()).add(arriving[a])
    scattered = {a for a in moving if len(targets[leaving[a]]) > 1}
    return leaving, arriving, moving, scattered


def reshard_steps(src: Spec, dst: Spec, order: Sequence[str]) -> list[Spec]:
    """The specs a reshard from ``src`` to ``dst`` goes through, one after another, ending at ``dst``.

    XLA's SPMD partitioner does one kind of change at a time directly (a local slice, an
    all-to-all between two dimensions, an all-gather, a permute of shards); asked for several at
    once (an axis leaving dimension 0 while another arrives on dimension 1, two axes of one
    dimension going different ways, axes of two dimensions joining a third) it replicates the
    whole array and slices it again ("Involuntary full rematerialization"). So a reshard is
    priced and emitted as these steps: the local slices first (they shrink what moves), one
    all-to-all per (source, target) dimension pair, then the all-gathers, then the final order.
    One step (``[dst]``) where the change is one thing already. Checked against XLA on meshes
    (2, 4) and (2, 2, 2) for every pair of rank-2 and rank-3 specs: no step falls back.
    """
    if src == dst:
        return []
    leaving, arriving, moving, scattered = _moves(src, dst, order)
    current = [list(axes) for axes in src]
    for a in order:
        if a in arriving and a not in leaving:
            current[arriving[a]].append(a)
    steps = [tuple(map(tuple, current))]
    pairs: dict[tuple[int, int], list[str]] = {}
    for a in moving:
        if a not in scattered:
            pairs.setdefault((leaving[a], arriving[a]), []).append(a)
    done: set[tuple[int, int]] = set()
    for (i, j) in pairs:
        if (i, j) in done:
            continue
        together = [(i, j)] + ([(j, i)] if (j, i) in pairs else [])    # two dimensions trading axes: one all-to-all
        for pair in together:
            done.add(pair)
            for a in pairs[pair]:
                current[pair[0]].remove(a)
        for pair in together:
            current[pair[1]] += pairs[pair]
        steps.append(tuple(map(tuple, current)))
    for a in order:
        if a in leaving and (a not in arriving or a in scattered):
            current[leaving[a]].remove(a)
    steps += [tuple(map(tuple, current)), dst]
    chain: list[Spec] = []
    for step in steps:
        if step != src and (not chain or chain[-1] != step):
            chain.append(step)
    return chain if len(chain) > 1 else [dst]


def spec_axes(spec: Spec) -> set[str]:
    return {a for axes in spec for a in axes}


class CostModel:
    """Prices collectives and compute on one mesh. Pure: the same inputs give the same seconds."""

    def __init__(self, mesh: MeshSpec):
        self.mesh = mesh
        self._sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
        self._links = {a.name: a.link for a in mesh.axes}
        self.tiled = tiled(mesh.device.name)           # a TPU: arrays in tiles (compiler.layout)
        self.gpu = gpu_of(mesh.device.name)             # an NVIDIA GPU: matmuls split K ways (compiler.splitk)
        # The planner asks the same questions of many tensors of one shape: answers are memoised
        # per instance (a method-level cache would keep every model alive for good).
        self._memo: dict[tuple, Any] = {}
        self._ids: dict[tuple, int] = {}                    # spec (or reduction) -> number, for tables
        self._pairs: dict[tuple[int, int], tuple] = {}      # (row number, column number) -> unit

    def _cached(self, key: tuple, compute):
        try:
            return self._memo[key]
        except KeyError:
            value = self._memo[key] = compute()
            return value

    @property
    def sizes(self) -> dict[str, int]:
        """Each mesh axis's size (do not modify)."""
        return self._sizes

    def shards(self, axes: Iterable[str]) -> int:
        key = axes if isinstance(axes, tuple) else tuple(axes)
        n = self._memo.get(key)
        if n is None:
            n = self._memo[key] = math.prod(self._sizes[a] for a in key)
        return n

    def per_device_bytes(self, shape: Sequence[int], itemsize: int, spec: Spec) -> float:
        """Bytes one device holds; an uneven split is priced at its largest shard."""
        n = itemsize
        for size, axes in zip(shape, spec):
            n *= math.ceil(size / self.shards(axes)) if axes else size
        return float(n)

    def memory_bytes(self, shape: Sequence[int], itemsize: int, spec: Spec,
                     minor: tuple[int, ...] | None = None) -> float:
        """Bytes one device's memory holds for its shard: :meth:`per_device_bytes`, laid out in
        tiles on a TPU (:mod:`shardplan.compiler.layout`; ``minor``: the dimensions tiled, where libtpu
        does not choose, :func:`shardplan.compiler.layout.minor_dims`). Collectives move the unpadded bytes."""
        key = ("bytes", tuple(shape), itemsize, spec, minor)
        try:
            n = self._memo.get(key)
        except TypeError:            # a spec given as lists: not kept
            return self._memory_bytes(shape, itemsize, spec, minor)
        if n is None:
            n = self._memo[key] = self._memory_bytes(shape, itemsize, spec, minor)
        return n

    def _memory_bytes(self, shape: Sequence[int], itemsize: int, spec: Spec, minor=None) -> float:
        if not self.tiled:
            return self.per_device_bytes(shape, itemsize, spec)
        local = [math.ceil(size / self.shards(axes)) if axes else size for size, axes in zip(shape, spec)]
        return float(tpu_bytes(local, itemsize, minor))

    # -- collectives --------------------------------------------------------------------------
    def _levels(self, axes: Sequence[str]) -> list[tuple[int, float, float]]:
        """The axes grouped by link, fastest first: (devices, bandwidth, latency) per level."""
        by_link: dict[str, list[str]] = {}
        for a in axes:
            by_link.setdefault(self._links[a].name, []).append(a)
        levels = [(self.shards(group), self._links[group[0]].bandwidth, self._links[group[0]].latency)
                  for group in by_link.values()]
        return sorted(levels, key=lambda level: -level[1])

    def collective_time(self, comm: Comm) -> float:
        return self._cached(("time", comm), lambda: self._collective_time(comm))

    def _collective_time(self, comm: Comm) -> float:
        """Ring formulas with a latency term per step, run hierarchically over the links it spans.

        Over axes on one link: a ring, (n-1)/n of the buffer over its bandwidth plus n-1 latencies
        (twice both for an all-reduce). Over axes on several links (an axis inside a node and one
        across nodes) the collective runs level by level, fastest link first, as NCCL and XLA's
        hierarchical collectives do: each slower level moves the buffer already divided by the
        faster levels' device count. An all-to-all has no such shortcut and runs at the slowest link.
        """
        n = self.shards(comm.axes)
        if n <= 1 or comm.nbytes <= 0:
            return 0.0
        if comm.kind in (ALL_TO_ALL, COLLECTIVE_PERMUTE):
            bandwidth = min(self._links[a].bandwidth for a in comm.axes)
            latency = max(self._links[a].latency for a in comm.axes)
            if comm.kind == COLLECTIVE_PERMUTE:       # every device sends its buffer to one other
                return comm.nbytes / bandwidth + latency
            return (n - 1) / n * comm.nbytes / bandwidth + (n - 1) * latency
        factor = 2.0 if comm.kind == ALL_REDUCE else 1.0
        total, divided = 0.0, 1
        for size, bandwidth, latency in self._levels(comm.axes):
            if size > 1:
                total += (size - 1) / size * comm.nbytes / divided / bandwidth + (size - 1) * latency
                divided *= size
        return factor * total

    def comms_time(self, comms: Iterable[Comm]) -> float:
        return sum(self.collective_time(c) for c in comms)

    def latency_time(self, comm: Comm) -> float:
        """The latency part of :meth:`collective_time`: what issuing the collective costs regardless of size."""
        n = self.shards(comm.axes)
        if n <= 1 or comm.nbytes <= 0:
            return 0.0
        if comm.kind in (ALL_TO_ALL, COLLECTIVE_PERMUTE):
            steps = 1 if comm.kind == COLLECTIVE_PERMUTE else n - 1
            return steps * max(self._links[a].latency for a in comm.axes)
        factor = 2.0 if comm.kind == ALL_REDUCE else 1.0
        return factor * sum((size - 1) * latency for size, _, latency in self._levels(comm.axes))

    def reshard(self, shape: Sequence[int], itemsize: int, src: Spec, dst: Spec) -> list[Comm]:
        key = ("reshard", tuple(shape), itemsize, src, dst)
        return list(self._cached(key, lambda: tuple(self._reshard(shape, itemsize, src, dst))))

    def _reshard(self, shape: Sequence[int], itemsize: int, src: Spec, dst: Spec) -> list[Comm]:
        """The collectives that turn an array sharded as ``src`` into one sharded as ``dst``, as XLA
        emits them: those of each of :func:`reshard_steps` in turn (the emitter asks for the same steps)."""
        comms, have = [], src
        for step in reshard_steps(src, dst, self.mesh.axis_names):
            comms += self._reshard_step(shape, itemsize, have, step)
            have = step
        return comms

    def _reshard_step(self, shape: Sequence[int], itemsize: int, src: Spec, dst: Spec) -> list[Comm]:
        """The collectives of one step of a reshard, as XLA emits them.

        Slicing is local and comes first (it shrinks what moves). On a dimension split by several
        axes (major to minor) only the shared leading axes stay put. An axis that moves to another
        dimension is an all-to-all, unless axes of one dimension scatter to several dimensions
        (XLA then gathers them and slices again). An axis that leaves is an all-gather. Where
        shards end up on other devices than they start on (an axis kept on its dimension but not
        in its place, two dimensions trading axes, a dimension trading one axis for another),
        XLA adds a collective-permute of the shard. Axes leaving several dimensions are gathered
        one dimension at a time.
        """
        if src == dst:
            return []
        order = self.mesh.axis_names
        leaving, arriving, moving, scattered = _moves(src, dst, order)
        stay = [a for a in order if a in leaving and arriving.get(a) == leaving[a]]
        moved = tuple(a for a in moving if a not in scattered)
        gathered = tuple(a for a in order if a in leaving and (a not in arriving or a in scattered))
        sliced = [a for a in order if a in arriving and a not in leaving]
        pairs = {(leaving[a], arriving[a]) for a in moved}
        permute = bool(stay) or any((j, i) in pairs for i, j in pairs) or any(
            leaving[g] == arriving[s] for g in gathered if g not in scattered for s in sliced)
        # Sharding after the local slices: src plus the new axes on their dst dimensions.
        current = [list(axes) for axes in src]
        for a in sliced:
            current[arriving[a]].append(a)
        comms = []
        size = self.per_device_bytes(shape, itemsize, tuple(tuple(c) for c in current))
        if permute:      # the source shards, sent to the devices that need them
            comms.append(Comm(COLLECTIVE_PERMUTE, tuple(a for a in order if a in leaving or a in arriving),
                              self.per_device_bytes(shape, itemsize, src)))
        if moved:
            comms.append(Comm(ALL_TO_ALL, moved, size))
        if gathered:
            # One all-gather per dimension, the last dimension first, each on what the one
            # before it made (XLA's order; checked on meshes (2, 4) and (2, 2, 2)).
            by_dim: dict[int, list[str]] = {}
            for a in gathered:
                by_dim.setdefault(leaving[a], []).append(a)
            for d in sorted(by_dim, reverse=True):
                size *= self.shards(by_dim[d])
                comms.append(Comm(ALL_GATHER, tuple(by_dim[d]), size))
        return comms

    def reduced_spec(self, produced: Spec, partial: Sequence[str], dst: Spec) -> Spec:
        """The spec a partial sum has once reduced, before any resharding to ``dst``: ``produced``
        plus the partial axes that ``dst`` shards (those are reduce-scattered onto their dimension)."""
        return self._reduction(produced, partial, dst)[3] if partial else produced

    def _reduction(self, produced: Spec, partial: Sequence[str], dst: Spec):
        dst_dim = {a: d for d, axes in enumerate(dst) for a in axes}
        scatter = tuple(a for a in self.mesh.axis_names if a in partial and a in dst_dim)
        reduce = tuple(a for a in self.mesh.axis_names if a in partial and a not in dst_dim)
        current = [list(axes) for axes in produced]
        for a in scatter:
            current[dst_dim[a]].append(a)
        # A reduce-scatter splits each device's block further, so the scattered axes go minor to
        # the axes the dimension is already split by, whatever the mesh order: a fact of XLA's SPMD
        # partitioner on every compiler. Asked for the reduced axis major (a dot whose result is
        # split over ``model`` and partial over ``fsdp`` pinned to ``('fsdp', 'model')``), its dot
        # handler gathers the operand's ``model`` split and all-reduces the whole result instead
        # (the CPU and GPU compilers: tests/compiler/test_cost.py; libtpu gathered gpt2-small's
        # 1.5 GiB logits gradient that way). Pinned as made, ``('model', 'fsdp')``, it is one
        # reduce-scatter, and a reshard to the tensor's own spec where that differs.
        return dst_dim, scatter, reduce, tuple(tuple(c) for c in current)

    def reduce_partial(self, shape: Sequence[int], itemsize: int, produced: Spec,
                       partial: Sequence[str], dst: Spec,
                       groups: Sequence[Sequence[str]] | None = None) -> list[Comm]:
        key = ("reduce", tuple(shape), itemsize, produced, tuple(partial), dst,
               _groups_key(groups))
        return list(self._cached(key, lambda: tuple(self._reduce_partial(shape, itemsize, produced, partial, dst,
                                                                           groups))))

    def _reduce_partial(self, shape: Sequence[int], itemsize: int, produced: Spec,
                        partial: Sequence[str], dst: Spec,
                        groups: Sequence[Sequence[str]] | None = None) -> list[Comm]:
        """Collectives that sum a result that is partial over mesh axes ``partial`` and reshard it to ``dst``.

        As XLA's partitioner does it: partial axes that ``dst`` shards on its first such dimension
        are reduce-scattered onto it; those ``dst`` shards on later dimensions are all-reduced whole
        before that (then sliced locally); the rest are all-reduced once the result is split.
        ``groups`` says which partial axes come from which contracting dimension of a dot: with
        nothing to scatter, XLA all-reduces each dimension's axes on their own, at full size,
        instead of once over all of them.

        ``groups == REDUCE_OP``: the partial sum of a reduce op (``reduce_sum`` over a sharded
        dimension). XLA's reduce handler all-reduces it over every partial axis at the size it is
        made, and the reshard to ``dst`` slices it locally; only where ``dst`` shards every partial
        axis on one dimension does the all-reduce + slice become a reduce-scatter (XLA's
        ReduceScatterCreator), as the rule above gives. (Checked on GPT-2's position-embedding
        gradient on h100-8: partial over (data, model), sharded over data: one all-reduce over
        all 8 devices of the whole (1024, 768) gradient, no reduce-scatter.)
        """
        if not partial:
            return self.reshard(shape, itemsize, produced, dst)
        dim_of, scatter, reduce, current_spec = self._reduction(produced, partial, dst)
        if groups == REDUCE_OP:
            if scatter and (reduce or len({dim_of[a] for a in scatter}) > 1):
                axes = tuple(a for a in self.mesh.axis_names if a in partial)
                return [Comm(ALL_REDUCE, axes, self.per_device_bytes(shape, itemsize, produced))] + \
                    self.reshard(shape, itemsize, produced, dst)
            groups = None
        comms = []
        if scatter:
            full = self.per_device_bytes(shape, itemsize, produced)
            first = min(dim_of[a] for a in scatter)
            later = tuple(a for a in scatter if dim_of[a] != first)
            if later:
                comms.append(Comm(ALL_REDUCE, later, full))
            comms.append(Comm(REDUCE_SCATTER, tuple(a for a in scatter if dim_of[a] == first), full))
        if reduce:
            nbytes = self.per_device_bytes(shape, itemsize, current_spec)
            parts = [tuple(a for a in reduce if a in g) for g in (groups or ())]
            parts = [p for p in parts if p]
            if scatter or len(parts) < 2 or set().union(*parts) != set(reduce):
                comms.append(Comm(ALL_REDUCE, reduce, nbytes))
            else:
                comms += [Comm(ALL_REDUCE, p, nbytes) for p in parts]
        return comms + self.reshard(shape, itemsize, current_spec, dst)

    # -- seconds, fast ------------------------------------------------------------------------
    # A collective's seconds are its latency plus its bytes over a bandwidth, and its bytes are
    # the bytes of one shard of the tensor: the product over dimensions of size / shards, with
    # a ceiling only where a split is uneven. So one "unit" per pair of specs, priced on a
    # canonical shape (each evenly split dimension at its divisor), prices every tensor of any
    # shape by scaling its bandwidth part. The ILP's tables ask hundreds of thousands of such
    # questions of a few thousand distinct spec pairs.
    def _unit(self, produced: Spec, partial: tuple[str, ...], dst: Spec, groups, odd: tuple[int, ...] | None):
        """``(divisors, reduction latency, other latency, bandwidth seconds on the canonical shape,
        the collectives on the canonical shape with their latency and bandwidth seconds)``.

        ``divisors[d]`` is how many shards dimension ``d`` is split in by the specs together;
        ``odd[d]`` is the size of a dimension that divisor does not divide (0 where it does;
        ``None``: all do), kept whole in the canonical shape."""
        key = ("unit", produced, partial, dst, groups, odd)
        unit = self._memo.get(key)
        if unit is None:
            used = [i for i, (p, d) in enumerate(zip(produced, dst)) if p or d]
            if len(used) < len(produced):
                # Dimensions no spec splits change nothing but the divisors: price the rest.
                sub = self._unit(tuple(produced[i] for i in used), partial, tuple(dst[i] for i in used), groups,
                                 None if odd is None else tuple(odd[i] for i in used))
                divs = [1] * len(produced)
                for i, n in zip(used, sub[0]):
                    divs[i] = n
                unit = self._memo[key] = (tuple(divs),) + sub[1:]
                return unit
            divs = tuple(self.shards(tuple(dict.fromkeys(p + d))) for p, d in zip(produced, dst))
            shape = divs if odd is None else tuple(o or n for o, n in zip(odd, divs))
            comms = self._reduce_partial(shape, 1, produced, partial, dst, groups) if partial else \
                self._reshard(shape, 1, produced, dst)
            lat_reduce = lat_other = bandwidth = 0.0
            items = []
            for c in comms:
                latency = self.latency_time(c)
                if c.kind in (ALL_REDUCE, REDUCE_SCATTER):
                    lat_reduce += latency
                else:
                    lat_other += latency
                bandwidth += self.collective_time(c) - latency
                items.append((c, latency, self.collective_time(c) - latency))
            unit = self._memo[key] = (divs, lat_reduce, lat_other, bandwidth, tuple(items))
        return unit

    def reduce_table(self, shape: Sequence[int], itemsize: int, rows: Sequence[tuple], cols: Sequence[Spec],
                     share: int = 1) -> np.ndarray:
        """``[len(rows), len(cols)]`` seconds of :meth:`reduce_partial`'s collectives, row ``i``
        being ``(produced, partial, groups)`` and column ``j`` the spec ``dst``. The reductions
        (all-reduce, reduce-scatter) pay ``1/share`` of their latency: they are combined with
        ``share - 1`` others into one collective (see :mod:`shardplan.compiler.combine`)."""
        # Specs are numbered once per table side, so a cell costs a lookup of two small ints.
        ids = self._ids
        rows = [(p, part if type(part) is tuple else tuple(part), None if grp is None else _groups_key(grp))
                for p, part, grp in rows]
        row_ids = tuple(ids.setdefault(("row",) + r, len(ids)) for r in rows)
        col_ids = tuple(ids.setdefault(("col", c), len(ids)) for c in cols)
        dims = np.asarray(shape, dtype=np.int64)
        if len(cols) == 0 or len(rows) == 0 or (dims == 0).any():
            return np.zeros((len(rows), len(cols)))
        key = ("table", row_ids, col_ids)
        units = self._memo.get(key)
        if units is None:
            pairs = self._pairs
            flat = []
            for r, ri in zip(rows, row_ids):
                for c, ci in zip(cols, col_ids):
                    unit = pairs.get((ri, ci))
                    if unit is None:
                        unit = pairs[(ri, ci)] = self._unit(r[0], r[1], c, r[2], None)
                    flat.append(unit)
            divs = np.array([u[0] for u in flat], dtype=np.int64).reshape(len(rows), len(cols), len(shape))
            values = np.array([u[1:4] for u in flat], dtype=float).reshape(len(rows), len(cols), 3)
            units = self._memo[key] = (divs, values)
        divs, values = units
        even = dims % divs == 0                                     # [rows, cols, dims]
        if not even.all():
            # Cells with an uneven split: priced on their own canonical shape, once per table
            # and set of sizes.
            odd_dims = tuple(int(n) if not even[..., d].all() else 0 for d, n in enumerate(shape))
            odd_key = ("odd", row_ids, col_ids, odd_dims)
            fixed = self._memo.get(odd_key)
            if fixed is None:
                values = values.copy()
                for i, j in zip(*np.nonzero(~even.all(axis=-1))):
                    odd = tuple(int(n) if not e else 0 for n, e in zip(shape, even[i, j]))
                    p, part, grp = rows[i]
                    values[i, j] = self._unit(p, part, cols[j], grp, odd)[1:4]
                fixed = self._memo[odd_key] = values
            values = fixed
        scale = itemsize * np.where(even, dims // divs, 1).prod(axis=-1)
        return values[..., 1] + values[..., 0] / share + values[..., 2] * scale

    def reshard_table(self, shape: Sequence[int], itemsize: int, srcs: Sequence[Spec], dsts: Sequence[Spec]) \
            -> np.ndarray:
        """``[len(srcs), len(dsts)]`` seconds of :meth:`reshard`'s collectives."""
        return self.reduce_table(shape, itemsize, [(s, (), None) for s in srcs], dsts)

    def reduce_items(self, shape: Sequence[int], itemsize: int, produced: Spec, partial: Sequence[str],
                     dst: Spec, groups: Sequence[Sequence[str]] | None = None, share: int = 1) \
            -> list[tuple[Comm, float]]:
        """The collectives of one cell of :meth:`reduce_table`, each with its seconds (they sum to
        the cell): the itemised cost of a chosen plan comes from the units that priced the ILP."""
        if itemsize * math.prod(shape) <= 0:
            return []
        partial = tuple(partial)
        groups = _groups_key(groups)
        divs = self._unit(produced, partial, dst, groups, None)[0]
        even = [n % d == 0 for n, d in zip(shape, divs)]
        odd = None if all(even) else tuple(0 if e else int(n) for n, e in zip(shape, even))
        items = self._unit(produced, partial, dst, groups, odd)[4]
        scale = itemsize * math.prod(n // d for n, d, e in zip(shape, divs, even) if e)
        return [(Comm(c.kind, c.axes, c.nbytes * scale),
                 latency / (share if c.kind in (ALL_REDUCE, REDUCE_SCATTER) else 1) + seconds * scale)
                for c, latency, seconds in items]

    def reshard_items(self, shape: Sequence[int], itemsize: int, src: Spec, dst: Spec) -> list[tuple[Comm, float]]:
        """The collectives of one cell of :meth:`reshard_table`, each with its seconds."""
        return [] if src == dst else self.reduce_items(shape, itemsize, src, (), dst)

    # -- compute ------------------------------------------------------------------------------
    def compute_time(self, flops: float, nbytes: float, dtype_name: str = "float32") -> float:
        """Roofline: the larger of FLOPs over peak FLOP/s and bytes moved over HBM bandwidth."""
        device = self.mesh.device
        return max(flops / device.flops_for(dtype_name), nbytes / device.hbm_bandwidth)


_SHARED: collections.OrderedDict[str, CostModel] = collections.OrderedDict()


def shared_model(mesh: MeshSpec) -> CostModel:
    """The :class:`CostModel` of ``mesh``, one per mesh among the last few planned on: a search
    that plans one step many times on a mesh (each candidate pipeline of one stage count,
    each recomputation or attention split) prices each pair of specs once. Pure, so sharing
    changes no answer."""
    key = repr(mesh)
    model = _SHARED.pop(key, None) or CostModel(mesh)
    _SHARED[key] = model
    while len(_SHARED) > 4:
        _SHARED.popitem(last=False)
    return model
