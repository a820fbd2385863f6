"""The benchmark harness: its cell selection, its ratio rule, and cells run end to end."""

import json

from shardplan.benchmarks.bench import CELLS, QUICK, Row, main
from shardplan.benchmarks.bench_output import ratio


def test_cells_filter_and_quick_subset(capsys):
    assert main(["--list", "--cells", "gpt2-small/h100-8(2,4);tiny/cpu-8(8,1)"]) == 0
    listed = capsys.readouterr().out.split()
    assert listed == ["gpt-tiny/cpu-8(8,1)/hbm", "llama-tiny/cpu-8(8,1)/hbm", "gpt2-small/h100-8(2,4)/hbm",
                      "gpt2-small/h100-8(2,4)/tight", "gpt2-small/h100-8(2,4)/tight/remat-full"]
    assert main(["--list", "--quick"]) == 0
    assert capsys.readouterr().out.split() == list(QUICK)
    assert main(["--list", "--cells", "no-such-cell"]) == 2
    assert {c.preset for c in CELLS} >= {"cpu-8", "h100-8", "h100-8x8", "a100-128x8", "tpu-v5e-256"}


def test_a_cell_runs_end_to_end_and_writes_its_tables(tmp_path, capsys):
    """One tiny cell through ``main``: every plan compiled on fake CPU devices, the tables and raw
    rows written, and on this cell (8-way data parallel is what a small model wants) the planner's
    compiled step no slower than the best hand plan."""
    assert main(["--cells", "gpt-tiny/cpu-8(8,1)/hbm", "--out", str(tmp_path), "--time-limit", "5"]) == 0
    rows = [Row(**r) for r in json.loads((tmp_path / "results.json").read_text())]
    assert {r.plan for r in rows} >= {"shardplan", "dp", "fsdp", "megatron", "maxtext"}
    assert all(r.status == "ok" or r.status.startswith("n/a") for r in rows), rows
    q, best = ratio(rows)
    assert best and q <= 1.001, (q, best)
    table = (tmp_path / "matrix.md").read_text()
    assert table.startswith("Command: `python -m shardplan.benchmarks.bench --cells") and "commit " in table
    assert (tmp_path / "results.csv").read_text().count("\n") == len(rows) + 1
    assert "gpt-tiny/cpu-8(8,1)/hbm" in capsys.readouterr().out


def test_ratio_uses_the_best_baseline_that_fits():
    rows = [Row("c", "shardplan", compiled_ms=9.0), Row("c", "dp", compiled_ms=10.0),
            Row("c", "fsdp", "over budget", compiled_ms=5.0), Row("c", "megatron", "n/a: x")]
    assert ratio(rows) == (0.9, "dp")
    assert ratio([Row("c", "shardplan", "infeasible: needs 1 GiB"), Row("c", "dp", compiled_ms=1.0)])[1] == ""


def test_megatron_3d_runs_a_pipeline_across_nodes_and_is_not_offered_on_one(tmp_path):
    """The Megatron 3D hand plan: stages split off the data axis across the two nodes, TP inside,
    compiled (on the cpu target here) with the pipeline's stage-to-stage permutes; one node: n/a."""
    import os
    import sys

    import jax
    # tests/parallel is on sys.path only where a test of it ran first in this process
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parallel"))
    from test_pipeline_search import TWO_NODES

    import shardplan
    from shardplan.benchmarks.bench import Cell, _megatron_3d
    from shardplan.models.train import reference
    path = tmp_path / "two_nodes.toml"
    path.write_text(TWO_NODES)
    ref = reference("gpt-tiny", scan=True)
    state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(16, abstract=True)
    cell = Cell("gpt-tiny", 16, str(path), (("data", 2), ("model", 4)))
    row = _megatron_3d(cell, ref, state, batch, shardplan.load_mesh(path), "cpu", 2**32)
    assert row.plan == "megatron-3d (PP 2, 16 microbatches, gpipe)" and row.status == "ok", row
    assert row.compiled_ms > 0 and row.collectives > 0
    one = _megatron_3d(Cell("gpt-tiny", 16, "cpu-8", (("data", 2), ("model", 4))), ref, state, batch,
                       shardplan.load_mesh("cpu-8", axes={"data": 2, "model": 4}), "cpu", 2**32)
    assert one.status.startswith("n/a: one node")


def test_a_long_context_cell_compares_the_planner_with_the_three_hand_sequence_splits():
    """The three MaxText context-parallel strategies as hand plans (sequence over ``seq``, FSDP
    weights) next to the planner's context="auto", compiled on fake CPU devices."""
    from shardplan.benchmarks.bench import Cell, run_cell
    cell = Cell("llama-tiny-cp", 4, "cpu-8", (("data", 2), ("seq", 4)), context=True)
    rows = {r.plan: r for r in run_cell(cell, time_limit=5.0)}
    assert "megatron-3d" not in rows
    for kind in ("cp-allgather", "cp-ulysses", "cp-ring"):
        assert rows[kind].status == "ok" and rows[kind].compiled_ms > 0, rows[kind]
    ring = rows["cp-ring"]
    assert ring.comm_ms_by_kind.get("collective-permute", 0) > 0
    assert rows["cp-ulysses"].comm_ms_by_kind.get("all-to-all", 0) > 0
    planner = rows["shardplan"]
    assert planner.status == "ok" and planner.predicted_ms > 0
