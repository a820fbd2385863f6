"""Manual regions: a ``jax.shard_map`` inside a traced step.

A ``shard_map`` fixes what it needs and makes: each operand sharded as its ``in_specs`` entry, each
result as its ``out_specs`` entry, over the region's mesh. The planner keeps both (the operands are
resharded to the region's specs before it, priced as XLA does; the results are held at the
region's specs, as a sharding constraint would hold them) and plans everything around the region.
What runs inside is the user's program on per-device shards: its collectives (``ppermute``,
``psum``, ``all_gather``, ``all_to_all``, ``psum_scatter``) and its matmuls are read off the body,
with the trip counts of its loops, and added to the plan's predicted step as they are, since no
choice of the planner changes them. Ring attention (:mod:`shardplan.context`), a hand-written
expert dispatch or a custom kernel's wrapper are such regions.

A region whose mesh has an axis the planning mesh lacks, or of another size, or that leaves some
of its mesh's axes automatic, is treated as an op without a rule (its operands gathered to
replicated, with a warning).

Its temporaries (:func:`body_peak`) are held at every memory checkpoint: an upper bound, since
the region runs at one point of the step.

>>> costs = body_costs(eqn.params["jaxpr"], {"seq": 4})      # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax.extend.core as jax_core

from shardplan.cost import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, COLLECTIVE_PERMUTE, REDUCE_SCATTER, Comm

Spec = tuple[tuple[str, ...], ...]

MANUAL_PRIMITIVE = "shard_map"

# Collective primitives of a manual body -> the HLO collective they lower to.
_COLLECTIVES = {"ppermute": COLLECTIVE_PERMUTE, "psum": ALL_REDUCE, "psum_invariant": ALL_REDUCE,
                "pmax": ALL_REDUCE, "pmin": ALL_REDUCE, "all_gather": ALL_GATHER,
                "all_gather_invariant": ALL_GATHER, "all_to_all": ALL_TO_ALL, "reduce_scatter": REDUCE_SCATTER}


@dataclasses.dataclass(frozen=True)
class BodyCosts:
    """What one run of a manual body does on each device: its collectives (``Comm`` with runs a
    step), its matmul FLOPs with the bytes they read and write, by operand dtype name, and the
    HBM traffic of its other materialised values."""

    comms: tuple[tuple[Comm, float], ...] = ()
    flops: Mapping[str, float] = dataclasses.field(default_factory=dict)
    dot_bytes: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # Bytes of the values other ops read or write whole (reductions, slices, updates, transposes:
    # each written once and read once, as :func:`shardplan.strategies.hbm_traffic` counts a
    # step's); elementwise chains fuse and cost nothing. Priced at HBM bandwidth.
    hbm_bytes: float = 0.0


def _spec(pspec, rank: int) -> Spec:
    out = []
    for d in range(rank):
        entry = pspec[d] if d < len(pspec) else None
        out.append(() if entry is None else (entry,) if isinstance(entry, str) else tuple(entry))
    return tuple(out)


def region_specs(eqn, mesh_sizes: Mapping[str, int]) -> tuple[list[Spec], list[Spec]] | None:
    """The specs a ``shard_map`` equation needs of its operands and makes of its results, or
    ``None`` where the planner cannot hold them on a mesh of ``mesh_sizes`` (see the module)."""
    p = eqn.params
    region = dict(zip(p["mesh"].axis_names, p["mesh"].axis_sizes))
    manual = set(p.get("newly_manual_axes") or region)
    if any(mesh_sizes.get(a) != n for a, n in region.items()) or manual != set(region):
        return None
    ins = [_spec(s, len(v.aval.shape)) for s, v in zip(p["in_specs"], eqn.invars)]
    outs = [_spec(s, len(v.aval.shape)) for s, v in zip(p["out_specs"], eqn.outvars)]
    return ins, outs


def _nbytes(aval) -> float:
    return float(math.prod(aval.shape) * aval.dtype.itemsize)


def _axes(name) -> tuple[str, ...]:
    return (name,) if isinstance(name, str) else tuple(name)


def _add(into: dict, other: Mapping, times: float) -> None:
    for k, v in other.items():
        into[k] = into.get(k, 0.0) + v * times


def body_costs(jaxpr, mesh_sizes: Mapping[str, int], operands: tuple = (), seen: dict | None = None,
               results: tuple = ()) -> BodyCosts:
    """The collectives and matmuls of one run of a manual body (a ``jax.core.Jaxpr`` on
    per-device shapes). A ``scan`` counts its body ``length`` times; of a ``cond``'s branches the
    costliest counts (the slowest device sets the pace); a ``while`` loop's body once (its trip
    count is not known when traced).

    ``operands`` and ``results``: the step's tensors behind the body's inputs and outputs;
    ``seen``: what the regions counted so far share (``{}`` to start). XLA computes one
    ``ppermute`` of one array once in a program (common-subexpression elimination), so a region
    that permutes values another region permuted alike (ring attention's backward rotating the
    K/V blocks its forward rotated first, or returned to it) does not count it again."""
    comms: list[tuple[Comm, float]] = []
    flops: dict[str, float] = {}
    dot_bytes: dict[str, float] = {}
    stored: set = set()              # values materialised in HBM (written once, read once)
    hbm = 0.0
    # Value numbers of the body's values computed from the step's tensors alone (XLA's CSE: one
    # computation of the same values is one), for the ppermutes that other regions repeat.
    numbers = seen.setdefault("numbers", {}) if seen is not None else {}
    permuted = seen.setdefault("permuted", set()) if seen is not None else set()
    value = {v: numbers.get(t, ("tensor", t)) for v, t in zip(jaxpr.invars, operands) if t is not None}
    for eqn in jaxpr.eqns:
        prim = eqn.primitive.name
        p = eqn.params
        if seen is not None and not _sub_jaxprs(eqn):
            key = (prim, repr(sorted(p.items())), tuple(_numbered(v, value) for v in eqn.invars))
            for k, v in enumerate(eqn.outvars):
                value[v] = key + (k,)
        if prim in _COLLECTIVES:
            kind = _COLLECTIVES[prim]
            axes = _axes(p.get("axis_name", p.get("axes", ())))
            axes = tuple(a for a in axes if isinstance(a, str) and mesh_sizes.get(a, 1) > 1)
            if not axes:
                continue
            if prim == "ppermute" and seen is not None:
                key = _numbered(eqn.invars[0], value)
                if key in permuted:
                    continue
                permuted.add(key)
            if kind == ALL_GATHER:
                moved = sum(_nbytes(v.aval) for v in eqn.outvars)
            else:
                moved = sum(_nbytes(v.aval) for v in eqn.invars if hasattr(v.aval, "shape"))
            comms.append((Comm(kind, axes, moved), 1.0))
        elif prim == "dot_general":
            (lc, _), _ = p["dimension_numbers"]
            lhs, rhs, out = eqn.invars[0].aval, eqn.invars[1].aval, eqn.outvars[0].aval
            dtype = lhs.dtype.name
            flops[dtype] = flops.get(dtype, 0.0) + 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in lc)
            dot_bytes[dtype] = dot_bytes.get(dtype, 0.0) + _nbytes(lhs) + _nbytes(rhs) + _nbytes(out)
        else:
            subs = _sub_jaxprs(eqn)
            if not subs:
                if prim in _SLICES:                 # reads its slice only
                    hbm += sum(_nbytes(v.aval) for v in eqn.outvars)
                elif prim in _UPDATES:              # in place: reads and writes the update only
                    hbm += 2 * _nbytes(eqn.invars[1 if prim == "dynamic_update_slice" else 2].aval)
                elif not _elementwise(eqn):
                    for v in (*eqn.invars, *eqn.outvars):
                        if not _literal(v) and v not in stored and hasattr(v.aval, "shape"):
                            stored.add(v)
                            hbm += 2 * _nbytes(v.aval)
                continue
            inner = [body_costs(j, mesh_sizes) for j in subs]
            if prim == "cond":
                inner = [max(inner, key=lambda c: (sum(f for f in c.flops.values()),
                                                   sum(cm.nbytes * n for cm, n in c.comms)))]
            times = float(p["length"]) if prim == "scan" else 1.0
            for c in inner:
                comms += [(cm, n * times) for cm, n in c.comms]
                _add(flops, c.flops, times)
                _add(dot_bytes, c.dot_bytes, times)
                hbm += c.hbm_bytes * times
    for v, t in zip(jaxpr.outvars, results):
        if t is not None and not _literal(v):
            numbers[t] = _numbered(v, value)
    return BodyCosts(tuple(comms), flops, dot_bytes, hbm)


_SLICES = {"dynamic_slice", "slice", "gather"}
_UPDATES = {"dynamic_update_slice", "scatter", "scatter-add", "scatter_add"}
# Ops with no HBM traffic of their own: index arithmetic, and the manual-axis bookkeeping.
_FREE = {"axis_index", "iota", "pvary", "pcast", "stop_gradient", "convert_element_type", "broadcast_in_dim",
         "squeeze", "expand_dims", "reshape", "select_n"}


def _elementwise(eqn) -> bool:
    """Whether XLA fuses ``eqn`` into its neighbours: one output the shape of each operand that
    is not a scalar (or a free op); reductions, slices, updates, transposes and the like are not."""
    if eqn.primitive.name in _FREE:
        return True
    if len(eqn.outvars) != 1 or not hasattr(eqn.outvars[0].aval, "shape"):
        return False
    shape = eqn.outvars[0].aval.shape
    return all(not getattr(v.aval, "shape", ()) or v.aval.shape == shape for v in eqn.invars)


def _literal(v) -> bool:
    return isinstance(v, jax_core.Literal)


def _numbered(v, value: dict):
    """A value's number: a literal's value, else what :func:`body_costs` numbered it, else the
    value itself (equal only to itself: what a call or a loop made)."""
    if _literal(v):
        return ("literal", repr(v.val))
    return value.get(v, ("value", id(v)))


def body_peak(jaxpr) -> float:
    """Bytes a manual body holds at once on a device beyond its inputs (they are the step's
    tensors): its materialised values live in program order, an inner loop's or branch's own
    peak on top of what is live around it. An elementwise result is fused into its reader and
    held nowhere (as :func:`body_costs` prices its traffic)."""
    last: dict = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not _literal(v):
                last[v] = i
    for v in jaxpr.outvars:
        if not _literal(v):
            last[v] = len(jaxpr.eqns)
    held: set = set()
    live = peak = 0.0
    for i, eqn in enumerate(jaxpr.eqns):
        inner = max((body_peak(j) for j in _sub_jaxprs(eqn)), default=0.0)
        fused = not _sub_jaxprs(eqn) and _elementwise(eqn)
        kept = [v for v in eqn.outvars if hasattr(v.aval, "shape") and not fused]
        made = sum(_nbytes(v.aval) for v in kept)
        peak = max(peak, live + inner + made)
        live += sum(_nbytes(v.aval) for v in kept if v in last)
        held.update(v for v in kept if v in last)
        for v in {v for v in eqn.invars if not _literal(v)}:
            if last.get(v) == i and v in held:
                live -= _nbytes(v.aval)
                held.discard(v)
    return peak


def _sub_jaxprs(eqn) -> list:
    """The jaxprs an equation runs (a while loop's condition aside: nothing worth pricing)."""
    values = [v for key, value in eqn.params.items() if key != "cond_jaxpr"
              for v in (value if isinstance(value, (tuple, list)) else (value,))]
    return [j for j in (getattr(v, "jaxpr", v) for v in values) if hasattr(j, "eqns")]
