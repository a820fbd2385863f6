"""Walking a traced step's jaxpr into a :class:`~shardplan.ir.graph.Graph`.

Every equation is visited once, recursing into ``pjit``, ``remat``, ``custom_jvp``/``custom_vjp``
bodies (inlined, as XLA inlines them) and into ``scan``, ``while`` and ``cond`` bodies (walked
once; a scan body's tensors carry its trip count). Each equation's rule (:mod:`shardplan.sharding.rules`)
relates its operands' and results' dimensions; :mod:`shardplan.compiler.liveness` records when each
tensor is live. Equations and tensors are named by stable paths (:func:`eqn_path`): tracing the
same step again gives the same names, which is how a saved plan finds its tensors.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.extend import core as jcore

from shardplan.compiler.combine import combined_reductions
from shardplan.compiler.liveness import IN_PLACE, Level, checkpoints, combining_point, fuse, multi_output_kernels, peak
from shardplan.errors import ShardplanError
from shardplan.ir.graph import Graph

CALL_PRIMITIVES = {"pjit", "jit", "closed_call", "core_call", "remat2", "checkpoint", "remat",
                    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"}
# The name of a jitted roll of a leading dimension by one (the pipeline's stage shift,
# :func:`shardplan.parallel.pipeline.stage_shift`): walked as one op, not inlined (:mod:`shardplan.sharding.rules`).
SHIFT_CALL = "shardplan_stage_shift"


def is_shift(eqn) -> bool:
    """Whether ``eqn`` is a call of :data:`SHIFT_CALL` (kept whole: walked and emitted as one op)."""
    return eqn.primitive.name in ("pjit", "jit") and eqn.params.get("name") == SHIFT_CALL


_LIBRARY_DIRS = tuple(f"{os.sep}{d}{os.sep}" for d in ("flax", "optax", "jax", "jaxlib"))
# shardplan's own wrappers of user code (layer_scan): the user's line that called them is the source.
_WRAPPERS = (os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parallel", "pipeline.py"),)


def source_of(eqn, inherited: str = "") -> str:
    """``file:line (function)`` of the innermost frame of the user's code that made ``eqn``
    (outside jax, flax and optax), else of its innermost frame; ``inherited`` (the enclosing
    call's) where the eqn carries no traceback, as the bodies of jax.numpy's own jitted functions."""
    try:
        from jax._src import source_info_util
        for frame in source_info_util.user_frames(eqn.source_info.traceback):
            if not any(d in frame.file_name for d in _LIBRARY_DIRS) and frame.file_name not in _WRAPPERS:
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


def scan_counts(params) -> tuple[int, int]:
    """A ``scan`` equation's (consts, carry) operand counts: ``num_consts``/``num_carry`` up to
    jax 0.10, the lengths of the ``ft_in`` flat tree's first two parts from jax 0.11."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def _carried(eqn, ins: list, outs: list) -> tuple[list, list]:
    """A ``scan``'s or ``while``'s carry operands (the initial values its carried results
    replace) and those results; none for a ``cond``."""
    if eqn.primitive.name == "scan":
        nc, nk = scan_counts(eqn.params)
        return ins[nc:nc + nk], outs[:nk]
    if eqn.primitive.name == "while":
        return ins[eqn.params["cond_nconsts"] + eqn.params["body_nconsts"]:], outs
    return [], []


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
        self.bodies: list[Level] = []     # every loop body's and branch's level, walked
        self.loops = 0                    # scans, whiles and conds walked

    def walk(self, jaxpr, in_tids: list[int | None], mult: float, level: Level | None = None,
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
        level = Level() if level is None else level

        def read(v):
            if isinstance(v, jcore.Literal):
                return None
            return env.get(v)

        prefix = g.prefix
        for position, eqn in enumerate(jaxpr.eqns):
            i = len(level.defined)          # this eqn's position in the level's schedule
            ins = [read(v) for v in eqn.invars]
            prim = eqn.primitive.name
            inlined = prim in CALL_PRIMITIVES and not is_shift(eqn)
            # An inlined call's operands are read where its body reads them; one its body never
            # reads is dead code to XLA (jnp.where's transpose passes one), not a live buffer.
            for t in ins if not inlined else ():
                if t is not None:
                    level.last_use[t] = i
                    if t in level.twin:          # a recomputed value: its first computation is read
                        level.last_use[level.twin[t]] = i
            here = eqn_path(prefix, position, eqn)
            if prim == "custom_lin":
                raise ShardplanError(
                    f"forward-mode differentiation (jax.jvp, jax.jacfwd) of a custom_vjp function at "
                    f"{source_of(eqn, g.call_source)}, which JAX cannot run forward; a pipelined layer_scan's "
                    "stage shift is one (shardplan.parallel.pipeline.stage_shift): differentiate in reverse mode "
                    "(jax.grad, jax.vjp), or plan with pipeline=None")
            if prim == "name":
                # checkpoint_name tags a value for a policy: the same buffer, no op in the program.
                for v, t in zip(eqn.outvars, ins):
                    env[v] = t
                level.defined.append([])
                continue
            if inlined:
                body, _ = sub_jaxpr(eqn)
                region = g.current_region
                if prim in ("checkpoint", "remat", "remat2") and eqn.params.get("differentiated") \
                        and eqn.params.get("prevent_cse", True):
                    g.barriered.update(t for t in ins if t is not None)
                    g._regions += 1
                    g.current_region = g._regions
                outer, g.call_source = g.call_source, source_of(eqn, g.call_source)
                g.prefix = body_prefix(here, eqn)
                for v, t in zip(eqn.outvars, self.walk(body, ins, mult, level, inline=True)):
                    env[v] = t
                g.call_source, g.prefix, g.current_region = outer, prefix, region
                continue
            if prim in ("scan", "while", "cond"):
                self.loops += 1
                outs = self._structured(eqn, ins, mult, level, i, here)
                g.prefix = prefix
                for init, result in zip(*_carried(eqn, ins, outs)):
                    if init is not None and result is not None and init in level.made_by and ins.count(init) == 1:
                        # The loop's result takes over its carry's initial buffer (XLA's while
                        # runs in its operand's buffer when nothing reads the operand later; a
                        # later reader moves its last use on again; an operand passed twice is
                        # copied).
                        level.last_use[init] = i - 1
                        level.takeovers.append((init, result, i))
                made = (prim, [x for x in ins if x is not None])
                g.made_by.update((t, made) for t in outs if t is not None)
            else:
                outs = self._fresh(mult, eqn, here)
                if g.compiler == "cpu" and outs and not g.loop_of[outs[0]]:
                    _recomputed(level, eqn, ins, outs, g.current_region != 0)
                self.rules(g, eqn, ins, outs, mult)
                for k, t in enumerate(ins):
                    if t is not None:
                        g.eqn_inputs[(here, k)] = t
                if prim in IN_PLACE and ins[0] in level.made_by:
                    # The result takes over the operand's buffer (XLA updates it in place when
                    # nothing reads the operand later; a later reader moves its last use on again).
                    level.last_use[ins[0]] = i - 1
                for t in outs:
                    level.made_by[t] = g.made_by[t] = (prim, [x for x in ins if x is not None])
                if prim == "broadcast_in_dim" and _is_zero(eqn.invars[0]):
                    g.zeros.update(outs)
            for t in ins:
                if t is not None:
                    g.readers.setdefault(t, []).append((prim, [o for o in outs if o is not None]))
            for v, t in zip(eqn.outvars, outs):
                env[v] = t
            level.defined.append([t for t in outs if t is not None and t not in level.twin])
        outs = [read(v) for v in jaxpr.outvars]
        if inline:
            return outs
        for t in outs:
            if t is not None:
                level.last_use[t] = len(level.defined)
                g.level_outputs.add(t)
        for init, result, i in level.takeovers:
            if result not in level.last_use:      # never read: the carry's buffer lives through the loop
                level.last_use[init] = max(level.last_use.get(init, i), i)
        fuse(g, level, set(outs) | set(level.twin.values()))     # (a recomputed value's first: stored)
        return outs

    def _fresh(self, mult: float, eqn, here: str) -> list[int]:
        src = source_of(eqn, self.g.call_source)
        return [self.g.new_tensor(v.aval, _name_of(eqn), "activation", src, mult, f"{here}:{j}")
                for j, v in enumerate(eqn.outvars)]

    def _inner(self, body, body_in: list[int | None], mult: float, level: Level, i: int,
               stacked: tuple[int, int] | None = None):
        inner = Level()
        outs = self.walk(body, body_in, mult, inner)
        self.bodies.append(inner)
        if stacked is not None:
            # (first stacked output, length) of a scan: its body's per-trip outputs from there on
            # are stacked (known before the body's peak: liveness.combined_matmuls reads them)
            for bt in outs[stacked[0]:]:
                if bt is not None:
                    self.g.stacked[bt] = stacked[1]
        # Body inputs and outputs are the eqn's operands and results, counted at this level (XLA
        # writes a scan's per-trip outputs into the stacked result in place).
        # A cond's branches run one at a time: the fuller one counts.
        for kept, host in ((level.inner_peak, False), (level.inner_host, True)):
            here, running, held, combining = peak(self.g, inner, set(body_in) | set(outs), host=host)
            if sum(self.g.tensors[t].nbytes for t in here) >= sum(self.g.tensors[t].nbytes for t in kept.get(i, [])):
                kept[i] = here
                if not host:
                    level.inner_running[i], level.inner_held[i] = running, held
                    level.inner_combining[i] = combining
        alt = combining_point(self.g, inner, set(body_in) | set(outs))
        if alt is not None and alt[0] != level.inner_peak.get(i):
            level.inner_alts.setdefault(i, []).append(alt)
        return outs

    def _structured(self, eqn, ins, mult, level, i, here: str) -> list[int]:
        g, prim = self.g, eqn.primitive.name
        outs = self._fresh(mult, eqn, here)
        g.prefix = body_prefix(here, eqn)
        if prim == "scan":
            p = eqn.params
            body = p["jaxpr"].jaxpr
            (nc, nk), length = scan_counts(p), int(p["length"])
            body_in = []
            for k, (v, t) in enumerate(zip(body.invars, ins)):
                bt = g.new_tensor(v.aval, _name_of(eqn) + "/body_in", "activation", source_of(eqn, g.call_source),
                                  mult * length, f"{g.prefix}in:{k}")
                if k < nc + nk:
                    g.union(t, bt)
                elif t is not None and g.tensors[t].rank:
                    g.union(t, bt, [(d + 1, d) for d in range(g.tensors[bt].rank)])
                    g.pin(t, 0)
                if t is not None:       # a scanned operand feeds its slices to bt; a const or carry: None
                    g.scanned_into.setdefault(t, []).append(bt if k >= nc + nk else None)
                body_in.append(bt)
            outer, g._loops = g.current_loop, g._loops + 1
            g.current_loop = g._loops
            for bt in body_in:
                g.loop_of[bt] = g.current_loop
            body_out = self._inner(body, body_in, mult * length, level, i, stacked=(nk, length))
            g.current_loop = outer
            first: dict[int, int] = {}
            for k, (bt, t) in enumerate(zip(body_out, outs)):
                if bt is None:
                    continue
                if k >= nk and g.compiler != "cpu" and first.setdefault(bt, k) != k:
                    # One value stacked twice (a residual and its checkpoint_name tag): the GPU and
                    # TPU compilers keep one buffer for both (XLA's CPU compiler, two).
                    outs[k] = outs[first[bt]]
                    continue
                if k < nk:
                    g.union(bt, body_in[nc + k])
                    g.union(bt, t)
                    g.union(t, ins[nc + k])
                elif g.tensors[t].rank:
                    g.union(t, bt, [(d + 1, d) for d in range(g.tensors[bt].rank)])
                    g.pin(t, 0)
                    g.stacked[bt] = length
                    g.stacked_into[bt] = t
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


def build_graph(closed_jaxpr, input_names: Sequence[str], rules: Callable, *, num_points: int = 12,
                ties: Sequence[tuple[int, int]] = (), device: str = "", compiler: str = "cpu",
                donated: Sequence[bool] = ()) -> Graph:
    """Walk a whole-step ``ClosedJaxpr``. ``input_names`` name its flat inputs (pytree paths);
    each (flat input, flat output) pair in ``ties`` shares one sharding (a state leaf returned anew).
    ``device``: the mesh's device name, for the rules where XLA partitions an op differently by
    target (:mod:`shardplan.sharding.rules`); ``compiler``: the kind of XLA compiler the mesh's programs go
    through (``"cpu"``, ``"gpu"``, ``"tpu"``), where memory differs by compiler (host offload,
    duplicate loop outputs); ``donated``: per flat input, whether its buffer is donated (the
    outputs XLA writes into them, :attr:`~shardplan.ir.graph.Graph.donated_outputs`, take no memory
    of their own, so the fullest points of the schedule are found without them)."""
    g = Graph()
    g.device, g.compiler = device, compiler
    jaxpr = closed_jaxpr.jaxpr
    ins = [g.new_tensor(v.aval, name, "input", name, 1.0, f"in:{k}")
           for k, (v, name) in enumerate(zip(jaxpr.invars, input_names))]
    g.inputs = ins
    walker = _Walker(g, rules)
    level = Level()
    consts = [g.new_tensor(v.aval, "constant", "input", "closure constant", 1.0, f"const:{k}")
              for k, v in enumerate(jaxpr.constvars)]
    outs = walker.walk(jaxpr, ins, 1.0, level, const_tids=consts)
    for t in outs:
        if t is not None and g.tensors[t].role == "activation":
            g.tensors[t].role = "output"
    g.outputs = outs
    # Each loop and conditional is one XLA instruction with a tuple result, and so is each kernel
    # of several results (stacked outputs are known once the whole step is walked).
    g.tuple_results = walker.loops + sum(multi_output_kernels(g, lv) for lv in [level, *walker.bodies])
    for i, j in ties:
        a, b = ins[i], outs[j]
        if b is not None and g.tensors[a].shape == g.tensors[b].shape:
            g.union(a, b)
    g.donated_outputs = _donated_outputs(g, donated)
    # Where the top-level gradients' combined collective runs, their partial sums wait
    # (compiler/held.py): that point is weighed too.
    g.combined = combined_reductions(g)
    scheduled = {t: i for i, ts in enumerate(level.defined) for t in ts}
    waiting = [scheduled[t] for t in g.combined if t in scheduled and not g.loop_of[t]]
    points = checkpoints(g, level, set(consts + ins) | g.donated_outputs, num_points,
                         also=frozenset([max(waiting)] if waiting else []))
    g.points = [live for live, *_ in points]
    g.running, g.held, g.combining = ([set(p[k]) for p in points] for k in (1, 2, 3))
    g.point_index = [p[4] for p in points]
    g.scheduled = scheduled
    if g.host_apart:
        g.host_points = [p for p, *_ in checkpoints(g, level, set(consts + ins), num_points, host=True) if p]
    return g


def _donated_outputs(graph: Graph, donated: Sequence[bool]) -> frozenset[int]:
    """Outputs that XLA can write into a donated input buffer of the same shape and dtype."""
    free: dict[tuple, int] = {}
    for t, d in zip(graph.inputs, donated):
        if d:
            key = (graph.tensors[t].shape, graph.tensors[t].dtype)
            free[key] = free.get(key, 0) + 1
    out = set()
    for t in graph.outputs:
        if t is None:
            continue
        key = (graph.tensors[t].shape, graph.tensors[t].dtype)
        if free.get(key):
            free[key] -= 1
            out.add(t)
    return frozenset(out)


# Ops XLA's CSE leaves apart: each draws or does something of its own.
_NOT_COMMONED = ("random", "rng", "custom", "callback", "pure_callback", "io_callback", "debug", "psum",
                 "all_gather", "all_to_all", "ppermute", "axis_index", "reduce_scatter", "device_put")


def _recomputed(level: Level, eqn, ins: list, outs: list, recomputing: bool) -> None:
    """On XLA's CPU compiler, at the top level: where an op a differentiated ``jax.checkpoint``
    recomputes (``recomputing``) computes what an op before it computed (its operands the same
    values, or their recomputations), its results are that op's
    (:attr:`~shardplan.compiler.liveness.Level.twin`): they take no memory of their own, and the
    first computation lives until the backward pass reads it. The CPU compiler's programs: a
    step with its layers unrolled and checkpointed holds what it holds without the checkpoints,
    while the recomputation's collectives are still run (tests/tracing/test_cse.py). (In a
    loop, the backward trip recomputes what another trip computed: the checkpoint saves there.)"""
    key = _computed_key(eqn, [level.twin.get(t, t) for t in ins])
    if key is None:
        return
    first = level.computed.setdefault(key, outs)
    if first is not outs and recomputing:
        level.twin.update((o, f) for o, f in zip(outs, first) if o is not None and f is not None)


def _computed_key(eqn, ins) -> tuple | None:
    """What an op computes, for XLA's CSE: its primitive, its parameters and its operands (a
    literal by value); ``None`` for an op CSE leaves apart, or whose parameters hold a program."""
    prim = eqn.primitive.name
    if any(word in prim for word in _NOT_COMMONED) or eqn.effects:
        return None
    params = []
    for k, v in sorted(eqn.params.items()):
        if isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)) or callable(v):
            return None
        params.append((k, repr(v)))
    operands = tuple(t if t is not None else ("literal", repr(getattr(v, "val", v)), str(v.aval))
                     for v, t in zip(eqn.invars, ins))
    return prim, tuple(params), operands


def _is_zero(v) -> bool:
    """Whether a jaxpr operand is the literal zero."""
    if not isinstance(v, jcore.Literal):
        return False
    try:
        return not np.any(np.asarray(v.val))
    except (TypeError, ValueError):
        return False
