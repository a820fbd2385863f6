"""Manual regions: a ``jax.shard_map`` inside a traced step.

A ``shard_map`` fixes what it needs and makes: each operand sharded as its ``in_specs`` entry, each
result as its ``out_specs`` entry, over the region's mesh. The planner keeps both (the operands are
resharded to the region's specs before it, priced as XLA does; the results are held at the
region's specs, as a sharding constraint would hold them) and plans everything around the region.
What runs inside is the user's program on per-device shards: its collectives (``ppermute``,
``psum``, ``all_gather``, ``all_to_all``, ``psum_scatter``) and its matmuls are read off the body,
with the trip counts of its loops, and added to the plan's predicted step as they are, since no
choice of the planner changes them. Ring attention (:mod:`shardplan.parallel.context`), a hand-written
expert dispatch or a custom kernel's wrapper are such regions.

A region whose mesh has an axis the planning mesh lacks, or of another size, or that leaves some
of its mesh's axes automatic, is treated as an op without a rule (its operands gathered to
replicated, with a warning).

Its temporaries (:func:`body_peak`: what XLA's GPU compiler holds beyond the region's operands
and results) are held at every memory checkpoint: an upper bound, since the region runs at one
point of the step.

>>> costs = body_costs(eqn.params["jaxpr"], {"seq": 4})      # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax.extend.core as jax_core

from shardplan.compiler.cost import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, COLLECTIVE_PERMUTE, REDUCE_SCATTER, Comm
from shardplan.compiler.liveness import FUSIBLE, REDUCTIONS
from shardplan.compiler.pricing import wire_itemsize
from shardplan.compiler.splitk import Gpu, dims_of, partials
from shardplan.tracing.walk import CALL_PRIMITIVES, scan_counts, sub_jaxpr

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
    # each written once and read once, as :func:`shardplan.compiler.traffic.hbm_traffic` counts a
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


def _moved(aval, cpu: bool) -> float:
    """Bytes a collective moves of a value (:func:`~shardplan.compiler.pricing.wire_itemsize`)."""
    return float(math.prod(aval.shape) * wire_itemsize(aval.dtype, cpu))


def _axes(name) -> tuple[str, ...]:
    return (name,) if isinstance(name, str) else tuple(name)


def _add(into: dict, other: Mapping, times: float) -> None:
    for k, v in other.items():
        into[k] = into.get(k, 0.0) + v * times


def body_costs(jaxpr, mesh_sizes: Mapping[str, int], operands: tuple = (), seen: dict | None = None,
               results: tuple = (), gpu: Gpu | None = None, cpu: bool = False) -> BodyCosts:
    """The collectives and matmuls of one run of a manual body (a ``jax.core.Jaxpr`` on
    per-device shapes). A ``scan`` counts its body ``length`` times; of a ``cond``'s branches the
    costliest counts (the slowest device sets the pace); a ``while`` loop's body once (its trip
    count is not known when traced).

    ``operands`` and ``results``: the step's tensors behind the body's inputs and outputs;
    ``seen``: what the regions counted so far share (``{}`` to start). XLA computes one
    ``ppermute`` of one array once in a program (common-subexpression elimination), so a region
    that permutes values another region permuted alike (ring attention's backward rotating the
    K/V blocks its forward rotated first, or returned to it) does not count it again. ``gpu``:
    the GPU the body runs on (:func:`shardplan.compiler.splitk.gpu_of`), whose matmuls XLA may split K
    ways (their float32 partial sums written, then reduced by a second kernel). ``cpu``: XLA's CPU
    compiler runs it, which moves a bfloat16 collective's values as float32."""
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
                moved = sum(_moved(v.aval, cpu) for v in eqn.outvars)
            else:
                moved = sum(_moved(v.aval, cpu) for v in eqn.invars if hasattr(v.aval, "shape"))
            comms.append((Comm(kind, axes, moved), 1.0))
        elif prim == "dot_general":
            (lc, _), _ = p["dimension_numbers"]
            lhs, rhs, out = eqn.invars[0].aval, eqn.invars[1].aval, eqn.outvars[0].aval
            dtype = lhs.dtype.name
            flops[dtype] = flops.get(dtype, 0.0) + 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in lc)
            dot_bytes[dtype] = dot_bytes.get(dtype, 0.0) + _nbytes(lhs) + _nbytes(rhs) + _nbytes(out)
            split = partials(gpu, *dims_of(lhs.shape, rhs.shape, p["dimension_numbers"]), lhs.dtype, rhs.dtype,
                             out.dtype) if gpu is not None else 0.0
            if split:
                dot_bytes[dtype] += split - _nbytes(out)      # written in place of the result
                hbm += split + _nbytes(out)                   # read and reduced by a second kernel
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
            inner = [body_costs(j, mesh_sizes, gpu=gpu, cpu=cpu) for j in subs]
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
# Ops whose result is its operand's buffer seen another way (XLA's bitcasts and no-ops).
_VIEWS = {"reshape", "squeeze", "expand_dims", "pvary", "pcast", "stop_gradient"}
_UPDATES = {"dynamic_update_slice", "scatter", "scatter-add", "scatter_add"}
# Ops with no HBM traffic of their own: index arithmetic, and the manual-axis bookkeeping.
_FREE = {"axis_index", "iota", "pvary", "pcast", "stop_gradient", "convert_element_type", "broadcast_in_dim",
         "squeeze", "expand_dims", "reshape", "select_n"}


def _operands_fit(eqn, broadcast: bool) -> bool:
    """One array result, and each operand a scalar or the result's shape (with ``broadcast``,
    also one it broadcasts from: size 1 where the result has more)."""
    if len(eqn.outvars) != 1 or not hasattr(eqn.outvars[0].aval, "shape"):
        return False
    shape = eqn.outvars[0].aval.shape

    def fits(s):
        return not s or s == shape or (broadcast and len(s) == len(shape)
                                       and all(a in (1, b) for a, b in zip(s, shape)))
    return all(fits(getattr(v.aval, "shape", ())) for v in eqn.invars)


def _elementwise(eqn) -> bool:
    """Whether XLA fuses ``eqn`` into its neighbours: one output the shape of each operand that
    is not a scalar (or a free op); reductions, slices, updates, transposes and the like are not."""
    return eqn.primitive.name in _FREE or _operands_fit(eqn, broadcast=False)


def _fused(eqn) -> bool:
    """Whether ``eqn`` is a free op (a broadcast, a convert ...) or elementwise
    (:data:`shardplan.compiler.liveness.FUSIBLE` less reductions and transposes) with each operand a
    scalar, the result's shape or one it broadcasts from (size 1 where the result has more:
    ``x - m[..., None]``)."""
    prim = eqn.primitive.name
    if prim in _FREE:
        return True
    return prim in FUSIBLE and prim not in REDUCTIONS and prim != "transpose" and _operands_fit(eqn, broadcast=True)


def _literal(v) -> bool:
    return isinstance(v, jax_core.Literal)


def _numbered(v, value: dict):
    """A value's number: a literal's value, else what :func:`body_costs` numbered it, else the
    value itself (equal only to itself: what a call or a loop made)."""
    if _literal(v):
        return ("literal", repr(v.val))
    return value.get(v, ("value", id(v)))


def body_peak(jaxpr) -> float:
    """Bytes a manual body holds at once on a device beyond its operands and its results (both
    are the step's tensors, which the step's memory model holds where the region runs): XLA's
    buffers simulated in program order (:class:`_Buffers`), as its GPU compiler lays them out.

    - Calls (``pjit``, ``custom_jvp``) are inlined, as XLA inlines them.
    - An elementwise result (a broadcast, a convert, ``x - m[..., None]``) is fused into its
      readers and held nowhere; what it is computed from lives until its last reader instead.
      It is stored where a loop, a conditional or a collective reads it, where the body returns
      it, and where a dot reads it beside other readers (a GEMM fuses the producer of an
      operand it alone reads). A stored one takes over a same-size buffer that dies there.
    - A reshape is a view of its operand.
    - An update (``dynamic_update_slice``, ``scatter``) writes into its operand where that
      dies there (a loop body's state too), and a loop into its carried operands; an operand
      that is an input of the body or of a conditional's branch is copied first (XLA does not
      write into a caller's buffer).
    - A loop or branch adds its own body's peak at its point; a loop body's results (its new
      carries) are held beside the old ones, a branch's are the conditional's result.

    >>> body_peak(eqn.params["jaxpr"])                      # doctest: +SKIP
    """
    return _Buffers(jaxpr).beyond_results


@dataclasses.dataclass
class _Op:
    """One equation of a body with its calls inlined: the values it reads and makes (keys)."""

    prim: str
    ins: list                       # value keys (None: a literal)
    outs: list
    sizes: list[float]
    kind: str                       # "view", "fused", "update", "loop", "branch" or "op"
    inner: float = 0.0              # a loop's or branch's own peak
    carried: dict = dataclasses.field(default_factory=dict)    # loop: result index -> operand index


class _Buffers:
    """XLA-style buffer liveness of one body (see :func:`body_peak`): ``peak``, the bytes it
    holds at once beyond its inputs (its results, once made, included); ``beyond_results``, less
    its results (where the caller holds them: a region's results are the step's tensors, a
    branch's the conditional's). ``state``: the inputs are a loop's state, which an update may
    write in place."""

    def __init__(self, jaxpr, state: bool = False):
        self.state = state
        self.ops: list[_Op] = []
        self.count = 0
        self.external: set = set()
        env = {v: self._key(external=True) for v in (*jaxpr.constvars, *jaxpr.invars)}
        self._flatten(jaxpr, env)
        self.results = [None if _literal(v) else env[v] for v in jaxpr.outvars]
        self.peak, made = self._simulate()
        self.beyond_results = max(self.peak - made, 0.0)

    def _key(self, external=False):
        self.count += 1
        if external:
            self.external.add(self.count)
        return self.count

    def _flatten(self, jaxpr, env: dict) -> None:
        for eqn in jaxpr.eqns:
            ins = [None if _literal(v) else env[v] for v in eqn.invars]
            prim = eqn.primitive.name
            body = _call_body(eqn) if prim in CALL_PRIMITIVES else None
            if body is not None:
                inner = {v: self._key(external=True) for v in body.constvars}
                inner.update(zip(body.invars, ins))
                self._flatten(body, inner)
                for v, w in zip(eqn.outvars, body.outvars):
                    env[v] = None if _literal(w) else inner[w]
                continue
            outs = [self._key() for _ in eqn.outvars]
            env.update(zip(eqn.outvars, outs))
            sizes = [_nbytes(v.aval) if hasattr(v.aval, "shape") else 0.0 for v in eqn.outvars]
            op = _Op(prim, ins, outs, sizes, "op")
            subs = _sub_jaxprs(eqn)
            if prim in _VIEWS:
                op.kind = "view"
            elif prim in _UPDATES:
                op.kind = "update"
            elif prim in ("scan", "while") and subs:
                op.kind = "loop"
                body = subs[0]
                op.inner = _Buffers(body, state=True).peak
                if prim == "scan":
                    first, count = scan_counts(eqn.params)
                else:
                    first, count = eqn.params["body_nconsts"] + eqn.params["cond_nconsts"], len(eqn.outvars)
                op.carried = {k: first + k for k in range(count)}
            elif subs:
                op.kind = "branch"
                op.inner = max(_Buffers(j).beyond_results for j in subs)
            elif _fused(eqn):
                op.kind = "fused"
            self.ops.append(op)

    def _simulate(self) -> tuple[float, float]:
        """``(peak, bytes of the results it made)``."""
        ops = self.ops
        unfused: set = set()       # values read where XLA cannot fuse their producer
        readers: dict = {}
        for op in ops:
            if op.kind in ("loop", "branch") or op.prim in _COLLECTIVES:
                unfused.update(op.ins)
            for x in set(op.ins):
                readers.setdefault(x, []).append(op.prim)
        # A GEMM fuses the elementwise producer of an operand it alone reads (XLA's GPU gemm
        # fusion); one other ops read too is stored once for all of them.
        unfused.update(k for k, prims in readers.items() if "dot_general" in prims and len(prims) > 1)
        returned = {k for k in self.results if k is not None}
        unfused |= returned
        # The buffers each value's bytes are in: its own, or those it is computed (or viewed) from.
        roots: dict = {k: (k,) for k in self.external}
        self.roots = roots
        for op in ops:
            for k in op.outs:
                if op.kind == "view" and op.ins[0] is not None:
                    roots[k] = roots[op.ins[0]]
                elif op.kind == "fused" and k not in unfused:
                    roots[k] = tuple({r for x in op.ins if x is not None for r in roots[x]})
                else:
                    roots[k] = (k,)
        last: dict = {}
        for i, op in enumerate(ops):
            for x in op.ins:
                for r in roots.get(x, ()):
                    last[r] = i
        for k in returned:
            for r in roots[k]:
                last[r] = len(ops)
        size: dict = {}            # the body's own buffers live now -> bytes
        live = peak = 0.0
        for i, op in enumerate(ops):
            made = 0.0
            for j, (k, nbytes) in enumerate(zip(op.outs, op.sizes)):
                if roots[k] != (k,):
                    continue
                into = self._reused(op, j, nbytes, size, last, i)
                if into in self.external:       # updated in place in an input's buffer
                    self.external.add(k)
                    roots[k] = roots[into]
                elif into is not None:          # takes over a buffer dying here
                    size[k] = size.pop(into)
                else:
                    size[k] = nbytes
                    made += size[k]
            peak = max(peak, live + made + op.inner)
            live += made
            for b in {r for x in (*op.ins, *op.outs) if x is not None for r in roots[x]}:
                if last.get(b, i) <= i and b in size:
                    live -= size.pop(b)
        return peak, sum(nbytes for op in ops for k, nbytes in zip(op.outs, op.sizes)
                         if k in returned and roots[k] == (k,) and k not in self.external)

    def _reused(self, op: _Op, j: int, nbytes: float, size: dict, last: dict, i: int):
        """The buffer that result ``j`` of ``op`` is written into where its operand dies there:
        an update's operand (an input's only where the inputs are a loop's state), a loop's
        carried operand (the body's own, not an input's, which XLA copies), a same-size operand of
        a stored elementwise result; ``None``: a new buffer."""
        if op.kind == "update" and j == 0:
            operands = [op.ins[0]]
        elif op.kind == "loop" and j in op.carried:
            operands = [op.ins[op.carried[j]]]
        elif op.kind == "fused":
            operands = op.ins
        else:
            return None
        candidates = [r for x in operands if x is not None for r in self.roots[x]]
        for c in candidates:
            if c is None or last.get(c) != i:
                continue
            if c in size and size[c] == nbytes:
                return c
            if c in self.external and op.kind == "update" and self.state:
                return c
        return None


def _call_body(eqn):
    """The body a call equation runs (XLA inlines it), or ``None`` where none matches its arity."""
    try:
        return sub_jaxpr(eqn)[0]
    except ValueError:
        return None


def _sub_jaxprs(eqn) -> list:
    """The jaxprs an equation runs (a while loop's condition aside: nothing worth pricing)."""
    values = [v for key, value in eqn.params.items() if key != "cond_jaxpr"
              for v in (value if isinstance(value, (tuple, list)) else (value,))]
    return [j for j in (getattr(v, "jaxpr", v) for v in values) if hasattr(j, "eqns")]
