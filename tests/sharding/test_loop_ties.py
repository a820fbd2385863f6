"""On a TPU the loss and metrics are computed before the backward loop, as the step's jaxpr has
them: the emitted program ties each small result of a large tensor that no loop and no state
reads (the loss's label gather, a metric's argmax) to the next loop's input through an
``optimization_barrier``, so libtpu cannot keep the logits alive through the loop to compute it
later (it did: RESULTS.md, session 31). Not for a GPU or CPU, whose schedulers do not."""

import json
import os
import subprocess
import sys
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

import shardplan
from shardplan import api
from shardplan.compiler import targets
from shardplan.devices.mesh import _preset_dir, mesh_from_dict
from shardplan.sharding import apply
from shardplan.tracing import trace

VOCAB, D, LAYERS, B, S = 512, 32, 3, 8, 16


def _v5e_8():
    """An 8-chip v5e slice (data 2, model 4): its plans run on the 8 CPU devices."""
    data = tomllib.loads((_preset_dir() / "tpu-v5e-256.toml").read_text())
    data["name"], data["topology"]["devices_per_node"] = "tpu-v5e-8", 8
    return mesh_from_dict(data, source="test", axes={"data": 2, "model": 4})


def _init():
    k = jax.random.split(jax.random.key(0), 3)
    return {"embed": jax.random.normal(k[0], (VOCAB, D)) / 4,
            "layers": jax.random.normal(k[1], (LAYERS, D, D)) / 8,
            "head": jax.random.normal(k[2], (D, VOCAB)) / 8}


def _batch():
    ids = jax.random.randint(jax.random.key(1), (B, S + 1), 0, VOCAB)
    return ids[:, :-1], ids[:, 1:]


def step(params, tokens, labels):
    def loss_fn(p):
        h = p["embed"][tokens]
        h, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w), None), h, p["layers"])
        logits = h @ p["head"]
        label_logits = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) - label_logits)
        return loss, jnp.mean(jnp.argmax(logits, axis=-1) == labels)
    (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), {"loss": loss, "accuracy": accuracy}


def _traced():
    params, (tokens, labels) = _init(), _batch()
    return trace.trace_step(step, (params, tokens, labels), {}, trace.CallSpec.make(step, donate_argnums=(0,)))


def _level_with_loops(jaxpr):
    """The jaxpr level that holds the step's loops (the step's own, or the body of a call it is)."""
    while not any(e.primitive.name == "scan" for e in jaxpr.eqns):
        (e,) = [e for e in jaxpr.eqns if apply._has_loop(e)]
        jaxpr = apply.sub_jaxpr(e)[0]
    return jaxpr


def test_the_loss_and_a_metric_are_tied_before_the_backward_loop_and_no_gradient_is():
    traced = _traced()
    state = frozenset(o for _, o in traced.state_pairs)
    assert len(state) == 3                             # the three updated weights
    jaxpr = _level_with_loops(traced.closed.jaxpr)
    ties, stateful = apply.pinned_before_loops(jaxpr, state)
    loops = [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "scan"]
    assert len(loops) == 2                             # forward, backward
    assert list(ties) == [loops[1]], ties              # all tied to the backward loop
    tied = ties[loops[1]]
    shapes = sorted(tuple(v.aval.shape) for v in tied)
    # the label logits (B, S, 1) as take_along_axis makes them, the argmax's (B, S) and the scalars
    assert (B, S, 1) in shapes and (B, S) in shapes and () in shapes, shapes
    # every tied result is small: none of the logits, nor their gradient, nor a weight's gradient
    assert all(int(np.prod(v.aval.shape)) <= B * S for v in tied), shapes
    assert not set(tied) & stateful
    made_by = {v: e for e in jaxpr.eqns for v in e.outvars}
    assert not any(made_by[v].primitive.name == "dot_general" for v in tied if v in made_by)


def test_a_step_without_state_outputs_ties_nothing():
    traced = _traced()
    jaxpr = _level_with_loops(traced.closed.jaxpr)
    # Every output taken for state: the loss and accuracy reach it, so nothing is free to move.
    ties, _ = apply.pinned_before_loops(jaxpr, frozenset(range(len(jaxpr.outvars))))
    assert ties == {}


def _barriers(lowered_text: str) -> int:
    return lowered_text.count("stablehlo.optimization_barrier")


def test_only_a_program_libtpu_compiles_is_tied_and_every_process_decides_alike():
    """The tie follows the platform of the devices the program is compiled for, which every
    process of a multi-controller job shares: a plan made on process 0 and one bound from its
    JSON on another emit the same program."""
    traced = _traced()
    assert api._tied_state(traced, "tpu") == frozenset(o for _, o in traced.state_pairs)
    assert api._tied_state(traced, "gpu") is None and api._tied_state(traced, "cpu") is None


def _tied_on_cpu(monkeypatch):
    """Ties on these CPU devices too, as libtpu's program has them."""
    tied = api._tied_state
    monkeypatch.setattr(api, "_tied_state", lambda traced, platform: tied(traced, "tpu"))


def test_the_tied_step_computes_what_jit_computes_in_a_loop(monkeypatch):
    _tied_on_cpu(monkeypatch)
    params, (tokens, labels) = _init(), _batch()
    planned = shardplan.auto(step, mesh=_v5e_8(), donate_argnums=(0,), cache=False)
    assert _barriers(planned.lower(params, tokens, labels).as_text()) == 1
    given = shardplan.auto(step, plan=shardplan.Plan.from_json(planned.plan.to_json()), donate_argnums=(0,))
    assert _barriers(given.lower(params, tokens, labels).as_text()) == 1     # as another process binds it
    plain = jax.jit(step)
    got, want = jax.tree.map(jnp.copy, params), params
    for _ in range(3):
        got, got_metrics = planned(got, tokens, labels)
        want, want_metrics = plain(want, tokens, labels)
        for k in ("loss", "accuracy"):
            np.testing.assert_allclose(float(got_metrics[k]), float(want_metrics[k]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_a_program_for_cpu_devices_holds_no_barrier():
    params, (tokens, labels) = _init(), _batch()
    planned = shardplan.auto(step, mesh=_v5e_8(), donate_argnums=(0,), cache=False)
    assert _barriers(planned.lower(params, tokens, labels).as_text()) == 0


def test_the_barrier_keeps_the_tied_values_and_the_loop_input_at_their_planned_specs(monkeypatch):
    _tied_on_cpu(monkeypatch)
    params, (tokens, labels) = _init(), _batch()
    planned = shardplan.auto(step, mesh=_v5e_8(), donate_argnums=(0,), cache=False)
    planned.make_plan(params, tokens, labels)
    c = planned._compiled((params, tokens, labels), {})
    with jax.set_mesh(c.mesh):
        closed = jax.make_jaxpr(c.jitted)(*planned._abstract(c, (params, tokens, labels), {}))

    def eqns(j):
        for e in j.eqns:
            yield e
            for p in e.params.values():
                for q in p if isinstance(p, (list, tuple)) else [p]:
                    sub = getattr(q, "jaxpr", q)
                    if isinstance(sub, jcore.Jaxpr):
                        yield from eqns(sub)
    found = list(eqns(closed.jaxpr))
    (barrier,) = [e for e in found if e.primitive.name == "optimization_barrier"]
    readers = [e for e in found if any(v in barrier.outvars for v in e.invars)]
    constrained = {v for e in readers if e.primitive.name == "sharding_constraint" for v in e.invars}
    planned_specs = [v for v in barrier.outvars if len(v.aval.shape)]
    assert planned_specs and set(planned_specs) <= constrained


def sequence(compiled_text: str) -> list[str]:
    """The entry computation's loops and label gathers, in the compiled schedule's order."""
    entry = compiled_text[compiled_text.index("\nENTRY"):].splitlines()
    return ["loop" if " while(" in line else "gather" for line in entry
            if " while(" in line or ("kCustom" in line and "gather" in line and "all-gather" not in line)]


@pytest.mark.skipif(not targets.available("tpu"), reason="needs libtpu: pip install 'shardplan[aot]'")
@pytest.mark.parametrize("tie", [True, False])
def test_libtpu_gathers_the_label_logits_after_the_backward_loop_unless_tied(tie):
    """256 v5e chips (16, 16), a vocabulary of 4096: without the tie, libtpu schedules the loss's
    label gather after both loops (only the returned loss reads it), so the logits live through
    the backward loop; with it, between the forward and backward loops."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tpu_label_gather.py")
    run = subprocess.run([sys.executable, script, "tie" if tie else "free"], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    order = json.loads(run.stdout.splitlines()[-1])
    # the embedding lookup's gather first, then the two loops with the label gather where it runs
    assert order == (["gather", "loop", "gather", "loop"] if tie else ["gather", "loop", "loop", "gather"]), order
