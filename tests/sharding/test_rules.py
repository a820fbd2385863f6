"""The sharding rules, one at a time: each registered rule run alone on one equation of a tiny
jaxpr, and what it relates (unions, pair edges with the spec they need, dots) checked."""

import jax
import jax.numpy as jnp
import pytest

from shardplan.ir.graph import Graph
from shardplan.sharding.rules import RULES, Site, apply_rule, default_rule, rule


def _site(fn, *args, index=-1, device=""):
    """The ``index``-th equation of ``fn``'s jaxpr as a :class:`Site` on a graph of its own
    tensors (its operands and results), with no rule applied yet."""
    eqn = jax.make_jaxpr(fn)(*args).jaxpr.eqns[index]
    g = Graph()
    g.device = device
    tid = lambda v, k: g.new_tensor(v.aval, f"t{k}", "activation", "test", 1.0, f"t:{k}") \
        if hasattr(v, "aval") and not isinstance(v, jax.extend.core.Literal) else None
    ins = [tid(v, k) for k, v in enumerate(eqn.invars)]
    outs = [tid(v, 100 + k) for k, v in enumerate(eqn.outvars)]
    return Site(g, eqn, ins, outs, 1.0)


def _needs(site, dst_spec, sizes=None):
    """For each pair edge the rule added: (src, dst, the spec ``src`` needs for ``dst_spec``)."""
    return [(e.src, e.dst, e.need(dst_spec, sizes or {})) for e in site.g.edges]


x23 = jnp.zeros((2, 3))
x234 = jnp.zeros((2, 3, 4))


def test_every_rule_is_registered_under_its_primitives_and_dispatched_by_name():
    assert RULES["dot_general"].__name__ == "dot_rule"
    assert RULES["scatter-add"] is RULES["scatter_add"]
    assert RULES["cumsum"] is RULES["cumprod"]
    with pytest.raises(AssertionError, match="two rules"):
        rule("transpose")(lambda site: None)


def test_transpose_needs_the_operand_permuted_back():
    site = _site(lambda x: jnp.transpose(x, (2, 0, 1)), x234)
    RULES["transpose"](site)
    [(src, dst, need)] = _needs(site, (("a",), ("b",), ()))
    assert (src, dst) == (site.ins[0], site.out)
    assert need == (("b",), (), ("a",))       # out dim 0 is in dim 2, out dim 1 in dim 0


def test_a_reduction_keeps_the_other_dims_and_leaves_the_reduced_axes_partial():
    site = _site(lambda x: jnp.sum(x, axis=1), x234)
    RULES["reduce_sum"](site)
    [edge] = site.g.edges
    assert edge.produced((("a",), ("b",), ())) == ((("a",), ()), ("b",))


def test_a_broadcast_needs_nothing_of_the_dims_it_grows():
    site = _site(lambda x: jnp.broadcast_to(x[:, None, :], (2, 5, 3)), x23)
    RULES["broadcast_in_dim"](site)
    [(_, _, need)] = _needs(site, (("a",), ("b",), ("c",)))
    assert need in ((("a",), ("c",)), (("a",), (), ("c",)))


@pytest.mark.parametrize("fn, whole", [
    (lambda x: x[:, 1:], {1}),                                # slice: the cut dim
    (lambda x: jax.lax.cumsum(x, axis=0), {0}),               # a scan along an axis
    (lambda x: jax.lax.rev(x, (1,)), {1}),
    (lambda x: jax.lax.sort(x, dimension=0), {0}),
    (lambda x: jnp.concatenate([x, x], axis=1), {1}),
])
def test_dims_an_op_moves_along_are_whole_on_every_device(fn, whole):
    site = _site(fn, x23)
    RULES[site.prim](site)
    assert site.g.edges, site.prim
    for _, _, need in _needs(site, (("a",), ("b",))):
        assert need == tuple(() if d in whole else axes for d, axes in enumerate((("a",), ("b",)))), site.prim


def test_a_batched_cholesky_is_whole_on_its_matrix_dims_not_elementwise():
    site = _site(lambda x: jax.lax.linalg.cholesky(x, symmetrize_input=False), jnp.ones((4, 3, 3)), index=0)
    assert site.prim == "cholesky" and not site.params        # same shape, no params: not elementwise
    apply_rule(site.g, site.eqn, site.ins, site.outs, 1.0)
    assert [n for _, _, n in _needs(site, (("a",), ("b",), ()))] == [(("a",), (), ())]


def test_the_dot_rule_adds_a_dot_with_its_batch_free_and_contracted_dims():
    site = _site(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), x234, jnp.zeros((2, 4, 5)))
    RULES["dot_general"](site)
    [dot] = site.g.dots
    assert dot.dims == ((0, 0, 0), (1, None, 1), (None, 2, 2), (2, 1, None))


def test_top_k_is_whole_on_gpu_and_cpu_and_split_but_its_last_dim_on_a_tpu():
    for device, need in (("NVIDIA H100 80GB HBM3", ((), ())), ("TPU v5 lite", (("a",), ()))):
        site = _site(lambda x: jax.lax.top_k(x, 2), x23, device=device)
        RULES["top_k"](site)
        assert {n for _, _, n in _needs(site, (("a",), ()))} == {need}, device


def test_the_default_rule_unions_elementwise_and_gathers_the_unknown_with_one_warning():
    site = _site(lambda x, y: x * y, x23, x23)
    assert site.prim not in RULES
    default_rule(site)
    assert not site.g.edges and len({site.g.group_of(t) for t in (*site.ins, site.out)}) == 1

    site = _site(lambda x: x * jnp.ones((1, 3)), x23)      # broadcasts along its size-1 dim
    default_rule(site)
    assert [n for _, _, n in _needs(site, (("a",), ("b",)))] == [((), ("b",))]

    site = _site(lambda a, b: jax.lax.linalg.triangular_solve(a, b, left_side=True, lower=True),
                 jnp.eye(3), jnp.ones((3, 2)))
    with pytest.warns(UserWarning, match="no sharding rule for primitive 'triangular_solve'"):
        apply_rule(site.g, site.eqn, site.ins, site.outs, 1.0)
    assert [n for _, _, n in _needs(site, (("a",), ()))] == [((), ()), ((), ())]      # both operands whole
