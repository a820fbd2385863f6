"""Recomputation chosen per layer class, jointly with the sharding (shardplan.parallel.recompute)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardplan
from shardplan.parallel import recompute
from shardplan.parallel.recompute import Site

# -- the search, on synthetic plans -------------------------------------------------------------------


@dataclasses.dataclass
class _Cost:
    step_s: float


@dataclasses.dataclass
class _Plan:
    cost: _Cost


def _synthetic(saves, extra, base_mem, budget):
    """An ``evaluate`` pricing policy p of class k at ``extra[k][p]`` seconds and ``base_mem -
    saves[k][p]`` bytes; ``None`` over ``budget``. Records what it was asked."""
    asked = []

    def evaluate(choices, beat=float("inf")):
        asked.append(dict(choices))
        mem = base_mem - sum(saves[k][p] for k, p in choices.items())
        if mem > budget:
            return None
        step = 1.0 + sum(extra[k][p] for k, p in choices.items())
        return _Plan(_Cost(step))
    return evaluate, asked


def _sites(*keys, checkpointed=()):
    return {k: Site(k, f"m:{i} (f)", 4, k in checkpointed) for i, k in enumerate(keys)}


SAVES = {"wide": {"none": 0, "dots_all": 3, "dots": 5, "full": 6},
         "narrow": {"none": 0, "dots_all": 0.2, "dots": 0.4, "full": 0.5}}
EXTRA = {"wide": {"none": 0, "dots_all": 0.01, "dots": 0.05, "full": 0.2},
         "narrow": {"none": 0, "dots_all": 0.01, "dots": 0.02, "full": 0.03}}


def test_search_recomputes_the_class_that_needs_it_and_not_the_other():
    evaluate, asked = _synthetic(SAVES, EXTRA, base_mem=10, budget=7)
    choices, plan, tried = recompute.search(evaluate, _sites("wide", "narrow"))
    assert choices == {"wide": "dots_all", "narrow": "none"}
    assert plan.cost.step_s == pytest.approx(1.01)
    assert len(tried) == len(asked) and asked[0] == {"wide": "none", "narrow": "none"}


def test_search_recomputes_with_memory_to_spare_where_that_is_priced_faster():
    # Nothing binds the budget, and recomputing the narrow class is priced faster (its kept
    # residuals cost more HBM traffic than recomputing them inside the backward's kernels): the
    # search does not stop at no recomputation because it fits.
    extra = {**EXTRA, "narrow": {**EXTRA["narrow"], "dots_all": -0.004}}
    evaluate, asked = _synthetic(SAVES, extra, base_mem=5, budget=7)
    choices, plan, _ = recompute.search(evaluate, _sites("wide", "narrow"))
    assert choices == {"wide": "none", "narrow": "dots_all"} and plan.cost.step_s == pytest.approx(0.996)
    assert len(asked) == 16            # every assignment of the two classes


def test_search_keeps_the_users_own_checkpoint_and_searches_the_rest():
    evaluate, asked = _synthetic({**SAVES, "mine": {"user": 0}}, {**EXTRA, "mine": {"user": 0}}, base_mem=10, budget=7)
    choices, _, _ = recompute.search(evaluate, _sites("wide", "narrow", "mine", checkpointed=("mine",)))
    assert choices["mine"] == recompute.USER and all(a["mine"] == recompute.USER for a in asked)


def test_search_of_many_classes_descends_one_class_at_a_time():
    keys = ("a", "b", "c")
    saves = {k: SAVES["narrow"] for k in keys} | {"a": SAVES["wide"]}
    extra = {k: EXTRA["narrow"] for k in keys} | {"a": EXTRA["wide"]}
    evaluate, asked = _synthetic(saves, extra, base_mem=10, budget=7)
    choices, plan, _ = recompute.search(evaluate, _sites(*keys))
    assert choices == {"a": "dots_all", "b": "none", "c": "none"}
    assert len(asked) < 4 ** 3


def test_bad_policy_names_are_refused_with_the_choices():
    with pytest.raises(shardplan.RecomputeError, match="'some' is not one of none, dots_all, dots, offload, full"):
        shardplan.plan(lambda s, b: (s, 0.0), {}, {}, mesh="cpu-8", remat="some")


# -- a step of two layer classes, planned and run ------------------------------------------------------

D, WIDE, NARROW, L, B = 64, 1024, 64, 4, 512
TX = optax.adamw(1e-3)


def _block(h, w):
    w_in, w_out = w
    return h + jnp.tanh(h @ w_in) @ w_out, None


def _linear_block(h, w):
    # Its only residual is a matmul's result, which every policy but "full" keeps: none, dots_all
    # and dots price alike, and the search keeps the first (no recomputation).
    w_in, w_out = w
    return h + (h @ w_in) @ w_out, None


def _loss(params, x, y, block=_block, narrow_block=_linear_block):
    h, _ = shardplan.layer_scan(block, x, (params["a_in"], params["a_out"]))            # the wide class
    h, _ = shardplan.layer_scan(narrow_block, h, (params["b_in"], params["b_out"]))     # the narrow class
    return jnp.mean((h - y) ** 2)


def _step(loss):
    def train_step(state, batch):
        params, opt = state
        value, grads = jax.value_and_grad(loss)(params, batch["x"], batch["y"])
        updates, opt = TX.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), value
    return train_step


def _state_and_batch():
    ks = jax.random.split(jax.random.key(0), 6)
    shapes = {"a_in": (L, D, WIDE), "a_out": (L, WIDE, D), "b_in": (L, D, NARROW), "b_out": (L, NARROW, D)}
    params = {k: jax.random.normal(kk, s) * 0.05 for kk, (k, s) in zip(ks, shapes.items())}
    batch = {"x": jax.random.normal(ks[4], (B, D)), "y": jax.random.normal(ks[5], (B, D))}
    return (params, TX.init(params)), batch


KW = dict(mesh="cpu-8", donate_argnums=(0,), cache=False)
BUDGET = "4MiB"      # the plan without recomputation needs about 5 MiB per device; recomputing the wide class fits


@pytest.fixture(scope="module")
def planned():
    state, batch = _state_and_batch()
    abstract = jax.eval_shape(lambda: state)
    step = _step(_loss)
    auto = shardplan.plan(step, abstract, batch, remat="auto", memory_budget=BUDGET, **KW)
    return step, state, batch, abstract, auto


@pytest.mark.slow
def test_two_layer_classes_get_different_policies(planned):
    step, _, batch, abstract, auto = planned
    wide, narrow = auto.remat["sites"]
    assert wide["layers"] == L and narrow["layers"] == L and wide["key"] != narrow["key"]
    assert wide["policy"] != "none" and narrow["policy"] == "none", auto.remat
    assert auto.cost.memory_bytes <= shardplan.parse_bytes(BUDGET)
    # No slower than any one policy for every class, and faster than no recomputation (which fits
    # only on a slower sharding, if at all).
    for policy in recompute.policies_for(False):         # a CPU mesh: no host offload
        try:
            uniform = shardplan.plan(step, abstract, batch, remat=policy, memory_budget=BUDGET, **KW)
        except shardplan.InfeasibleBudgetError:
            assert policy != wide["policy"]
            continue
        assert auto.cost.step_s <= uniform.cost.step_s * (1 + 1e-9), policy
        if policy == "none":
            assert auto.cost.step_s < uniform.cost.step_s and uniform.solver.memory_bound
    assert "recomputation: " in auto.explain() and f"({L} layers): {wide['policy']}" in auto.explain()


def test_ample_memory_recomputes_nothing(planned):
    step, _, batch, abstract, _ = planned
    p = shardplan.plan(step, abstract, batch, remat="auto", **KW)
    assert [s["policy"] for s in p.remat["sites"]] == ["none", "none"]


@pytest.mark.slow
def test_the_chosen_recomputation_runs_and_matches_jit(planned):
    step, state, batch, _, auto = planned
    f = shardplan.auto(step, remat="auto", memory_budget=BUDGET, **KW)
    ref_state, sharded_state = state, jax.tree.map(jnp.copy, state)
    jitted = jax.jit(step)
    for _ in range(3):
        ref_state, ref_loss = jitted(ref_state, batch)
        sharded_state, loss = f(sharded_state, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert f.plan.remat == auto.remat and f.plan.digest() == auto.digest()


def test_a_saved_plan_keeps_its_recomputation(planned, tmp_path):
    step, state, batch, _, auto = planned
    path = tmp_path / "plan.json"
    auto.save(path)
    assert json.loads(path.read_text())["remat"] == auto.remat
    loaded = shardplan.Plan.load(path)
    assert loaded.remat == auto.remat and loaded.digest() == auto.digest()
    f = shardplan.auto(step, plan=path, donate_argnums=(0,))
    _, loss = f(jax.tree.map(jnp.copy, state), batch)
    _, ref = jax.jit(step)(state, batch)
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)
    # An edited policy is refused by name.
    data = json.loads(path.read_text())
    data["remat"]["sites"][0]["policy"] = "most"
    path.write_text(json.dumps(data))
    with pytest.raises(shardplan.PlanFileError, match="recomputation policy 'most'"):
        shardplan.Plan.load(path)


def test_a_class_the_user_checkpointed_keeps_its_policy(planned):
    _, _, batch, abstract, _ = planned
    mine = jax.checkpoint(_block, policy=jax.checkpoint_policies.nothing_saveable)
    step = _step(lambda p, x, y: _loss(p, x, y, block=mine, narrow_block=mine))
    p = shardplan.plan(step, abstract, batch, remat="auto", memory_budget=BUDGET, **KW)
    assert [s["policy"] for s in p.remat["sites"]] == [recompute.USER, recompute.USER]


def test_unrolled_layers_marked_with_layer_remat_form_one_class():
    def loss(params, x, y):
        h = x
        for i in range(L):
            h = shardplan.layer_remat(lambda h, w_in, w_out: _block(h, (w_in, w_out))[0])(
                h, params["a_in"][i], params["a_out"][i])
        return jnp.mean((h - y) ** 2)
    state, batch = _state_and_batch()
    abstract = jax.eval_shape(lambda: state)
    # On a GPU mesh: the GPU compiler recomputes unrolled layers (the CPU's holds what it holds
    # without: tests/tracing/test_cse.py).
    kw = {**KW, "mesh": "h100-8"}
    p = shardplan.plan(_step(loss), abstract, batch, remat="full", **kw)
    (site,) = p.remat["sites"]
    assert site["layers"] == L and site["policy"] == "full"
    p_none = shardplan.plan(_step(loss), abstract, batch, remat="none", **kw)
    assert p.cost.memory_bytes < p_none.cost.memory_bytes and p.cost.compute_s > p_none.cost.compute_s


def test_a_step_without_layer_markers_says_so():
    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
        return w - 0.1 * g, loss
    p = shardplan.plan(step, jax.ShapeDtypeStruct((64, 64), jnp.float32), jax.ShapeDtypeStruct((64, 64), jnp.float32),
                       mesh="cpu-8", remat="auto", cache=False)
    assert p.remat == {"sites": []} and any("the step has no layer stack" in w for w in p.warnings)
