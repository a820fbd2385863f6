"""The benchmark harness's cell selection and its ratio rule (the runs themselves are in CI's --quick)."""

from shardplan.benchmarks.bench import CELLS, QUICK, Row, main, ratio


def test_cells_filter_and_quick_subset(capsys):
    assert main(["--list", "--cells", "gpt2-small/h100-8(2,4);tiny/cpu-8(8,1)"]) == 0
    listed = capsys.readouterr().out.split()
    assert listed == ["gpt-tiny/cpu-8(8,1)/hbm", "llama-tiny/cpu-8(8,1)/hbm", "gpt2-small/h100-8(2,4)/hbm",
                      "gpt2-small/h100-8(2,4)/tight", "gpt2-small/h100-8(2,4)/tight/remat-full"]
    assert main(["--list", "--quick"]) == 0
    assert capsys.readouterr().out.split() == list(QUICK)
    assert main(["--list", "--cells", "no-such-cell"]) == 2
    assert {c.preset for c in CELLS} >= {"cpu-8", "h100-8", "h100-8x8", "a100-128x8", "tpu-v5e-256"}


def test_ratio_uses_the_best_baseline_that_fits():
    rows = [Row("c", "shardplan", compiled_ms=9.0), Row("c", "dp", compiled_ms=10.0),
            Row("c", "fsdp", "over budget", compiled_ms=5.0), Row("c", "megatron", "n/a: x")]
    assert ratio(rows) == (0.9, "dp")
    assert ratio([Row("c", "shardplan", "infeasible: needs 1 GiB"), Row("c", "dp", compiled_ms=1.0)])[1] == ""
