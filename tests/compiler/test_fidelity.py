"""The fidelity corpus's draws (benchmarks/fidelity.py): reproducible, varied, and valid for the
reference models they build; its summary's figures."""

import pytest

import shardplan
from shardplan.benchmarks.fidelity import MESHES, draw, summary


def test_a_seed_draws_the_same_model_every_time_and_the_fixed_set_covers_each_kind_and_mesh():
    for compiler in ("cpu", "gpu", "tpu"):
        fixed = [draw(seed, compiler) for seed in range(60)]
        assert fixed == [draw(seed, compiler) for seed in range(60)]
        assert {d.kind for d in fixed} == {"gpt", "llama", "moe", "cnn"}
        assert {(d.preset, d.axes) for d in fixed} == {(p, tuple(a.items())) for p, a in MESHES[compiler]}
        assert {d.scan for d in fixed} == {True, False} and {d.binding for d in fixed} == {True, False}
        for d in fixed:
            rows = 1
            for axis, n in d.axes:
                rows *= n if axis != "model" else 1
            assert d.batch % rows == 0, d.describe()


@pytest.mark.parametrize("seed", range(12))
def test_every_draw_builds_its_reference_model(seed):
    import jax

    from shardplan.benchmarks.fidelity import BASE
    from shardplan.models.train import reference
    d = draw(seed, "gpu")
    ref = reference(BASE[d.kind], scan=d.scan, **dict(d.overrides))
    jax.eval_shape(ref.init, jax.random.key(0))


def test_the_summary_gives_median_90th_percentile_and_worst_of_the_absolute_errors():
    rows = [{"status": "ok", "config": f"m{k}", "memory_error": e, "comm_error": 0.0, "memory_compiled": 1.0,
             "budget_bytes": 2.0} for k, e in enumerate([0.01, -0.02, 0.03, -0.10, 0.20])]
    rows.append({"status": "infeasible", "config": "big"})
    table, worst = summary("cpu", rows)
    assert table == "| cpu | 6 | 5 | 3.0% / 16.0% / 20.0% | 0.0% / 0.0% / 0.0% | 0 | 0 |"
    # Compiled over the budget: planned again with fit_compiled, which fitted one and not the other.
    rows[0].update(memory_compiled=3.0, fitted_compiled=1.5)
    rows[1].update(memory_compiled=3.0, fitted_compiled=2.5)
    assert summary("cpu", rows)[0].endswith("| 2 | 1 |")
    del rows[1]["fitted_compiled"]          # a row of a run that did not plan it again
    assert summary("cpu", rows)[0].endswith("| 2 | not run |")
    assert worst.splitlines()[0].startswith("  - cpu, memory +20.0%") and "m4" in worst.splitlines()[0]


def test_explain_gives_the_memory_band_measured_on_the_plans_compilers_corpus():
    import json
    import pathlib

    import jax.numpy as jnp

    from shardplan.compiler import bands
    rows = json.loads((pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "fidelity_cpu.json")
                      .read_text())["rows"]["cpu"]
    errors = sorted(abs(r["memory_error"]) for r in rows if r["status"] == "ok")
    n, p90, worst = bands.memory_band("cpu")
    assert (n, worst) == (len(errors), errors[-1]) and errors[0] <= p90 <= worst
    p = shardplan.plan(lambda w, x: jnp.sum(jnp.tanh(x @ w)), jnp.ones((64, 64)), jnp.ones((32, 64)), mesh="cpu-8",
                       cache=False)
    assert f"({n} models nobody tuned on), 90% of predicted memories within {p90:.0%}" in p.explain()
    assert bands.memory_band("none-such") is None and "no run of the seeded corpus" in bands.describe("none-such")


@pytest.mark.parametrize("seed", [2, 3])
def test_the_shipped_corpus_rows_are_what_this_code_predicts_and_compiles(seed):
    """The quick subset of the corpus: two fixed CPU models planned and compiled again give the
    rows that ship (a rule changed without running the corpus again fails here). The planner is
    deterministic (CP-SAT's deterministic time, one seed); the compiled bytes are XLA's, pinned
    by the jax version the rows were made with."""
    import json
    import pathlib

    import jax

    from shardplan.benchmarks.fidelity import measure
    data = json.loads((pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "fidelity_cpu.json")
                      .read_text())
    (shipped,) = [r for r in data["rows"]["cpu"] if r["seed"] == seed]
    row = measure(draw(seed, "cpu"), "cpu", 5.0)
    assert row["status"] == shipped["status"] == "ok"
    assert row["memory_predicted"] == pytest.approx(shipped["memory_predicted"], rel=1e-6)
    assert row["comm_predicted"] == pytest.approx(shipped["comm_predicted"], rel=1e-6)
    if jax.__version__ == data["jax"]:
        assert row["memory_compiled"] == pytest.approx(shipped["memory_compiled"], rel=0.01)
        assert row["comm_compiled"] == pytest.approx(shipped["comm_compiled"], rel=0.01)
