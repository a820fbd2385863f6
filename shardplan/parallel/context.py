"""Context parallelism: attention over a sequence split across mesh axes.

Each strategy is a function called inside ``jax.jit`` on global arrays in the BTNH layout of
``jax.nn.dot_product_attention`` (q ``[batch, seq, q_heads, head_dim]``, k and v
``[batch, seq, kv_heads, head_dim]``, grouped-query attention when ``kv_heads`` divides
``q_heads``), sharded ``P(batch_axes, seq_axes, head_axes, None)``; each wraps a ``jax.shard_map``
body and returns the output sharded as q. Softmax statistics are float32 whatever the input dtype.
Each device attends blockwise (:mod:`shardplan.parallel.flash`, forward and backward): queries and keys in
chunks of ``block_size`` (default 512, or a ``(block_q, block_k)`` pair), so it holds one chunk
pair's scores at a time, never a whole ``[local seq, seq]`` block; the chunking adds no collective.

- :func:`allgather_attention` all-gathers K and V over the seq axes and attends this device's
  query chunk to the whole sequence. It moves K and V whole (and reduce-scatters their gradients):
  the simplest, and cheapest when K/V are small next to Q (GQA with few kv heads, short context).
- :func:`ulysses_attention` (DeepSpeed-Ulysses, Jacobs et al. 2023) all-to-alls q, k, v from
  sequence-split to head-split, attends the full sequence on its heads and all-to-alls back: four
  all-to-alls a layer forward, each moving a 1/n slice of an activation, so its traffic per device
  does not grow with n. Needs the local head counts divisible by the seq-axis size.
- :func:`ring_attention` (Ring Attention, Liu et al. 2023) rotates K/V blocks around the seq axes
  with ``ppermute`` while each device folds the block it holds into a flash-style online softmax:
  the rotation overlaps compute, there is no head constraint and memory stays O(local sequence).
  With a causal mask the devices late in the sequence do most of the work unless
  ``load_balance="zigzag"``.

Head parallelism times context parallelism (LoongTrain's 2-D attention, Gu et al. 2024) is
``head_axes`` plus ``seq_axes``. MaxText calls the choice ``context_parallel_strategy``
(``all_gather`` or ``ring``). :func:`collectives` lists what each strategy emits, for the cost model.

>>> out = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, seq_axes=("seq",),
...                                              causal=True))(q, k, v)   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from shardplan.compiler.cost import ALL_GATHER, ALL_TO_ALL, COLLECTIVE_PERMUTE, REDUCE_SCATTER
from shardplan.errors import ShardplanError
from shardplan.parallel import flash

Axes = tuple[str, ...]
BLOCK_SIZE = 512     # the default query and key chunk of the local attention (shardplan.parallel.flash)


class Strategy(str, enum.Enum):
    ALLGATHER = "allgather"
    ULYSSES = "ulysses"
    RING = "ring"


class LoadBalance(str, enum.Enum):
    ZIGZAG = "zigzag"


class ContextParallelError(ShardplanError, ValueError):
    """The attention inputs do not fit the mesh axes they are split over; ``dim`` names the
    array dimension and ``axes`` the mesh axes at fault."""

    def __init__(self, message: str, *, dim: str | None = None, axes: Axes = ()):
        super().__init__(message)
        self.dim, self.axes = dim, axes


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Validated shapes and mesh axes of one attention call."""
    batch_axes: Axes
    seq_axes: Axes
    head_axes: Axes
    n: int                                   # devices along the (combined) seq axes
    scale: float

    @property
    def spec(self) -> P:
        return P(self.batch_axes or None, self.seq_axes or None, self.head_axes or None, None)


def _axes(value: str | Sequence[str]) -> Axes:
    return (value,) if isinstance(value, str) else tuple(value)


def _layout(fn: str, q_shape, kv_shape, axis_sizes: dict, batch_axes, seq_axes, head_axes,
            scale: float | None, seq_multiple: int = 1) -> _Layout:
    """Check the shapes against the mesh axes, naming the dimension, the axes and the fix."""
    batch_axes, seq_axes, head_axes = _axes(batch_axes), _axes(seq_axes), _axes(head_axes)
    q_shape, kv_shape = tuple(q_shape), tuple(kv_shape)
    if len(q_shape) != 4 or len(kv_shape) != 4 or kv_shape[:2] + kv_shape[3:] != q_shape[:2] + q_shape[3:]:
        raise ContextParallelError(
            f"{fn}: q {tuple(q_shape)} and k/v {tuple(kv_shape)} must be [batch, seq, heads, head_dim] with "
            "the same batch, seq and head_dim (self-attention in jax.nn.dot_product_attention's layout)")
    used = batch_axes + seq_axes + head_axes
    for a in used:
        if a not in axis_sizes:
            raise ContextParallelError(f"{fn}: unknown mesh axis {a!r}; the mesh has axes {tuple(axis_sizes)}",
                                       axes=(a,))
    if len(set(used)) != len(used):
        raise ContextParallelError(f"{fn}: a mesh axis is used twice in batch_axes={batch_axes}, "
                                   f"seq_axes={seq_axes}, head_axes={head_axes}", axes=used)
    if q_shape[2] % kv_shape[2]:
        raise ContextParallelError(f"{fn}: q_heads={q_shape[2]} is not a multiple of kv_heads={kv_shape[2]}; "
                                   "grouped-query attention needs each kv head to serve whole query heads",
                                   dim="heads")
    def size(axes):
        return math.prod(axis_sizes[a] for a in axes)

    checks = [("batch", 0, q_shape[0], batch_axes, 1), ("seq", 1, q_shape[1], seq_axes, seq_multiple),
              ("q_heads", 2, q_shape[2], head_axes, 1), ("kv_heads", 2, kv_shape[2], head_axes, 1)]
    for dim, index, length, axes, mult in checks:
        parts = size(axes) * mult
        if length % parts:
            why = f" times {mult} (the zigzag layout cuts it into 2n chunks; load_balance=None does not)" \
                if mult > 1 else ""
            raise ContextParallelError(
                f"{fn}: the {dim} dimension (array axis {index}, size {length}) is split over mesh axes {axes} "
                f"of size {size(axes)}{why}, which does not divide it; pad {dim} to a multiple of {parts} "
                "or split it over other mesh axes", dim=dim, axes=axes)
    return _Layout(batch_axes, seq_axes, head_axes, size(seq_axes),
                   1.0 / math.sqrt(q_shape[3]) if scale is None else float(scale))


def _mesh_sizes(mesh: jax.sharding.Mesh) -> dict:
    return dict(mesh.shape)


def _blocks(fn: str, block_size) -> tuple[int, int]:
    try:
        return flash.block_sizes(block_size)
    except ValueError as e:
        raise ContextParallelError(f"{fn}: {e}") from None


def _local_attention(q, k, v, scale: float, causal: bool, block_size, q_offset=0):
    """Blockwise attention of a query block at global offset ``q_offset`` to keys from 0."""
    return flash.attention(q, k, v, scale=scale, causal=causal, q_offset=q_offset, block_size=block_size)[0]


def allgather_attention(q, k, v, *, mesh: jax.sharding.Mesh, seq_axes, batch_axes=(), head_axes=(),
                        causal: bool = False, scale: float | None = None, block_size=BLOCK_SIZE):
    """Attention with K and V all-gathered over ``seq_axes``; each device keeps its query chunk.

    The local attention is blockwise (:func:`shardplan.parallel.flash.attention`, chunks of ``block_size``).
    Under ``causal`` every chunk pair is visited (the device's offset is traced) and masked
    arithmetically: the last device, which sets the pace, needs all but half a diagonal anyway.

    >>> out = allgather_attention(q, k, v, mesh=mesh, seq_axes="seq", causal=True)   # doctest: +SKIP
    """
    lay = _layout("allgather_attention", q.shape, k.shape, _mesh_sizes(mesh), batch_axes, seq_axes, head_axes,
                  scale)
    block_size = _blocks("allgather_attention", block_size)

    def body(q, k, v):
        if not lay.seq_axes:
            return _local_attention(q, k, v, lay.scale, causal, block_size)
        k, v = (lax.all_gather(x, lay.seq_axes, axis=1, tiled=True) for x in (k, v))
        return _local_attention(q, k, v, lay.scale, causal, block_size, lax.axis_index(lay.seq_axes) * q.shape[1])

    return jax.shard_map(body, mesh=mesh, in_specs=(lay.spec,) * 3, out_specs=lay.spec)(q, k, v)


def _kv_repeat(fn: str, q_heads: int, kv_heads: int, lay: _Layout) -> int:
    """How many times Ulysses repeats each local kv head so the all-to-all can split them."""
    group = q_heads // kv_heads
    if q_heads % lay.n:
        raise ContextParallelError(
            f"{fn}: {q_heads} local q_heads (after head_axes {lay.head_axes}) cannot be split over seq axes "
            f"{lay.seq_axes} of size {lay.n}; use ring_attention or allgather_attention, or make the heads a "
            f"multiple of {lay.n}", dim="q_heads", axes=lay.seq_axes)
    return next(r for r in range(1, group + 1) if group % r == 0 and (kv_heads * r) % lay.n == 0)


def ulysses_attention(q, k, v, *, mesh: jax.sharding.Mesh, seq_axes, batch_axes=(), head_axes=(),
                      causal: bool = False, scale: float | None = None, block_size=BLOCK_SIZE):
    """DeepSpeed-Ulysses: all-to-all q, k, v to head-split over ``seq_axes``, attend, all-to-all back.

    The local head counts must divide by the seq-axis size. With grouped-query attention whose
    local kv heads do not, each kv head is repeated (the fewest times that divides them) before
    the all-to-all, which moves the repeated K and V. The attention of the whole sequence on the
    local heads is blockwise (:func:`shardplan.parallel.flash.attention`, chunks of ``block_size``); under
    ``causal`` the chunk pairs above the diagonal are skipped.

    >>> out = ulysses_attention(q, k, v, mesh=mesh, seq_axes="seq", head_axes="model")   # doctest: +SKIP
    """
    sizes = _mesh_sizes(mesh)
    lay = _layout("ulysses_attention", q.shape, k.shape, sizes, batch_axes, seq_axes, head_axes, scale)
    heads = math.prod(sizes[a] for a in lay.head_axes)
    repeat = _kv_repeat("ulysses_attention", q.shape[2] // heads, k.shape[2] // heads, lay)
    block_size = _blocks("ulysses_attention", block_size)

    def body(q, k, v):
        if not lay.seq_axes:
            return _local_attention(q, k, v, lay.scale, causal, block_size)
        k, v = (jnp.repeat(x, repeat, axis=2) for x in (k, v))
        q, k, v = (lax.all_to_all(x, lay.seq_axes, 2, 1, tiled=True) for x in (q, k, v))
        out = _local_attention(q, k, v, lay.scale, causal, block_size)
        return lax.all_to_all(out, lay.seq_axes, 1, 2, tiled=True)

    return jax.shard_map(body, mesh=mesh, in_specs=(lay.spec,) * 3, out_specs=lay.spec)(q, k, v)


# Ring attention. Device i starts with its own K/V block; at step t it holds the block of device
# (i - t) mod n. With a causal mask a block is attended whole, on the diagonal (own block, a
# static mask), or not at all; zigzag blocks attend half (see _cases). Each block is folded in
# blockwise (shardplan.parallel.flash), the parts of a case given as causal positions within the block.
_FULL, _DIAG, _SKIP, _KV_FRONT, _Q_BACK = range(5)


@dataclasses.dataclass(frozen=True)
class _Ring:
    mesh: jax.sharding.Mesh
    lay: _Layout
    causal: bool
    zigzag: bool
    block_q: int = BLOCK_SIZE
    block_k: int = BLOCK_SIZE

    axes = property(lambda self: self.lay.seq_axes)
    n = property(lambda self: self.lay.n)
    scale = property(lambda self: self.lay.scale)


def _cases(cfg: _Ring) -> tuple[int, ...]:
    """The parts a device attends of its own block (t = 0), an earlier one, a later one.

    Contiguous: an earlier block whole, a later one not at all. Zigzag (chunks i and 2n-1-i):
    an earlier block through its front chunk, by every row; a later one whole, by the back rows."""
    if not cfg.causal:
        return (_FULL,)
    return (_DIAG, _KV_FRONT, _Q_BACK) if cfg.zigzag else (_DIAG, _FULL, _SKIP)


def _mask(cfg: _Ring, kind: int, s: int) -> flash.Mask:
    """A case as causal positions of the block's rows and columns (keys at 0 .. s-1), all static.

    The diagonal is causal in local positions (zigzag's too: its chunks i and 2n-1-i keep their
    order); the front half of the keys is what a row at s/2 - 1 sees; back rows only: the front
    rows sit before every key, the back rows after. Zigzag chunks are cut from each half (the
    whole half where the block does not divide it), so the pairs a case leaves out are skipped."""
    pos = None
    if kind == _KV_FRONT:
        pos = (s // 2 - 1,) * s
    elif kind == _Q_BACK:
        pos = (-1,) * (s // 2) + (s,) * (s - s // 2)
    bq, bk = cfg.block_q, cfg.block_k
    if cfg.zigzag:
        bq, bk = flash.chunk(s // 2, bq), flash.chunk(s // 2, bk)
    return flash.Mask(kind != _FULL, bq, bk, pos)


def _fold(cfg: _Ring, kind: int, q, k, v, stats):
    """Fold one K/V block into the running (max, sum, unnormalised output) of the query rows;
    ``stats=None`` starts them."""
    if kind == _SKIP:
        return stats
    return flash.fold(q, k, v, stats, scale=cfg.scale, mask=_mask(cfg, kind, q.shape[3]))


def _grads(cfg: _Ring, kind: int, q, k, v, do, lse, delta, grads):
    """Add one block's share to (dq, dk, dv), recomputing its probabilities from the logsumexp;
    ``grads=None`` starts them."""
    if kind == _SKIP:
        return grads
    return flash.grads(q, k, v, do, lse, delta, grads, scale=cfg.scale, mask=_mask(cfg, kind, q.shape[3]))


def _switch(cfg: _Ring, t, fn, *operands):
    branches = [functools.partial(fn, cfg, kind) for kind in _cases(cfg)]
    if len(branches) == 1:
        return branches[0](*operands)
    earlier = t <= lax.axis_index(cfg.axes)            # the block of device i - t
    return lax.switch(jnp.where(t == 0, 0, jnp.where(earlier, 1, 2)), branches, *operands)


def _rotate(cfg: _Ring, xs):
    """Send each block to the next device along the (combined, major-first) seq axes."""
    return lax.ppermute(xs, cfg.axes, perm=[(j, (j + 1) % cfg.n) for j in range(cfg.n)])


# Both passes start from the block every row attends (t = 0: the own block, whole or diagonal).
# The rotation for the next step is issued before the fold of the current block, which does not
# depend on it: XLA can overlap the two.

def _ring_forward(cfg: _Ring, q, k, v):
    qg, first = flash.grouped(q, k.shape[2]), _cases(cfg)[0]
    kb, vb = _rotate(cfg, (k, v))                     # in flight while the own block is folded
    stats = _fold(cfg, first, qg, k, v, None)

    def step(carry, t):
        kb, vb, stats = carry
        nxt = _rotate(cfg, (kb, vb))
        return (*nxt, _switch(cfg, t, _fold, qg, kb, vb, stats)), None

    (kb, vb, stats), _ = lax.scan(step, (kb, vb, stats), jnp.arange(1, cfg.n - 1))
    out, lse = flash.finish(_switch(cfg, cfg.n - 1, _fold, qg, kb, vb, stats))
    return flash.ungrouped(out).astype(q.dtype), lse


def _ring_backward(cfg: _Ring, q, k, v, out, lse, dout):
    qg, dog = flash.grouped(q, k.shape[2]), flash.grouped(dout, k.shape[2])
    delta = jnp.sum(dog.astype(jnp.float32) * flash.grouped(out, k.shape[2]).astype(jnp.float32), -1)
    dq, dk, dv = _grads(cfg, _cases(cfg)[0], qg, k, v, dog, lse, delta, None)
    kb, vb, dk, dv = _rotate(cfg, (k, v, dk, dv))     # dk, dv travel with their block

    def step(carry, t):
        kb, vb, (dq, dk, dv) = carry
        dq, dk, dv = _switch(cfg, t, _grads, qg, kb, vb, dog, lse, delta, (dq, dk, dv))
        kb, vb, dk, dv = _rotate(cfg, (kb, vb, dk, dv))
        return (kb, vb, (dq, dk, dv)), None

    (kb, vb, grads), _ = lax.scan(step, (kb, vb, (dq, dk, dv)), jnp.arange(1, cfg.n - 1))
    dq, dk, dv = _switch(cfg, cfg.n - 1, _grads, qg, kb, vb, dog, lse, delta, grads)
    dk, dv = _rotate(cfg, (dk, dv))                   # one more hop brings each block's gradient home
    return flash.ungrouped(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _zigzag(cfg: _Ring, x, inverse: bool = False):
    """Reorder a local ``[b, s, ...]`` block from contiguous (device i holds chunks 2i, 2i+1) to
    zigzag (device j holds chunks j, 2n-1-j) or back: two ppermutes of half, each a permutation."""
    n = cfg.n
    home = [c if c < n else 2 * n - 1 - c for c in range(2 * n)]        # the device of chunk c
    front, back = [(i, home[2 * i]) for i in range(n)], [(i, home[2 * i + 1]) for i in range(n)]
    even = lax.axis_index(cfg.axes) % 2 == 0      # on device j, chunk j came from the even halves if j is even
    h = x.shape[1] // 2
    a, b = x[:, :h], x[:, h:]
    if inverse:
        a, b = jnp.where(even, a, b), jnp.where(even, b, a)
        front, back = [(d, s) for s, d in front], [(d, s) for s, d in back]
    a, b = lax.ppermute(a, cfg.axes, front), lax.ppermute(b, cfg.axes, back)
    if not inverse:
        a, b = jnp.where(even, a, b), jnp.where(even, b, a)
    return jnp.concatenate([a, b], axis=1)


def ring_attention(q, k, v, *, mesh: jax.sharding.Mesh, seq_axes, batch_axes=(), head_axes=(),
                   causal: bool = False, scale: float | None = None, load_balance: str | None = None,
                   block_size=BLOCK_SIZE):
    """Ring attention: K/V blocks rotate around ``seq_axes`` (``ppermute``), flash-style online softmax.

    The backward is a second ring pass (a ``jax.custom_vjp``): the forward saves q, k, v, the
    output and the float32 logsumexp, and the backward recomputes each block's probabilities while
    dk, dv accumulators travel with their K/V block, so memory per device is O(local sequence).
    With ``causal``, blocks wholly masked are skipped (``lax.switch``), which leaves the devices
    late in the sequence with the most work; ``load_balance="zigzag"`` evens it: the sequence is
    cut into 2n chunks and device i attends chunks i and 2n-1-i. The inputs arrive contiguous, so
    q, k, v are reordered on entry and the output back on exit by two ``ppermute``s of half the
    local block each (one local block per tensor, eight tensors moved per forward and backward);
    the caller sees the contiguous order. Without ``causal`` there is nothing to balance and
    ``load_balance`` is ignored. Several ``seq_axes`` form one ring, devices ordered major-first.
    Each block is folded in (and its gradient computed) blockwise, :mod:`shardplan.parallel.flash` chunks
    of ``block_size``, skipping the chunk pairs wholly masked: above the own block's diagonal, and
    under zigzag the half a case leaves out (its chunks are cut from each half of the block, the
    whole half where ``block_size`` does not divide it).

    >>> out = ring_attention(q, k, v, mesh=mesh, seq_axes=("seq",), causal=True,
    ...                      load_balance="zigzag")   # doctest: +SKIP
    """
    zigzag = _load_balance(load_balance) is LoadBalance.ZIGZAG and causal
    sizes = _mesh_sizes(mesh)
    lay = _layout("ring_attention", q.shape, k.shape, sizes, batch_axes, seq_axes, head_axes, scale,
                  seq_multiple=2 if zigzag else 1)
    if lay.n == 1:
        return allgather_attention(q, k, v, mesh=mesh, seq_axes=(), batch_axes=batch_axes, head_axes=head_axes,
                                   causal=causal, scale=lay.scale, block_size=block_size)
    return _ring(_Ring(mesh, lay, causal, zigzag, *_blocks("ring_attention", block_size)), q, k, v)


# The custom_vjp wraps two shard_maps, the forward and the backward ring, so its residuals are
# global arrays sharded like the inputs (the logsumexp as _lse_spec) and autodiff never looks
# inside either ring.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg: _Ring, q, k, v):
    return _ring_fwd(cfg, q, k, v)[0]


def _lse_spec(lay: _Layout) -> P:        # the logsumexp is [batch, kv_heads, group, seq]
    return P(lay.batch_axes or None, lay.head_axes or None, None, lay.seq_axes)


def _ring_fwd(cfg: _Ring, q, k, v):
    def body(q, k, v):
        if not cfg.zigzag:
            return _ring_forward(cfg, q, k, v)
        q, k, v = (_zigzag(cfg, x) for x in (q, k, v))
        out, lse = _ring_forward(cfg, q, k, v)
        return _zigzag(cfg, out, inverse=True), (q, k, v, out, lse)     # residuals in zigzag order

    spec, lse_spec = cfg.lay.spec, _lse_spec(cfg.lay)
    if not cfg.zigzag:
        out, lse = jax.shard_map(body, mesh=cfg.mesh, in_specs=(spec,) * 3, out_specs=(spec, lse_spec))(q, k, v)
        return out, (q, k, v, out, lse)
    return jax.shard_map(body, mesh=cfg.mesh, in_specs=(spec,) * 3,
                         out_specs=(spec, (spec,) * 4 + (lse_spec,)))(q, k, v)


def _ring_bwd(cfg: _Ring, res, dout):
    def body(q, k, v, out, lse, dout):
        if cfg.zigzag:
            dout = _zigzag(cfg, dout)
        grads = _ring_backward(cfg, q, k, v, out, lse, dout)
        return tuple(_zigzag(cfg, g, inverse=True) for g in grads) if cfg.zigzag else grads

    spec = cfg.lay.spec
    return jax.shard_map(body, mesh=cfg.mesh, in_specs=(spec,) * 4 + (_lse_spec(cfg.lay), spec),
                         out_specs=(spec,) * 3)(*res, dout)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _load_balance(value) -> LoadBalance | None:
    if value is None:
        return None
    try:
        return LoadBalance(value)
    except ValueError:
        raise ContextParallelError(f"load_balance={value!r}; choose None or 'zigzag'") from None


def collectives(strategy: str | Strategy, q_shape, kv_shape, dtype, axis_sizes: dict, *, seq_axes,
                batch_axes=(), head_axes=(), causal: bool = False, load_balance: str | None = None,
                backward: bool = False) -> list[tuple[str, Axes, int]]:
    """``(kind, mesh axes, bytes per device)`` of each collective one call emits (with ``backward``,
    one forward and backward), in HLO kinds; bytes as XLA counts them (all-gather: its result,
    reduce-scatter: its operand, all-to-all and collective-permute: the buffer moved). Ring
    attention's dk, dv accumulators travel in float32. Compiled in one program, the backward ring
    shares its first K/V rotation with the forward (XLA's CSE); where a scan over layers puts
    them in separate loops, the backward sends that one again.

    >>> collectives("ring", (2, 64, 8, 16), (2, 64, 8, 16), "float32", {"seq": 8}, seq_axes=("seq",))
    ... # doctest: +SKIP
    [('collective-permute', ('seq',), 8192), ...]   # seven rotations of k and of v
    """
    if strategy not in tuple(Strategy):
        raise ContextParallelError(f"collectives: unknown strategy {strategy!r}; choose one of "
                                   f"{[s.value for s in Strategy]}")
    strategy = Strategy(strategy)
    zigzag = strategy is Strategy.RING and causal and _load_balance(load_balance) is LoadBalance.ZIGZAG
    lay = _layout(f"collectives({strategy.value!r})", q_shape, kv_shape, axis_sizes, batch_axes, seq_axes,
                  head_axes, None, seq_multiple=2 if zigzag else 1)
    n, axes = lay.n, lay.seq_axes
    if n == 1:
        return []
    shards = math.prod(axis_sizes[a] for a in lay.batch_axes + lay.seq_axes + lay.head_axes)
    itemsize = jnp.dtype(dtype).itemsize
    q_bytes = math.prod(q_shape) * itemsize // shards          # this device's block of q
    kv_bytes = math.prod(kv_shape) * itemsize // shards
    out: list[tuple[str, Axes, int]] = []
    if strategy is Strategy.ALLGATHER:
        out += [(ALL_GATHER, axes, kv_bytes * n)] * 2
        out += [(REDUCE_SCATTER, axes, kv_bytes * n)] * 2 if backward else []
    elif strategy is Strategy.ULYSSES:
        heads = math.prod(axis_sizes[a] for a in lay.head_axes)
        repeat = _kv_repeat("collectives('ulysses')", q_shape[2] // heads, kv_shape[2] // heads, lay)
        moved = [q_bytes, kv_bytes * repeat, kv_bytes * repeat, q_bytes]     # q, k, v in; out back
        out += [(ALL_TO_ALL, axes, b) for b in moved * (2 if backward else 1)]
    else:
        out += [(COLLECTIVE_PERMUTE, axes, kv_bytes)] * 2 * (n - 1)
        if backward:
            # The backward's first rotation of k, v is the forward's (the same ppermute of the
            # same arrays): compiled in one program, XLA's CSE keeps one.
            out += [(COLLECTIVE_PERMUTE, axes, kv_bytes)] * 2 * (n - 2)
            out += [(COLLECTIVE_PERMUTE, axes, kv_bytes * 4 // itemsize)] * 2 * n
        if zigzag:      # q, k, v in and out back; with backward also dout in and dq, dk, dv back
            halves = [q_bytes, kv_bytes, kv_bytes, q_bytes] * (2 if backward else 1)
            out += [(COLLECTIVE_PERMUTE, axes, b // 2) for b in halves for _ in range(2)]
    return out
