"""benchmarks/weak_scaling.py (the Megatron-LM weak-scaling table): its meshes, and the fields of a
row planned on a shrunken configuration held against each other (the real rows are in RESULTS.md)."""

import pytest

from shardplan.benchmarks import weak_scaling as ws

# Two nodes of 8, a GPT small enough to plan in seconds; the batch divides over all 16 GPUs.
SMALL = ws.Row(layers=2, hidden=128, heads=4, gpus=16, batch=32, seq=128, vocab=1024)


def test_rows_are_the_papers_and_their_meshes_are_nodes_of_eight(tmp_path):
    import shardplan
    assert len(ws.ROWS) == 10 and ws.ROWS[0] == ws.Row(24, 2304, 24, 32, 512)
    assert all(r.hidden % r.heads == 0 and r.gpus % 8 == 0 for r in ws.ROWS)
    mesh = ws.cluster_mesh(32, mesh_dir=str(tmp_path))
    preset = shardplan.load_mesh("a100-128x8")
    assert dict(zip(mesh.axis_names, mesh.axis_sizes)) == {"data": 4, "model": 8}
    assert mesh.device == preset.device and mesh.devices_per_node == 8
    assert [a.link for a in mesh.axes] == [preset.inter_node_link, preset.intra_node_link]
    assert (tmp_path / f"{mesh.name}.toml").exists()
    with pytest.raises(ValueError, match="nodes"):
        ws.cluster_mesh(12, mesh_dir=str(tmp_path))


@pytest.mark.parametrize("pipeline", ["off", 2])
def test_row_fields_are_consistent(pipeline, tmp_path):
    r = ws.plan_row(SMALL, pipeline=pipeline, remat="full", time_limit=5, mesh_dir=str(tmp_path))
    plan = r["plan"]
    # Every GPU is accounted for: tensor x pipeline x data parallel x what is left (replication, ...).
    assert r["tp"] * r["pp"] * r["dp"] * r["other"] == SMALL.gpus
    assert SMALL.batch % r["dp"] == 0
    assert r["pp"] == (plan.pipeline_config().stages if plan.pipeline else 1)
    assert (r["schedule"] == "-") == (plan.pipeline is None)
    if pipeline == 2:
        assert r["pp"] == 2 and "mb" in r["schedule"]
    # Exact parameter count of the GPT decoder: 12h^2 + 13h per layer, token and position embeddings, final LayerNorm.
    h, l = SMALL.hidden, SMALL.layers
    assert r["params_b"] * 1e9 == pytest.approx(l * (12 * h * h + 13 * h) + (SMALL.vocab + SMALL.seq) * h + 2 * h)
    assert r["step_s"] == pytest.approx(plan.cost.step_s) and r["step_s"] > 0
    assert 0 < r["memory_gib"] <= r["budget_gib"]
    assert 0 < r["tflops"] < ws.A100_PEAK_TFLOPS
    assert r["tflops"] == pytest.approx(ws.megatron_flops(SMALL) / r["step_s"] / SMALL.gpus / 1e12)
    assert r["remat"] == "full"
    cells = ws.format_row(r).strip("|").split("|")
    assert len(cells) == ws.HEADER.splitlines()[0].count("|") - 1


@pytest.mark.slow
def test_main_prints_the_table_and_survives_a_row_that_fails(monkeypatch, capsys):
    tiny_budget = ws.Row(layers=2, hidden=128, heads=4, gpus=16, batch=32, seq=128, vocab=1024)
    monkeypatch.setattr(ws, "ROWS", [SMALL, tiny_budget])
    assert ws.main(["--rows", "1", "--time-limit", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("| 2 | 128 | 4 | 16 | 32 |") and out[-3] == ws.HEADER.splitlines()[0]
    assert ws.main(["--rows", "2", "--memory-budget", "1KiB", "--time-limit", "5"]) == 1
    assert "InfeasibleBudgetError" in capsys.readouterr().out.splitlines()[-1]
