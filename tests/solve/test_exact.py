"""Wide problems (meshes of three or more axes) searched a few options at a time: the tables
priced for a subset of options are the full tables' cells, and the search by mesh axes finds the
exact optimum where one is known, keeps a budget, and is what the planner runs."""

import jax
import numpy as np
import pytest

import shardplan
from shardplan.compiler.cost import CostModel
from shardplan.models.train import reference
from shardplan.sharding.rules import apply_rule
from shardplan.sharding.strategies import Enumerator
from shardplan.solve.exact import restricted_of, solve_by_axis_blocks, solve_reduced
from shardplan.solve.solver import peak_memory, total_cost
from shardplan.tracing.trace import CallSpec, trace_step
from shardplan.tracing.walk import build_graph

AXES = {"data": 2, "fsdp": 2, "model": 2}


def _enumerator(model, scan, batch=16, axes=AXES):
    ref = reference(model, scan=scan)
    state = jax.eval_shape(ref.init, jax.random.key(0))
    traced = trace_step(ref.train_step, (state, ref.batch(batch, abstract=True)), {},
                        CallSpec.make(ref.train_step, (), (), (0,), ()))
    graph = build_graph(traced.closed, traced.names, apply_rule, num_points=12, ties=traced.state_pairs)
    return Enumerator(graph, CostModel(shardplan.load_mesh("cpu-8", axes=axes)))


@pytest.mark.slow
def test_tables_priced_for_some_options_are_the_full_tables_cells():
    enum = _enumerator("llama-tiny", scan=True)
    full = enum.build()
    rng = np.random.default_rng(0)
    allowed = [sorted(rng.choice(len(o), size=min(len(o), int(rng.integers(1, 6))), replace=False).tolist())
               for o in enum.node_options()]
    part, expected = enum.build(allowed), restricted_of(full)(allowed)
    assert len(part.nodes) == len(expected.nodes)
    for got, want in zip(part.nodes, expected.nodes):
        assert got.options == want.options
        np.testing.assert_allclose(got.cost, want.cost, rtol=1e-12, atol=0)
        np.testing.assert_array_equal(got.memory, want.memory)
    assert set(part.edges) == set(expected.edges)
    for key, table in part.edges.items():
        np.testing.assert_allclose(table, expected.edges[key], rtol=1e-12, atol=0, err_msg=str(key))


def test_search_by_mesh_axes_finds_the_exact_optimum_where_elimination_can():
    enum = _enumerator("mlp-tiny", scan=True)
    full = enum.build()
    exact = solve_reduced(full)
    assert exact is not None
    start = [0] * len(full.nodes)
    sol = solve_by_axis_blocks(enum.node_options(), enum.build, start, bound=0.0)
    assert sol.stats.status == "LOCAL_OPTIMUM"
    assert sol.stats.objective == pytest.approx(total_cost(full, sol.choice), rel=1e-9)
    assert sol.stats.objective == pytest.approx(total_cost(full, exact), rel=1e-9)
    assert sol.stats.objective < total_cost(full, start)


def test_search_by_mesh_axes_under_a_budget_keeps_it_and_improves_on_its_start():
    enum = _enumerator("mlp-tiny", scan=True)
    nodes = enum.build(tables=False)
    free = solve_by_axis_blocks(enum.node_options(), enum.build, [0] * len(nodes.nodes), bound=0.0)
    leanest = [int(np.argmin(n.memory.max(axis=0) + 1e-30 * n.cost)) for n in nodes.nodes]
    low, high = peak_memory(nodes, leanest), peak_memory(nodes, free.choice)
    assert low < high
    budget = (low + high) / 2
    sol = solve_by_axis_blocks(enum.node_options(), enum.build, leanest, bound=0.0, budget_bytes=budget,
                               time_limit=2)
    assert sol.peak_memory <= budget
    start_cost = total_cost(enum.build([[c] for c in leanest]), [0] * len(leanest))
    assert sol.stats.objective < start_cost


@pytest.mark.parametrize("model", ["gpt-tiny", "vit-tiny"])
def test_the_planner_searches_three_axis_meshes_by_axes_and_prices_what_it_chose(model):
    ref = reference(model, scan=False)
    state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(16, abstract=True)
    p = shardplan.plan(ref.train_step, state, batch, mesh=shardplan.load_mesh("cpu-8", axes=AXES), cache=False)
    assert p.solver.status == "LOCAL_OPTIMUM"
    assert p.cost.searched_s == pytest.approx(p.solver.objective, rel=1e-9)
    assert p.solver.bound <= p.solver.objective
    # No worse than the best plan on two of the axes (a 2-axis mesh of the same devices).
    two = shardplan.plan(ref.train_step, state, batch, mesh=shardplan.load_mesh("cpu-8", axes={"data": 2, "model": 4}),
                         cache=False)
    assert p.cost.step_s <= two.cost.step_s * (1 + 1e-9)


@pytest.mark.slow
def test_memory_priced_into_the_exact_solve_finds_a_plan_within_the_budget():
    """:func:`lagrangian_start`, CP-SAT's start under a budget: within it, near CP-SAT's optimum."""
    from shardplan.solve.exact import lagrangian_start
    from shardplan.solve.simplify import eliminate_dead_ends, simplify
    from shardplan.solve.solver import solve
    from shardplan.solve.tying import tie
    enum = _enumerator("llama-tiny", scan=True, axes={"data": 2, "model": 4})
    problem, _ = eliminate_dead_ends(simplify(tie(enum.build()).problem).problem, memory=True)
    free = solve_reduced(problem, tie_layers=False)
    loose = peak_memory(problem, free)
    assert lagrangian_start(problem, loose) == free              # the optimum fits: it is the answer
    lean = solve(problem, budget_bytes=None, minimize_memory=True, time_limit=10)
    floor = peak_memory(problem, lean.choice)
    budget = floor + 0.3 * (loose - floor)
    start = lagrangian_start(problem, budget)
    assert start is not None and peak_memory(problem, start) <= budget
    best = solve(problem, budget_bytes=budget, time_limit=10, relative_gap=0.0, hint=start)
    assert best.stats.bound <= total_cost(problem, best.choice) <= total_cost(problem, start)
    assert total_cost(problem, start) <= 1.2 * best.stats.bound      # 3.7% over CP-SAT's optimum here
    assert total_cost(problem, start) > total_cost(problem, free)   # the budget costs something here
    assert lagrangian_start(problem, 0.5 * floor) is None          # below every plan: nothing fits


def _moe_step():
    """A top-2 mixture of experts with capacity, dispatch and combine written as one-hot einsums
    (as a user writes it, not the reference models' layer): every einsum couples the experts,
    groups, tokens and capacity dimensions, so its decisions are densely paired."""
    import jax.numpy as jnp
    experts, k, d, h, groups, tokens = 4, 2, 32, 64, 8, 16
    capacity = 2 * tokens * k // experts

    def loss(p, x, t):
        x = jnp.tanh(x @ p["emb"])
        probs = jax.nn.softmax(x @ p["router"], -1)
        gate, idx = jax.lax.top_k(probs, k)
        onehot = jax.nn.one_hot(idx, experts)
        flat = onehot.transpose(0, 2, 1, 3).reshape(groups, k * tokens, experts)
        pos = ((jnp.cumsum(flat, 1) - 1) * flat).reshape(groups, k, tokens, experts).transpose(0, 2, 1, 3)
        keep = (pos < capacity) * onehot
        slot = jax.nn.one_hot(jnp.sum(pos * keep, -1).astype(jnp.int32), capacity)
        dispatch = jnp.einsum("gske,gskc->gsec", keep, slot)
        combine = jnp.einsum("gsk,gske,gskc->gsec", gate / gate.sum(-1, keepdims=True), keep, slot)
        xe = jnp.einsum("gsec,gsd->egcd", dispatch, x)
        ye = jnp.einsum("egch,ehd->egcd", jax.nn.gelu(jnp.einsum("egcd,edh->egch", xe, p["wi"])), p["wo"])
        return jnp.mean(((x + jnp.einsum("egcd,gsec->gsd", ye, combine)) @ p["head"] - t) ** 2)

    def step(p, x, t):
        value, g = jax.value_and_grad(loss)(p, x, t)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), value

    keys = jax.random.split(jax.random.key(0), 6)
    p = {"emb": jax.random.normal(keys[0], (d, d)) * 0.1, "router": jax.random.normal(keys[1], (d, experts)),
         "wi": jax.random.normal(keys[2], (experts, d, h)) * 0.1,
         "wo": jax.random.normal(keys[3], (experts, h, d)) * 0.1, "head": jax.random.normal(keys[4], (d, d)) * 0.1}
    x = jax.random.normal(keys[5], (groups, tokens, d))
    return step, p, x, jnp.sin(x)


@pytest.mark.slow
def test_a_densely_paired_step_on_two_axes_is_solved_exactly(monkeypatch):
    """Eliminating the least table first grows one table past the limit on this step; the least
    fill first does not, so a two-axis mesh is still solved exactly (the search by mesh axes it
    fell back to stopped 14% short: the experts on the wrong axis)."""
    from shardplan.solve import exact
    step, p, x, t = _moe_step()
    mesh = shardplan.load_mesh("cpu-8", axes={"data": 2, "expert": 4})
    plan = shardplan.plan(step, p, x, t, mesh=mesh, cache=False, time_limit=5)
    assert plan.solver.status == "OPTIMAL", plan.solver
    greedy = exact._greedy_order
    monkeypatch.setattr(exact, "_greedy_order",
                        lambda problem, cap, fill: None if fill else greedy(problem, cap, fill=False))
    searched = shardplan.plan(step, p, x, t, mesh=mesh, cache=False, time_limit=5)
    assert searched.solver.status == "LOCAL_OPTIMUM"
    assert plan.solver.objective < searched.solver.objective
    # The exact plan runs as jax.jit computes the step.
    f = shardplan.auto(step, mesh=mesh, plan=plan)
    np.testing.assert_allclose(f(p, x, t)[1], jax.jit(step)(p, x, t)[1], rtol=1e-5)
