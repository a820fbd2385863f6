"""The seam for strategies that emit another computation: a vocabulary-parallel embedding lookup."""

import json
import re

import jax
import jax.numpy as jnp
import pytest

import shardplan
from shardplan.sharding import indexing

V, D = 65536, 4          # a table that must be split (budget) and can only be split by rows on 8 devices
MESH = shardplan.load_mesh("cpu-8", axes={"model": 8})


def _step(params, ids):
    def loss(p):
        return jnp.mean((p["embed"][ids] @ p["w"]) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, grads), value


def _args():
    params = {"embed": jax.random.normal(jax.random.key(0), (V, D)),
              "w": jax.random.normal(jax.random.key(1), (D, 16))}
    return params, jax.random.randint(jax.random.key(2), (8, 32), 0, V)


def test_a_row_split_table_is_looked_up_in_place_and_summed():
    params, ids = _args()
    f = shardplan.auto(_step, mesh=MESH, memory_budget="1MiB", donate_argnums=(0,), cache=False)
    ref = jax.jit(_step)
    mine, theirs = params, jax.tree.map(jnp.copy, params)
    for _ in range(3):                               # a loop of donated calls
        mine, loss = f(mine, ids)
        theirs, expected = ref(theirs, ids)
        assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    rewrites = f.plan.rewrites
    assert [r["kind"] for r in rewrites.values()] == ["vocab-parallel-gather"]
    assert next(iter(rewrites.values()))["operand"][0] == ("model",)
    # What XLA compiled: one all-reduce of the looked-up rows, no all-gather of the table.
    hlo = f.lower(params, ids).compile().as_text()
    assert not [line for line in hlo.splitlines() if "all-gather" in line and f"[{V}," in line]
    assert re.search(r"= f32\[8,32,4\]\{[0-9,]*\} all-reduce\(", hlo)
    # The rewrite travels with a saved plan.
    again = shardplan.Plan.from_json(f.plan.to_json())
    assert again.rewrites == rewrites and again.digest() == f.plan.digest()
    # A plan file naming a rewrite this shardplan does not know is refused, naming the kind.
    data = json.loads(f.plan.to_json())
    next(iter(data["rewrites"].values()))["kind"] = "ring-attention"
    with pytest.raises(shardplan.PlanFileError, match="unknown kind 'ring-attention'"):
        shardplan.Plan.from_json(json.dumps(data), source="edited.json")


def test_the_rewrite_is_chosen_because_it_is_cheaper(monkeypatch):
    params, ids = _args()
    with_rewrite = shardplan.plan(_step, params, ids, mesh=MESH, memory_budget="1MiB", cache=False)
    monkeypatch.setattr(indexing, "vocab_parallel_applies", lambda eqn: False)
    without = shardplan.plan(_step, params, ids, mesh=MESH, memory_budget="1MiB", cache=False)
    assert not without.rewrites
    assert with_rewrite.cost.comm_s < without.cost.comm_s
