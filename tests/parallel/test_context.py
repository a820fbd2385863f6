"""Context parallelism: all-gather, Ulysses and ring attention equal plain attention, values and
gradients, on 8 fake CPU devices, with their local attention cut into several chunks or whole;
their collectives are the ones :func:`collectives` predicts, and no device holds more than a few
chunks' scores."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from shardplan.compiler import hlo
from shardplan.parallel import context, flash
from shardplan.tracing.manual import body_peak

B, S, H, D = 4, 64, 8, 16

MESHES = {    # name: (axis sizes, batch_axes, seq_axes, head_axes)
    "seq8": ({"seq": 8}, (), ("seq",), ()),
    "data2-seq4": ({"data": 2, "seq": 4}, ("data",), ("seq",), ()),
    "data2-heads2-seq2": ({"data": 2, "heads": 2, "seq": 2}, ("data",), ("seq",), ("heads",)),   # LoongTrain 2-D
    "seq2-seq4": ({"seq": 2, "seq2": 4}, (), ("seq", "seq2"), ()),                                  # one ring of 8
}
FUNCTIONS = {"allgather": context.allgather_attention, "ulysses": context.ulysses_attention,
             "ring": context.ring_attention, "zigzag": context.ring_attention}


def _mesh(sizes):
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=(jax.sharding.AxisType.Auto,) * len(sizes))


def _attention(name, mesh_name, causal, **kw):
    sizes, batch_axes, seq_axes, head_axes = MESHES[mesh_name]
    if name == "zigzag":
        kw["load_balance"] = "zigzag"
    return lambda q, k, v: FUNCTIONS[name](q, k, v, mesh=_mesh(sizes), batch_axes=batch_axes, seq_axes=seq_axes,
                                           head_axes=head_axes, causal=causal, **kw)


def reference(q, k, v, causal):
    """Unsharded attention: einsum, softmax, einsum; each kv head serves H/K query heads."""
    k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _inputs(kv_heads, dtype=jnp.float32, seq=S):
    keys = jax.random.split(jax.random.key(0), 4)
    q, dout = (jax.random.normal(kk, (B, seq, H, D), dtype) for kk in keys[::3])
    k, v = (jax.random.normal(kk, (B, seq, kv_heads, D), dtype) for kk in keys[1:3])
    return q, k, v, dout


def _forward_backward(attn):
    def run(q, k, v, dout):
        out, pull = jax.vjp(attn, q, k, v)
        return (out, *pull(dout))
    return run


def _close(got, want, rtol):
    for g, w, what in zip(got, want, ("out", "dq", "dk", "dv")):
        err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)) / jnp.max(jnp.abs(w)))
        assert err < rtol, f"{what}: relative error {err:.2e}"


def _bytes_by_kind(entries):
    total = collections.Counter()
    for kind, _, nbytes in entries:
        total[kind] += nbytes
    return dict(total)


def _compiled_bytes(compiled, mesh):
    return _bytes_by_kind((c.kind, c.axes, c.nbytes * c.count) for c in hlo.collectives(compiled.as_text(), mesh))


def _predicted(name, mesh_name, causal, q, k, backward):
    sizes, batch_axes, seq_axes, head_axes = MESHES[mesh_name]
    return _bytes_by_kind(context.collectives(
        "ring" if name == "zigzag" else name, q.shape, k.shape, q.dtype, sizes, batch_axes=batch_axes,
        seq_axes=seq_axes, head_axes=head_axes, causal=causal, backward=backward,
        load_balance="zigzag" if name == "zigzag" else None))


# (strategy, mesh, causal, kv_heads): every strategy on every mesh, causal and not, GQA and not.
CASES = [(name, mesh, causal, kv) for name in ("allgather", "ulysses", "ring") for i, mesh in enumerate(MESHES)
         for causal, kv in (((False, 8), (True, 2)) if i % 2 == 0 else ((True, 8), (False, 2)))]
CASES += [("zigzag", mesh, True, kv) for mesh, kv in zip(MESHES, (8, 2, 8, 2))] + [("ring", "seq8", True, 8)]
# Local chunks (block_size: both, or (block_q, block_k)), several per device; 3 divides no length
# here, so its cases attend in one piece (the fallback), as 512 does in the tests below.
BLOCKS = (4, (2, 8), 2, 3, (8, 4))
CASES = [(*case, BLOCKS[i % len(BLOCKS)]) for i, case in enumerate(CASES)]


@pytest.mark.parametrize("name,mesh_name,causal,kv_heads,block_size", CASES,
                         ids=["-".join(map(str, c[:4])) + "-block" + "x".join(map(str, np.atleast_1d(c[4])))
                              for c in CASES])
def test_sharded_attention_equals_plain_attention_and_its_collectives_are_predicted(name, mesh_name, causal,
                                                                                        kv_heads, block_size):
    q, k, v, dout = _inputs(kv_heads)
    attn = _attention(name, mesh_name, causal, block_size=block_size)
    compiled = jax.jit(_forward_backward(attn)).lower(q, k, v, dout).compile()
    want = _forward_backward(lambda q, k, v: reference(q, k, v, causal))(q, k, v, dout)
    _close(compiled(q, k, v, dout), want, rtol=1e-5)
    # One forward and backward, in one program: exactly the bytes collectives() lists, per kind.
    mesh = _mesh(MESHES[mesh_name][0])
    assert _compiled_bytes(compiled, mesh) == _predicted(name, mesh_name, causal, q, k, backward=True)


@pytest.mark.parametrize("name,mesh_name", [("allgather", "data2-seq4"), ("ulysses", "seq8"), ("ring", "seq2-seq4"),
                                            ("zigzag", "data2-heads2-seq2")])
def test_forward_collectives_are_predicted(name, mesh_name):
    q, k, v, _ = _inputs(2)
    compiled = jax.jit(_attention(name, mesh_name, causal=True)).lower(q, k, v).compile()
    predicted = _predicted(name, mesh_name, True, q, k, backward=False)
    assert _compiled_bytes(compiled, _mesh(MESHES[mesh_name][0])) == predicted
    kind = {"allgather": "all-gather", "ulysses": "all-to-all"}.get(name, "collective-permute")
    assert set(predicted) == {kind}


def test_ring_attention_saves_only_its_inputs_output_and_logsumexp(capsys):
    q, k, v, _ = _inputs(2)
    print_saved_residuals(lambda q, k, v: _attention("ring", "data2-seq4", True)(q, k, v).sum(), q, k, v)
    saved = [line for line in capsys.readouterr().out.splitlines() if line.startswith("f32")]
    sizes = sorted(np.prod([int(d) for d in re.match(r"f32\[([\d,]*)\]", line).group(1).split(",")]) for line in saved)
    logsumexp = B * H * S          # [batch, kv heads, group, seq], float32
    assert sizes == sorted([q.size, k.size, v.size, q.size, logsumexp])


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.nothing_saveable])
def test_ring_attention_under_checkpoint(policy):
    q, k, v, dout = _inputs(2)
    attn = jax.checkpoint(_attention("zigzag", "data2-seq4", True, block_size=4), policy=policy)   # 2 per half
    got = jax.jit(_forward_backward(attn))(q, k, v, dout)
    _close(got, _forward_backward(lambda q, k, v: reference(q, k, v, True))(q, k, v, dout), rtol=1e-5)


@pytest.mark.slow
def test_ring_attention_in_a_scan_over_layers():
    q, _, _, dout = _inputs(H)
    weights = 0.3 * jax.random.normal(jax.random.key(1), (2, 3, D, D))     # two layers: wq, wk, wv each

    def model(attn):
        def loss(weights, x):
            def layer(x, w):
                return x + attn(x @ w[0], x @ w[1], x @ w[2]), None
            return jnp.sum(jax.lax.scan(layer, x, weights)[0] * dout)
        return jax.grad(loss, argnums=(0, 1))

    got = jax.jit(model(jax.checkpoint(_attention("ring", "seq8", True, block_size=4))))(weights, q)
    want = model(lambda q, k, v: reference(q, k, v, True))(weights, q)
    _close(got, want, rtol=1e-5)


@pytest.mark.parametrize("name", ["ulysses", "zigzag"])
def test_bfloat16_inputs_run_with_float32_statistics(name):
    q, k, v, dout = _inputs(2, jnp.bfloat16)
    got = jax.jit(_forward_backward(_attention(name, "data2-seq4", True, block_size=4)))(q, k, v, dout)
    assert all(x.dtype == jnp.bfloat16 for x in got)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, dout)]
    _close(got, _forward_backward(lambda q, k, v: reference(q, k, v, True))(*f32), rtol=2e-2)


def test_ulysses_needs_heads_divisible_by_the_seq_axis():
    q, k, v, _ = _inputs(2)
    q = q[:, :, :4]
    with pytest.raises(ValueError, match=r"4 local q_heads .* seq axes \('seq',\) of size 8; use ring_attention"):
        _attention("ulysses", "seq8", False)(q, k, v)


@pytest.mark.parametrize("name", ["allgather", "ulysses", "ring"])
def test_a_sequence_the_seq_axes_do_not_divide_is_refused(name):
    q, k, v, _ = _inputs(8, seq=60)
    with pytest.raises(ValueError, match=r"seq dimension \(array axis 1, size 60\) is split over mesh axes "
                                         r"\('seq',\) of size 8.*pad seq to a multiple of 8"):
        _attention(name, "seq8", False)(q, k, v)


def test_zigzag_needs_two_chunks_per_device():
    q, k, v, _ = _inputs(8, seq=72)
    with pytest.raises(ValueError, match=r"size 72\) is split over mesh axes \('seq',\) of size 8 times 2"):
        _attention("zigzag", "seq8", True)(q, k, v)


def test_unknown_mesh_axis_and_options_are_refused():
    q, k, v, _ = _inputs(8)
    mesh = _mesh({"seq": 8})
    with pytest.raises(ValueError, match=r"unknown mesh axis 'sequence'; the mesh has axes \('seq',\)"):
        context.ring_attention(q, k, v, mesh=mesh, seq_axes="sequence")
    with pytest.raises(ValueError, match=r"load_balance='striped'; choose None or 'zigzag'"):
        context.ring_attention(q, k, v, mesh=mesh, seq_axes="seq", causal=True, load_balance="striped")
    with pytest.raises(ValueError, match=r"unknown strategy 'flash'"):
        context.collectives("flash", q.shape, k.shape, q.dtype, {"seq": 8}, seq_axes=("seq",))
    with pytest.raises(ValueError, match=r"q_heads=8 is not a multiple of kv_heads=3"):
        context.allgather_attention(q, k[:, :, :3], v[:, :, :3], mesh=mesh, seq_axes="seq")
    with pytest.raises(ValueError, match=r"ulysses_attention: block_size=0; give a positive int or a \(block_q"):
        context.ulysses_attention(q, k, v, mesh=mesh, seq_axes="seq", block_size=0)


@pytest.mark.parametrize("name,block_size", [("zigzag", 3), ("allgather", (4, 3)), ("ulysses", (3, 4))])
def test_chunks_that_are_not_powers_of_two(name, block_size):
    # Sequence 48 on data2-seq4: 12 a device, zigzag halves of 6.
    q, k, v, dout = (x[:, :48] for x in _inputs(2))
    got = jax.jit(_forward_backward(_attention(name, "data2-seq4", True, block_size=block_size)))(q, k, v, dout)
    _close(got, jax.jit(_forward_backward(lambda q, k, v: reference(q, k, v, True)))(q, k, v, dout), rtol=1e-5)


def _plain(q, k, v, causal, offset):
    """Attention of queries at positions ``offset ..`` to keys from 0, with its logsumexp
    ``[batch, kv_heads, group, seq]``."""
    (b, sq, h, d), kv_heads = q.shape, k.shape[2]
    k, v = (jnp.repeat(x, h // kv_heads, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    if causal:
        s = jnp.where(offset + jnp.arange(sq)[:, None] >= jnp.arange(k.shape[1]), s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1).reshape(b, -1, h // kv_heads, sq)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v), lse


@pytest.mark.parametrize("causal,block_size,traced", [(False, 4, False), (True, (2, 6), False), (True, (4, 3), True),
                                                      (True, 5, True)])
def test_flash_attention_and_its_logsumexp_with_their_gradients(causal, block_size, traced):
    # Queries 16 .. 23 of 24 keys, the offset known or traced (all-gather's); 5 divides neither.
    q, k, v, dout = _inputs(2)
    q, k, v, dout = q[:, 16:24], k[:, :24], v[:, :24], dout[:, 16:24]
    w = jax.random.normal(jax.random.key(2), (B, 2, H // 2, 8))

    def loss(attn):
        def f(q, k, v, offset):
            out, lse = attn(q, k, v, offset)
            return jnp.sum(out * dout) + jnp.sum(lse * w), (out, lse)
        return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)

    def blockwise(q, k, v, offset):
        return flash.attention(q, k, v, scale=1 / np.sqrt(D), causal=causal, q_offset=offset if traced else 16,
                               block_size=block_size)

    (_, got), got_grads = jax.jit(loss(blockwise))(q, k, v, 16)
    (_, want), want_grads = jax.jit(loss(lambda q, k, v, offset: _plain(q, k, v, causal, 16)))(q, k, v, 16)
    _close([*got, *got_grads], [*want, *want_grads], rtol=1e-5)


def test_causal_chunk_pairs_wholly_masked_are_skipped():
    assert len(flash.Mask(True, 4, 4).pairs(16, 16)[2]) == 10                  # a triangle: 4 * 5 / 2 of 16
    assert len(flash.Mask(False, 4, 4).pairs(16, 16)[2]) == 16
    assert len(flash.Mask(True, 4, 4, shifted=True).pairs(16, 16)[2]) == 16     # a traced offset: all, masked
    assert flash.Mask(True, 5, 512).pairs(16, 16)[:2] == (16, 16)               # no chunk divides: whole
    # Zigzag's cases: its own block (causal), an earlier one through the front half, a later one
    # by the back rows; chunks cut from each half.
    zigzag = context._Ring(None, None, causal=True, zigzag=True, block_q=4, block_k=4)
    pairs = {kind: context._mask(zigzag, kind, 16).pairs(16, 16) for kind in context._cases(zigzag)}
    assert [len(p[2]) for p in pairs.values()] == [10, 8, 8]
    assert context._mask(zigzag, context._DIAG, 12).pairs(12, 12)[:2] == (6, 6)  # 4 does not divide 6


def _largest(jaxpr) -> int:
    """The bytes of the largest value any equation makes, in ``jaxpr`` and all jaxprs inside it."""
    big = 0
    for eqn in jaxpr.eqns:
        big = max([big] + [int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in eqn.outvars])
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    big = max(big, _largest(sub))
    return big


@pytest.mark.parametrize("name", ["zigzag", "allgather"])
def test_no_device_holds_more_than_a_few_chunks_of_scores(name):
    # Sequence 4096 on data2-seq4: a device holds batch 1, 4 heads (2 kv heads), 1024 positions.
    block, local = 128, 1024
    q, kv = jax.ShapeDtypeStruct((2, 4096, 4, 8), jnp.float32), jax.ShapeDtypeStruct((2, 4096, 2, 8), jnp.float32)
    attn = _attention(name, "data2-seq4", True, block_size=block)
    jaxpr = jax.make_jaxpr(_forward_backward(attn))(q, kv, kv, q).jaxpr
    bodies = [e.params["jaxpr"] for e in jaxpr.eqns if e.primitive.name == "shard_map"]   # per-device values
    assert len(bodies) == 2                                                               # forward, backward
    chunk_scores, whole_scores = 4 * block * block * 4, 4 * local * local * 4
    largest = max(_largest(body) for body in bodies)
    assert chunk_scores <= largest <= 2 * chunk_scores           # the walk saw the chunks' scores, no more
    # What the planner's memory model holds (manual.body_peak: unfused, all values live at once).
    assert max(body_peak(body) for body in bodies) < whole_scores / 4


def test_a_scanned_model_keeps_no_stacked_masks_outside_its_attention():
    # Masks made from constants alone are the same in every layer: JAX's partial evaluation of
    # the layer scan would compute each chunk pair's mask once outside it, stacked (32 GiB a
    # device for Llama-3-8B at 131072 tokens). Nothing the attention hands out may exceed q.
    mesh = _mesh({"data": 2, "seq": 4})

    def layer(x, w):
        q = (x @ w).reshape(2, 512, 8, 16)
        o = context.ulysses_attention(q, q, q, mesh=mesh, seq_axes=("seq",), batch_axes=("data",), causal=True,
                                      block_size=64)
        return x + o.reshape(2, 512, 128), None

    def loss(ws, x):
        return jax.lax.scan(layer, x, ws)[0].sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss))(jax.ShapeDtypeStruct((2, 128, 128), jnp.float32),
                                           jax.ShapeDtypeStruct((2, 512, 128), jnp.float32))
    outs = []

    def walk(j):
        for e in j.eqns:
            if e.primitive.name == "shard_map":
                outs.extend(v.aval for v in e.outvars)
                continue
            for p in e.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
                        walk(getattr(sub, "jaxpr", sub))
    walk(jaxpr.jaxpr)
    assert outs and not any(a.dtype == jnp.bool_ for a in outs)
    assert max(a.size for a in outs) <= 2 * 512 * 8 * 16
