"""Attention the planner may split over the sequence: the one line a model writes, the ways to
split it (:class:`ContextConfig`) and their search.

A model calls :func:`attention` where it would call ``jax.nn.dot_product_attention`` (same
BTNH layout, grouped-query heads, causal mask). Outside :func:`context_parallel` it *is*
``jax.nn.dot_product_attention``. Inside, it runs one of :mod:`shardplan.parallel.context`'s strategies
(all-gather of K/V, Ulysses' all-to-alls, ring attention) as a ``shard_map`` over the mesh, with
the sequence split over ``seq_axes``, the batch over ``batch_axes`` and the heads over
``head_axes``. The planner traces the step once per :class:`ContextConfig` worth trying
(:func:`candidates`), plans each (the ``shard_map`` fixes the attention's shardings and its
collectives are priced from its body, :mod:`shardplan.tracing.manual`) and keeps the fastest that fits:
``shardplan.auto(step, mesh=..., context="auto")``; ``plan.context`` says which. A step that
calls ``jax.nn.dot_product_attention`` or writes its attention out as einsum-softmax-einsum
(:mod:`shardplan.tracing.einsum_attention`) reaches the same strategies with no change.

>>> out = shardplan.attention(q, k, v, causal=True)          # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math

import jax

from shardplan.errors import ShardplanError
from shardplan.parallel import context as cp
from shardplan.parallel.context import LoadBalance, Strategy
from shardplan.parallel.defaults import runner_up
from shardplan.parallel.families import Family
from shardplan.tracing import einsum_attention
from shardplan.util.progress import Status


@dataclasses.dataclass(frozen=True)
class ContextConfig:
    """One way to run the step's attention: ``strategy`` with the sequence over ``seq_axes``,
    the batch over ``batch_axes``, the heads over ``head_axes`` (mesh axes), and for the ring
    under a causal mask ``load_balance`` (``"zigzag"``)."""

    strategy: Strategy
    seq_axes: tuple[str, ...]
    batch_axes: tuple[str, ...] = ()
    head_axes: tuple[str, ...] = ()
    load_balance: LoadBalance | None = None

    def __post_init__(self):
        try:
            object.__setattr__(self, "strategy", Strategy(self.strategy))
        except ValueError:
            raise ShardplanError(f"ContextConfig: strategy={self.strategy!r} is not one of "
                                 f"{', '.join(repr(x.value) for x in Strategy)}") from None
        if self.load_balance is not None:
            try:
                object.__setattr__(self, "load_balance", LoadBalance(self.load_balance))
            except ValueError:
                raise ShardplanError(f"ContextConfig: load_balance={self.load_balance!r} is not one of None, "
                                     f"{', '.join(repr(x.value) for x in LoadBalance)}") from None
        for name in ("seq_axes", "batch_axes", "head_axes"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        if not self.seq_axes:
            raise ShardplanError("ContextConfig: seq_axes is empty; name the mesh axes the sequence is split over")

    def describe(self) -> str:
        text = f"{self.strategy.value} attention, sequence over {'x'.join(self.seq_axes)}"
        if self.batch_axes:
            text += f", batch over {'x'.join(self.batch_axes)}"
        if self.head_axes:
            text += f", heads over {'x'.join(self.head_axes)}"
        return text + (f" ({self.load_balance.value})" if self.load_balance else "")

    def to_json(self) -> dict:
        return {"strategy": self.strategy.value, "seq_axes": list(self.seq_axes), "batch_axes": list(self.batch_axes),
                "head_axes": list(self.head_axes),
                "load_balance": None if self.load_balance is None else self.load_balance.value}

    @classmethod
    def from_json(cls, data: dict) -> ContextConfig:
        return cls(data["strategy"], tuple(data["seq_axes"]), tuple(data["batch_axes"]), tuple(data["head_axes"]),
                   data.get("load_balance"))


@dataclasses.dataclass
class Use:
    """What a trace met: each :func:`attention` call's (q shape, kv shape, causal)."""

    sites: list = dataclasses.field(default_factory=list)


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("shardplan_context_parallel", default=None)


_DOT_PRODUCT_ATTENTION = jax.nn.dot_product_attention


@contextlib.contextmanager
def context_parallel(config: ContextConfig | None, mesh):
    """Within this context (while a step is traced), :func:`attention` runs as ``config`` on
    ``mesh`` (a ``Mesh`` or an ``AbstractMesh``); ``config=None`` records the calls only. So does
    a call of ``jax.nn.dot_product_attention`` (looked up when called, as ``jax.nn.`` code does)
    with no bias, mask, sequence lengths or window: the attribute is routed through
    :func:`attention` for the duration, and so is attention written out in a function given to
    ``jax.grad``, ``jax.value_and_grad`` or ``jax.vjp`` (:mod:`shardplan.tracing.einsum_attention`).
    JAX's trace caches are cleared on entry, and on exit under a configuration, so that jitted
    functions are traced here afresh and their traces here serve no call outside. Yields a
    :class:`Use`."""
    use = Use()
    # JAX reuses the trace of a jitted function (the user's jitted step, a jitted layer) made
    # before with the same arguments: one made outside would hide the attention from the routing
    # here, and one made here, with its sequence split, must not serve a call outside.
    jax.clear_caches()
    token = _ACTIVE.set((config, mesh, use))
    jax.nn.dot_product_attention = _routed
    # Wrapped as they are now: inside shardplan's own routers (shardplan.parallel.unrolled), if in place.
    saved = {name: getattr(jax, name) for name in _TRANSFORMS}
    for name, transform in saved.items():
        setattr(jax, name, _differentiating(transform))
    try:
        yield use
    finally:
        jax.nn.dot_product_attention = _DOT_PRODUCT_ATTENTION
        for name, transform in saved.items():
            setattr(jax, name, transform)
        _ACTIVE.reset(token)
        if config is not None:
            jax.clear_caches()


# The transforms whose function is searched for attention written out (einsum-softmax-einsum).
_TRANSFORMS = ("grad", "value_and_grad", "vjp")


def _differentiating(transform):
    """``transform`` (``jax.grad``, ``jax.value_and_grad``, ``jax.vjp``) applied to the function
    with the attention it writes out replaced (:func:`shardplan.tracing.einsum_attention.rewritten`): by
    :func:`attention` under a configuration, only recorded without one."""
    @functools.wraps(transform)
    def patched(fun, *args, **kwargs):
        active = _ACTIVE.get()
        if active is not None:
            config, _, use = active
            fun = functools.wraps(fun)(einsum_attention.rewritten(
                fun, attention if config is not None else None,
                record=lambda shapes, causal: use.sites.append((*shapes, bool(causal)))))
        return transform(fun, *args, **kwargs)
    return patched


def _routed(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False, query_seq_lengths=None,
            key_value_seq_lengths=None, local_window_size=None, implementation=None, return_residual=False):
    """``jax.nn.dot_product_attention`` while a step is traced for the planner: the plain
    self-attention calls go through :func:`attention`, the others as they are."""
    plain = bias is None and mask is None and query_seq_lengths is None and key_value_seq_lengths is None \
        and local_window_size is None and not return_residual
    if plain:
        return attention(query, key, value, causal=is_causal, scale=scale)
    return _DOT_PRODUCT_ATTENTION(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                                  query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
                                  local_window_size=local_window_size, implementation=implementation,
                                  return_residual=return_residual)


_FUNCTIONS = {Strategy.ALLGATHER: cp.allgather_attention, Strategy.ULYSSES: cp.ulysses_attention,
              Strategy.RING: cp.ring_attention}


def attention(q, k, v, *, causal: bool = False, scale: float | None = None):
    """``jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal)``, or inside
    :func:`context_parallel` the configured context-parallel strategy (same result)."""
    active = _ACTIVE.get()
    if active is None:
        return _DOT_PRODUCT_ATTENTION(q, k, v, scale=scale, is_causal=causal)
    config, mesh, use = active
    self_attention = q.ndim == 4 and k.shape == v.shape and q.shape[:2] == k.shape[:2] and q.shape[3] == k.shape[3]
    if self_attention:
        use.sites.append((tuple(q.shape), tuple(k.shape), bool(causal)))
    if config is None or not self_attention:
        return _DOT_PRODUCT_ATTENTION(q, k, v, scale=scale, is_causal=causal)
    kw = dict(mesh=mesh, seq_axes=config.seq_axes, batch_axes=config.batch_axes, head_axes=config.head_axes,
              causal=causal, scale=scale)
    if config.strategy == Strategy.RING:
        kw["load_balance"] = config.load_balance
    return _FUNCTIONS[config.strategy](q, k, v, **kw)


def candidates(sites: list, axis_sizes: dict) -> list[ContextConfig]:
    """The configurations worth planning for attention calls of these (q shape, kv shape,
    causal) on a mesh of ``axis_sizes``: per mesh axis that divides the sequence, the sequence
    over it and the other axes over the batch where they divide it, else over the heads (the 2-D
    head x context mix); all-gather, Ulysses where the heads divide, and the ring (zig-zag under
    a causal mask). The planner adds no split at all."""
    if not sites:
        return []
    q_shape, kv_shape, causal = sites[0]
    batch, seq, heads, kv_heads = q_shape[0], q_shape[1], q_shape[2], kv_shape[2]
    out = []
    for axis, n in axis_sizes.items():
        if n < 2 or seq % n:
            continue
        rest = [a for a, m in axis_sizes.items() if a != axis and m > 1]
        batch_axes, head_axes, left = [], [], batch
        for a in rest:
            if left % axis_sizes[a] == 0:
                batch_axes.append(a)
                left //= axis_sizes[a]
            elif heads % axis_sizes[a] == 0 and kv_heads % axis_sizes[a] == 0 and not head_axes:
                head_axes.append(a)
        if len(batch_axes) + len(head_axes) < len(rest):
            continue            # an axis neither splits: the step runs replicated over it
        local_heads = heads // math.prod(axis_sizes[a] for a in head_axes)
        common = dict(seq_axes=(axis,), batch_axes=tuple(batch_axes), head_axes=tuple(head_axes))
        out.append(ContextConfig(Strategy.ALLGATHER, **common))
        if local_heads % n == 0:
            out.append(ContextConfig(Strategy.ULYSSES, **common))
        zigzag = causal and seq % (2 * n) == 0
        out.append(ContextConfig(Strategy.RING, **common, load_balance=LoadBalance.ZIGZAG if zigzag else None))
    return out


def traced_in(trace, config: ContextConfig | None, axis_names, axis_sizes, use: Use | None = None):
    """``trace`` (a step's trace) made to run inside ``config`` on a mesh of these axes (an
    ``AbstractMesh``: the devices need not be present); the calls met are added to ``use``."""
    mesh = jax.sharding.AbstractMesh(tuple(axis_sizes), tuple(axis_names),
                                     axis_types=(jax.sharding.AxisType.Auto,) * len(axis_names))

    def run():
        with context_parallel(config, mesh) as met:
            traced = trace()
        if use is not None:
            use.sites.extend(met.sites)
        return traced
    return run


def check_setting(setting):
    """``setting`` as ``context=`` takes it: ``None`` (the default: :mod:`shardplan.parallel.defaults`),
    ``"off"``, ``"auto"`` or a :class:`ContextConfig`."""
    if setting is None or isinstance(setting, ContextConfig) or (isinstance(setting, str)
                                                                 and setting in ("auto", "off")):
        return setting
    raise ShardplanError(f"context={setting!r}: give 'auto', 'off' (or None), or a shardplan.ContextConfig")


def check_with_pipeline(setting, pipeline) -> None:
    """Refuse ``context=setting`` with a pipeline (``pipeline`` as the planner takes it)."""
    if setting is not None and pipeline not in (None, "off"):
        raise ShardplanError(f"context={setting!r} with pipeline={pipeline!r}: context parallelism is not planned "
                             "together with a pipeline yet; pass pipeline='off' or context='off'")


class ContextFamily(Family):
    """Sequence splits as a :class:`~shardplan.parallel.families.Family`: ``"auto"``, no split and every
    :func:`candidates` entry for the attention calls the step makes; a :class:`ContextConfig`, that
    one; ``None``: the step as written."""

    name = "context"
    errors = (cp.ContextParallelError,)

    def __init__(self, setting):
        super().__init__(setting)
        self.sites = None            # the attention calls "auto" found
        self.configs = 1

    def pinned(self) -> bool:
        return self.setting != "auto"

    def explore(self, point, search, alone: bool = True):
        if self.setting is None:
            yield None
            return
        if isinstance(self.setting, ContextConfig):
            configs = [self.setting]
        elif self.setting == "auto":
            use = Use()
            traced_in(point.trace, None, point.axis_names, point.axis_sizes, use)()   # the attention calls made
            self.sites = use.sites
            configs = [None] + candidates(use.sites, dict(zip(point.axis_names, point.axis_sizes)))
        else:
            raise ShardplanError(f"context={self.setting!r}: give 'auto', 'off' (or None), or a "
                                 "shardplan.ContextConfig")
        self.configs = len(configs)
        for k, config in enumerate(configs):
            if len(configs) > 1:
                with Status() as line:
                    line.done(f"context candidate {k + 1}/{len(configs)}: "
                              f"{'no sequence split' if config is None else config.describe()}")
            yield config

    def enter(self, config, point):
        if config is None:        # no split: the step as written, traced as the plan will be applied (no routing)
            return point.entered(self, None)
        met = Use()
        return point.entered(self, config, met, trace=traced_in(point.trace, config, point.axis_names,
                                                                 point.axis_sizes, met))

    def record(self, plan, config, met):
        if config is not None and not met.sites:
            # asked for by name, but nothing in the step is split: the plan is the step as written
            return dataclasses.replace(plan, context=None, warnings=plan.warnings + (
                f"context={config.describe()!r}: {_NOTHING_TO_SPLIT}; the step is planned as written",))
        return dataclasses.replace(plan, context=None if config is None else config.to_json())

    def from_plan(self, plan, point):
        return None if plan.context is None else plan.context_config()

    def finish(self, plan, completed):
        if self.configs > 1:
            plan = dataclasses.replace(plan, searched={**plan.searched,
                                                       "context": runner_up(completed, plan, "context")})
        if self.setting == "auto" and not self.sites:
            plan = dataclasses.replace(plan, warnings=plan.warnings + (
                f"context='auto': {_NOTHING_TO_SPLIT}, so no sequence split could be chosen; the step is planned as "
                "written",))
        return plan

    def explain(self, error):
        if self.setting == "auto" and not self.sites and error.args:
            error.args = (f"{error.args[0]}\n(context='auto' could not help: {_NOTHING_TO_SPLIT})",) + error.args[1:]
        return error


_NOTHING_TO_SPLIT = ("the step has no attention the planner can split (a shardplan.attention or "
                     "jax.nn.dot_product_attention call, or einsum-softmax-einsum attention with a causal mask or "
                     "none, differentiated by jax.grad, jax.value_and_grad or jax.vjp)")
