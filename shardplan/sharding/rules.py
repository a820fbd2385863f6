"""How each primitive relates the shardings of its operands and results: the rules, registered by
primitive name (:mod:`shardplan.sharding.site`; those of gather and scatter in
:mod:`shardplan.sharding.indexing`), and :func:`apply_rule`, which runs an equation's rule.

Every rule adds to the graph either unions (same-shape elementwise ops: one sharding for all),
a :class:`~shardplan.ir.graph.DotOp`, or :class:`~shardplan.ir.graph.PairEdge` relations whose cost the
planner prices. A primitive without a rule and not elementwise falls back to a safe choice: its
operands are gathered to replicated and its result is sliced from that, with one warning naming
the primitive and the source line.
"""

from __future__ import annotations

from shardplan.compiler.layout import tiled
from shardplan.ir.graph import DotOp, Graph, ManualRegion
from shardplan.sharding import indexing  # noqa: F401  (registers the gather and scatter rules)
from shardplan.sharding.site import RULES, Site, rank, rule
from shardplan.tracing.manual import MANUAL_PRIMITIVE, body_peak, region_specs
from shardplan.tracing.walk import is_shift, source_of

_REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
               "reduce_xor"}
# Params that do not stop a same-shape op from being elementwise. ``reshard`` (``dst_sharding``:
# NNX draws dropout masks through it under ``nnx.vmap``) moves no data on the planner's Auto axes.
_ELEMENTWISE_PARAMS = {"accuracy", "new_dtype", "weak_type", "sharding", "y", "out_dtype", "exponent_bits",
                       "mantissa_bits", "dst_sharding", "concrete_mesh"}
# Primitives of jax.random: key creation, splitting, folding and bit generation.
_RANDOM = {"random_seed", "random_wrap", "random_unwrap", "random_split", "random_fold_in", "random_bits",
           "random_clone", "threefry2x32", "rng_bit_generator", "rng_uniform"}
_WINDOWED = {"reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
             "select_and_scatter_add", "select_and_gather_add", "select_and_scatter"}
_SCANS_ALONG_AXIS = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}


def _bf16_pass(g: Graph, eqn, lhs, rhs) -> bool:
    """Whether a dot or convolution multiplies float32 operands at DEFAULT precision (on a TPU,
    one bfloat16 pass: its operands move as bfloat16)."""
    if lhs is None or rhs is None or any(g.tensors[t].dtype.name != "float32" for t in (lhs, rhs)):
        return False
    precision = eqn.params.get("precision")
    if precision is None:
        return True
    precision = precision if isinstance(precision, tuple) else (precision, precision)
    return all(p is None or getattr(p, "name", str(p)) == "DEFAULT" for p in precision)


def apply_rule(g: Graph, eqn, ins: list, outs: list, mult: float) -> None:
    """Add ``eqn``'s relations to ``g``: its primitive's rule, else the elementwise rule, else the
    safe fallback (operands gathered to replicated, one warning naming the primitive)."""
    site = Site(g, eqn, ins, outs, mult)
    RULES.get(site.prim, default_rule)(site)


@rule("dot_general")
def dot_rule(site: Site) -> None:
    """A :class:`DotOp`: each dimension of the result, and each contracted pair, as operand dims."""
    g, ins = site.g, site.ins
    (lc, rc), (lb, rb) = site.params["dimension_numbers"]
    lhs, rhs = ins
    lr, rr = rank(g, lhs), rank(g, rhs)
    dims = [(l, r, k) for k, (l, r) in enumerate(zip(lb, rb))]
    lfree = [d for d in range(lr) if d not in lc and d not in lb]
    rfree = [d for d in range(rr) if d not in rc and d not in rb]
    k = len(lb)
    dims += [(d, None, k + i) for i, d in enumerate(lfree)]
    dims += [(None, d, k + len(lfree) + i) for i, d in enumerate(rfree)]
    dims += [(l, r, None) for l, r in zip(lc, rc)]
    g.dots.append(DotOp(lhs, rhs, site.out, tuple(dims), site.mult, source_of(site.eqn, g.call_source),
                        bf16_pass=_bf16_pass(g, site.eqn, lhs, rhs)))


@rule(*_RANDOM)
def random_rule(site: Site) -> None:
    """Keys and counters are read whole (replicated); the bits may come out in any sharding: with
    partitionable threefry (jax's default) each device draws exactly its shard's bits."""
    g = site.g
    if site.prim == "threefry2x32":
        for t in site.operands:
            for o in site.outs:
                if g.tensors[t].shape == g.tensors[o].shape:
                    g.union(t, o)
        return
    for o in site.outs:
        for t in site.operands:
            site.replicated(t, o)



@rule(*_WINDOWED)
def window_rule(site: Site) -> None:
    """Pooling and its gradient: dims the window slides over (or strides, pads, dilates) are whole
    on every device; batch and feature dims keep any sharding."""
    p = site.params
    w = p["window_dimensions"]
    moved = {d for d in range(len(w)) if w[d] != 1 or p["window_strides"][d] != 1
             or tuple(p["padding"][d]) != (0, 0)
             or (p.get("base_dilation") or (1,) * len(w))[d] != 1
             or (p.get("window_dilation") or (1,) * len(w))[d] != 1}
    for t in site.operands:
        if site.rank(t) == len(w):
            site.whole_along(t, site.out, moved)


@rule("top_k")
def top_k_rule(site: Site) -> None:
    """XLA's TPU compiler splits top_k along its other dims; the CPU and GPU compilers run it as a
    custom call on the whole operand, all-gathered first (checked on both, deviceless GPU)."""
    n = site.rank(site.ins[0])
    whole = set(range(n)) if not tiled(site.g.device) else {n - 1}
    for o in site.outs:
        site.whole_along(site.ins[0], o, whole)




@rule("optimization_barrier")
def barrier_rule(site: Site) -> None:
    """Identity on each operand (jax.checkpoint's CSE fence)."""
    for t, o in zip(site.ins, site.outs):
        if t is not None and site.rank(t):
            site.g.union(t, o)


@rule(*_REDUCTIONS)
def reduction_rule(site: Site) -> None:
    """The kept dims keep their axes; the reduced dims' axes are left partial (a reduction to pay)."""
    axes = set(site.params["axes"])
    kept = [d for d in range(site.rank(site.ins[0])) if d not in axes]

    def produced(spec, kept=kept, axes=axes):
        partial = tuple(a for d in axes for a in spec[d])
        return tuple(spec[d] for d in kept), partial
    site.edge(site.ins[0], site.out, produced=produced)


@rule("argmax", "argmin")
def arg_reduction_rule(site: Site) -> None:
    axis = site.params["axes"][0]
    site.edge(site.ins[0], site.out, required=lambda s, axis=axis: s[:axis] + ((),) + s[axis:])


@rule("unstack")
def unstack_rule(site: Site) -> None:
    """``lax.unstack``; from jax 0.12 also ``a, b = x`` (slice + squeeze before)."""
    axis = site.params["axis"]
    for o in site.outs:
        site.edge(site.ins[0], o, required=lambda s, axis=axis: s[:axis] + ((),) + s[axis:])


@rule("stack")
def stack_rule(site: Site) -> None:
    """``unstack``'s transpose (jax >= 0.12): the result gains ``axis``."""
    axis = site.params["axis"]
    for t in site.ins:
        site.edge(t, site.out, required=lambda s, axis=axis: s[:axis] + s[axis + 1:])


@rule("broadcast_in_dim")
def broadcast_rule(site: Site) -> None:
    """An operand dim keeps the result dim's axes where it is not broadcast (size 1 grown)."""
    bd = site.params["broadcast_dimensions"]
    shape_in = site.g.tensors[site.ins[0]].shape if site.ins[0] is not None else ()
    shape_out = site.shape_out

    def required(s, bd=bd, shape_in=shape_in):
        return tuple(s[o] if shape_in[i] == shape_out[o] else () for i, o in enumerate(bd))
    site.edge(site.ins[0], site.out, required=required)


@rule("transpose")
def transpose_rule(site: Site) -> None:
    perm = site.params["permutation"]
    inv = [perm.index(d) for d in range(len(perm))]
    site.edge(site.ins[0], site.out, required=lambda s, inv=inv: tuple(s[inv[d]] for d in range(len(inv))))


@rule("reshape", "squeeze", "expand_dims")
def reshape_rule(site: Site) -> None:
    shape_in = site.g.tensors[site.ins[0]].shape
    site.edge(site.ins[0], site.out, required=_reshape_rule(shape_in, site.shape_out), sized=True)


@rule("slice", "pad", "dynamic_slice")
def slice_rule(site: Site) -> None:
    """The dims whose size changes are whole on every device; the others keep their axes."""
    shape_in, shape_out = site.g.tensors[site.ins[0]].shape, site.shape_out
    site.whole_along(site.ins[0], site.out, {d for d in range(len(shape_in)) if shape_in[d] != shape_out[d]})


@rule("rev")
def rev_rule(site: Site) -> None:
    site.whole_along(site.ins[0], site.out, set(site.params["dimensions"]))


@rule("tile")
def tile_rule(site: Site) -> None:
    site.whole_along(site.ins[0], site.out, {d for d, r in enumerate(site.params["reps"]) if r != 1})


@rule(*_SCANS_ALONG_AXIS)
def scan_along_axis_rule(site: Site) -> None:
    """``cumsum`` and its kind: the scanned dim is whole on every device."""
    site.whole_along(site.ins[0], site.out, {site.params["axis"]})


@rule("sort")
def sort_rule(site: Site) -> None:
    """Every operand and result whole along the sorted dim."""
    for o in site.outs:
        for t in site.ins:
            site.whole_along(t, o, {site.params["dimension"]})


@rule("cholesky")
def matrix_rule(site: Site) -> None:
    """A factorisation of each matrix in a batch (same shape, no params: not elementwise): the
    matrix dims (the last two) whole on every device, the batch dims keep their axes."""
    n = site.rank(site.ins[0])
    site.whole_along(site.ins[0], site.out, {n - 2, n - 1})


@rule("concatenate")
def concatenate_rule(site: Site) -> None:
    for t in site.ins:
        site.whole_along(t, site.out, {site.params["dimension"]})


@rule("split")
def split_rule(site: Site) -> None:
    for o in site.outs:
        site.whole_along(site.ins[0], o, {site.params["axis"]})


@rule("dynamic_update_slice")
def dynamic_update_slice_rule(site: Site) -> None:
    """The result is the operand updated in place; the update is whole along the dims it is smaller."""
    operand, update, out = site.ins[0], site.ins[1], site.out
    site.g.union(operand, out)
    shape_up, shape_out = site.g.tensors[update].shape, site.shape_out
    site.whole_along(update, out, {d for d in range(len(shape_out)) if shape_up[d] != shape_out[d]})






@rule("pjit", "jit")
def shift_rule(site: Site) -> None:
    """The pipeline's stage shift (the only call the walk keeps whole): its result keeps its
    operand's sharding; where the rolled dimension is split, XLA moves each device's edge rows on
    (a collective-permute, priced per spec by the strategies' enumerator). One of constants alone
    (partial evaluation's known part) is computed where it is used and moves nothing."""
    if not is_shift(site.eqn):
        default_rule(site)
        return
    if not site.ins or site.ins[0] is None:
        return
    site.g.union(site.ins[0], site.out)
    site.g.shifts.add(site.out)


def default_rule(site: Site) -> None:
    """A primitive without a rule of its own: nothing for ``iota`` or one with no array operand;
    elementwise where every operand has the result's shape or broadcasts along its size-1 dims;
    else its operands gathered to replicated, with one warning naming it and its source line."""
    g, outs, shape_out, operands = site.g, site.outs, site.shape_out, site.operands
    if site.prim == "iota" or not operands:
        return
    if len(outs) == 1 and set(site.params) <= _ELEMENTWISE_PARAMS and all(
            len(g.tensors[t].shape) == len(shape_out)
            and all(a in (b, 1) for a, b in zip(g.tensors[t].shape, shape_out)) for t in operands):
        for t in operands:
            shape_in = g.tensors[t].shape
            if shape_in == shape_out:
                g.union(t, site.out)
            else:
                site.whole_along(t, site.out, {d for d, n in enumerate(shape_in) if n != shape_out[d]})
        return
    where = source_of(site.eqn, g.call_source)
    g.warn_once(site.prim, f"shardplan: no sharding rule for primitive {site.prim!r} at {where}; "
                           "its operands are gathered to replicated (correct, maybe slow)")
    for o in outs:
        for t in operands:
            site.replicated(t, o)


@rule(MANUAL_PRIMITIVE)
def manual_rule(site: Site) -> None:
    """``shard_map``: each operand resharded to its ``in_specs`` entry, each result held at its
    ``out_specs`` entry; the body's own costs are read at planning (:mod:`shardplan.tracing.manual`).
    Where the region leaves some of its mesh axes automatic, its operands are gathered to
    replicated (a warning says why)."""
    g, eqn, ins, outs, mult, edge = site.g, site.eqn, site.ins, site.outs, site.mult, site.edge
    region = eqn.params["mesh"]
    sizes = dict(zip(region.axis_names, region.axis_sizes))
    specs = region_specs(eqn, sizes)
    if specs is None:
        auto = sorted(set(region.axis_names) - set(eqn.params.get("newly_manual_axes") or ()))
        g.warn_once(f"shard_map {source_of(eqn, g.call_source)}",
                    f"shardplan: the shard_map at {source_of(eqn, g.call_source)} leaves mesh axes {auto} automatic "
                    "(axis_names=), which the planner cannot plan around: its operands are gathered to replicated "
                    "(correct, maybe slow); make it manual over every mesh axis to have it planned around")
        for o in outs:
            for t in ins:
                if t is not None and rank(g, t):
                    edge(t, o, required=lambda s, r=rank(g, t): ((),) * r)
        return
    in_specs, out_specs = specs
    source = source_of(eqn, g.call_source)
    ranked = [o for o in outs if o is not None and rank(g, o)]
    for t, spec in zip(ins, in_specs):
        if t is not None and rank(g, t) and ranked:
            edge(t, ranked[0], required=lambda s, spec=spec: spec)
    for o, spec in zip(outs, out_specs):
        if o is not None:
            for d, axes in enumerate(spec):
                g.require(o, d, axes, source)
    g.manual.append(ManualRegion(tuple(sizes.items()), eqn.params["jaxpr"], mult,
                                 ranked[0] if ranked else None, source, tuple(ins), tuple(outs),
                                 body_peak(eqn.params["jaxpr"])))


@rule("device_put")
def device_put_rule(site: Site) -> None:
    """``jax.device_put`` inside the step, one operand at a time. To a memory space (a
    ``jax.checkpoint`` policy offloading a residual to the host and fetching it back) or nowhere
    in particular: the result keeps the operand's sharding, and a move between device and host
    memory is a transfer (:attr:`~shardplan.ir.graph.Graph.transfers`). To a ``NamedSharding``: a
    sharding constraint. To one device: gathered there (replicated)."""
    g, eqn, ins, outs, edge = site.g, site.eqn, site.ins, site.outs, site.edge
    for k, (t, o) in enumerate(zip(ins, outs)):
        dst = eqn.params["devices"][k]
        if t is None or o is None or not rank(g, t):
            continue
        if dst is None or type(dst).__name__ == "MemorySpace":
            g.union(t, o)
            if g.tensors[t].host != g.tensors[o].host:
                g.transfers.add(o)
                if g.tensors[o].host and not any(part.endswith((".scan", ".while")) for part in g.prefix.split("/")):
                    g.fetched_early.add(o)
                    if g.host_apart:
                        where = source_of(eqn, g.call_source)
                        g.warn_once("offload outside a loop", f"shardplan: a value offloaded to host memory outside "
                                    f"any loop (at {where}): XLA's GPU and TPU compilers start its copy back to the "
                                    "device as early as they can, so it saves no device memory; it is counted "
                                    "there. Offload pays inside a scanned layer stack (jax.lax.scan, "
                                    "shardplan.layer_scan)")
        elif getattr(dst, "spec", None) is not None:
            edge(t, o, required=lambda s: s)
            if g.tensors[t].host != g.tensors[o].host:
                g.transfers.add(o)
            spec = tuple(dst.spec)
            for d in range(rank(g, o)):
                entry = spec[d] if d < len(spec) else None
                g.require(o, d, () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry),
                          source_of(eqn, g.call_source))
        else:
            edge(t, o, required=lambda s, r=rank(g, t): ((),) * r)


@rule("sharding_constraint")
def constraint_rule(site: Site) -> None:
    """``with_sharding_constraint``: the result is sharded as the constraint says on every
    dimension it names (``None``: unsharded), free on its ``UNCONSTRAINED`` ones; the operand is
    resharded to it (priced, as XLA does)."""
    g, eqn, src, out, edge = site.g, site.eqn, site.ins[0], site.out, site.edge
    edge(src, out, required=lambda s: s)
    spec = getattr(eqn.params["sharding"], "spec", None)
    if spec is None:
        g.warn_once(f"constraint {source_of(eqn, g.call_source)}", "shardplan: a sharding constraint at "
                    f"{source_of(eqn, g.call_source)} is not a NamedSharding; the planner does not hold it")
        return
    free = eqn.params.get("unconstrained_dims") or ()
    for d in range(rank(g, out)):
        if d in free:
            continue
        entry = spec[d] if d < len(spec) else None
        g.require(out, d, () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry),
                  source_of(eqn, g.call_source))


@rule("conv_general_dilated")
def conv_rule(site: Site) -> None:
    """A convolution as a dot: batch (lhs, out), output features (rhs, out), input features
    contracted; output positions and the kernel window never sharded (XLA would need halo
    exchanges), nor grouped features (depthwise convolutions: only the batch splits)."""
    g, eqn, ins, out, mult = site.g, site.eqn, site.ins, site.out, site.mult
    p = eqn.params
    dn = p["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    lhs, rhs = ins[0], ins[1]
    lshape, rshape, oshape = g.tensors[lhs].shape, g.tensors[rhs].shape, g.tensors[out].shape
    grouped = p["feature_group_count"] > 1 or p["batch_group_count"] > 1
    dims = [(lhs_spec[0], None, out_spec[0]), (None, rhs_spec[0], out_spec[1]), (lhs_spec[1], rhs_spec[1], None)]
    sizes = [lshape[lhs_spec[0]] // p["batch_group_count"], rshape[rhs_spec[0]], rshape[rhs_spec[1]]]
    fixed = {1, 2} if grouped else set()
    if p["batch_group_count"] > 1:
        fixed.add(0)
    for i in range(len(lhs_spec) - 2):
        fixed.add(len(dims))
        dims.append((lhs_spec[2 + i], None, out_spec[2 + i]))
        sizes.append(oshape[out_spec[2 + i]])
        fixed.add(len(dims))
        dims.append((None, rhs_spec[2 + i], None))
        sizes.append(rshape[rhs_spec[2 + i]])
    g.dots.append(DotOp(lhs, rhs, out, tuple(dims), mult, source_of(eqn, g.call_source), frozenset(fixed), tuple(sizes),
                        bf16_pass=_bf16_pass(g, eqn, lhs, rhs)))


def _reshape_rule(shape_in, shape_out):
    """Map an output spec back to the input through groups of dims whose sizes multiply equally.

    An output dim's mesh axes carry over to the input dims of its group, major to minor: each
    axis to the first dim (size-1 dims skipped) whose size left over by the axes before it the
    axis's size divides, moving on only once those axes have used up a dim. A batch of 1024 rows
    over ``('data', 'model')`` (16 x 8) reshaped from ``(16, 1, 64)`` rows needs ``data`` on the
    16 and ``model`` on the 64. An axis that fits no dim so, and every axis after it, must be
    gathered first; so must a sharded output dim that is not its group's major one.
    """
    groups, i, j = [], 0, 0
    while i < len(shape_in) or j < len(shape_out):
        gi, gj = [i] if i < len(shape_in) else [], [j] if j < len(shape_out) else []
        pi = shape_in[i] if i < len(shape_in) else 1
        pj = shape_out[j] if j < len(shape_out) else 1
        i, j = i + bool(gi), j + bool(gj)
        while pi != pj:
            if pi < pj and i < len(shape_in):
                pi *= shape_in[i]
                gi.append(i)
                i += 1
            elif j < len(shape_out):
                pj *= shape_out[j]
                gj.append(j)
                j += 1
            else:
                break
        groups.append((gi, gj))

    def required(s, sizes):
        req = [[] for _ in shape_in]
        for gi, gj in groups:
            major_out = next((o for o in gj if shape_out[o] != 1), None)
            dims = [d for d in gi if shape_in[d] != 1]
            if major_out is None or not dims:
                continue
            # only the major output dim of a group maps cleanly
            if any(s[o] for o in gj if o != major_out):
                continue
            k, left = 0, shape_in[dims[0]]
            for axis in s[major_out]:
                n = sizes[axis]
                if left == 1 and k + 1 < len(dims):
                    k += 1
                    left = shape_in[dims[k]]
                if left % n:
                    break
                req[dims[k]].append(axis)
                left //= n
        return tuple(tuple(axes) for axes in req)
    return required
