"""The train step as a graph: every tensor, how their dimensions must agree, and the ops between them.

Tracing gives one jaxpr for forward, backward and optimizer update. Walking it (recursing into
``pjit``, ``remat``, ``custom_jvp``/``custom_vjp``, ``cond``, ``while`` and ``scan`` bodies) yields:

* tensors, each with shape, dtype, a name (input path or Flax name stack) and a trip-count multiplier;
* *groups*: tensors joined by same-shape elementwise ops, which share one sharding (their
  dimensions fall into *dimension classes*, so a group's sharding maps mesh axes to classes);
* edges between groups for every other op, priced by the op's rule (:mod:`shardplan.rules`),
  and ``dot_general`` ops, which choose their own strategy;
* memory checkpoints: the sets of tensors live at the fullest points of the schedule.

A scan over layers is walked once: its body's tensors carry the trip count as multiplier.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

Spec = tuple[tuple[str, ...], ...]

# Ops a per-layer gradient may pass through on its way to a scan's stacked output: layout
# changes, casts and accumulation.
_ACCUMULATE = {"add", "add_any", "convert_element_type", "reshape", "transpose", "copy", "copy_p",
               "squeeze", "expand_dims"}

CALL_PRIMITIVES = {"pjit", "jit", "closed_call", "core_call", "remat2", "checkpoint", "remat",
                    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"}


@dataclasses.dataclass
class Tensor:
    id: int
    shape: tuple[int, ...]
    dtype: np.dtype
    name: str
    role: str           # "input", "output" or "activation"
    source: str         # "file:line (function)" of the op that made it, or the input path
    mult: float         # how many times it is produced per step (trip counts of enclosing scans)
    path: str = ""      # where it is in the step: see :func:`eqn_path`

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * self.dtype.itemsize

    @property
    def rank(self) -> int:
        return len(self.shape)


@dataclasses.dataclass(frozen=True)
class PairEdge:
    """An op seen as a relation between two tensors.

    Exactly one of ``required`` / ``produced`` is set: ``required(dst_spec)`` gives the spec the op
    needs of ``src`` to make ``dst`` locally; ``produced(src_spec)`` gives the spec of the result the
    op makes from ``src`` and the mesh axes over which that result is still a partial sum.
    """

    src: int
    dst: int
    primitive: str
    mult: float
    required: Callable[[Spec], Spec] | None = None
    produced: Callable[[Spec], tuple[Spec, tuple[str, ...]]] | None = None
    # With ``required``: the spec of ``dst`` the op makes when ``src`` stays as it is (``None``
    # where it cannot); XLA then reshards the result instead of the operand when that is cheaper.
    passthrough: Callable[[Spec, Spec], Spec | None] | None = None


@dataclasses.dataclass(frozen=True)
class DotOp:
    """A ``dot_general`` or convolution: dims are (lhs dim, rhs dim, out dim) with None where absent.

    ``fixed`` holds the indices of dims that are never sharded (a convolution's spatial and
    window dims, grouped features); ``sizes`` the iteration extent of each dim where it is not
    the operand's dim size (a convolution's output positions, a grouped feature dim).
    """

    lhs: int
    rhs: int
    out: int
    dims: tuple[tuple[int | None, int | None, int | None], ...]
    mult: float
    source: str
    fixed: frozenset[int] = frozenset()
    sizes: tuple[int, ...] | None = None


class _UnionFind:
    def __init__(self):
        self.parent: list[int] = []

    def add(self) -> int:
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def find(self, x: int) -> int:
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


@dataclasses.dataclass
class _Level:
    """Liveness bookkeeping of one jaxpr being walked."""

    defined: list[list[int]] = dataclasses.field(default_factory=list)   # per eqn, tensors it defines
    last_use: dict[int, int] = dataclasses.field(default_factory=dict)   # tensor -> last eqn index using it
    inner_peak: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # eqn index -> body's peak set
    made_by: dict[int, tuple[str, list[int]]] = dataclasses.field(default_factory=dict)  # tensor -> (primitive, inputs)


# Primitives XLA fuses into a loop fusion with their producers: the producer's result is computed
# inside the consumer's kernel and never stored, if every reader is one of these.
_FUSIBLE = frozenset("""
abs add add_any and atan2 broadcast_in_dim cbrt ceil clamp convert_element_type copy cos div eq erf erf_inv erfc exp exp2
expand_dims expm1 floor ge gt integer_pow iota is_finite le log log1p logistic lt max min mul ne neg
nextafter not or pow reduce_and reduce_max reduce_min reduce_or reduce_prod reduce_sum rem reshape
reduce_precision round rsqrt select_n sign sin sqrt square squeeze stop_gradient sub tan tanh transpose xor
""".split())
# Ops whose result XLA writes into their first operand's buffer when the operand dies there.
_IN_PLACE = frozenset({"scatter-add", "scatter_add", "scatter", "scatter-mul", "scatter_mul", "scatter-min",
                       "scatter-max", "dynamic_update_slice"})
# Results XLA would rather store than recompute in each of several readers (its "expensive" ops).
_EXPENSIVE = frozenset("""
cos div erf erf_inv exp exp2 expm1 integer_pow log log1p logistic pow rem rsqrt sin sqrt tan tanh
""".split())
_REDUCTIONS = frozenset(("reduce_and", "reduce_max", "reduce_min", "reduce_or", "reduce_prod", "reduce_sum"))


class Graph:
    """Build with :func:`build_graph`; read-only afterwards."""

    def __init__(self):
        self.tensors: list[Tensor] = []
        self.edges: list[PairEdge] = []
        self.dots: list[DotOp] = []
        self.inputs: list[int] = []
        self.outputs: list[int | None] = []
        self.points: list[list[int]] = []
        self.eqn_inputs: dict[tuple[str, int], int] = {}    # (eqn path, operand index) -> tensor
        self.by_path: dict[str, int] = {}                   # tensor path -> tensor
        self.prefix = ""           # the path of the jaxpr being walked (see eqn_path)
        self.stacked: dict[int, int] = {}   # body tensors a scan stacks into an output -> its length
        self.loop_of: list[int] = []     # tensor -> the scan body (walk) it lives in; 0 at top level
        self.readers: dict[int, list[tuple[str, list[int]]]] = {}   # tensor -> (primitive, its outputs)
        self.current_loop = 0
        self.call_source = ""      # where the call being walked inline was made (see source_of)
        self._loops = 0
        self.warnings: list[str] = []
        self._groups = _UnionFind()
        self._dims = _UnionFind()
        self._dim_offset: list[int] = []
        self._pinned: set[int] = set()      # dimension keys that must stay unsharded
        self._warned: set[str] = set()

    # -- construction --------------------------------------------------------------------------
    def new_tensor(self, aval, name: str, role: str, source: str, mult: float, path: str) -> int:
        tid = len(self.tensors)
        shape = tuple(int(s) for s in getattr(aval, "shape", ()))
        dtype, is_key = storage_dtype(getattr(aval, "dtype", np.float32))
        if path in self.by_path:
            raise AssertionError(f"two tensors at path {path}")
        self.by_path[path] = tid
        self.tensors.append(Tensor(tid, shape, dtype, name, role, source, mult, path))
        self.loop_of.append(self.current_loop)
        self._groups.add()
        self._dim_offset.append(len(self._dims.parent))
        for _ in shape:
            self._dims.add()
        if is_key:      # random keys stay replicated: each device draws the bits of its own shard
            for d in range(len(shape)):
                self.pin(tid, d)
        return tid

    def dim_key(self, tid: int, dim: int) -> int:
        return self._dim_offset[tid] + dim

    def union(self, a: int | None, b: int | None, dim_map: Sequence[tuple[int, int]] | None = None) -> None:
        """Make ``a`` and ``b`` share a sharding; ``dim_map`` pairs their dims (default: identical shapes)."""
        if a is None or b is None or a == b:
            return
        ta, tb = self.tensors[a], self.tensors[b]
        if ta.rank == 0 or tb.rank == 0:
            return
        if dim_map is None:
            dim_map = [(d, d) for d in range(ta.rank)]
        self._groups.union(a, b)
        for da, db in dim_map:
            self._dims.union(self.dim_key(a, da), self.dim_key(b, db))

    def pin(self, tid: int, dim: int) -> None:
        """Dimension ``dim`` of ``tid`` is never sharded (a scan's layer axis)."""
        self._pinned.add(self.dim_key(tid, dim))

    def add_edge(self, edge: PairEdge) -> None:
        if self.tensors[edge.src].rank and self.tensors[edge.dst].rank:
            self.edges.append(edge)

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.warnings.append(message)
            warnings.warn(message, stacklevel=3)

    # -- queries -------------------------------------------------------------------------------
    def group_of(self, tid: int) -> int:
        return self._groups.find(tid)

    def dim_class(self, tid: int, dim: int) -> int:
        return self._dims.find(self.dim_key(tid, dim))

    def pinned_classes(self) -> set[int]:
        return {self._dims.find(k) for k in self._pinned}

    def feeds_stacked_output(self, tid: int) -> bool:
        """Whether ``tid``, made in a scan body, only flows into a tensor the scan stacks into an output.

        Such a tensor is a per-layer gradient on its way to the stacked gradient. Every path from
        it inside the body passes only through layout and accumulation ops; nothing else in the
        body reads it, so its reduction is independent of every other one in the body, and XLA's
        collective combiners merge them all into one collective per trip.
        """
        loop = self.loop_of[tid]
        if not loop:
            return False
        stack, seen, reached = [tid], {tid}, False
        while stack:
            t = stack.pop()
            reached |= t in self.stacked
            if t not in self.stacked and not self.readers.get(t):
                return False      # a body output that is carried to the next trip, not stacked
            for prim, outs in self.readers.get(t, []):
                if prim not in _ACCUMULATE:
                    return False
                for o in outs:
                    if self.loop_of[o] != loop:
                        return False
                    if o not in seen:
                        seen.add(o)
                        stack.append(o)
        return reached

    def feeds_update(self, tid: int) -> bool:
        """Whether ``tid``, made at the top level, only flows through elementwise work into outputs.

        Such a tensor is a gradient on its way into the optimizer update. No gradient reduction
        reads another's result, so XLA's collective combiners merge them: like the per-layer
        reductions of a scan (:meth:`feeds_stacked_output`), they share one collective's latency.
        """
        if self.loop_of[tid]:
            return False
        outputs = {t for t in self.outputs if t is not None}
        stack, seen, reached = [tid], {tid}, False
        while stack:
            t = stack.pop()
            reached |= t in outputs
            for prim, outs in self.readers.get(t, []):
                if prim not in _FUSIBLE and prim not in _ACCUMULATE:      # (calls are walked inline: not readers)
                    return False
                for o in outs:
                    if o not in seen:
                        seen.add(o)
                        stack.append(o)
        return reached

    def groups(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for t in self.tensors:
            out.setdefault(self.group_of(t.id), []).append(t.id)
        return out


def storage_dtype(dtype) -> tuple[np.dtype, bool]:
    """The numpy dtype a tensor is stored as, and whether it is a typed random key.

    A typed key (``jax.random.key``: ``key<fry>``) is stored as its implementation's words
    (two uint32 for threefry): an opaque record of that size.
    """
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return np.dtype((np.void, dtype.itemsize)), True
    return np.dtype(dtype), False


# Library frames skipped when naming where an op comes from: the user's line is the useful one.
_LIBRARY_DIRS = tuple(f"{os.sep}{d}{os.sep}" for d in ("flax", "optax", "jax", "jaxlib"))


def source_of(eqn, inherited: str = "") -> str:
    """``file:line (function)`` of the innermost frame of the user's code that made ``eqn``
    (outside jax, flax and optax), else of its innermost frame; ``inherited`` (the enclosing
    call's) where the eqn carries no traceback, as the bodies of jax.numpy's own jitted functions."""
    try:
        from jax._src import source_info_util
        for frame in source_info_util.user_frames(eqn.source_info.traceback):
            if not any(d in frame.file_name for d in _LIBRARY_DIRS):
                return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"
        return inherited or source_info_util.summarize(eqn.source_info) or "<unknown source>"
    except Exception:  # the summary is a nicety; an internal API change must not break planning
        return inherited or "<unknown source>"


def _name_of(eqn) -> str:
    """The Flax module path (JAX's name stack) and the primitive."""
    stack = str(getattr(eqn.source_info, "name_stack", "") or "")
    return f"{stack}/{eqn.primitive.name}" if stack else eqn.primitive.name


def eqn_path(prefix: str, index: int, eqn) -> str:
    """A stable name for an equation: its position in its jaxpr and its primitive, after the path
    of the enclosing equation whose body that jaxpr is: ``"12.scan/3.dot_general"``. Tracing the
    same step again gives the same paths; its tensors are ``"<eqn path>:<output index>"``, the
    step's arguments ``"in:<k>"``, a scan body's arguments ``"<eqn path>/in:<k>"``."""
    return f"{prefix}{index}.{eqn.primitive.name}"


def body_prefix(here: str, eqn, branch: int = 0) -> str:
    """The path prefix of an equation's body (a call's, a loop's, a cond branch's)."""
    return f"{here}/b{branch}/" if eqn.primitive.name == "cond" else f"{here}/"


def sub_jaxpr(eqn) -> tuple[Any, list]:
    """The body of a call-like eqn (open jaxpr, consts) whose arity matches the eqn."""
    for value in eqn.params.values():
        jaxpr = getattr(value, "jaxpr", value)
        if isinstance(jaxpr, jcore.Jaxpr) and len(jaxpr.invars) == len(eqn.invars) \
                and len(jaxpr.outvars) == len(eqn.outvars):
            return jaxpr, list(getattr(value, "consts", []))
    raise ValueError(f"cannot find the body of {eqn.primitive.name}")


class _Walker:
    def __init__(self, graph: Graph, rules: Callable):
        self.g = graph
        self.rules = rules

    def walk(self, jaxpr, in_tids: list[int | None], mult: float, level: _Level | None = None,
             const_tids: list[int] | None = None, inline: bool = False) -> list[int | None]:
        """Walk ``jaxpr`` whose invars are ``in_tids``; return the tensors of its outvars.

        Calls (``pjit``, ``custom_jvp_call``, ``remat`` ...) are walked ``inline``, into the
        caller's level: XLA inlines them, so their ops fuse and free memory as the caller's do.
        """
        g = self.g
        env: dict[Any, int | None] = {}
        for k, v in enumerate(jaxpr.constvars):
            env[v] = const_tids[k] if const_tids is not None else \
                g.new_tensor(v.aval, "constant", "activation", "closure constant", mult, f"{g.prefix}const:{k}")
        for v, t in zip(jaxpr.invars, in_tids):
            env[v] = t
        level = _Level() if level is None else level

        def read(v):
            if isinstance(v, jcore.Literal):
                return None
            return env.get(v)

        prefix = g.prefix
        for position, eqn in enumerate(jaxpr.eqns):
            i = len(level.defined)          # this eqn's position in the level's schedule
            ins = [read(v) for v in eqn.invars]
            for t in ins:
                if t is not None:
                    level.last_use[t] = i
            prim = eqn.primitive.name
            here = eqn_path(prefix, position, eqn)
            if prim in CALL_PRIMITIVES:
                body, _ = sub_jaxpr(eqn)
                outer, g.call_source = g.call_source, source_of(eqn, g.call_source)
                g.prefix = body_prefix(here, eqn)
                for v, t in zip(eqn.outvars, self.walk(body, ins, mult, level, inline=True)):
                    env[v] = t
                g.call_source, g.prefix = outer, prefix
                continue
            if prim in ("scan", "while", "cond"):
                outs = self._structured(eqn, ins, mult, level, i, here)
                g.prefix = prefix
            else:
                outs = self._fresh(mult, eqn, here)
                self.rules(g, eqn, ins, outs, mult)
                for k, t in enumerate(ins):
                    if t is not None:
                        g.eqn_inputs[(here, k)] = t
                if prim in _IN_PLACE and ins[0] in level.made_by:
                    # The result takes over the operand's buffer (XLA updates it in place when
                    # nothing reads the operand later; a later reader moves its last use on again).
                    level.last_use[ins[0]] = i - 1
                for t in outs:
                    level.made_by[t] = (prim, [x for x in ins if x is not None])
            for t in ins:
                if t is not None:
                    g.readers.setdefault(t, []).append((prim, [o for o in outs if o is not None]))
            for v, t in zip(eqn.outvars, outs):
                env[v] = t
            level.defined.append([t for t in outs if t is not None])
        outs = [read(v) for v in jaxpr.outvars]
        if inline:
            return outs
        for t in outs:
            if t is not None:
                level.last_use[t] = len(level.defined)
        self._fuse(level, set(outs))
        return outs

    def _fuse(self, level: _Level, kept: set) -> None:
        """Drop from the liveness schedule the results XLA fuses into their readers.

        A result of an elementwise op (or broadcast, reshape, convert ...) whose readers are all
        fusible is computed inside each reader's kernel and never stored; its inputs live instead
        until its last reader. An expensive result read more than once is stored (XLA does not
        duplicate it). Later results first, so a fused chain hands liveness back to its start.
        """
        g = self.g
        fused = set()
        for i in range(len(level.defined) - 1, -1, -1):
            for t in level.defined[i]:
                made = level.made_by.get(t)
                if made is None or t in kept or made[0] not in _FUSIBLE or made[0] in _REDUCTIONS:
                    continue
                readers = g.readers.get(t, [])
                # XLA folds a transpose into the dots that read it (its TransposeFolding pass).
                fold = _FUSIBLE | {"dot_general", "conv_general_dilated"} if made[0] == "transpose" else _FUSIBLE
                if not readers or any(p not in fold for p, _ in readers):
                    continue
                if len(readers) > 1 and made[0] in _EXPENSIVE:
                    continue
                fused.add(t)
                end = level.last_use.get(t, i)
                for x in made[1]:
                    if x in level.last_use:
                        level.last_use[x] = max(level.last_use[x], end)
        if fused:
            level.defined = [[t for t in ts if t not in fused] for ts in level.defined]
        # A stored elementwise result takes over the buffer of a same-size operand that dies in
        # its kernel (XLA shares an elementwise fusion's output with such an operand).
        for i, ts in enumerate(level.defined):
            for t in ts:
                made = level.made_by.get(t)
                if made is None or made[0] not in _FUSIBLE or made[0] in _REDUCTIONS:
                    continue
                stack, seen = list(made[1]), set()
                while stack:
                    x = stack.pop()
                    if x in seen:
                        continue
                    seen.add(x)
                    if x in fused:
                        stack.extend(level.made_by[x][1])
                    elif x in level.made_by and x not in kept and level.last_use.get(x) == i \
                            and g.tensors[x].nbytes == g.tensors[t].nbytes:
                        level.last_use[x] = i - 1
                        break

    def _fresh(self, mult: float, eqn, here: str) -> list[int]:
        src = source_of(eqn, self.g.call_source)
        return [self.g.new_tensor(v.aval, _name_of(eqn), "activation", src, mult, f"{here}:{j}")
                for j, v in enumerate(eqn.outvars)]

    def _inner(self, body, body_in: list[int | None], mult: float, level: _Level, i: int):
        inner = _Level()
        outs = self.walk(body, body_in, mult, inner)
        # Body inputs and outputs are the eqn's operands and results, counted at this level (XLA
        # writes a scan's per-trip outputs into the stacked result in place).
        level.inner_peak[i] = _peak(self.g, inner, set(body_in) | set(outs))
        return outs

    def _structured(self, eqn, ins, mult, level, i, here: str) -> list[int]:
        g, prim = self.g, eqn.primitive.name
        outs = self._fresh(mult, eqn, here)
        g.prefix = body_prefix(here, eqn)
        if prim == "scan":
            p = eqn.params
            body = p["jaxpr"].jaxpr
            nc, nk, length = p["num_consts"], p["num_carry"], int(p["length"])
            body_in = []
            for k, (v, t) in enumerate(zip(body.invars, ins)):
                bt = g.new_tensor(v.aval, _name_of(eqn) + "/body_in", "activation", source_of(eqn, g.call_source),
                                  mult * length, f"{g.prefix}in:{k}")
                if k < nc + nk:
                    g.union(t, bt)
                elif t is not None and g.tensors[t].rank:
                    g.union(t, bt, [(d + 1, d) for d in range(g.tensors[bt].rank)])
                    g.pin(t, 0)
                body_in.append(bt)
            outer, g._loops = g.current_loop, g._loops + 1
            g.current_loop = g._loops
            for bt in body_in:
                g.loop_of[bt] = g.current_loop
            body_out = self._inner(body, body_in, mult * length, level, i)
            g.current_loop = outer
            for k, (bt, t) in enumerate(zip(body_out, outs)):
                if bt is None:
                    continue
                if k < nk:
                    g.union(bt, body_in[nc + k])
                    g.union(bt, t)
                    g.union(t, ins[nc + k])
                elif g.tensors[t].rank:
                    g.union(t, bt, [(d + 1, d) for d in range(g.tensors[bt].rank)])
                    g.pin(t, 0)
                    g.stacked[bt] = length
        elif prim == "while":
            p = eqn.params
            cn, bn = p["cond_nconsts"], p["body_nconsts"]
            carry_in = ins[cn + bn:]
            body_in = ins[cn:cn + bn] + carry_in
            # The trip count is unknown before running: the body is priced once.
            body_out = self._inner(p["body_jaxpr"].jaxpr, body_in, mult, level, i)
            for bt, t, c in zip(body_out, outs, carry_in):
                g.union(bt, t)
                g.union(t, c)
        elif prim == "cond":
            for b, branch in enumerate(eqn.params["branches"]):
                g.prefix = body_prefix(here, eqn, b)
                branch_out = self._inner(branch.jaxpr, ins[1:], mult, level, i)
                for bt, t in zip(branch_out, outs):
                    g.union(bt, t)
        return outs


def _peak(g: Graph, level: _Level, exclude: set[int]) -> list[int]:
    """The live set of the level's fullest point, counted with every tensor replicated."""
    best, best_bytes = [], -1
    for live in _live_sets(g, level):
        live = [t for t in live if t not in exclude]
        n = sum(g.tensors[t].nbytes for t in live)
        if n > best_bytes:
            best, best_bytes = live, n
    return best


def _live_sets(g: Graph, level: _Level):
    live: set[int] = set()
    for i, defined in enumerate(level.defined):
        live.update(t for t in defined if t in level.last_use)
        yield sorted(live) + level.inner_peak.get(i, [])
        live = {t for t in live if level.last_use.get(t, -1) > i}


def build_graph(closed_jaxpr, input_names: Sequence[str], rules: Callable, *, num_points: int = 12,
                ties: Sequence[tuple[int, int]] = ()) -> Graph:
    """Walk a whole-step ``ClosedJaxpr``. ``input_names`` name its flat inputs (pytree paths);
    each (flat input, flat output) pair in ``ties`` shares one sharding (a state leaf returned anew)."""
    g = Graph()
    jaxpr = closed_jaxpr.jaxpr
    ins = [g.new_tensor(v.aval, name, "input", name, 1.0, f"in:{k}")
           for k, (v, name) in enumerate(zip(jaxpr.invars, input_names))]
    g.inputs = ins
    walker = _Walker(g, rules)
    level = _Level()
    consts = [g.new_tensor(v.aval, "constant", "input", "closure constant", 1.0, f"const:{k}")
              for k, v in enumerate(jaxpr.constvars)]
    outs = walker.walk(jaxpr, ins, 1.0, level, const_tids=consts)
    for t in outs:
        if t is not None and g.tensors[t].role == "activation":
            g.tensors[t].role = "output"
    g.outputs = outs
    for i, j in ties:
        a, b = ins[i], outs[j]
        if b is not None and g.tensors[a].shape == g.tensors[b].shape:
            g.union(a, b)
    always = set(consts + ins)
    scored = []
    for live in _live_sets(g, level):
        live = [t for t in live if t not in always]
        scored.append((sum(g.tensors[t].nbytes for t in live), live))
    scored.sort(key=lambda x: -x[0])
    seen, points = set(), []
    for _, live in scored:
        key = tuple(live)
        if key not in seen:
            seen.add(key)
            points.append(live)
        if len(points) >= num_points:
            break
    g.points = points or [[]]
    return g
