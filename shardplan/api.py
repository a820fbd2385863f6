"""The user-facing entry points: ``shardplan.plan`` and the ``@shardplan.auto`` decorator."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, overload

import jax

from shardplan.compiler import footprint, targets
from shardplan.compiler.fit import fit_compiled
from shardplan.devices.hardware import runs_on, spec_for_mesh
from shardplan.devices.mesh import MeshSpec, auto_axes, load_mesh, make_jax_mesh
from shardplan.errors import InfeasibleBudgetError, PlanMismatchError, ShardplanError
from shardplan.parallel import defaults, sequence
from shardplan.parallel.pipeline_search import staged_axes
from shardplan.planning.planner import PlannerOptions
from shardplan.planning.search import budget_for, plan_search, plan_traced, remat_setting, traced_as_planned
from shardplan.plans.multihost import bound_everywhere, check_given_plan, share_plan
from shardplan.plans.plan import Plan
from shardplan.plans.plan import signature as plan_signature
from shardplan.sharding.apply import constrained_function
from shardplan.sharding.rules import apply_rule
from shardplan.tracing.trace import CallSpec, TracedStep, abstract_leaf, signature, trace_step
from shardplan.tracing.walk import build_graph
from shardplan.util.progress import Status
from shardplan.util.sizes import format_bytes


def _mesh_spec(mesh, hardware=None) -> MeshSpec:
    """What prices ``mesh``: a ``jax.sharding.Mesh`` on its devices' hardware (or ``hardware``), or
    a preset name, mesh file or ``MeshSpec``."""
    if isinstance(mesh, jax.sharding.Mesh):
        return spec_for_mesh(mesh, hardware)
    if hardware is not None:
        raise TypeError("hardware= prices a jax.sharding.Mesh; with a preset or mesh file as mesh=, the "
                        "preset already is the hardware (pass mesh=jax_mesh, hardware=...)")
    return load_mesh(mesh)


def _bind_in_pipeline(plan: Plan, trace: Callable[[], TracedStep], source: str) -> tuple[Plan, tuple]:
    """``(plan bound to the step, (graph, traced step))``, the step traced as the plan was made."""
    traced = traced_as_planned(trace, plan)
    bound, graph = bind_plan(plan, traced, source)
    return bound, (graph, traced)


def _given_plan(plan) -> tuple[Plan | None, str]:
    if plan is None or isinstance(plan, Plan):
        return plan, "the plan"
    if isinstance(plan, (str, os.PathLike)):
        return Plan.load(os.fspath(plan)), os.fspath(plan)
    raise TypeError(f"plan= takes a shardplan.Plan or the path of a plan file, not {type(plan).__name__}")


def _mesh_for_plan(plan: Plan, mesh, source: str) -> jax.sharding.Mesh:
    """The jax Mesh to run a given plan on: ``mesh`` if its axes are the plan's, else the plan's axes."""
    if mesh is None:
        return plan.jax_mesh()
    if isinstance(mesh, jax.sharding.Mesh):
        axes = dict(mesh.shape)
    else:
        spec = _mesh_spec(mesh)
        axes, mesh = dict(zip(spec.axis_names, spec.axis_sizes)), None
    want = dict(zip(plan.axis_names, plan.axis_sizes))
    if axes != want and _staged(axes, plan) == want:
        # The mesh the plan was made on: its stage axis split off as the planner split it.
        return plan.jax_mesh() if mesh is None else _laid(plan, mesh)
    if axes != want:
        raise PlanMismatchError(f"{source} was made for mesh axes {want}; mesh= has {axes}: pass a mesh with "
                                "those axes, or omit mesh= to lay the plan's axes over jax.devices()")
    return auto_axes(mesh) if mesh is not None else plan.jax_mesh()


def _laid(plan: Plan, mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """``mesh``, or where the plan has other axes (a stage axis split off) the same devices laid
    out as its axes."""
    if dict(mesh.shape) == dict(zip(plan.axis_names, plan.axis_sizes)):
        return mesh
    return make_jax_mesh(plan.axis_names, plan.axis_sizes, list(mesh.devices.flat), name=plan.mesh_name)


def _staged(axes: dict[str, int], plan: Plan) -> dict[str, int] | None:
    """``axes`` with the plan's pipeline stage axis split off as the planner splits it (``None``
    where the plan has no pipeline or the axes cannot take it)."""
    config = plan.pipeline_config()
    try:
        return None if config is None else staged_axes(axes, config.stages, config.axis)
    except ShardplanError:
        return None


def bind_plan(plan: Plan, traced: TracedStep, source: str = "the plan"):
    """A given plan checked against a traced step and bound to its pytree structures; with the
    step's graph (its tensor paths are the plan's)."""
    graph = build_graph(traced.closed, traced.names, apply_rule, ties=traced.state_pairs)
    problem = plan.mismatch(plan_signature(graph), traced.names)
    if problem:
        raise PlanMismatchError(f"{source} does not match this step: {problem}. Plan the step again "
                                "(shardplan.plan / shardplan.auto without plan=)")
    return dataclasses.replace(plan, in_tree=traced.arg_tree, out_tree=traced.out_tree), graph


def _axis_types(sharding) -> tuple:
    """A sharding's mesh axis types (``()`` where it has no mesh): an array on an ``Explicit``
    mesh's axes is moved onto the plan's ``Auto`` view of it (:func:`~shardplan.devices.mesh.auto_axes`),
    else jit refuses the two meshes together."""
    return tuple(getattr(getattr(sharding, "mesh", None), "axis_types", ()))


def _tied_state(traced: TracedStep, platform: str) -> frozenset[int] | None:
    """The step's state outputs, for the emitter to tie the loss and metrics before the loops
    that follow them (:func:`~shardplan.sharding.apply.pinned_before_loops`), where libtpu compiles the
    program (``platform``: its devices'; the same on every process): its scheduler runs them
    after the backward loop otherwise. XLA's GPU scheduler does not, and a barrier there moves
    its head gradient past the loop instead (llama3-8b on h200-8 compiles 3 GiB larger with it;
    RESULTS.md, session 31). ``None``: no ties."""
    if platform != "tpu" or not traced.state_pairs:
        return None
    return frozenset(o for _, o in traced.state_pairs)


class _Compiled:
    """One traced signature: its plan and the jitted planned function."""

    def __init__(self, traced: TracedStep, plan: Plan, graph, mesh: jax.sharding.Mesh, jit_kwargs: dict):
        self.traced, self.plan, self.mesh, self.graph = traced, plan, mesh, graph
        run = constrained_function(traced.closed, graph, plan.specs_by_tensor(), plan.dot_operands, mesh,
                                   plan.operand_pins, plan.result_pins, plan.rewrites,
                                   state=_tied_state(traced, mesh.devices.flat[0].platform))
        self.in_shardings = Plan.flat_shardings(plan.inputs, mesh)
        out_sh = Plan.flat_shardings(plan.outputs, mesh)
        flat_donate = tuple(i for i, d in enumerate(traced.donated) if d)
        self.jitted = jax.jit(run, in_shardings=self.in_shardings, out_shardings=out_sh,
                              donate_argnums=flat_donate, **jit_kwargs)
        self._executable = None
        self.compiled_for: dict[str, tuple] = {}    # deviceless target -> (compiled, jax mesh, compiler)
        self.fit_attempts: list = []                # the compiled-budget loop's, where it ran

    def lower(self, *leaves):
        """``self.jitted.lower`` under the plan's own mesh, whatever mesh the caller has set
        (``jax.set_mesh`` of a mesh with Explicit axes would turn every constraint into an assertion)."""
        with jax.set_mesh(self.mesh):
            return self.jitted.lower(*leaves)

    def trace(self, *leaves):
        """``self.jitted.trace`` under the plan's own mesh (:meth:`lower`)."""
        with jax.set_mesh(self.mesh):
            return self.jitted.trace(*leaves)

    def placed(self, leaves: list) -> list:
        """The leaves on their planned shardings: arrays made elsewhere (on one device, or by
        another jit) are moved once; the step's own outputs already sit there. Python scalars and
        numpy arrays become arrays as jit would make them (a ``TrainState``'s ``step=0`` then has
        the same signature as the step's own output, so the second call does not recompile)."""
        out = []
        many = jax.process_count() > 1
        for k, (x, sh) in enumerate(zip(leaves, self.in_shardings)):
            if not isinstance(x, jax.Array) or not x.sharding.is_equivalent_to(sh, x.ndim) \
                    or _axis_types(x.sharding) not in ((), _axis_types(sh)):
                if many and not sh.is_fully_replicated and not (isinstance(x, jax.Array)
                                                               and not x.is_fully_addressable):
                    # Each process would pass its own data as the whole array: a wrong result, no error.
                    raise ShardplanError(
                        f"argument leaf {self.traced.names[k]} is a process-local value, but the plan shards it "
                        f"({sh.spec}) across processes: build the global array from each process's share "
                        "with shardplan.global_batch(f.plan, local_batch, arg=...) (or "
                        "jax.make_array_from_process_local_data), or jit the initialisation with "
                        "out_shardings=f.plan.in_shardings()[...]")
                x = jax.device_put(x, sh)
            out.append(x)
        return out

    def executable(self, leaves: list):
        """The compiled step, compiled on the first call with a status line (XLA's compile of a
        large step takes a while: it is the last stage a user waits for). ``leaves`` may be
        arrays or ``jax.ShapeDtypeStruct``. On a TPU its heap is read as it compiles
        (:func:`shardplan.compiler.footprint.compile`): the compiled-budget loop and an audit hold it."""
        if self._executable is None:
            with Status() as line:
                line.say("compiling the planned step")
                start = time.perf_counter()
                self._executable = footprint.compile(self.lower(*leaves),
                                                     platform=self.mesh.devices.flat[0].platform)
                line.done(f"compiled in {time.perf_counter() - start:.1f} s")
        return self._executable

    def __call__(self, call: CallSpec, args, kwargs):
        leaves = self.placed(self.traced.flat_args(call, args, kwargs))
        return jax.tree_util.tree_unflatten(self.traced.out_tree, self.executable(leaves)(*leaves))


class AutoFunction:
    """A train step planned by shardplan; called, traced and lowered like the result of ``jax.jit``.

    Each new signature (pytree structure, shapes, dtypes, static values) is traced, planned
    and compiled once; later calls reuse it.
    """

    def __init__(self, fn: Callable, *, mesh=None, hardware=None, memory_budget=None, static_argnums=(),
                 static_argnames=(), donate_argnums=(), donate_argnames=(), time_limit: float = 30.0,
                 cache=True, plan: Plan | str | os.PathLike | None = None, fit_compiled: bool | str | None = None,
                 pipeline=None, remat=None, context=None, **jit_kwargs):
        functools.update_wrapper(self, fn)
        self.pipeline = pipeline
        self.context = sequence.check_setting(context)
        self.remat = remat_setting(remat)
        self.cache = cache
        self.fn = fn
        self.given, self._source = _given_plan(plan)
        if self.given is not None:
            self.mesh_spec = None
            self._jax_mesh = _mesh_for_plan(self.given, mesh, self._source)
            self.budget = None
        else:
            if mesh is None:
                raise TypeError("shardplan.auto needs mesh= (a jax.sharding.Mesh, a preset name or a mesh "
                                "file), or plan= (a Plan or a plan file)")
            self.mesh_spec = _mesh_spec(mesh, hardware)
            self._jax_mesh = auto_axes(mesh) if isinstance(mesh, jax.sharding.Mesh) else None
            self.budget = budget_for(memory_budget, self.mesh_spec)
        self.call = CallSpec.make(fn, static_argnums, static_argnames, donate_argnums, donate_argnames)
        self.options = PlannerOptions(time_limit=time_limit)
        self.fit_compiled = fit_compiled
        self.jit_kwargs = jit_kwargs
        self._cache: dict[Any, _Compiled] = {}
        self._last: _Compiled | None = None

    def _compiled(self, args, kwargs) -> _Compiled:
        key = signature(self.call, args, kwargs)
        if key not in self._cache:
            trace = functools.partial(trace_step, self.fn, args, kwargs, self.call)
            mesh = self._jax_mesh if self._jax_mesh is not None else self.mesh_spec.to_jax_mesh()
            if self.given is not None:
                check_given_plan(self.given)
                traced = traced_as_planned(trace, self.given)
                plan, graph = bound_everywhere(lambda: bind_plan(self.given, traced, self._source))
                self._cache[key] = _Compiled(traced, plan, graph, mesh, self.jit_kwargs)
            else:
                self._cache[key] = self._planned(trace, mesh, args, kwargs)
        self._last = self._cache[key]
        return self._last

    def _plan_for(self, trace: Callable[[], TracedStep]):
        """``plan_for(budget) -> (plan, graph, traced step)``: the step planned under ``budget``
        (inside each candidate pipeline and recomputation where asked, or where the defaults
        search them: :mod:`shardplan.parallel.defaults`), the same plan on every process."""
        plain = (defaults.pipeline_default(self.mesh_spec, self.pipeline, self.context) is None
                 and self.remat in (None, "off") and self.context in (None, "off"))
        traced = trace() if plain else None      # the step as written, traced once for every budget

        def make(budget: int):
            written = None
            if plain:
                try:
                    plan, graph = plan_traced(traced, self.mesh_spec, budget, self.options, self.cache)
                    return plan, (graph, traced)
                except InfeasibleBudgetError as e:      # the defaults may search the families (or re-raise)
                    written = e
            return plan_search(trace, self.mesh_spec, budget, self.options, self.cache, self.pipeline, self.remat,
                               self.context, written=written)

        def bind(q: Plan):
            source = "the plan from process 0"
            if plain and q.pipeline is None and q.remat is None and q.context is None:
                bound, graph = bind_plan(q, traced, source)       # the step as written: traced already
                return bound, (graph, traced)
            return _bind_in_pipeline(q, trace, source)

        def plan_for(budget: int):
            plan, (graph, traced_step) = share_plan(lambda: make(budget), bind)
            return plan, graph, traced_step
        return plan_for

    def _fit_target(self, mesh: jax.sharding.Mesh) -> str | None:
        """Where the compiled-budget loop compiles: ``"here"`` (this mesh's devices), a deviceless
        target (``"gpu"``, ``"tpu"``), or ``None`` (no loop)."""
        fit = self.fit_compiled
        if isinstance(fit, str):
            target = targets.resolve(fit, self.mesh_spec)
            if not targets.available(target):
                raise ShardplanError(f"fit_compiled={fit!r}: the {target.upper()} compiler is not installed; "
                                     "pip install 'shardplan[aot]', or fit_compiled=True to compile on this mesh")
            return "here" if target == "cpu" else target
        if fit is None:
            # By default on accelerators: fake CPU devices share the host's memory (nothing runs
            # out there), and the CPU compiler's bytes for a small or bf16 step are not a GPU's.
            fit = mesh.devices.flat[0].platform != "cpu"
        # Planned for other hardware than it is lowered on (an H100 plan on fake CPU devices):
        # this compiler's bytes are not the target's.
        return "here" if fit and runs_on(self.mesh_spec, mesh) else None

    def _planned(self, trace: Callable[[], TracedStep], mesh: jax.sharding.Mesh, args, kwargs) -> _Compiled:
        """Plan and, where :meth:`_fit_target` says, compile at once and hold the budget on the
        compiled program (:func:`shardplan.compiler.fit.fit_compiled`)."""
        plan_for = self._plan_for(trace)

        def made_compiled(made) -> _Compiled:
            plan, graph, traced = made
            return _Compiled(traced, plan, graph, _laid(plan, mesh), self.jit_kwargs)

        target = self._fit_target(mesh)
        if target is None:
            return made_compiled(plan_for(self.budget))

        def compile_plan(made):
            c = made_compiled(made)
            abstract = [abstract_leaf(x) for x in c.traced.flat_args(self.call, args, kwargs)]
            if target == "here":
                return c, c.executable(abstract)
            c.compiled_for[target] = _compile_for_target(c, c.plan.mesh_spec or self.mesh_spec, target, abstract,
                                                         self.jit_kwargs)
            return c, c.compiled_for[target][0]

        def say(text):
            with Status() as line:
                line.done(text)

        (plan, _, _), c, attempts = fit_compiled(plan_for, compile_plan, self.budget,
                                                 lambda made: made[0].cost.memory_bytes, say=say,
                                                 identity=lambda made: made[0].digest())
        c.fit_attempts = attempts
        if len(attempts) > 1:
            first = attempts[0]
            c.plan = dataclasses.replace(plan, warnings=plan.warnings + (
                f"planned again under {format_bytes(attempts[-1].budget_bytes)}: the plan for the budget "
                f"{format_bytes(first.budget_bytes)} compiled to {format_bytes(first.compiled_bytes)} per device "
                f"(predicted {format_bytes(first.predicted_bytes)})",))
        return c

    @property
    def plan(self) -> Plan:
        """The :class:`Plan` of the last traced signature."""
        if self._last is None:
            raise RuntimeError("no plan yet: call the function, or .make_plan()/.lower() it, first")
        return self._last.plan

    def make_plan(self, *args, **kwargs) -> Plan:
        """Plan the step for these arguments (concrete or ``jax.ShapeDtypeStruct``) without running
        it; a later call with arguments of the same signature reuses this plan."""
        return self._compiled(args, kwargs).plan

    def __call__(self, *args, **kwargs):
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs))):
            raise ShardplanError(
                "a shardplan.auto step was called on traced values (inside jax.grad, jax.jit, jax.vmap ... of "
                "a function that calls it): the step is its own jit and runs on arrays; transform inside the "
                "step (as a train step calls jax.grad on its loss), or plan the outer function instead")
        return self._compiled(args, kwargs)(self.call, args, kwargs)

    def _abstract(self, c: _Compiled, args, kwargs):
        return [abstract_leaf(x) for x in c.traced.flat_args(self.call, args, kwargs)]

    def trace(self, *args, **kwargs):
        c = self._compiled(args, kwargs)
        return c.trace(*self._abstract(c, args, kwargs))

    def lower(self, *args, **kwargs):
        c = self._compiled(args, kwargs)
        return c.lower(*self._abstract(c, args, kwargs))

    def compile_for(self, target: str, *args, **kwargs):
        """The planned step compiled for ``target`` (:mod:`shardplan.compiler.targets`): ``"cpu"``, these
        devices; ``"gpu"`` / ``"tpu"``, the real compiler of the hardware the plan is priced for,
        with no such device present (never run); ``"auto"``, that where installed. Returns
        ``(compiled, jax_mesh, compiler)``."""
        c = self._compiled(args, kwargs)
        abstract = self._abstract(c, args, kwargs)
        spec = c.plan.mesh_spec or self.mesh_spec       # the mesh it was priced on (a stage axis included)
        target = targets.resolve(target, spec) if spec is not None else "cpu"
        if target == "cpu":
            platform = c.mesh.devices.flat[0].platform
            return c.executable(abstract), c.mesh, f"XLA {platform.upper()} ({platform} devices)"
        if target not in c.compiled_for:
            c.compiled_for[target] = _compile_for_target(c, spec, target, abstract, self.jit_kwargs)
        return c.compiled_for[target]

    def audit_for(self, target: str, *args, **kwargs):
        """The plan for these arguments held against its program compiled for ``target`` (as
        :meth:`compile_for`): an :class:`shardplan.compiler.audit.Audit`. On a TPU target the memory is
        read from a second compile that counts HBM alone (:data:`shardplan.compiler.targets.HBM_ONLY_OPTIONS`).

        >>> print(step.audit_for("auto", state, batch).table())         # doctest: +SKIP
        """
        from shardplan.compiler.audit import audit
        compiled, jax_mesh, compiler = self.compile_for(target, *args, **kwargs)
        c = self._compiled(args, kwargs)
        spec = c.plan.mesh_spec or self.mesh_spec
        resolved = targets.resolve(target, spec) if spec is not None else "cpu"
        memory = None
        if resolved in targets.HBM_ONLY_OPTIONS:
            memory, _, _ = _compile_for_target(c, spec, resolved, self._abstract(c, args, kwargs), self.jit_kwargs,
                                               targets.HBM_ONLY_OPTIONS[resolved])
            compiler += "; memory with VMEM placement off (HBM alone)"
        # "cpu" is these devices (a GPU's own compiler where they are GPUs): audit reads their platform.
        return audit(c.plan, compiled, spec, jax_mesh, platform=None if resolved == "cpu" else resolved,
                     compiler=compiler, memory_compiled=memory)

    @property
    def fit_attempts(self) -> list:
        """The compiled-budget loop's attempts for the last traced signature
        (:class:`shardplan.compiler.fit.Attempt`: budget planned under, predicted and compiled bytes per
        device); empty where the step was not compiled while planned. On a TPU the compiled bytes
        are the HBM of the program as it runs (libtpu's VMEM placement on), which on small programs
        is well under what :meth:`audit_for` reads (VMEM placement off: HBM alone)."""
        if self._last is None:
            raise RuntimeError("no plan yet: call the function, or .make_plan()/.lower() it, first")
        return list(self._last.fit_attempts)


def _compile_for_target(c: _Compiled, spec: MeshSpec, target: str, abstract: list, jit_kwargs: dict,
                        options: dict | None = None):
    """``(compiled, jax_mesh, compiler)``: ``c``'s plan compiled by ``target``'s compiler over
    compile-only devices of the hardware ``spec`` prices (:mod:`shardplan.compiler.targets`); never run.
    ``options``: XLA compile options (:data:`shardplan.compiler.targets.HBM_ONLY_OPTIONS`)."""
    mesh, compiler = targets.target_mesh(spec, target)
    other = _Compiled(c.traced, c.plan, c.graph, mesh, jit_kwargs)
    with Status() as line:
        line.say(f"compiling the planned step for {compiler}")
        compiled = footprint.compile(other.lower(*abstract), options, platform=target)
        line.done(f"compiled for {compiler}")
    return compiled, mesh, compiler


@overload
def auto(fn: Callable, **kwargs) -> AutoFunction: ...
@overload
def auto(fn: None = None, **kwargs) -> Callable[[Callable], AutoFunction]: ...


def auto(fn=None, *, mesh=None, hardware=None, memory_budget=None, time_limit: float = 30.0, cache=True, plan=None,
         fit_compiled: bool | str | None = None, pipeline=None, remat=None, context=None, **jit_kwargs):
    """Plan and compile a train step; works bare (``auto(fn, mesh=...)``) and as ``@auto(mesh=...)``.

    ``mesh``: a ``jax.sharding.Mesh`` (priced on its devices' hardware, or on ``hardware``), a
    preset name or a mesh file. ``cache``: plans are kept on disk (:mod:`shardplan.plans.cache`; ``True``:
    the default directory, a path: that one, ``False``: off). ``jit_kwargs`` are ``jax.jit``'s:
    ``static_argnums``, ``static_argnames``, ``donate_argnums``, ``donate_argnames``, ...
    ``fit_compiled``: compile while planning and hold the budget on the compiled program,
    planning again under a tighter budget while it overshoots (:mod:`shardplan.compiler.fit`); ``True``:
    on this mesh's compiler, only where the mesh's devices are the priced hardware (default: on
    accelerators, off on CPU devices); ``"gpu"``, ``"tpu"`` or ``"auto"``: on the priced
    hardware's real compiler with no such device present (:mod:`shardplan.compiler.targets`, ``[aot]``
    extra); ``step.fit_attempts`` lists the compiles.
    ``pipeline``: as :func:`plan`'s (a stage axis split off the mesh's first axis runs on the
    same devices). ``remat``, ``context``: as :func:`plan`'s; each family left at ``None`` is
    searched where it can help (:mod:`shardplan.parallel.defaults`), ``"off"`` keeps the step as written.
    ``plan``: a :class:`Plan` or a plan file (:meth:`Plan.save`) to compile instead of solving;
    the traced step must be the one it was made for (:class:`PlanMismatchError` says what
    differs). ``mesh`` is then optional (default: the plan's axes over ``jax.devices()``).

    Under ``jax.distributed`` every process calls the step; process 0 plans and the plan reaches
    the others (:mod:`shardplan.plans.multihost`), and every process checks it holds the same plan
    before the first step runs.

    >>> @shardplan.auto(mesh="h100-8", memory_budget="60GiB", donate_argnums=(0,))   # doctest: +SKIP
    ... def train_step(state, batch): ...
    """
    if fn is None:
        return functools.partial(auto, mesh=mesh, hardware=hardware, memory_budget=memory_budget,
                                 time_limit=time_limit, cache=cache, plan=plan, fit_compiled=fit_compiled,
                                 pipeline=pipeline, remat=remat, context=context, **jit_kwargs)
    return AutoFunction(fn, mesh=mesh, hardware=hardware, memory_budget=memory_budget, time_limit=time_limit,
                        cache=cache, plan=plan, fit_compiled=fit_compiled, pipeline=pipeline, remat=remat,
                        context=context, **jit_kwargs)


def plan(fn: Callable, *args, mesh, hardware=None, memory_budget=None, static_argnums: Sequence[int] = (),
         static_argnames: Sequence[str] = (), donate_argnums: Sequence[int] = (),
         donate_argnames: Sequence[str] = (), time_limit: float = 30.0, cache=True, pipeline=None,
         remat=None, context=None, **kwargs) -> Plan:
    """Plan ``fn(*args, **kwargs)`` without compiling or allocating; arguments may be ``jax.ShapeDtypeStruct``.

    Each family left at ``None`` (the default) is searched where it can help
    (:mod:`shardplan.parallel.defaults`): a pipeline on a mesh of several nodes; recomputation, a
    sequence split and (on one node) a pipeline where the step as written does not fit the
    budget. ``"off"`` keeps the step exactly as written; ``plan.warnings`` says which family a
    default chose, and ``plan.explain()`` the best candidate each search's choice beat.

    ``pipeline``: ``"off"`` (no pipeline), a :class:`~shardplan.parallel.pipeline.PipelineConfig`, a
    number of stages, or ``"auto"``: the step is planned inside each candidate pipeline of its
    layer stack (a plain ``jax.lax.scan`` over stacked layer weights, :mod:`shardplan.tracing.stacks`, or
    a :func:`~shardplan.parallel.pipeline.layer_scan`; :mod:`shardplan.parallel.pipeline_search`) and the plan with
    the lowest predicted step that fits is kept; ``plan.pipeline`` says which.

    ``remat``: ``"off"`` (the step's recomputation as written), a policy name of
    :data:`shardplan.parallel.recompute.POLICIES` for every layer class, or ``"auto"``: each layer class
    (a layer stack, or a :func:`~shardplan.parallel.recompute.layer_remat` layer) gets the policy that,
    planned jointly with the sharding, gives the lowest predicted step within the budget
    (:func:`shardplan.parallel.recompute.search`); ``plan.remat`` says which.

    ``context``: ``"off"`` (each attention runs as written), a
    :class:`~shardplan.parallel.sequence.ContextConfig`, or ``"auto"``: the step is planned with its
    attention unsplit and split over the sequence each way :func:`shardplan.parallel.sequence.candidates`
    lists (all-gather, Ulysses, ring), the fastest that fits kept; ``plan.context`` says which.

    >>> p = shardplan.plan(train_step, abstract_state, abstract_batch, mesh="h100-8")   # doctest: +SKIP
    """
    mesh_spec = _mesh_spec(mesh, hardware)
    call = CallSpec.make(fn, static_argnums, static_argnames, donate_argnums, donate_argnames)
    options = PlannerOptions(time_limit=time_limit)
    trace = functools.partial(trace_step, fn, args, kwargs, call)
    remat = remat_setting(remat)
    context = sequence.check_setting(context)
    p, _ = share_plan(lambda: plan_search(trace, mesh_spec, memory_budget, options, cache, pipeline, remat, context),
                      lambda q: _bind_in_pipeline(q, trace, "the plan from process 0"))
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
    traced = trace_step(fn, args, {}, CallSpec.make(fn, static_argnums, (), donate_argnums, ()))
    best, tried = None, []
    for shape in shapes:
        spec = base.with_axes(dict(zip(axis_names, shape)))
        start = time.perf_counter()
        try:
            p, _ = plan_traced(traced, spec, budget_for(memory_budget, spec), PlannerOptions(time_limit=time_limit))
        except InfeasibleBudgetError:
            tried.append((dict(zip(axis_names, shape)), None, time.perf_counter() - start))
            continue
        tried.append((dict(zip(axis_names, shape)), p.cost.step_s, time.perf_counter() - start))
        if best is None or p.cost.step_s < best.cost.step_s:
            best = p
    if best is None:
        raise InfeasibleBudgetError(
            f"no mesh shape over {tuple(axis_names)} of {base.name}'s {n} devices fits the budget; "
            f"tried {[t[0] for t in tried]}", budget_bytes=budget_for(memory_budget, base), min_feasible_bytes=None,
            largest_tensors=[])
    return best, tried


def _apply(self: Plan, fn, **kwargs) -> AutoFunction:
    """``fn`` compiled under this plan, without solving: ``shardplan.auto(fn, plan=self, **kwargs)``.
    The first call (or ``make_plan``) traces ``fn`` and checks that it is the step this plan
    was made for (:class:`PlanMismatchError` names the first difference)."""
    return auto(fn, plan=self, **kwargs)


# A plan is a record below the decorator that compiles it: its ``apply`` is the decorator's,
# set here so that shardplan.plans.plan imports nothing above it.
Plan.apply = _apply
