"""Blockwise (flash-style) attention on one device, forward and backward.

The per-device attention of every :mod:`shardplan.parallel.context` strategy: queries in chunks of
``block_q`` rows, keys and values in chunks of ``block_k`` columns, an online softmax over the
key chunks with float32 running max and sum (FlashAttention, Dao et al. 2022; the backward of
FlashAttention-2, Dao 2023). Neither direction holds more than one ``[batch, kv_heads, group,
block_q, block_k]`` block of scores (and a few of its size: probabilities, their gradient).

Layouts: queries grouped ``[batch, kv_heads, group, seq_q, head_dim]`` (query head ``h`` serves kv
head ``h // group``), keys and values ``[batch, seq_k, kv_heads, head_dim]``, statistics
``[batch, kv_heads, group, seq_q]`` float32. :func:`attention` takes and returns
``jax.nn.dot_product_attention``'s BTNH layout.

Chunk sizes: ``block_q`` (``block_k``) when it divides the query (key) length, else the whole
length, so a length below the block or not a multiple of it is one chunk.

Causal masking is by position: row ``i`` sees column ``j`` when ``q_pos[i] + shift >= k_pos[j]``
(``q_pos``, ``k_pos`` static, default ``arange``; ``shift`` a traced scalar or 0). The chunk pairs
the loop visits are a static list, one ``lax.scan`` over it (as Splash attention's block-sparse
mask): with static positions (``shift`` 0) the pairs wholly masked (every column after every row)
are left out of the list, so no work or loop trip is spent on them (a causal triangle visits
``nq (nq + 1) / 2`` of ``nq^2`` pairs); with a traced shift (all-gather's device offset) every pair
is visited and masked arithmetically. The running values live in whole-length buffers that each
pair reads and writes at its chunk (``dynamic_update_slice``, in place in XLA's loop).

>>> out, lse = attention(q, k, v, scale=0.125, causal=True, block_size=512)   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

MASKED = -1e30      # a masked logit: finite, so subtracting a running max never makes inf - inf
F32 = dict(preferred_element_type=jnp.float32)


def block_sizes(block_size) -> tuple[int, int]:
    """``(block_q, block_k)`` from an int (both) or a pair."""
    pair = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    if len(pair) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in pair):
        raise ValueError(f"block_size={block_size!r}; give a positive int or a (block_q, block_k) pair of them")
    return pair


def chunk(length: int, block: int) -> int:
    """The chunk a length is cut into: ``block`` where it divides ``length``, else ``length`` whole."""
    return block if block <= length and length % block == 0 else length


@dataclasses.dataclass(frozen=True)
class Mask:
    """Static chunking and causal positions of one attention call (see the module)."""
    causal: bool
    block_q: int
    block_k: int
    q_pos: tuple | None = None           # static positions (None: arange)
    k_pos: tuple | None = None
    shifted: bool = False                # a traced shift is added to q_pos: visit every pair

    def positions(self, sq: int, sk: int):
        qp = np.arange(sq) if self.q_pos is None else np.asarray(self.q_pos)
        kp = np.arange(sk) if self.k_pos is None else np.asarray(self.k_pos)
        return qp.astype(np.int32), kp.astype(np.int32)

    def pairs(self, sq: int, sk: int) -> tuple[int, int, np.ndarray, np.ndarray]:
        """``(bq, bk, qi, kj)``: the chunk sizes and the chunk pairs visited, query-major."""
        bq, bk = chunk(sq, self.block_q), chunk(sk, self.block_k)
        need = np.ones((sq // bq, sk // bk), bool)
        if self.causal and not self.shifted:
            qp, kp = self.positions(sq, sk)
            need = qp.reshape(-1, bq).max(1)[:, None] >= kp.reshape(-1, bk).min(1)[None, :]
        qi, kj = np.nonzero(need)
        return bq, bk, qi.astype(np.int32), kj.astype(np.int32)


def _visit(mask: Mask, sq: int, sk: int, shift, body, carry, start, data):
    """``carry`` through ``body(carry, i, j, bq, bk, visible)`` at each visited chunk pair: ``i``,
    ``j`` the first row and column of the chunks, ``visible`` their ``[bq, bk]`` causal mask (None
    without ``causal``). One pair, the whole of both, is a plain call that may start from
    ``carry=None``; a loop starts from ``start()`` where ``carry`` is None.

    The masks are made from ``data`` too (an exact zero, :func:`_data_zero`): computed from
    constants alone, they are the same in every layer of a scanned model, and JAX's partial
    evaluation of that scan computes such values once outside it, every chunk pair's mask
    stacked (Llama-3-8B at 131072 tokens: 32 GiB of masks a device)."""
    bq, bk, qi, kj = mask.pairs(sq, sk)
    if not len(qi):
        return start() if carry is None else carry
    zero = _data_zero(data)
    qp, kp = (jnp.asarray(p) + zero for p in mask.positions(sq, sk))

    def visible(i, j):
        if not mask.causal:
            return None
        return (_get(qp, 0, i, bq) + shift)[:, None] >= _get(kp, 0, j, bk)[None, :]

    if bq == sq and bk == sk:
        return body(carry, 0, 0, bq, bk, visible(0, 0))

    def step(carry, ij):
        i, j = ij[0] * bq, ij[1] * bk
        return body(carry, i, j, bq, bk, visible(i, j)), None

    carry = start() if carry is None else carry
    return lax.scan(step, carry, jnp.asarray(np.stack([qi, kj], 1)))[0]


def _data_zero(x):
    """An int32 zero computed from ``x`` (the sum of an empty slice of it): what depends on it
    varies wherever ``x`` does; XLA folds it to the constant."""
    return lax.stop_gradient(jnp.sum(lax.slice_in_dim(x, 0, 0, axis=0))).astype(jnp.int32)


def _zeros(shape, like, value=0.0):
    """A float32 buffer varying over the manual mesh axes ``like``'s arrays vary over (inside a
    ``shard_map``, a loop carry must keep its type: buffers filled by the loop start as varying)."""
    vma = frozenset().union(*(_varying(x) for x in like))
    x = jnp.full(shape, value, jnp.float32)
    return lax.pcast(x, tuple(sorted(vma)), to="varying") if vma else x


def _varying(x) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)          # JAX 0.10; earlier versions: aval.vma
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _get(x, axis, start, size):
    if isinstance(start, int) and start == 0 and size == x.shape[axis]:
        return x
    return lax.dynamic_slice_in_dim(x, start, size, axis)


def _set(x, axis, start, value):
    if value.shape == x.shape:
        return value
    return lax.dynamic_update_slice_in_dim(x, value, start, axis)


def fold(q, k, v, stats, *, scale: float, mask: Mask, shift=0):
    """Fold the keys and values ``k``, ``v`` into the running ``(max, sum, unnormalised output)``
    of the grouped queries ``q``, chunk pair by chunk pair; ``stats=None`` starts them. Rows that
    see no column of this ``k`` keep their values."""
    def start():
        like = (q, k, v, shift)
        return _zeros(q.shape[:4], like, MASKED), _zeros(q.shape[:4], like), _zeros(q.shape, like)

    def body(carry, i, j, bq, bk, visible):
        qc, kc, vc = _get(q, 3, i, bq), _get(k, 1, j, bk), _get(v, 1, j, bk)
        s = jnp.einsum("bkgqd,bskd->bkgqs", qc, kc, **F32) * scale
        if visible is not None:
            s = jnp.where(visible, s, MASKED)
        m_new = s.max(-1)
        if carry is not None:
            m, l, acc = carry
            m_old, l_old, acc_old = _get(m, 3, i, bq), _get(l, 3, i, bq), _get(acc, 3, i, bq)
            m_new = jnp.maximum(m_old, m_new)
        p = jnp.exp(s - m_new[..., None])
        if visible is not None:
            p = jnp.where(visible, p, 0.0)       # a row with no visible column so far: exp(0), not 1
        pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vc, **F32)
        if carry is None:
            return m_new, p.sum(-1), pv
        alpha = jnp.exp(m_old - m_new)
        return (_set(m, 3, i, m_new), _set(l, 3, i, alpha * l_old + p.sum(-1)),
                _set(acc, 3, i, alpha[..., None] * acc_old + pv))

    return _visit(mask, q.shape[3], k.shape[1], shift, body, stats, start, q)


def finish(stats):
    """``(output float32, logsumexp)`` of folded statistics."""
    m, l, acc = stats
    return acc / l[..., None], m + jnp.log(l)


def grads(q, k, v, do, lse, delta, acc, *, scale: float, mask: Mask, shift=0):
    """Add this ``k``, ``v``'s share to the float32 gradients ``acc = (dq, dk, dv)`` (``None``:
    from zero), recomputing each chunk pair's probabilities from ``q``, ``k`` and the logsumexp;
    ``delta`` is the row sum of ``do * out`` (less the logsumexp's own cotangent)."""
    def start():
        like = (q, k, v, do, lse, delta, shift)
        return _zeros(q.shape, like), _zeros(k.shape, like), _zeros(v.shape, like)

    def body(carry, i, j, bq, bk, visible):
        qc, doc, kc, vc = _get(q, 3, i, bq), _get(do, 3, i, bq), _get(k, 1, j, bk), _get(v, 1, j, bk)
        s = jnp.einsum("bkgqd,bskd->bkgqs", qc, kc, **F32) * scale
        p = jnp.exp(s - _get(lse, 3, i, bq)[..., None])
        if visible is not None:
            p = jnp.where(visible, p, 0.0)
        dp = jnp.einsum("bkgqd,bskd->bkgqs", doc, vc, **F32)
        ds = (p * (dp - _get(delta, 3, i, bq)[..., None]) * scale).astype(q.dtype)
        dq_c = jnp.einsum("bkgqs,bskd->bkgqd", ds, kc, **F32)
        dk_c = jnp.einsum("bkgqs,bkgqd->bskd", ds, qc, **F32)
        dv_c = jnp.einsum("bkgqs,bkgqd->bskd", p.astype(do.dtype), doc, **F32)
        if carry is None:
            return dq_c, dk_c, dv_c
        dq, dk, dv = carry
        return (_set(dq, 3, i, _get(dq, 3, i, bq) + dq_c), _set(dk, 1, j, _get(dk, 1, j, bk) + dk_c),
                _set(dv, 1, j, _get(dv, 1, j, bk) + dv_c))

    return _visit(mask, q.shape[3], k.shape[1], shift, body, acc, start, q)


def grouped(x, kv_heads: int):
    """``[b, s, H, d]`` -> ``[b, K, G, s, d]``: query head ``h`` serves kv head ``h // G``."""
    b, s, h, d = x.shape
    return x.reshape(b, s, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4)


def ungrouped(x):
    b, k, g, s, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, s, k * g, d)


def attention(q, k, v, *, scale: float, causal: bool = False, q_offset=0, block_size=512):
    """Blockwise attention of ``q`` ``[b, sq, H, d]`` to ``k``, ``v`` ``[b, sk, K, d]`` (BTNH,
    ``K`` dividing ``H``): ``(output like q, logsumexp [b, K, H/K, sq] float32)``, with a custom VJP
    whose backward is blockwise too. With ``causal``, query row ``i`` sits at position
    ``q_offset + i`` and sees keys ``0 .. q_offset + i``; a traced ``q_offset`` visits every chunk
    pair, an int skips those wholly masked. ``block_size``: an int or ``(block_q, block_k)``,
    each used where it divides its length, else the whole length."""
    bq, bk = block_sizes(block_size)
    shifted = not isinstance(q_offset, int)
    q_pos = None if shifted or not q_offset else tuple(range(q_offset, q_offset + q.shape[1]))
    mask = Mask(bool(causal), bq, bk, q_pos, None, shifted)
    return _attention(float(scale), mask, q, k, v, jnp.asarray(q_offset if shifted else 0, jnp.int32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(scale, mask, q, k, v, shift):
    return _attention_fwd(scale, mask, q, k, v, shift)[0]


def _attention_fwd(scale, mask, q, k, v, shift):
    out, lse = finish(fold(grouped(q, k.shape[2]), k, v, None, scale=scale, mask=mask, shift=shift))
    out = ungrouped(out).astype(q.dtype)
    return (out, lse), (q, k, v, out, lse, shift)


def _attention_bwd(scale, mask, res, cotangents):
    q, k, v, out, lse, shift = res
    dout, dlse = cotangents
    kv = k.shape[2]
    do = grouped(dout, kv)
    delta = jnp.sum(do.astype(jnp.float32) * grouped(out, kv).astype(jnp.float32), -1) - dlse
    dq, dk, dv = grads(grouped(q, kv), k, v, do, lse, delta, None, scale=scale, mask=mask, shift=shift)
    return ungrouped(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)
