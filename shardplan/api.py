"""The user-facing entry points: ``shardplan.plan`` and the ``@shardplan.auto`` decorator."""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, overload

import jax

from shardplan.errors import InfeasibleBudgetError, PlanMismatchError
from shardplan.mesh import MeshSpec, load_mesh, mesh_from_jax
from shardplan.plan import Plan
from shardplan.planner import PlannerOptions, plan_jaxpr
from shardplan.apply import constrained_function
from shardplan.sizes import parse_bytes


def _mesh_spec(mesh) -> MeshSpec:
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh_from_jax(mesh)
    return load_mesh(mesh)


def _budget(memory_budget, mesh_spec: MeshSpec) -> int:
    """Bytes per device: the given budget, or the device's HBM."""
    return parse_bytes(memory_budget) if memory_budget is not None else mesh_spec.device.hbm_bytes


def _normalize(argnums, n) -> tuple[int, ...]:
    argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums or ())
    for a in argnums:
        if not -n <= a < n:
            raise ValueError(f"argnum {a} is out of range for a call with {n} positional arguments")
    return tuple(sorted(a % n for a in argnums))


def trace_step(fn, args, static, donate):
    """Trace ``fn(*args)`` with the non-static args abstract; name every flat input by its pytree path."""
    dynamic = [i for i in range(len(args)) if i not in static]

    def flat_fn(*dyn):
        full = list(args)
        for i, a in zip(dynamic, dyn):
            full[i] = a
        return fn(*full)

    dyn_args = tuple(args[i] for i in dynamic)
    leaves_with_path, in_tree = jax.tree_util.tree_flatten_with_path(dyn_args)
    names = [jax.tree_util.keystr(p).replace(".value", "") for p, _ in leaves_with_path]
    arg_of = [dynamic[p[0].idx] if p and hasattr(p[0], "idx") else 0 for p, _ in leaves_with_path]
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=getattr(x, "weak_type", False)), dyn_args)
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*abstract)
    donated = [a in donate for a in arg_of]
    return closed, names, arg_of, donated, dynamic, in_tree, jax.tree_util.tree_structure(out_shape)


class _Traced:
    """One traced signature: the jaxpr, its plan, and the jitted planned function."""

    def __init__(self, fn, args, mesh_spec: MeshSpec, budget: int, static: tuple[int, ...],
                 donate: tuple[int, ...], options: PlannerOptions, jit_kwargs: dict, jax_mesh=None):
        closed, names, arg_of, donated, self.dynamic, in_tree, out_tree = trace_step(fn, args, static, donate)
        self.plan, self.graph = plan_jaxpr(closed, names, arg_of, mesh_spec, budget, donated=donated,
                                           options=options, in_tree=in_tree, out_tree=out_tree)
        self.mesh = jax_mesh if jax_mesh is not None else mesh_spec.to_jax_mesh()
        run = constrained_function(closed, self.graph, self.plan.specs_by_tensor(), self.plan.dot_operands, self.mesh,
                                   self.plan.operand_pins, self.plan.result_pins)
        in_sh = Plan.flat_shardings(self.plan.inputs, self.mesh)
        out_sh = Plan.flat_shardings(self.plan.outputs, self.mesh)
        flat_donate = tuple(i for i, d in enumerate(donated) if d)
        self.jitted = jax.jit(run, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=flat_donate,
                              **jit_kwargs)
        self.in_tree, self.out_tree = in_tree, out_tree

    def flat_args(self, args):
        dyn = tuple(args[i] for i in self.dynamic)
        leaves, tree = jax.tree_util.tree_flatten(dyn)
        if tree != self.in_tree:
            raise PlanMismatchError(f"arguments have structure {tree}, the plan was made for {self.in_tree}")
        return leaves

    def __call__(self, args):
        return jax.tree_util.tree_unflatten(self.out_tree, self.jitted(*self.flat_args(args)))


def _signature(args, static):
    def leaf(x):
        return (tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__)))
    dyn = [jax.tree.map(leaf, a) if i not in static else ("static", a) for i, a in enumerate(args)]
    leaves, tree = jax.tree_util.tree_flatten(dyn, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2)
    return (str(tree), tuple(map(str, leaves)))


class AutoFunction:
    """A train step planned by shardplan; behaves like the result of ``jax.jit``."""

    def __init__(self, fn: Callable, *, mesh, memory_budget=None, static_argnums=(), donate_argnums=(),
                 time_limit: float = 30.0, **jit_kwargs):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.mesh_spec = _mesh_spec(mesh)
        self._jax_mesh = mesh if isinstance(mesh, jax.sharding.Mesh) else None
        self.budget = _budget(memory_budget, self.mesh_spec)
        self.static_argnums = static_argnums
        self.donate_argnums = donate_argnums
        self.options = PlannerOptions(time_limit=time_limit)
        self.jit_kwargs = jit_kwargs
        self._cache: dict[Any, _Traced] = {}
        self._last: _Traced | None = None

    def _traced(self, args) -> _Traced:
        static = _normalize(self.static_argnums, len(args))
        donate = _normalize(self.donate_argnums, len(args))
        key = _signature(args, static)
        if key not in self._cache:
            self._cache[key] = _Traced(self.fn, args, self.mesh_spec, self.budget, static, donate, self.options,
                                       self.jit_kwargs, self._jax_mesh)
        self._last = self._cache[key]
        return self._last

    @property
    def plan(self) -> Plan:
        """The :class:`Plan` of the last traced signature."""
        if self._last is None:
            raise RuntimeError("no plan yet: call the function, or .trace()/.lower() it, first")
        return self._last.plan

    def __call__(self, *args):
        return self._traced(args)(args)

    def trace(self, *args):
        t = self._traced(args)
        return t.jitted.trace(*self.flat_abstract(t, args))

    def lower(self, *args):
        t = self._traced(args)
        return t.jitted.lower(*self.flat_abstract(t, args))

    @staticmethod
    def flat_abstract(t: _Traced, args):
        return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in t.flat_args(args)]


@overload
def auto(fn: Callable, **kwargs) -> AutoFunction: ...
@overload
def auto(fn: None = None, **kwargs) -> Callable[[Callable], AutoFunction]: ...


def auto(fn=None, *, mesh, memory_budget=None, time_limit: float = 30.0, **jit_kwargs):
    """Plan and compile a train step; works bare (``auto(fn, mesh=...)``) and as ``@auto(mesh=...)``.

    >>> @shardplan.auto(mesh="h100-8", memory_budget="60GiB", donate_argnums=(0,))   # doctest: +SKIP
    ... def train_step(state, batch): ...
    """
    if fn is None:
        return functools.partial(auto, mesh=mesh, memory_budget=memory_budget, time_limit=time_limit, **jit_kwargs)
    return AutoFunction(fn, mesh=mesh, memory_budget=memory_budget, time_limit=time_limit, **jit_kwargs)


def plan(fn: Callable, *args, mesh, memory_budget=None, static_argnums: Sequence[int] = (),
         donate_argnums: Sequence[int] = (), time_limit: float = 30.0) -> Plan:
    """Plan ``fn(*args)`` without compiling or allocating; ``args`` may be ``jax.ShapeDtypeStruct``.

    >>> p = shardplan.plan(train_step, abstract_state, abstract_batch, mesh="h100-8")   # doctest: +SKIP
    """
    mesh_spec = _mesh_spec(mesh)
    budget = _budget(memory_budget, mesh_spec)
    static = _normalize(static_argnums, len(args))
    donate = _normalize(donate_argnums, len(args))
    closed, names, arg_of, donated, _, in_tree, out_tree = trace_step(fn, args, static, donate)
    p, _ = plan_jaxpr(closed, names, arg_of, mesh_spec, budget, donated=donated,
                      options=PlannerOptions(time_limit=time_limit), in_tree=in_tree, out_tree=out_tree)
    return p


def search_mesh(fn: Callable, *args, hardware, axis_names: Sequence[str] = ("data", "model"), memory_budget=None,
                static_argnums: Sequence[int] = (), donate_argnums: Sequence[int] = (), time_limit: float = 30.0):
    """Let the planner choose the logical mesh shape too.

    ``hardware`` is a preset name, mesh file or :class:`MeshSpec` (its axes are ignored). Every
    way to factor its device count over ``axis_names`` (major to minor, laid over nodes as
    :meth:`MeshSpec.with_axes` does) is planned from one trace; the plan with the lowest
    predicted step time that fits the budget wins. Returns ``(best plan, tried)`` where
    ``tried`` lists ``(axes, predicted step seconds or None if infeasible, planner seconds)``.
    """
    base = _mesh_spec(hardware)
    n = base.num_devices
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    shapes = [s for s in itertools.product(divisors, repeat=len(axis_names)) if math.prod(s) == n]
    static = _normalize(static_argnums, len(args))
    donate = _normalize(donate_argnums, len(args))
    closed, names, arg_of, donated, _, in_tree, out_tree = trace_step(fn, args, static, donate)
    best, tried = None, []
    for shape in shapes:
        spec = base.with_axes(dict(zip(axis_names, shape)))
        start = time.perf_counter()
        try:
            p, _ = plan_jaxpr(closed, names, arg_of, spec, _budget(memory_budget, spec), donated=donated,
                              options=PlannerOptions(time_limit=time_limit), in_tree=in_tree, out_tree=out_tree)
        except InfeasibleBudgetError:
            tried.append((dict(zip(axis_names, shape)), None, time.perf_counter() - start))
            continue
        tried.append((dict(zip(axis_names, shape)), p.cost.step_s, time.perf_counter() - start))
        if best is None or p.cost.step_s < best.cost.step_s:
            best = p
    if best is None:
        raise InfeasibleBudgetError(
            f"no mesh shape over {tuple(axis_names)} of {base.name}'s {n} devices fits the budget; "
            f"tried {[t[0] for t in tried]}", budget_bytes=_budget(memory_budget, base), min_feasible_bytes=None,
            largest_tensors=[])
    return best, tried
