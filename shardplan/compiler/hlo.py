"""Read the collectives of a compiled program from its HLO text.

Every all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute (sync, async
``-start`` or tuple-shaped) with its bytes per device, the mesh axes its replica groups span, and
how many times it runs: inside a while loop, times the loop's ``known_trip_count``. Replica
groups come in several notations: ``{{0,1},{2,3}}``, ``[2,4]<=[8]``, ``[4,2]<=[2,4]T(1,0)`` and
``mesh['a'=2,'b'=4] {'a'}`` (optionally with ``device_ids=(...)``); all are read.

>>> stats = collectives(compiled.as_text(), jax_mesh)   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import numpy as np

from shardplan.compiler.cost import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, COLLECTIVE_PERMUTE, REDUCE_SCATTER, Comm

_KINDS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, COLLECTIVE_PERMUTE)
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) (" + "|".join(_KINDS) + r")(-start)?\((.*)$")
_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\dm\d(?:fn)?)?)\[([\d,]*)\]")
_WHILE = re.compile(r"\bwhile\(.*condition=%?([\w.\-]+), body=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONDITIONAL = re.compile(r" conditional\(")
_CALLS = re.compile(r"(?:calls|to_apply|branch_computations|called_computations)=\{?%?([\w.\-]+(?:, ?%?[\w.\-]+)*)\}?")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    nbytes: float                  # per device, as Comm.nbytes (operand size for reduce-scatter)
    axes: tuple[str, ...]          # mesh axes the replica groups span
    group_size: int
    count: float                   # how many times it runs per step
    name: str
    emitted: str = ""              # the HLO op, where the audit reads it as another kind (see below)

    def comm(self) -> Comm:
        return Comm(self.kind, self.axes, self.nbytes)


def _top_level(text: str) -> list[str]:
    """The elements of a tuple shape ``(a, (b, c), d)`` (the text itself if it is no tuple)."""
    text = text.strip()
    if not text.startswith("("):
        return [text]
    parts, depth, begin = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                parts.append(text[begin:i])
                break
        elif ch == "," and depth == 1:
            parts.append(text[begin:i])
            begin = i + 1
    return [p.strip() for p in parts if p.strip()]


def _async_outputs(result: str) -> str:
    """An async collective's ``-start`` (GPU) has the shape ``(operands, outputs)``, each part
    a shape or a tuple of them, sometimes with scalar context after: the outputs."""
    parts = _top_level(result)
    return parts[1] if len(parts) >= 2 else result


def _shape_bytes(text: str) -> float:
    total = 0.0
    for dtype, dims in _SHAPE.findall(text):
        if dtype in _BYTES:
            total += _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _iota(dims: list[int], perm: list[int] | None, reshape: list[int]) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    if perm is not None:
        ids = ids.transpose(perm)
    return ids.reshape(reshape)


def replica_groups(text: str, num_devices: int) -> list[list[int]]:
    """Device groups from any of the HLO replica-group notations."""
    m = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", text)
    if m:
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d, ]*)\}", m.group(1))]
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        perm = [int(x) for x in m.group(3).split(",")] if m.group(3) else None
        return _iota(dims, perm, shape).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? \{([^}]*)\}",
                  text)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        if m.group(2):
            dims = [int(x) for x in m.group(2).split(",")]
            perm = [int(x) for x in m.group(3).split(",")] if m.group(3) else None
            devices = _iota(dims, perm, sizes)
        else:
            devices = np.arange(math.prod(sizes)).reshape(sizes)
        grouped = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(4))]
        rest = [i for i in range(len(names)) if i not in grouped]
        moved = devices.transpose(rest + grouped)
        return moved.reshape(-1, math.prod(sizes[i] for i in grouped) if grouped else 1).tolist()
    return [list(range(num_devices))]


def _axes_of(group: list[int], mesh) -> tuple[str, ...]:
    """Mesh axes along which the devices of one group differ. Groups name logical devices:
    positions in the program's device assignment (the mesh's devices in order), not device ids.
    The two differ where a mesh orders its devices otherwise than by id: always on a TPU
    topology (the v5e's ids follow its physical torus: the first mesh row is ids 0, 1, 16, 17,
    2, ...), and on any mesh built from a permuted device list."""
    coords = [np.unravel_index(d, mesh.devices.shape) for d in group]
    return tuple(name for k, name in enumerate(mesh.axis_names) if len({int(c[k]) for c in coords}) > 1)


_ROOT_OPERANDS = re.compile(r"ROOT .*? (compare|fusion)\(%?([\w.\-]+), %?([\w.\-]+)\)(.*)")
_INT_CONSTANT = re.compile(r"^\s*%?([\w.\-]+) = [su](?:32|64)\[\]\S* constant\((\d+)\)")


def _counted_trips(condition: list[str], bodies: dict[str, list[str]], body: list[str] = ()) -> int:
    """A loop's trips read off its condition where the compiler gives no ``known_trip_count``
    (libtpu does not): ``i < N`` with a constant ``N`` (the compare itself, or a fusion of it),
    the counter a scan starts at 0, stepping by the constant ``body`` adds to it (libtpu's
    windowed einsum loops unroll two steps a trip and count ``i += 2``). Else 1."""
    constants = {m.group(1): int(m.group(2)) for m in map(_INT_CONSTANT.match, condition) if m}
    for line in condition:
        m = _ROOT_OPERANDS.search(line)
        if not m:
            continue
        op, a, b, rest = m.groups()
        if op == "fusion":
            callee = re.search(r"calls=%?([\w.\-]+)", rest)
            root = next((ln for ln in bodies.get(callee.group(1), []) if "ROOT" in ln), "") if callee else ""
            if not re.search(r"compare\(%?param_0[\w.]*, %?param_1[\w.]*\), direction=LT", root):
                return 1
        elif "direction=LT" not in rest:
            return 1
        if b not in constants or a in constants:
            return 1
        return max(-(-constants[b] // _counter_step(condition, a, body)), 1)
    return 1


def _counter_step(condition: list[str], counter: str, body: list[str]) -> int:
    """What a while body adds to the loop counter ``counter`` (a tuple element of the
    condition's parameter) each trip: a constant, else 1."""
    index = next((re.search(r"index=(\d+)", ln) for ln in condition
                  if re.match(rf"\s*%?{re.escape(counter)} = \S+ get-tuple-element\(", ln)), None)
    root = next((ln for ln in body if ln.lstrip().startswith("ROOT ") and " tuple(" in ln), None)
    if index is None or root is None:
        return 1
    operands = [o.strip().lstrip("%") for o in re.sub(r"/\*[^*]*\*/", "", root.split(" tuple(", 1)[1]).split(",")]
    k = int(index.group(1))
    if k >= len(operands):
        return 1
    name = operands[k].rstrip(")")
    constants = {m.group(1): int(m.group(2)) for m in map(_INT_CONSTANT.match, body) if m}
    for ln in body:
        m = re.match(rf"\s*%?{re.escape(name)} = \S+ add\(%?([\w.\-]+), %?([\w.\-]+)\)", ln)
        if m:
            step = constants.get(m.group(2), constants.get(m.group(1)))
            return step if step and step > 0 else 1
    return 1


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], dict[str, float]]:
    """Each computation's lines, and how many times it runs per step (ENTRY once; a while body
    its ``known_trip_count`` times, else as its condition counts, else once; called computations as
    often as callers)."""
    bodies: dict[str, list[str]] = {}
    current, entry = None, None
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if m and not line.startswith(" "):
            current = m.group(1)
            bodies[current] = [line]        # the header: parameter shapes
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None:
            bodies[current].append(line)
    mult: dict[str, float] = {}
    top: set[str] = set()

    def callees(line: str, comp: str) -> list[str]:
        """The computations ``line`` calls (fused bodies, reducers, branches), ``comp`` aside."""
        named = [c.lstrip("%") for found in _CALLS.findall(line) for c in re.split(r",\s*", found)]
        return [c for c in named if c in bodies and c != comp]

    @functools.cache
    def weight(comp: str) -> float:
        """Bytes of every result a computation (and what it calls) makes: which branch of a
        conditional is the costliest."""
        total = 0.0
        for line in bodies.get(comp, [])[1:]:
            d = _DEF.match(line)
            if d:
                total += _shape_bytes(d.group(2))
            total += sum(weight(c) for c in callees(line, comp))
        return total

    def visit(comp: str, times: float, is_top: bool = False) -> None:
        mult[comp] = mult.get(comp, 0.0) + times
        if is_top:
            top.add(comp)
        for line in bodies.get(comp, [])[1:]:
            w = _WHILE.search(line)
            if w:
                trip = _TRIP.search(line)
                n = int(trip.group(1)) if trip else _counted_trips(bodies.get(w.group(1), []), bodies,
                                                                    bodies.get(w.group(2), []))
                visit(w.group(2), times * n, True)
                continue
            called = callees(line, comp)
            if _CONDITIONAL.search(line) and called:
                # One branch runs per call: priced as the costliest (as the planner prices a
                # shard_map body's conditional), not as all of them.
                called = [max(called, key=weight)]
                visit(called[0], times, True)
                continue
            for callee in called:
                visit(callee, times)
    if entry is not None:
        visit(entry, 1.0, True)
    bodies["__top__"] = sorted(top)   # computations that run as programs, not inside a fusion
    return bodies, mult


_DOT = re.compile(r"=\s*(\S+) dot\((?:\S+ )?%?([\w.\-]+), (?:\S+ )?%?([\w.\-]+)\).*?lhs_contracting_dims=\{([\d,]*)\}")
_DEF = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ")
_PARAM = re.compile(r"([\w.\-]+): (\w+\[[\d,]*\])")


_OP = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*?)\)(?:,|$)")
_NO_TRAFFIC = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional", "call",
               "after-all", "partition-id", "replica-id", "iota"}


def _real(bodies):
    return [(c, lines) for c, lines in bodies.items() if c != "__top__"]


def _sliced_read(fused: list[str], index: int, full: float) -> float:
    """Bytes a fusion reads of parameter ``index``: only the slices, if slices are all that use it
    (directly, or through a whole ``convert``: XLA's CPU compiler widens bfloat16 first)."""
    param = next((d.group(1) for ln in fused[1:] if re.search(r"\bparameter\(" + str(index) + r"\)", ln)
                  for d in [_DEF.match(ln)] if d), None)
    return full if param is None else full * _kept_share(fused, param, full)


def _kept_share(fused: list[str], name: str, nbytes: float) -> float:
    """The share of value ``name`` (of ``nbytes``) that the slices reading it keep, directly or
    through a whole ``convert``; 1 where anything else reads it."""
    users = [ln for ln in fused[1:] if re.search(r"[(, ]%" + re.escape(name) + r"[,)]", ln)]
    if not users or nbytes <= 0:
        return 1.0
    kept = 0.0
    for ln in users:
        m = _OP.match(ln)
        if m and m.group(3) == "convert":
            kept += _kept_share(fused, m.group(1), _shape_bytes(m.group(2)))
        elif m and m.group(3) in ("dynamic-slice", "slice", "gather") and \
                re.search(r"\(%" + re.escape(name) + r"[,)]", ln):
            kept += _shape_bytes(m.group(2)) / nbytes       # a slice keeps its value's dtype
        else:
            return 1.0
    return min(1.0, kept)


def _in_place(fused: list[str]) -> tuple[set[int], float] | None:
    """``(parameters written in place, bytes written)`` of a fusion whose root (or each element
    of a root tuple) is a dynamic-update-slice of one of its parameters: XLA updates that buffer
    in place, so it is neither read whole nor written whole, only the update is. ``None`` otherwise."""
    shapes = _shapes(fused)
    defs = {d.group(1): ln for ln in fused[1:] for d in [_DEF.match(ln)] if d}
    root = next((ln for ln in fused[1:] if ln.lstrip().startswith("ROOT")), None)
    if root is None:
        return None
    m = _OP.match(root)
    names = re.findall(r"%([\w.\-]+)", m.group(4)) if m and m.group(3) == "tuple" else [m.group(1)] if m else []
    buffers, written = set(), 0.0
    for name in names:
        op = _OP.match(defs.get(name, ""))
        if not op or op.group(3) != "dynamic-update-slice":
            return None
        buffer, update = (re.findall(r"%([\w.\-]+)", op.group(4)) + ["", ""])[:2]
        # The buffer may be a parameter seen another way (a bitcast: the same bytes).
        while (view := _OP.match(defs.get(buffer, ""))) and view.group(3) == "bitcast":
            buffer = (re.findall(r"%([\w.\-]+)", view.group(4)) + [""])[0]
        param = re.search(r"parameter\((\d+)\)", defs.get(buffer, ""))
        if param is None:
            return None
        buffers.add(int(param.group(1)))
        written += _shape_bytes(shapes.get(update, ""))
    return (buffers, written) if buffers else None


def _shapes(lines: list[str]) -> dict[str, str]:
    """Name -> shape text of a computation's parameters and instructions."""
    shapes = dict(_PARAM.findall(lines[0].split("->")[0]))
    for line in lines[1:]:
        d = _DEF.match(line)
        if d:
            shapes[d.group(1)] = d.group(2)
    return shapes


def _top_ops(hlo_text: str):
    """``(runs per step, bytes read and written, matmul FLOPs, lhs dtype)`` of every top-level op
    (a fusion or an unfused op of a computation that runs at the top level: the entry, loop
    bodies, branches): what :func:`hbm_bytes` and :func:`roofline_seconds` add up. Each op reads
    its operands and writes its result once; what happens inside a fusion stays on chip.
    Collectives are left to :func:`collectives` (no bytes here)."""
    bodies, mult = _computations(hlo_text)
    in_place = functools.cache(lambda callee: _in_place(bodies[callee]))
    inner = functools.cache(lambda callee: _matmul_flops(bodies, callee))
    for comp in bodies["__top__"]:
        lines = bodies[comp]
        shapes = _shapes(lines)
        for line in lines[1:]:
            m = _OP.match(line)
            if not m:
                continue
            callee = re.search(r"calls=%?([\w.\-]+)", line)
            fused = callee.group(1) if m.group(3) == "fusion" and callee and callee.group(1) in bodies else None
            dtype, flops = inner(fused) if fused is not None else _line_flops(line, shapes)
            if m.group(3) in _NO_TRAFFIC or any(m.group(3).startswith(k) for k in _KINDS) \
                    or m.group(3).endswith(("-start", "-done")):
                if flops:
                    yield mult.get(comp, 0.0), 0.0, flops, dtype
                continue
            operands = [_shape_bytes(shapes.get(o, "")) for o in re.findall(r"%([\w.\-]+)", m.group(4))]
            if fused is not None:
                operands = [_sliced_read(bodies[fused], i, b) for i, b in enumerate(operands)]
            result = _shape_bytes(m.group(2))
            updated = in_place(fused) if fused is not None else None
            if updated is not None:
                # Writes into one of its operands' buffer: the update only (GPU and TPU fusions).
                result = updated[1]
                operands = [b for i, b in enumerate(operands) if i not in updated[0]]
            elif m.group(3) == "dynamic-update-slice" or "update-slice" in m.group(1):
                result = sum(operands[1:2])                       # writes in place: the update only
                operands = operands[1:]
            elif "slice" in m.group(1) or "slice" in m.group(3) or m.group(3) == "gather":
                operands = [min(b, result) for b in operands]     # a slice reads only what it keeps
            yield mult.get(comp, 0.0), result + sum(operands), flops, dtype


def hbm_bytes(hlo_text: str) -> float:
    """Bytes per device that the program's top-level ops read and write per step (trip counts
    included): each fusion or op reads its operands and writes its result once; what happens
    inside a fusion stays on chip. Collectives are left to :func:`collectives`."""
    return sum(runs * nbytes for runs, nbytes, _, _ in _top_ops(hlo_text))


def roofline_seconds(hlo_text: str, flops_per_s, hbm_bandwidth: float) -> float:
    """The program's compute priced op by op: each top-level op takes the longer of its matmul
    FLOPs over ``flops_per_s(dtype)`` and its bytes (as :func:`hbm_bytes` counts them) over
    ``hbm_bandwidth``, trip counts included; collectives left out. The planner prices each op so
    (``CostModel.compute_time``). Adding a program's FLOP time and byte time instead counts a
    compute-bound matmul's operand bytes on top of its FLOPs."""
    return sum(runs * max(flops / flops_per_s(dtype) if flops else 0.0, nbytes / hbm_bandwidth)
               for runs, nbytes, flops, dtype in _top_ops(hlo_text))


def _line_flops(line: str, shapes: dict[str, str]) -> tuple[str, float]:
    """(lhs dtype, FLOPs) of one dot or convolution line; ("", 0) for any other op."""
    m = _DOT.search(line)
    if m:
        (ldtype, ldims), = _SHAPE.findall(shapes.get(m.group(2), ""))[:1] or [("f32", "")]
        (_, rdims), = _SHAPE.findall(m.group(1))[:1] or [("f32", "")]
        lsizes = [int(d) for d in ldims.split(",") if d]
        k = math.prod(lsizes[int(c)] for c in m.group(4).split(",") if c)
        return ldtype, 2.0 * math.prod(int(d) for d in rdims.split(",") if d) * k
    c = _CONV.search(line)
    return _conv_flops(c, shapes) if c else ("", 0.0)


def _matmul_flops(bodies: dict[str, list[str]], comp: str) -> tuple[str, float]:
    """(lhs dtype, FLOPs) of the dots and convolutions a fused computation (and what it calls) runs once."""
    dtype, total = "", 0.0
    lines = bodies.get(comp, [])
    shapes = _shapes(lines) if lines else {}
    for line in lines[1:]:
        d, f = _line_flops(line, shapes)
        if f:
            dtype, total = dtype or d, total + f
        for callee in re.findall(r"calls=%?([\w.\-]+)", line):
            if callee in bodies and callee != comp:
                d, f = _matmul_flops(bodies, callee)
                if f:
                    dtype, total = dtype or d, total + f
    return dtype, total


_CONV = re.compile(r"=\s*(\S+) convolution\((?:\S+ )?%?([\w.\-]+), (?:\S+ )?%?([\w.\-]+)\).*?"
                   r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)")


def _conv_flops(m, shapes: dict[str, str]) -> tuple[str, float]:
    """(lhs dtype, FLOPs) of a convolution: 2 x output elements x (input features per group x
    the window's taps that meet real input), read from the kernel's shape and its dim_labels
    (``i`` in-features, digits the window). The TPU compiler emits every matmul this way
    (``bf_io->bf``), and batched or outer-product ones with a window over an input of size 1 or
    one dilated as wide as the window (``size=8 pad=7_7``, ``size=32 lhs_dilate=32``): each
    output position meets one real input there, not the window's size."""
    (_, rdims), = _SHAPE.findall(m.group(1))[:1] or [("f32", "")]
    (ldtype, ldims), = _SHAPE.findall(shapes.get(m.group(2), ""))[:1] or [("f32", "")]
    (_, kdims), = _SHAPE.findall(shapes.get(m.group(3), ""))[:1] or [("f32", "")]
    ksizes = [int(d) for d in kdims.split(",") if d]
    lsizes = [int(d) for d in ldims.split(",") if d]
    labels, lhs_labels = m.group(5), m.group(4)
    if len(labels) != len(ksizes):
        return ldtype, 0.0
    window = re.search(r"window=\{([^}]*)\}", m.string)
    fields = dict(kv.split("=", 1) for kv in window.group(1).split() if "=" in kv) if window else {}
    dilate = [int(x) for x in fields.get("lhs_dilate", "").split("x") if x]
    k = 1
    for n, c in zip(ksizes, labels):
        if c == "i":
            k *= n
        elif c.isdigit():
            d = int(c)
            spatial = lsizes[lhs_labels.index(c)] if c in lhs_labels and len(lhs_labels) == len(lsizes) else n
            k *= min(n, spatial, -(-n // (dilate[d] if d < len(dilate) else 1)))
    return ldtype, 2.0 * math.prod(int(d) for d in rdims.split(",") if d) * k


def dot_flops(hlo_text: str) -> dict[str, float]:
    """FLOPs of every dot (and convolution: the TPU's matmuls, and convolutional layers) per device
    per step, by the dtype of its lhs, trip counts included."""
    bodies, mult = _computations(hlo_text)
    out: dict[str, float] = {}
    for comp, lines in _real(bodies):
        shapes = _shapes(lines)
        for line in lines[1:]:
            dtype, flops = _line_flops(line, shapes)
            if flops:
                out[dtype] = out.get(dtype, 0.0) + flops * mult.get(comp, 0.0)
    return out


def _element_name(lines: list[str], name: str, index: int) -> str | None:
    """The get-tuple-element that reads element ``index`` of tuple ``name``."""
    pattern = re.compile(r"get-tuple-element\(%" + re.escape(name) + r"\), index=" + str(index) + r"\b")
    for ln in lines:
        if pattern.search(ln):
            d = _DEF.match(ln)
            return d.group(1) if d else None
    return None


def _users_shrink(lines: list[str], name: str, nbytes: float, factor: int,
                  bodies: dict[str, list[str]] | None = None) -> bool:
    """True when every user of ``name`` keeps at most 1/``factor`` of it (a slice of a reduction).

    A user is a slice whose result is that small, or a fusion that reads only such slices of it
    (for instance the dynamic-update-slice that stores one layer's gradient shard in a scan).
    """
    users = [ln for ln in lines if re.search(r"[(, ]%" + re.escape(name) + r"[,)]", ln)]
    if not users:
        return False
    for ln in users:
        m, d = _OP.match(ln), _DEF.match(ln)
        callee = re.search(r"calls=%?([\w.\-]+)", ln)
        if m and d and _converts(m, callee, bodies):
            # A whole convert (XLA's CPU compiler reduces bfloat16 in float32, then converts back):
            # what its users keep of it is what is kept of the reduction.
            if not _users_shrink(lines, d.group(1), _shape_bytes(d.group(2)), factor, bodies):
                return False
        elif m and m.group(3) == "fusion" and callee and bodies and callee.group(1) in bodies:
            operands = re.findall(r"%([\w.\-]+)", m.group(4))
            kept = sum(_sliced_read(bodies[callee.group(1)], i, nbytes) for i, o in enumerate(operands) if o == name)
            if kept * factor > nbytes * 1.01:
                return False
        elif d is None or _shape_bytes(d.group(2)) * factor > nbytes * 1.01:
            return False
    return True


def _converts(op, callee, bodies) -> bool:
    """Whether instruction ``op`` (an :data:`_OP` match) converts its one operand whole: a
    ``convert``, or a fusion of nothing else."""
    if op.group(3) == "convert":
        return True
    if op.group(3) != "fusion" or not callee or not bodies or callee.group(1) not in bodies:
        return False
    ops = [_OP.match(ln) for ln in bodies[callee.group(1)][1:] if ln.strip() and ln.strip() != "}"]
    return bool(ops) and all(o is not None and o.group(3) in ("parameter", "convert") for o in ops) \
        and sum(o.group(3) == "parameter" for o in ops) == 1


_SPLIT_CALL = re.compile(r"%async-collective-(?:start|done)[\w.\-]* = .* fusion\(.*calls=%?([\w.\-]+)")


def _split_collective_bodies(hlo_text: str) -> set[str]:
    """Computations holding a piece of one collective that libtpu runs asynchronously: it fuses
    the collective's start, each continuation (a chunk overlapped with some compute) and its done
    into their own fusions, every one with a copy of the collective (the same ``channel_id``)."""
    names = set(re.findall(r"^%?(async_collective_fusion[\w.\-]*) ", hlo_text, re.MULTILINE))
    return names | set(_SPLIT_CALL.findall(hlo_text))


def collectives(hlo_text: str, mesh, *, read_cpu_reduce_scatter: bool = True) -> list[Collective]:
    """Every collective of a compiled module, with its trip-count multiplicity.

    The CPU backend emits a reduce-scatter as an all-reduce whose users keep only their slice;
    with ``read_cpu_reduce_scatter`` such an all-reduce is reported as the reduce-scatter a GPU or
    TPU compile emits (``emitted='all-reduce'`` says so), so that CPU audits price what the
    accelerator will run.
    """
    bodies, mult = _computations(hlo_text)
    out = []
    n = int(np.prod(mesh.devices.shape))
    split = _split_collective_bodies(hlo_text)
    seen: set[tuple[str, str]] = set()
    for comp, lines in _real(bodies):
        for line in lines[1:]:
            m = _INSTR.match(line)
            if not m:
                continue
            name, result, kind, start, rest = m.groups()
            if comp in split:
                channel = re.search(r"channel_id=(\d+)", rest)
                if channel:
                    if (kind, channel.group(1)) in seen:
                        continue
                    seen.add((kind, channel.group(1)))
            groups = replica_groups(rest, n)
            moved_along = None
            if kind == COLLECTIVE_PERMUTE:
                pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", rest)
                ids = [int(x) for x in re.findall(r"\d+", pairs.group(1))] if pairs else list(range(n))
                group = sorted(set(ids))
                # The axes a device's buffer moves along: where a source and its target differ.
                moved_along = {a for src, dst in zip(ids[::2], ids[1::2]) for a in _axes_of([src, dst], mesh)}
            else:
                group = groups[0]
            if start and kind != ALL_REDUCE:
                result = _async_outputs(result)
            nbytes = _shape_bytes(result)
            if kind == REDUCE_SCATTER:
                nbytes *= len(group)
            axes, times = _axes_of(group, mesh), mult.get(comp, 0.0)
            if moved_along is not None:
                axes = tuple(a for a in mesh.axis_names if a in moved_along)
            if not (read_cpu_reduce_scatter and kind == ALL_REDUCE and len(group) > 1):
                out.append(Collective(kind, nbytes, axes, len(group), times, name))
                continue
            # Per element (a combined all-reduce is a tuple): does every user keep only its slice?
            elements = [(name, nbytes)] if not result.startswith("(") else [
                (_element_name(lines[1:], name, i), _BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d))
                for i, (dt, dims) in enumerate(_SHAPE.findall(result))]
            scattered = [b for n, b in elements if n and _users_shrink(lines[1:], n, b, len(group), bodies)]
            if scattered:
                out.append(Collective(REDUCE_SCATTER, sum(scattered), axes, len(group), times, name, ALL_REDUCE))
            if nbytes - sum(scattered) > 0:
                out.append(Collective(ALL_REDUCE, nbytes - sum(scattered), axes, len(group), times, name))
    return out
