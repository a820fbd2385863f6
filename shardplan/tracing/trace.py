"""Tracing a train step as ``jax.jit`` takes it: any pytree, keyword, static and donated arguments.

:func:`trace_step` turns a call ``fn(*args, **kwargs)`` into one jaxpr over the flat leaves of
its dynamic arguments, names every leaf by its pytree path, and finds the *state* leaves: outputs
the step returns in place of an input leaf (``state, metrics = step(state, batch)``), which must
leave with the sharding they came in with so that the next call accepts them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax

from shardplan.errors import PlanMismatchError
from shardplan.tracing import stacks
from shardplan.util.progress import Status

ArgId = int | str          # a positional argument's index or a keyword argument's name


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """Which arguments are static and which donated, by position and by name (as ``jax.jit`` takes them)."""

    static_argnums: tuple[int, ...] = ()
    static_argnames: tuple[str, ...] = ()
    donate_argnums: tuple[int, ...] = ()
    donate_argnames: tuple[str, ...] = ()

    @classmethod
    def make(cls, fn: Callable, static_argnums=(), static_argnames=(), donate_argnums=(),
             donate_argnames=()) -> CallSpec:
        """Normalise the options and fill in names from positions and positions from names, as
        ``jax.jit`` does where ``fn`` has a signature."""
        def listed(x, kind, what):       # one int / name, or a sequence of them
            x = (x,) if isinstance(x, kind) else tuple(x or ())
            for a in x:
                if not isinstance(a, kind) or isinstance(a, bool):
                    raise TypeError(f"{what} takes {'ints' if kind is int else 'names (str)'}, got {a!r}")
            return x
        s_nums = listed(static_argnums, int, "static_argnums")
        s_names = listed(static_argnames, str, "static_argnames")
        d_nums = listed(donate_argnums, int, "donate_argnums")
        d_names = listed(donate_argnames, str, "donate_argnames")
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            params = []
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        has_var_kw = any(p.kind == p.VAR_KEYWORD for p in params)
        for what, names in (("static_argnames", s_names), ("donate_argnames", d_names)):
            for n in names:
                if params and n not in named and not has_var_kw:
                    raise ValueError(f"{what} names {n!r}, which is not a parameter of "
                                     f"{getattr(fn, '__name__', fn)}{inspect.signature(fn)}")

        def both(nums, names):
            nums = set(nums) | {positional.index(n) for n in names if n in positional}
            names = set(names) | {positional[i] for i in nums if 0 <= i < len(positional)}
            return tuple(sorted(nums)), tuple(sorted(names))
        s_nums, s_names = both(s_nums, s_names)
        d_nums, d_names = both(d_nums, d_names)
        clash = (set(s_nums) & set(d_nums)) or (set(s_names) & set(d_names))
        if clash:
            raise ValueError(f"argument {sorted(clash)[0]!r} is both static and donated; a static argument "
                             "is not an array and cannot be donated")
        return cls(s_nums, s_names, d_nums, d_names)

    def split(self, args: Sequence, kwargs: dict) -> tuple[tuple, dict, tuple, tuple]:
        """(dynamic positional args, dynamic kwargs, their ids, the static part as a hashable key)."""
        n = len(args)      # like jax.jit, an argnum past the call's arguments is ignored
        static_pos = {a % n for a in self.static_argnums if -n <= a < n}
        dyn_ids = tuple(i for i in range(n) if i not in static_pos)
        dyn_args = tuple(args[i] for i in dyn_ids)
        dyn_kwargs = {k: v for k, v in sorted(kwargs.items()) if k not in self.static_argnames}
        static = tuple((i, args[i]) for i in sorted(static_pos)) + \
            tuple((k, v) for k, v in sorted(kwargs.items()) if k in self.static_argnames)
        for where, value in static:
            try:
                hash(value)
            except TypeError:
                raise ValueError(f"static argument {where!r} must be hashable (as for jax.jit); "
                                 f"got {type(value).__name__}") from None
        return dyn_args, dyn_kwargs, dyn_ids + tuple(dyn_kwargs), static

    def donated(self, arg: ArgId, nargs: int) -> bool:
        if isinstance(arg, str):
            return arg in self.donate_argnames
        return any(arg == a % nargs for a in self.donate_argnums if -nargs <= a < nargs)


def abstract_leaf(x) -> jax.ShapeDtypeStruct:
    """The abstract value of one argument leaf: arrays, numpy arrays, keys and Python scalars
    (weakly typed, as ``jax.jit`` sees them) alike."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=getattr(x, "weak_type", False))
    try:
        aval = jax.typeof(x)
    except TypeError:
        raise TypeError(f"an argument leaf of type {type(x).__name__} is not an array or a Python scalar; "
                        "mark its argument static (static_argnums / static_argnames) or make it a pytree "
                        "of arrays") from None
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def _leaf_name(path) -> str:
    return jax.tree_util.keystr(path).replace(".value", "")


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """One traced signature of a step: its jaxpr and what each flat input and output is."""

    closed: Any                          # ClosedJaxpr over the flat dynamic leaves
    names: tuple[str, ...]               # flat input names: pytree paths ("[0]['params']...", "['batch']...")
    arg_of: tuple[ArgId, ...]            # the argument each flat input belongs to
    donated: tuple[bool, ...]
    in_tree: Any                         # PyTreeDef of the dynamic (args, kwargs) pair
    arg_tree: Any                        # what Plan.in_shardings() mirrors: the args tuple, or (args, kwargs)
    out_tree: Any
    out_names: tuple[str, ...]           # flat output names: pytree paths of the result
    state_pairs: tuple[tuple[int, int], ...]   # (flat input, flat output) returned in its place
    dyn_ids: tuple[ArgId, ...]
    has_kwargs: bool

    def flat_args(self, call: CallSpec, args, kwargs) -> list:
        dyn_args, dyn_kwargs, _, _ = call.split(args, kwargs)
        leaves, tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        if tree != self.in_tree:
            raise PlanMismatchError(f"arguments have structure {tree}, the plan was made for {self.in_tree}")
        return leaves


def _auto_context():
    """The caller's mesh context (``jax.set_mesh``) with its axes ``Auto``: each equation keeps the
    context it was traced in, and under ``Explicit`` axes the plan's sharding constraints would be
    assertions and its shardings another mesh's. A step's own ``with_sharding_constraint(x, P(...))``
    still finds the mesh's axes."""
    context = jax.sharding.get_abstract_mesh()
    auto = jax.sharding.AxisType.Auto
    if context.empty or all(t == auto for t in context.axis_types):
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(context.update_axis_types({a: auto for a in context.axis_names}))


def trace_step(fn: Callable, args: Sequence, kwargs: dict | None = None, call: CallSpec | None = None) -> TracedStep:
    """Trace ``fn(*args, **kwargs)`` with its dynamic arguments abstract."""
    kwargs = dict(kwargs or {})
    call = call if call is not None else CallSpec()
    args = tuple(args)
    dyn_args, dyn_kwargs, dyn_ids, static = call.split(args, kwargs)
    static_pos = dict((k, v) for k, v in static if isinstance(k, int))
    static_kw = dict((k, v) for k, v in static if isinstance(k, str))
    pos_ids = [i for i in dyn_ids if isinstance(i, int)]

    def flat_fn(*leaves):
        a, kw = jax.tree_util.tree_unflatten(in_tree, leaves)
        full = [None] * len(args)
        for i, v in static_pos.items():
            full[i] = v
        for i, v in zip(pos_ids, a):
            full[i] = v
        return fn(*full, **kw, **static_kw)

    with_path, in_tree = jax.tree_util.tree_flatten_with_path((dyn_args, dyn_kwargs))
    names, arg_of = [], []
    for path, _ in with_path:
        which, key = path[0].idx, path[1]
        arg = pos_ids[key.idx] if which == 0 else key.key
        # "[i]..." by the argument's position in the call (static ones counted), "['name']..." by keyword
        names.append((f"[{arg}]" + _leaf_name(path[2:])) if which == 0 else _leaf_name(path[1:]))
        arg_of.append(arg)
    abstract = [abstract_leaf(x) for _, x in with_path]
    with Status() as line, _auto_context(), stacks.step_inputs(abstract):
        line.say(f"tracing {getattr(fn, '__name__', 'the step')} ({len(abstract)} input arrays)")
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*abstract)
        line.done(f"traced: {len(closed.jaxpr.eqns)} equations at the top level")
    out_with_path, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
    donated = tuple(call.donated(a, len(args)) for a in arg_of)
    pairs = _state_pairs(dyn_args, dyn_kwargs, pos_ids, abstract, out_shape, donated, arg_of)
    arg_tree = in_tree if dyn_kwargs else jax.tree_util.tree_structure(dyn_args)
    return TracedStep(closed, tuple(names), tuple(arg_of), donated, in_tree, arg_tree, out_tree,
                      tuple(_leaf_name(p) for p, _ in out_with_path), pairs, tuple(dyn_ids), bool(dyn_kwargs))


def _subtrees(tree, offset=0):
    """Every subtree of ``tree`` with the index of its first flat leaf, outermost first."""
    leaves = jax.tree_util.tree_leaves(tree)
    yield tree, offset, len(leaves)
    children = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: x is not tree)
    if len(children) == 1 and children[0] is tree:
        return
    for child in children:
        yield from _subtrees(child, offset)
        offset += len(jax.tree_util.tree_leaves(child))


def _state_pairs(dyn_args, dyn_kwargs, pos_ids, abstract, out_shape, donated, arg_of):
    """Flat (input, output) pairs where the step returns a whole argument anew: an output subtree
    with the same structure, shapes and dtypes as the argument. Donated arguments are matched
    first; each output subtree stands in for at most one argument."""
    def sig(leaves):
        return tuple((tuple(x.shape), str(x.dtype)) for x in leaves)

    args = [(i, a) for i, a in zip(pos_ids, dyn_args)] + list(dyn_kwargs.items())
    start, starts = 0, {}
    for arg_id, a in args:
        starts[arg_id] = start
        start += len(jax.tree_util.tree_leaves(a))
    order = sorted(args, key=lambda ia: not any(d for d, g in zip(donated, arg_of) if g == ia[0]))
    candidates = [(jax.tree_util.tree_structure(t), off, n) for t, off, n in _subtrees(out_shape) if n]
    out_leaves = jax.tree_util.tree_leaves(out_shape)
    used, pairs = set(), []
    for arg_id, a in order:
        tree, n = jax.tree_util.tree_structure(a), len(jax.tree_util.tree_leaves(a))
        if not n:
            continue
        first = starts[arg_id]
        want = sig(abstract[first:first + n])
        for c_tree, off, m in candidates:
            if (off, m) in used or m != n or c_tree != tree or sig(out_leaves[off:off + m]) != want:
                continue
            used.add((off, m))
            pairs += [(first + k, off + k) for k in range(n)]
            break
    return tuple(sorted(pairs))


def signature(call: CallSpec, args, kwargs) -> tuple:
    """A hashable key of a call: pytree structure, abstract values of the leaves, static values."""
    dyn_args, dyn_kwargs, _, static = call.split(args, kwargs)
    leaves, tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
    avals = []
    for x in leaves:
        a = abstract_leaf(x)
        avals.append((a.shape, str(a.dtype), a.weak_type))
    return (tree, tuple(avals), static)
