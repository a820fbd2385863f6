"""The ILP, its exact simplification and layer tying, against brute force on small problems."""

import itertools
import threading

import jax
import numpy as np
import pytest

import shardplan
from shardplan.ir.problem import Node, Problem
from shardplan.models.train import reference
from shardplan.solve.simplify import expand, simplify
from shardplan.solve.solver import peak_memory, solve, total_cost
from shardplan.solve.tying import tie, untie


def _random_problem(seed, n=7, points=2, memory=True):
    rng = np.random.default_rng(seed)
    nodes = []
    for i in range(n):
        k = int(rng.integers(2, 4))
        mem = rng.uniform(0, 10, (points, k)) if memory and i % 3 == 0 else np.zeros((points, k))
        nodes.append(Node("group", i, [{} for _ in range(k)], rng.uniform(0, 1, k), mem))
    edges = {}
    for a in range(n - 1):                          # a chain, plus a few chords (cycles)
        edges[(a, a + 1)] = rng.uniform(0, 2, (len(nodes[a].options), len(nodes[a + 1].options)))
    for a, b in [(0, 3), (2, 6)]:
        edges[(a, b)] = rng.uniform(0, 2, (len(nodes[a].options), len(nodes[b].options)))
    return Problem(nodes, edges, np.zeros(points), {}, {})


def _brute(problem, budget=None):
    best = None
    for choice in itertools.product(*[range(len(n.options)) for n in problem.nodes]):
        if budget is not None and peak_memory(problem, list(choice)) > budget:
            continue
        cost = total_cost(problem, list(choice))
        if best is None or cost < best[0] - 1e-12:
            best = (cost, list(choice))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_simplified_solve_matches_brute_force(seed):
    problem = _random_problem(seed)
    reduced = simplify(problem)
    sol = solve(reduced.problem, budget_bytes=None, time_limit=10)
    choice = expand(reduced, sol.choice, len(problem.nodes))
    assert total_cost(problem, choice) == pytest.approx(_brute(problem)[0], abs=1e-8)
    assert sol.stats.status == "OPTIMAL"


@pytest.mark.parametrize("seed", range(4))
def test_memory_budget_is_respected_and_optimal(seed):
    problem = _random_problem(seed)
    free = _brute(problem)
    budget = peak_memory(problem, free[1]) * 0.8
    expected = _brute(problem, budget)
    reduced = simplify(problem)
    sol = solve(reduced.problem, budget_bytes=budget, time_limit=10)
    if expected is None:
        assert sol is None
        return
    choice = expand(reduced, sol.choice, len(problem.nodes))
    assert peak_memory(problem, choice) <= budget + 1e-6
    assert total_cost(problem, choice) == pytest.approx(expected[0], rel=1e-6)


def test_tying_gives_every_member_the_same_choice_and_exact_cost():
    problem = _random_problem(0, memory=False)
    for i in (1, 4):            # two pairs of "repeated layers"
        problem.nodes[i + 1] = dataclass_copy(problem.nodes[i])
    for node, sig in zip(problem.nodes, [0, 7, 7, 0, 9, 9, 0]):
        node.signature = sig
    tied = tie(problem)
    assert len(tied.problem.nodes) == 5
    sol = solve(tied.problem, budget_bytes=None, time_limit=10)
    choice = untie(tied, sol.choice)
    assert choice[1] == choice[2] and choice[4] == choice[5]
    assert total_cost(problem, choice) == pytest.approx(sol.stats.objective, rel=1e-9)
    constrained = min(total_cost(problem, list(c))
                      for c in itertools.product(*[range(len(n.options)) for n in problem.nodes])
                      if c[1] == c[2] and c[4] == c[5])
    assert sol.stats.objective == pytest.approx(constrained, rel=1e-6)


def dataclass_copy(node):
    import dataclasses
    return dataclasses.replace(node, cost=node.cost.copy(), memory=node.memory.copy())


def test_unrolled_layers_are_planned_alike():
    ref = reference("gpt-tiny", scan=False, n_layers=3)
    state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(8, abstract=True)
    p = shardplan.plan(ref.train_step, state, batch, mesh="cpu-8", time_limit=5)
    specs = {r.name: r.spec for r in p.inputs}
    for leaf in ("['fc']['kernel']", "['qkv']['kernel']", "['out']['kernel']"):
        layer_specs = {specs[f"[0]['params']['layers']['blocks'][{i}]{leaf}"] for i in range(3)}
        assert len(layer_specs) == 1, leaf


def test_a_stopped_token_stops_the_solves_of_its_thread():
    """Planning on a second thread that the caller gave up on (Ctrl-C, an error) stops: the
    next CP-SAT solve there raises Stopped; other threads' solves are untouched."""
    from shardplan.planning.search import _on_thread
    from shardplan.solve.solver import Stopped, StopToken, stoppable
    problem = _random_problem(0)
    token = StopToken()
    token.stop()
    with stoppable(token), pytest.raises(Stopped):
        solve(problem, budget_bytes=None, time_limit=5)
    assert solve(problem, budget_bytes=None, time_limit=5) is not None             # not under the token: solved

    started = threading.Event()

    def work():
        started.wait()
        return solve(problem, budget_bytes=None, time_limit=5)
    wait = _on_thread(work)
    wait.stop()
    started.set()
    with pytest.raises(Stopped):
        wait()
