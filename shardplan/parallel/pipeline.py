"""Pipeline parallelism over a stack of layers: an SPMD pipeline in ``jax.lax.scan``.

A model marks its layer stack with :func:`layer_scan` in place of ``jax.lax.scan`` (the one line
a user writes). Outside :func:`pipelined` it *is* ``jax.lax.scan``. Inside, the stack runs as a
pipeline over one mesh axis, the stage axis:

* the stacked layer parameters ``[layers, ...]`` are viewed as ``[repeats, stages, layers per
  stage, ...]`` and stage ``s`` holds chunk ``r * stages + s`` of every repeat ``r`` (for GPipe,
  ``repeats == 1``, that is the contiguous block of layers a ``PartitionSpec("stage")`` on the
  layer dimension gives it: no data moves; the circular schedule interleaves the chunks, which
  XLA does with an all-to-all of the parameters over the stage axis);
* the batch (the leading dimension of every carry leaf) is split into ``microbatches``, each
  spread over the batch's own sharding (rows ``m, m + M, m + 2M, ...``);
* one loop of ``microbatches * repeats + stages - 1`` iterations: every stage runs its chunk of
  layers on the microbatch it holds (a ``vmap`` over the stage dimension, sharded over the stage
  axis), then the results move one stage on (a roll of the stage dimension, which XLA's
  partitioner emits as a collective-permute of one stage's state; its gradient is the roll back,
  another, where JAX's own transpose of a roll would move two); stage 0 takes the next microbatch, or under the
  circular schedule the one coming back from the last stage for its next repeat. GPipe's loop
  is one ``jax.lax.scan``; the circular schedule's runs as ``2 * repeats - 1`` of them, so that
  each stage's chunk of weights is a static slice of the parameters wherever all stages are in
  one round (the backward loop would otherwise keep each trip's chunk).

The backward pass is the transpose of that loop, which JAX derives: the microbatches flow back
through the stages in reverse. GPipe keeps every microbatch's activations until the backward
pass; the bubble is ``(stages - 1) / (microbatches * repeats + stages - 1)`` of the loop.

>>> cfg = PipelineConfig(stages=4, microbatches=8)                       # doctest: +SKIP
>>> with pipelined(cfg, mesh):                                           # doctest: +SKIP
...     state, metrics = jax.jit(train_step)(state, batch)   # traced here: its layer_scan pipelines
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from shardplan.errors import ShardplanError
from shardplan.parallel import recompute, unrolled
from shardplan.tracing import stacks
from shardplan.tracing.walk import SHIFT_CALL


class Schedule(enum.Enum):
    """How microbatches go round the stages. ``GPIPE``: once through, all forward then all
    backward. ``CIRCULAR``: ``repeats`` times round (each stage holds ``repeats`` interleaved
    chunks of layers), which shrinks the bubble by ``repeats`` for the same microbatches."""

    GPIPE = "gpipe"
    CIRCULAR = "circular"


class PipelineError(ShardplanError, ValueError):
    """A pipeline that cannot run as asked: the message names the setting and what works."""


class NoLayerStackError(PipelineError):
    """The step has no layer stack a pipeline can split; the message says why each one met cannot be."""


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """One pipeline: ``stages`` over mesh axis ``axis``, the batch in ``microbatches``.

    ``repeats`` is the circular schedule's number of rounds (1 for GPipe). ``batch_axes``: the
    mesh axes the batch is split over, which each microbatch's rows keep where the last stage's
    output is stored. The planner constrains every tensor itself and leaves it empty; a step
    sharded by hand (``jax.jit`` with ``in_shardings`` only) names its data axes, or XLA may
    all-gather the whole output buffer over them on every trip of the loop.

    ``replicas``: where above 1, each microbatch is held as ``replicas`` groups of rows (the
    batch's data-parallel ranks: split the new dimension over the data axes) and every stage's
    weights are broadcast to one copy per group before the loop. Each group then accumulates its
    own weight gradients through the loop, and they are summed once, after it, as Megatron-LM's
    data parallelism does: without it a partitioner must reduce every microbatch's weight
    gradient over the data axes on every trip (GPT-3 175B on 1024 A100s, 8 stages x 48
    microbatches: 11.3 s of the step's 33.3 s). It costs one copy of a stage's weights and of
    their gradients per device (they are not split over the data axes inside the loop).
    """

    stages: int
    microbatches: int
    schedule: Schedule = Schedule.GPIPE
    repeats: int = 1
    axis: str = "stage"
    batch_axes: tuple[str, ...] = ()
    replicas: int = 1

    def __post_init__(self):
        if isinstance(self.schedule, str):
            try:
                object.__setattr__(self, "schedule", Schedule(self.schedule))
            except ValueError:
                raise PipelineError(f"schedule={self.schedule!r} is not a pipeline schedule; choose one of "
                                    f"{', '.join(s.value for s in Schedule)}") from None
        for name in ("stages", "microbatches", "repeats", "replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PipelineError(f"{name}={value!r} is not a positive whole number")
        axes = self.batch_axes
        object.__setattr__(self, "batch_axes", (axes,) if isinstance(axes, str) else tuple(axes))
        if self.axis in self.batch_axes:
            raise PipelineError(f"batch_axes={self.batch_axes} holds the stage axis {self.axis!r}: the batch is split "
                                "over the other mesh axes")
        if self.schedule is Schedule.GPIPE and self.repeats != 1:
            raise PipelineError(f"repeats={self.repeats} needs schedule='circular' (GPipe goes round once)")
        if self.schedule is Schedule.CIRCULAR and self.microbatches < self.stages:
            raise PipelineError(f"the circular schedule needs at least as many microbatches as stages: "
                                f"microbatches={self.microbatches} < stages={self.stages}; use "
                                f"microbatches>={self.stages} or schedule='gpipe'")

    @property
    def iterations(self) -> int:
        """Trips of the pipeline loop: every microbatch's every repeat, plus the fill."""
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble(self) -> float:
        """The fraction of the loop a stage spends idle (filling and draining the pipeline)."""
        return (self.stages - 1) / self.iterations

    def to_json(self) -> dict:
        out = {"stages": self.stages, "microbatches": self.microbatches, "schedule": self.schedule.value,
               "repeats": self.repeats, "axis": self.axis}
        if self.batch_axes:
            out["batch_axes"] = list(self.batch_axes)
        if self.replicas > 1:
            out["replicas"] = self.replicas
        return out

    @classmethod
    def from_json(cls, data: dict) -> PipelineConfig:
        return cls(int(data["stages"]), int(data["microbatches"]), Schedule(data["schedule"]), int(data["repeats"]),
                   str(data["axis"]), tuple(map(str, data.get("batch_axes", ()))), int(data.get("replicas", 1)))

    def describe(self) -> str:
        rounds = f", {self.repeats} rounds" if self.schedule is Schedule.CIRCULAR else ""
        replicas = f", weight gradients summed over {self.replicas} row groups" if self.replicas > 1 else ""
        return (f"{self.stages} stages over mesh axis {self.axis!r}, {self.microbatches} microbatches, "
                f"{self.schedule.value}{rounds}{replicas} (bubble {self.bubble:.0%})")


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("shardplan_pipeline", default=None)
_SEEN: contextvars.ContextVar = contextvars.ContextVar("shardplan_layer_scans", default=None)


@dataclasses.dataclass
class Seen:
    """What :func:`seen_stacks` yields: the stacks a pipeline could split (``sites``) and, for the
    layer stacks recognised in plain loops that it cannot, why (``refused``)."""

    sites: list = dataclasses.field(default_factory=list)
    refused: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class StackSite:
    """A :func:`layer_scan` met while a step was traced outside a pipeline: its layer count, the
    batch (leading size of its carry; ``None`` where the carry leaves disagree) and the bytes of
    its stacked parameters."""

    layers: int
    batch: int | None
    nbytes: int = 0         # the stacked layer parameters' bytes


@contextlib.contextmanager
def seen_stacks():
    """Within this context, every :func:`layer_scan` (or layer stack recognised in a plain loop,
    :func:`recognising`) traced outside a pipeline adds a :class:`StackSite` to the
    :class:`Seen` it yields (what a pipeline could split, and into what), or why it cannot."""
    found = Seen()
    token = _SEEN.set(found)
    try:
        yield found
    finally:
        _SEEN.reset(token)


@dataclasses.dataclass
class Use:
    """What :func:`pipelined` yields: whether the traced step ran a :func:`layer_scan` pipeline,
    and why each layer stack recognised in a plain loop that it met could not be pipelined."""

    pipelined: int = 0
    refused: list = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def pipelined(config: PipelineConfig, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh):
    """Within this context (while a step is traced), :func:`layer_scan` runs as ``config``'s
    pipeline on ``mesh`` (a ``Mesh``, or an ``AbstractMesh`` to trace for devices not present),
    whose axis ``config.axis`` must have ``config.stages`` devices. Yields a :class:`Use`."""
    if config.axis not in mesh.shape:
        raise PipelineError(f"the pipeline's stage axis {config.axis!r} is not a mesh axis (axes: "
                            f"{', '.join(mesh.axis_names)}); name one with PipelineConfig(axis=...)")
    missing = [a for a in config.batch_axes if a not in mesh.shape]
    if missing:
        raise PipelineError(f"batch_axes {missing} are not mesh axes (axes: {', '.join(mesh.axis_names)})")
    types = tuple(getattr(mesh, "axis_types", ()))
    if types and jax.sharding.AxisType.Auto not in types:
        raise PipelineError(f"the mesh's axes are {tuple(t.name for t in types)} (jax.make_mesh's default): "
                            "the pipeline places its stages with sharding constraints, which need automatic axes; "
                            "build the mesh with axis_types=(jax.sharding.AxisType.Auto,) * "
                            f"{len(mesh.axis_names)}")
    if mesh.shape[config.axis] != config.stages:
        raise PipelineError(f"mesh axis {config.axis!r} has {mesh.shape[config.axis]} devices, the pipeline "
                            f"{config.stages} stages; use stages={mesh.shape[config.axis]} or resize the axis")
    use = Use()
    token = _ACTIVE.set((config, mesh, use))
    try:
        yield use
    finally:
        _ACTIVE.reset(token)


def layer_scan(f, init, xs, length: int | None = None):
    """``jax.lax.scan(f, init, xs)`` over a stack of layers (``xs``: the stacked layer
    parameters, leading dimension the layer), pipelined inside :func:`pipelined`. A plain
    ``jax.lax.scan`` over stacked weights is recognised as the same (:func:`recognising`); this
    marks a stack explicitly.

    Under a pipeline ``f`` must return ``(carry, None)`` and every carry leaf must have the batch
    as its leading dimension.

    >>> def body(h, layer):                       # doctest: +SKIP
    ...     return h + jnp.tanh(h @ layer["w"]), None
    >>> h, _ = layer_scan(body, h, {"w": stacked})   # was: jax.lax.scan(body, h, {"w": stacked})
    """
    where = recompute.caller(1)
    stacks.note(where)
    with stacks.inside():
        return _stack(f, init, xs, length, where, None, {})


def _stack(f, init, xs, length, where: str, why_not, scan_kwargs: dict, checkpointed: bool | None = None,
           written=None):
    """A layer stack's scan at ``where``: recomputed as its class is, pipelined where one is
    active and ``why_not`` (``None``, or ``why_not()``: why this stack cannot be) allows.
    ``checkpointed``: whether ``f`` recomputes itself (``None``: found by tracing it).
    ``written``: the body as the model wrote it, where ``f`` is it traced once at the step's
    shapes (:func:`shardplan.tracing.stacks.traced_once`): a pipeline runs microbatches, of other shapes."""
    active, seen = _ACTIVE.get(), _SEEN.get()
    reason = why_not() if why_not is not None and (active is not None or seen is not None) else None
    if reason is not None:
        _refuse(where, reason)
        active = None
    # Recomputed as the planner chose for this stack's layer class (shardplan.parallel.recompute), if it
    # chose; in a pipeline the layers run under a vmap over the stages (and one over row groups).
    vmapped = 0 if active is None else 1 + (active[0].replicas > 1)
    once = f
    f = recompute.scan_body(f if active is None or written is None else written, init, xs, where, vmapped,
                            checkpointed)
    if active is None:
        leaves = jax.tree.leaves(xs)
        if seen is not None and reason is None and leaves and leaves[0].ndim:
            batches = {x.shape[0] if x.ndim else None for x in jax.tree.leaves(init)}
            seen.sites.append(StackSite(leaves[0].shape[0], batches.pop() if len(batches) == 1 else None,
                                        sum(x.size * x.dtype.itemsize for x in leaves)))
        return stacks.ORIGINAL_SCAN(f, init, xs, length=length, **scan_kwargs)
    config, mesh, use = active
    use.pipelined += 1
    carry = _pipeline(f, init, xs, config, mesh, ys_aside=why_not is not None)
    if why_not is None:
        return carry, None
    # A plain scan's caller unpacks ys as the body made them (Linen's nn.scan maps over their
    # structure; NNX's are the layers' state updates). They do not depend on the activation
    # (stacks.why_not_pipelined): each layer's, from its stacked inputs and any carry.
    zeros = jax.tree.map(jnp.zeros_like, init)
    return carry, stacks.ORIGINAL_SCAN(lambda _, x: (None, once(zeros, x)[1]), None, xs, length=length)[1]


def _refuse(where: str, reason: str) -> None:
    """Note why the layer stack at ``where`` is not pipelined, for the active pipeline's
    :class:`Use` or :func:`seen_stacks`' :class:`Seen` (where either is active)."""
    active, seen = _ACTIVE.get(), _SEEN.get()
    note = f"the layer stack at {where}: {reason}"
    if active is not None:
        active[2].refused.append(note)
    elif seen is not None:
        seen.refused.append(note)


def _plain_scan(f, init, xs=None, length=None, reverse=False, unroll=1, **kwargs):
    """``jax.lax.scan`` while a step is traced (:func:`recognising`): a layer stack
    (:func:`shardplan.tracing.stacks.classify_scan`) runs as :func:`layer_scan`, its body traced once
    (:func:`shardplan.tracing.stacks.traced_once`); any other loop as written."""
    found = stacks.classify_scan(f, init, xs, length, reverse)
    if found is None:
        return stacks.ORIGINAL_SCAN(f, init, xs, length, reverse=reverse, unroll=unroll, **kwargs)
    body = stacks.traced_once(f, init, stacks.one_layer(xs))
    with stacks.inside():
        return _stack(body.fn, init, xs, length, found.where,
                      lambda: stacks.why_not_pipelined(body, init, xs, found.layers), dict(unroll=unroll, **kwargs),
                      checkpointed=recompute.recomputes(body.jaxpr.jaxpr), written=f)


def _plain_fori(lower, upper, body_fun, init_val, **kwargs):
    """``jax.lax.fori_loop`` while a step is traced (:func:`recognising`): over a layer stack
    (:func:`shardplan.tracing.stacks.classify_fori`) its body is a layer class for recomputation; no
    pipeline splits it (the reason is kept for the plan)."""
    found = stacks.classify_fori(lower, upper, init_val)
    if found is None:
        return stacks.ORIGINAL_FORI(lower, upper, body_fun, init_val, **kwargs)
    _refuse(found.where, found.unpipelinable)
    index = jax.ShapeDtypeStruct((), jnp.result_type(lower, upper))
    body = stacks.traced_once(body_fun, index, init_val)
    with stacks.inside():
        fn = recompute.loop_body(body.fn, (index, init_val), found.layers, found.where,
                                 checkpointed=recompute.recomputes(body.jaxpr.jaxpr))
        return stacks.ORIGINAL_FORI(lower, upper, fn, init_val, **kwargs)


def recognising():
    """Within this context (while shardplan traces a step, :func:`shardplan.tracing.stacks.step_inputs`),
    ``jax.lax.scan`` and ``jax.lax.fori_loop`` calls over layer stacks run as :func:`layer_scan`
    does: recomputed as their layer class is chosen, pipelined inside :func:`pipelined`; and
    unrolled repeated layers in what ``jax.grad``, ``jax.value_and_grad`` and ``jax.vjp``
    differentiate are recomputed as their class is chosen (:mod:`shardplan.parallel.unrolled`)."""
    return stacks.PATCH.installed({"lax.scan": _plain_scan, "lax.fori_loop": _plain_fori, **unrolled.ROUTERS})


def _rolled(a, shift: int):
    return jnp.roll(a, shift, axis=0)


# A jitted call under this name is one op to the planner (:mod:`shardplan.tracing.walk`): the stage
# dimension rolled, its sharding kept, a collective-permute where that dimension is split.
_rolled.__name__ = _rolled.__qualname__ = SHIFT_CALL
_roll_call = jax.jit(_rolled, static_argnums=1)


@jax.custom_vjp
def stage_shift(a):
    """``a`` with its leading (stage) dimension rolled by one: what stage ``s`` held, stage
    ``s + 1`` holds. Its gradient rolls back by one (JAX's transpose of a roll, a split and two
    pads, would be partitioned as two collective-permutes)."""
    return _roll_call(a, 1)


stage_shift.defvjp(lambda a: (_roll_call(a, 1), None), lambda _, g: (_roll_call(g, -1),))


def _constrain(x, mesh, axis: str | None):
    """``x`` with its leading dimension on ``axis`` (``None``: whole) and the rest left to XLA."""
    spec = PartitionSpec(axis, *([PartitionSpec.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _pipeline(f, init, xs, config: PipelineConfig, mesh, ys_aside: bool = False):
    S, M, R = config.stages, config.microbatches, config.repeats
    leaves = jax.tree.leaves(xs)
    if not leaves:
        raise PipelineError("layer_scan under a pipeline needs stacked layer parameters (xs) to split into stages")
    layers = leaves[0].shape[0]
    if layers % (S * R):
        repeats = [r for r in range(1, layers // S + 1) if layers % (S * r) == 0]
        stages = [s for s in range(2, layers + 1) if layers % (s * R) == 0]
        keep = (f"with the mesh's {S} stages use repeats in {repeats}" if repeats else
                f"no number of repeats splits them into {S} stages")
        raise PipelineError(f"{layers} layers do not split into {S} stages x {R} repeats; stages x repeats must "
                            f"divide {layers}: {keep}, or stages in {stages} with repeats={R} (mesh axis "
                            f"{config.axis!r} resized to that many devices)")
    per = layers // (S * R)
    leads = [(jax.tree_util.keystr(path) or "the carry", x.shape[0] if x.ndim else None)
             for path, x in jax.tree_util.tree_leaves_with_path(init)]
    batch_sizes = {n for _, n in leads}
    if len(batch_sizes) != 1 or None in batch_sizes:
        shown = ", ".join(f"{where}: {'a scalar' if n is None else n}" for where, n in leads)
        raise PipelineError("under a pipeline every layer_scan carry leaf needs the batch as its leading "
                            f"dimension, the same for all (leading sizes: {shown}); carry per-example values "
                            "with the batch first, or keep other state out of the carry (or plan with pipeline=None)")
    (batch,) = batch_sizes
    if batch % M:
        raise PipelineError(f"a batch of {batch} does not split into {M} microbatches; use microbatches dividing "
                            f"{batch}")
    mb, D = batch // M, config.replicas
    if mb % D:
        raise PipelineError(f"microbatches of {mb} rows (a batch of {batch} in {M}) do not split into "
                            f"replicas={D} groups; use replicas dividing {mb}")
    # One layer's shapes, not a slice of the stack (a traced slice would stay in the step).
    layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), xs)
    ys = () if ys_aside else jax.eval_shape(lambda c, x: f(c, x)[1], init, layer)
    if jax.tree.leaves(ys):
        raise PipelineError("under a pipeline the layer_scan body must return (carry, None): per-layer outputs "
                            "are not collected; keep what you need in the carry (leaves with the batch first), "
                            "or plan with pipeline=None")

    def groups(x, lead: int):
        """``x`` with its dimension ``lead`` (a microbatch's rows or row groups) over ``batch_axes``, the rest free."""
        if not config.batch_axes:
            return x
        spec = [PartitionSpec.UNCONSTRAINED] * x.ndim
        spec[lead] = config.batch_axes
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))

    # Parameters: [layers, ...] -> [stages, repeats, per, ...], stage s holding chunks r * S + s;
    # with replicas, one copy per row group: [stages, replicas, repeats, per, ...].
    def stage_major(a):
        a = a.reshape((R, S, per) + a.shape[1:])
        a = _constrain(jnp.swapaxes(a, 0, 1), mesh, config.axis)
        if D == 1:
            return a
        return _constrain(groups(jnp.broadcast_to(a[:, None], (S, D) + a.shape[1:]), 1), mesh, config.axis)
    params = jax.tree.map(stage_major, xs)
    # Microbatch m: rows m, m + M, ... (each spread over the batch's sharding), as [M, mb, ...];
    # with replicas, group d of it the rows of the batch's d-th block: [M, D, mb / D, ...].
    if D == 1:
        inputs = jax.tree.map(lambda a: jnp.swapaxes(a.reshape((mb, M) + a.shape[1:]), 0, 1), init)
    else:
        inputs = jax.tree.map(lambda a: jnp.moveaxis(a.reshape((D, mb // D, M) + a.shape[1:]), 2, 0), init)

    def run_chunk(chunk, h):
        return jax.lax.scan(lambda c, layer: (f(c, layer)[0], None), h, chunk)[0]

    # Where a new round starts, a stage runs round r's chunk or round r - 1's (``started``): each
    # layer selects its weights inside a checkpoint that keeps only its operands, both rounds'
    # layers being static slices of the parameters (read from them by the backward loop). A
    # chunk selected outside the layers was kept per trip, its predicate too: GPT-3 175B on 8
    # stages x 2 rounds (1024 A100s), 7 trips' chunks, 19 GiB a device, and their weight-shaped
    # masks, 6 GiB. The layer's forward is run again in the backward loop, as under remat full.
    def run_selected(new, old, started, h):
        def layer(c, both):
            return f(c, jax.tree.map(lambda a, b: jnp.where(started, a, b), *both))[0]
        layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)
        return jax.lax.scan(lambda c, both: (layer(c, both), None), h, (new, old))[0]

    if D > 1:
        run_chunk = jax.vmap(run_chunk)          # each row group with its own copy of the weights
        run_selected = jax.vmap(run_selected, in_axes=(0, 0, None, 0))

    stage_ids = jnp.arange(S)

    def is_first(a):
        return (stage_ids == 0).reshape((S,) + (1,) * (a.ndim - 1))
    state = jax.tree.map(lambda a: _constrain(jnp.zeros((S,) + a.shape[1:], a.dtype), mesh, config.axis), inputs)
    outputs = jax.tree.map(jnp.zeros_like, inputs)

    def salted(chunk, t):
        """``chunk`` with each stage's microbatch (and row group) folded into its layers' PRNG
        keys: the layers' random draws (dropout) differ between microbatches as they differ
        between rows of the whole batch. Without it every microbatch drew the same masks."""
        ids = (t - stage_ids) % M                    # the microbatch each stage holds
        if D > 1:
            ids = ids[:, None] * D + jnp.arange(D)[None, :]

        def fold(k):
            if not jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key):
                return k
            salt = jnp.broadcast_to(ids.reshape(ids.shape + (1,) * (k.ndim - ids.ndim)), k.shape)
            return jax.vmap(jax.random.fold_in)(k.ravel(), salt.ravel()).reshape(k.shape)
        return jax.tree.map(fold, chunk)

    def iteration(carry, t, pick):
        state, outputs = carry
        # Stage 0 takes item t: microbatch t % M, repeat t // M (its input, or the last stage's
        # output of the repeat before).
        m0, first = t % M, t < M
        take = lambda a, i: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)
        put = lambda a, x, i: jax.lax.dynamic_update_index_in_dim(a, x, i, 0)
        fresh = jax.tree.map(lambda i, o: jnp.where(first, take(i, m0), take(o, m0)), inputs, outputs)
        # Into stage 0 by a select, not an update of row 0: its transpose (the backward loop) is
        # a select too, and the cotangent reaches the replicated input by an all-reduce of one
        # microbatch, where the transposed update all-gathered every stage's microbatch.
        state = jax.tree.map(lambda s, x: _constrain(jnp.where(is_first(s), x[None], s), mesh, config.axis),
                             state, fresh)
        chunk, started = pick(t)
        if started is None:
            out = jax.vmap(run_chunk)(salted(chunk, t), state)
        else:
            new, old = chunk
            out = jax.vmap(run_selected)(salted(new, t), salted(old, t), started, state)
        out = jax.tree.map(lambda a: _constrain(a, mesh, config.axis), out)
        # The last stage finishes item t - (S - 1).
        done = t - (S - 1)
        finished = (done >= 0) & (done < M * R)
        outputs = jax.tree.map(
            lambda o, a: jnp.where(finished, put(o, groups(a[S - 1], 0), jnp.maximum(done, 0) % M), o), outputs, out)
        state = jax.tree.map(lambda a: _constrain(stage_shift(a), mesh, config.axis), out)
        return (state, outputs), None

    # Stage s works on round r = (t - s) // M of its item (clipped while idle). The loop runs as
    # segments: where every stage is in the same round its chunk of weights is a static slice of
    # the parameters (loop-invariant, so the backward loop reads it from them); only in the S - 1
    # trips after each round starts on stage 0 do the stages' rounds differ, and there each stage
    # runs both rounds' static chunks, selecting layer by layer (``run_selected``). (One loop
    # picking by a dynamic index kept every trip's chunk: llama3-70b on 4 stages x 2 rounds,
    # 184 GiB a device.) A pick gives ``(chunk, None)``, or ``((new, old), started)``.
    def chunk_of(r):
        """Every stage's chunk of round ``r``: a static slice of the parameters."""
        return jax.tree.map(lambda p: p[:, r] if D == 1 else p[:, :, r], params)

    def same_round(r):
        return lambda t: (chunk_of(r), None)

    def new_round(r):                                   # started: the stages already on round r
        return lambda t: ((chunk_of(r), chunk_of(r - 1)), stage_ids <= t - r * M)

    segments = [(0, M if R > 1 else config.iterations, same_round(0))]
    for r in range(1, R):
        segments.append((r * M, r * M + S - 1, new_round(r)))
        segments.append((r * M + S - 1, (r + 1) * M if r < R - 1 else config.iterations, same_round(r)))
    carry = (state, outputs)
    for lo, hi, pick in segments:
        if hi > lo:
            carry, _ = jax.lax.scan(functools.partial(iteration, pick=pick), carry, jnp.arange(lo, hi))
    outputs = carry[1]
    if D == 1:
        return jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1).reshape((batch,) + a.shape[2:]), outputs)
    return jax.tree.map(lambda a: jnp.moveaxis(a, 0, 2).reshape((batch,) + a.shape[3:]), outputs)
