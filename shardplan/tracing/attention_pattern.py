"""Attention in a jaxpr: softmax(mask(q @ k * scale)) @ v as a model writes it out, found
and read (its operands' layouts, scale and causal mask) for :mod:`shardplan.tracing.einsum_attention`.

What is recognised, per attention: the first dot_general contracts one head dimension of q and k,
with the batch and (key/value) heads as its batch dimensions, q's free dimensions its sequence
(and, for grouped-query attention, the group of query heads per key/value head), k's free
dimension its sequence, of the same length (self-attention); between it and the softmax over the
key sequence only dtype conversions, a scale (a constant multiplier or divisor), and masks (a
``jnp.where`` with a constant condition and a large negative fill, or an added constant bias of 0
and large negatives) whose allowed positions are causal (query position >= key position) or
everywhere; after the softmax only dtype conversions before the second dot_general with v
(contracting the key sequence, the same batch dimensions). A mask is checked by computing sampled
rows and columns of it (the first and last 64 and 256 spread between), so a mask of a long
sequence is never built whole. Anything else (a mask that depends on the data, dropout on the
weights, ALiBi biases, cross-attention) is left as written.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.extend import core as jcore

# A fill or bias at most this is a masked-out position (Flax uses finfo.min, MaxText -0.7 * max).
_MASKED = -1e4
_SAMPLED = 64        # rows and columns checked at each end of a mask, and about 4x as many between


@dataclasses.dataclass(frozen=True)
class Found:
    """One attention in a jaxpr: the second dot_general's position, its q, k and v operands and
    each one's dimension labels (``b`` batch, ``h`` key/value heads, ``g`` query heads per
    key/value head, ``t`` sequence, ``d`` head dimension, ``e`` value dimension), the output's
    labels, the scale and the causal mask."""

    position: int
    q: object
    k: object
    v: object
    q_labels: tuple[str, ...]
    k_labels: tuple[str, ...]
    v_labels: tuple[str, ...]
    out_labels: tuple[str, ...]
    scale: float
    causal: bool

    def shapes(self) -> tuple[tuple, tuple]:
        """(q shape, kv shape) as ``jax.nn.dot_product_attention`` takes them: ``[b, t, heads, d]``."""
        q, k = dict(zip(self.q_labels, self.q.aval.shape)), dict(zip(self.k_labels, self.k.aval.shape))
        heads = q.get("h", 1) * q.get("g", 1)
        return (q["b"], q["t"], heads, q["d"]), (k["b"], k["t"], k.get("h", 1), k["d"])


_PASS_THROUGH = ("convert_element_type", "reduce_precision", "copy", "copy_p")
_SHAPE_OPS = ("broadcast_in_dim", "reshape", "squeeze", "expand_dims", "stop_gradient", "convert_element_type")


_ELEMENTWISE = {"add", "sub", "mul", "div", "max", "min", "ge", "gt", "le", "lt", "eq", "ne", "and", "or",
                "not", "xor", "select_n", "convert_element_type", "neg", "abs", "sign", "floor", "ceil", "round",
                "rem", "pow", "integer_pow", "exp", "log", "clamp", "is_finite", "stop_gradient", "copy"}
_MATERIALISED = 1 << 22       # a constant of at most this many elements may be computed whole


class Dataflow:
    """One jaxpr's dataflow: each variable's producing equation, and which variables are constants
    (computed from literals, iotas and concrete arrays alone). ``outer`` names this jaxpr's
    inputs known outside it: ``("value", array)`` or ``("ref", level, var)`` (a scan's or a
    checkpoint's operand in the enclosing jaxpr)."""

    def __init__(self, jaxpr, outer: dict):
        self.jaxpr, self.outer = jaxpr, dict(outer)
        self.producer = {}
        for eqn in jaxpr.eqns:
            for v in eqn.outvars:
                self.producer[v] = eqn
        self.memo = {}

    def eqn(self, v):
        return None if isinstance(v, jcore.Literal) else self.producer.get(v)

    def ref(self, v):
        """What an enclosed jaxpr's input bound to ``v`` is known as, or None if not a constant."""
        return ("ref", self, v) if self.thunk(v) is not None else None

    def thunk(self, v):
        """A function computing ``v`` from constants alone, or None where it depends on an input."""
        if isinstance(v, jcore.Literal):
            return lambda: v.val
        if v in self.outer:
            known = self.outer[v]
            return (lambda: known[1]) if known[0] == "value" else known[1].thunk(known[2])
        if v in self.memo:
            return self.memo[v]
        eqn = self.eqn(v)
        if eqn is None or eqn.effects:
            return None
        ins = [self.thunk(x) for x in eqn.invars]
        if any(f is None for f in ins):
            self.memo[v] = None
            return None
        index = eqn.outvars.index(v)

        def compute(eqn=eqn, ins=ins, index=index):
            outs = eqn.primitive.bind(*[f() for f in ins], **eqn.primitive.get_bind_params(eqn.params))
            return outs[index] if eqn.primitive.multiple_results else outs
        self.memo[v] = compute
        return compute

    def at(self, v, coords: tuple, grid: tuple) -> np.ndarray | None:
        """A constant ``v``'s values at the points ``coords`` (one index array per dimension,
        broadcasting to ``grid``), computed point by point where the ops allow, so a mask of a
        long sequence is never built whole; None if ``v`` is not a constant or cannot be."""
        if isinstance(v, jcore.Literal) or not v.aval.shape:
            f = self.thunk(v)
            return None if f is None else np.broadcast_to(np.asarray(self._eager(f), v.aval.dtype), grid)
        if v in self.outer:
            known = self.outer[v]
            if known[0] == "value":
                return np.broadcast_to(np.asarray(known[1])[coords], grid)
            return known[1].at(known[2], coords, grid)
        eqn = self.eqn(v)
        if eqn is None or eqn.effects:
            return None
        name, params = eqn.primitive.name, eqn.params
        if name == "iota":
            return np.broadcast_to(coords[params["dimension"]].astype(params["dtype"]), grid)
        if name == "broadcast_in_dim":
            x = eqn.invars[0]
            inner = tuple(coords[d] if n != 1 else np.zeros((), int)
                          for d, n in zip(params["broadcast_dimensions"], x.aval.shape))
            return self.at(x, inner, grid)
        if name == "transpose":
            inner = [None] * len(coords)
            for i, d in enumerate(params["permutation"]):
                inner[d] = coords[i]
            return self.at(eqn.invars[0], tuple(inner), grid)
        if name in ("reshape", "squeeze", "expand_dims"):
            x = eqn.invars[0]
            kept = [c for c, n in zip(coords, v.aval.shape) if n != 1]
            if [n for n in x.aval.shape if n != 1] != [n for n in v.aval.shape if n != 1]:
                return self._whole(v, coords, grid)
            it = iter(kept)
            return self.at(x, tuple(next(it) if n != 1 else np.zeros((), int) for n in x.aval.shape), grid)
        if name in _ELEMENTWISE and not eqn.primitive.multiple_results:
            ins = [self.at(x, coords, grid) for x in eqn.invars]
            if any(x is None for x in ins):
                return None
            return np.asarray(self._eager(lambda: eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(params))))
        return self._whole(v, coords, grid)

    def _whole(self, v, coords, grid):
        f = self.thunk(v)
        if f is None or math.prod(v.aval.shape) > _MATERIALISED:
            return None
        return np.broadcast_to(np.asarray(self._eager(f))[coords], grid)

    @staticmethod
    def _eager(f):
        """``f()`` computed now, op by op (each op's program cached by its shapes, so the masks of
        many layers cost one compile), even while a step is being traced."""
        with jax.ensure_compile_time_eval():
            return f()


def _scalar(level: Dataflow, v) -> float | None:
    """The value of a constant ``v`` that is one number (however broadcast), else None."""
    v = _through(level, v, ("broadcast_in_dim", "reshape", "convert_element_type"))
    f = level.thunk(v)
    if f is None or math.prod(v.aval.shape) > 1 << 16:
        return None
    x = np.asarray(level._eager(f), dtype=np.float64)
    return float(x.flat[0]) if x.size and np.all(x == x.flat[0]) else None


def _sampled(n: int) -> np.ndarray:
    ends = np.concatenate([np.arange(min(n, _SAMPLED)), np.arange(max(0, n - _SAMPLED), n)])
    return np.unique(np.concatenate([ends, np.linspace(0, n - 1, 4 * _SAMPLED).round().astype(int)]))


def _allowed(level: Dataflow, v, q_dim: int, k_dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Sampled rows and columns of a constant mask ``v`` (in the scores' layout): (rows, columns,
    values on them), the other dimensions at their first and last index and required to agree;
    None if ``v`` is not a constant or varies along them."""
    shape = v.aval.shape
    rows, cols = _sampled(shape[q_dim]), _sampled(shape[k_dim])
    index = [rows if dim == q_dim else cols if dim == k_dim else np.unique([0, size - 1])
             for dim, size in enumerate(shape)]
    x = level.at(v, np.ix_(*index), tuple(len(i) for i in index))
    if x is None:
        return None
    x = np.moveaxis(x, (q_dim, k_dim), (-2, -1)).reshape(-1, len(rows), len(cols))
    if not np.all(x == x[:1]):
        return None
    return rows, cols, x[0]


def _producing(level: Dataflow, v, names) -> tuple[object, object] | None:
    eqn = level.eqn(v)
    return (eqn, eqn.invars) if eqn is not None and eqn.primitive.name in names else None


def _through(level: Dataflow, v, names=_SHAPE_OPS):
    """``v`` followed back through shape and dtype-only equations."""
    while (hit := _producing(level, v, names)) is not None:
        v = hit[1][0]
    return v


def find(level: Dataflow) -> list[Found]:
    """Each attention in ``level``'s jaxpr (its own equations only), as :class:`Found`."""
    jaxpr = level.jaxpr
    users = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal):
                users.setdefault(v, []).append((i, eqn))
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "exp":
            continue
        hit = _max_of(level, eqn)
        if hit is None:
            continue
        x, axis = hit
        e = eqn.outvars[0]
        divs = [u for _, u in users.get(e, ()) if u.primitive.name == "div" and u.invars[0] is e
                and _is_sum_of(level, u.invars[1], e, axis)]
        if not divs:
            continue
        p = divs[0].outvars[0]
        while len(users.get(p, ())) == 1 and users[p][0][1].primitive.name in _PASS_THROUGH:
            p = users[p][0][1].outvars[0]
        for position, user in users.get(p, ()):
            if user.primitive.name == "dot_general":
                hit = _attention(level, x, axis, p, position, user)
                if hit is not None:
                    found.append(hit)
    return found


def _max_of(level: Dataflow, eqn) -> tuple[object, int] | None:
    hit = _producing(level, eqn.invars[0], ("sub",))
    if hit is None:
        return None
    x, m = hit[1]
    for _ in range(8):
        inner = level.eqn(m)
        if inner is None:
            return None
        name = inner.primitive.name
        if name == "reduce_max":
            if inner.invars[0] is x and len(inner.params["axes"]) == 1:
                return x, inner.params["axes"][0]
            return None
        if name == "max":      # jax.nn.softmax: max(-inf, reduce_max(x))
            m = next((w for w in inner.invars if level.thunk(w) is None), None)
        elif name in _SHAPE_OPS:
            m = inner.invars[0]
        else:
            return None
        if m is None:
            return None
    return None


def _is_sum_of(level: Dataflow, v, e, axis: int) -> bool:
    v = _through(level, v)
    eqn = level.eqn(v)
    return (eqn is not None and eqn.primitive.name == "reduce_sum"
            and _through(level, eqn.invars[0], _PASS_THROUGH) is e and tuple(eqn.params["axes"]) == (axis,))


def _attention(level: Dataflow, x, axis: int, p, position: int, second) -> Found | None:
    """The attention whose softmax input is ``x`` (over ``axis``) and whose weights ``p`` meet v
    in ``second``, if the scores come from q and k as this module's docstring says."""
    scale, masks = 1.0, []
    v, at = x, list(range(x.aval.ndim))     # at[j]: the dimension of x that v's dimension j is
    while True:
        eqn = level.eqn(v)
        if eqn is None:
            return None
        name = eqn.primitive.name
        if name == "dot_general":
            break
        if name in _PASS_THROUGH:
            v = eqn.invars[0]
        elif name == "transpose":
            before = [0] * len(at)
            for i, d in enumerate(eqn.params["permutation"]):
                before[d] = at[i]
            v, at = eqn.invars[0], before
        elif name in ("mul", "div"):
            a, b = eqn.invars
            if name == "mul" and level.thunk(a) is not None:
                a, b = b, a
            c = _scalar(level, b)
            if c is None or c == 0:
                return None
            scale, v = (scale * c if name == "mul" else scale / c), a
        elif name == "select_n" and len(eqn.invars) == 3:
            pred, false_case, true_case = eqn.invars
            flow_true = level.thunk(true_case) is None
            c = _scalar(level, false_case if flow_true else true_case)
            if c is None or c > _MASKED or level.thunk(pred) is None:
                return None
            masks.append(("where", pred, flow_true, list(at)))
            v = true_case if flow_true else false_case
        elif name == "add":
            a, b = eqn.invars
            if level.thunk(a) is not None:
                a, b = b, a
            if level.thunk(b) is None:
                return None
            masks.append(("bias", b, None, list(at)))
            v = a
        else:
            return None
    labels = _dot_labels(eqn, axis_label_at=at.index(axis))
    if labels is None:
        return None
    q, k, q_labels, k_labels, score_labels = labels
    x_labels = [None] * len(at)
    for j, d in enumerate(at):
        x_labels[d] = score_labels[j]
    causal = _causal(level, masks, x_labels)
    if causal is None:
        return None
    # the second dot_general: the weights (``p``, laid out as x) against v over the key sequence
    (lc, rc), (lb, rb) = second.params["dimension_numbers"]
    if second.invars[0] is p:
        pc, vc, pb, vb, value, p_first = lc, rc, lb, rb, second.invars[1], True
    elif second.invars[1] is p:
        pc, vc, pb, vb, value, p_first = rc, lc, rb, lb, second.invars[0], False
    else:
        return None
    if tuple(pc) != (axis,) or sorted(x_labels[d] for d in pb) != sorted(c for c in x_labels if c in "bh"):
        return None
    v_labels = [None] * value.aval.ndim
    for i, d in zip(pb, vb):
        v_labels[d] = x_labels[i]
    v_labels[vc[0]] = "t"
    rest = [d for d in range(value.aval.ndim) if v_labels[d] is None]
    if len(rest) != 1:
        return None
    v_labels[rest[0]] = "e"
    k_shape = dict(zip(k_labels, k.aval.shape))
    if value.aval.shape[vc[0]] != k_shape["t"] or value.aval.shape[rest[0]] != k_shape["d"] \
            or k.aval.dtype != value.aval.dtype:
        return None
    p_free = [x_labels[d] for d in range(len(at)) if d not in pb and d != axis]
    out_labels = [x_labels[i] for i in pb] + (p_free + ["e"] if p_first else ["e"] + p_free)
    if "h" in k_labels:       # k and v repeated for grouped-query heads: attend to the unrepeated ones
        k_once, v_once = _unrepeated(level, k, k_labels), _unrepeated(level, value, v_labels)
        if k_once is not None and v_once is not None and k_once[1] == v_once[1]:
            k, value = k_once[0], v_once[0]
    return Found(position, q, k, value, tuple(q_labels), tuple(k_labels), tuple(v_labels), tuple(out_labels),
                 scale, causal)


def _unrepeated(level: Dataflow, x, labels) -> tuple[object, int] | None:
    """For ``x`` that is ``jnp.repeat(y, g, axis=heads)`` (a broadcast to a new dimension after
    the heads, merged into them): (y, g); else None."""
    merge = level.eqn(x)
    if merge is None or merge.primitive.name != "reshape" or merge.params.get("dimensions") is not None:
        return None
    wide = merge.invars[0]
    spread = level.eqn(wide)
    if spread is None or spread.primitive.name != "broadcast_in_dim":
        return None
    h, shape, wide_shape = labels.index("h"), x.aval.shape, wide.aval.shape
    if len(wide_shape) != len(shape) + 1 or wide_shape[:h] != shape[:h] or wide_shape[h + 2:] != shape[h + 1:] \
            or wide_shape[h] * wide_shape[h + 1] != shape[h]:
        return None
    once = spread.invars[0]
    if tuple(spread.params["broadcast_dimensions"]) != tuple(d for d in range(len(wide_shape)) if d != h + 1) \
            or once.aval.shape != wide_shape[:h + 1] + wide_shape[h + 2:]:
        return None
    return once, wide_shape[h + 1]


def _dot_labels(first, axis_label_at: int):
    """(q, k, q's labels, k's labels, the scores' labels) for the scores' dot_general, whose
    dimension ``axis_label_at`` is the softmax's (the key sequence, ``s``); None if it is not
    q against k as this module's docstring says."""
    (lc, rc), (lb, rb) = first.params["dimension_numbers"]
    if len(lc) != 1 or not 1 <= len(lb) <= 2:
        return None
    lhs, rhs = first.invars
    nb = len(lb)
    l_free = [d for d in range(lhs.aval.ndim) if d not in lc and d not in lb]
    r_free = [d for d in range(rhs.aval.ndim) if d not in rc and d not in rb]
    if axis_label_at >= nb + len(l_free):     # the softmax runs over rhs's free dimension: rhs is k
        q, k, qc, kc, qb, kb, q_free, k_free, q_first = lhs, rhs, lc[0], rc[0], lb, rb, l_free, r_free, True
    elif axis_label_at >= nb:
        q, k, qc, kc, qb, kb, q_free, k_free, q_first = rhs, lhs, rc[0], lc[0], rb, lb, r_free, l_free, False
    else:
        return None
    if len(k_free) != 1 or len(q_free) not in (1, 2):
        return None
    t = [d for d in q_free if q.aval.shape[d] == k.aval.shape[k_free[0]]]
    if len(t) != 1:
        return None
    order = sorted(range(nb), key=lambda i: qb[i])     # the batch dimension first in q, then the heads
    batch = ["bh"[order.index(i)] for i in range(nb)]
    q_labels, k_labels = [None] * q.aval.ndim, [None] * k.aval.ndim
    for i in range(nb):
        q_labels[qb[i]] = k_labels[kb[i]] = batch[i]
    q_labels[qc] = k_labels[kc] = "d"
    k_labels[k_free[0]] = "t"
    for d in q_free:
        q_labels[d] = "t" if d == t[0] else "g"
    queries = [q_labels[d] for d in q_free]
    score_labels = batch + (queries + ["s"] if q_first else ["s"] + queries)
    if score_labels[axis_label_at] != "s":
        return None
    return q, k, tuple(q_labels), tuple(k_labels), score_labels


def _causal(level: Dataflow, masks: list, x_labels: list) -> bool | None:
    """Whether the masks allow exactly query position >= key position (True) or everything
    (False); None for any other mask."""
    allowed = None
    for kind, v, flow_true, at in masks:
        here = [x_labels[d] for d in at]
        if v.aval.ndim != len(here):
            return None
        q_dim, k_dim = here.index("t"), here.index("s")
        hit = _allowed(level, v, q_dim, k_dim)
        if hit is None:
            return None
        rows, cols, x = hit
        if kind == "where":
            ok = x.astype(bool) if flow_true else ~x.astype(bool)
        else:
            x = x.astype(np.float64)
            if not np.all((x == 0) | (x <= _MASKED)):
                return None          # a real bias (ALiBi and the like): not a mask
            ok = x == 0
        if not (np.all(ok) or np.array_equal(ok, rows[:, None] >= cols[None, :])):
            return None
        allowed = ok if allowed is None else allowed & ok
    if allowed is None or np.all(allowed):
        return False
    return True
