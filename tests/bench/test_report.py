"""RESULTS.md's generated tables (benchmarks/report.py): in step with the results files, and
rewritten from them."""

import json
import shutil

from shardplan.benchmarks import report


def test_the_committed_page_is_in_step_with_the_results_files():
    assert report.main(["--check"]) == 0, "run python -m shardplan.benchmarks.report"


def test_a_table_is_rewritten_from_its_file_and_the_check_sees_a_stale_one(tmp_path, monkeypatch):
    results = tmp_path / "results"
    shutil.copytree(report.RESULTS, results, ignore=shutil.ignore_patterns("h200_profile", "*.png"))
    monkeypatch.setattr(report, "RESULTS", str(results))
    page = tmp_path / "RESULTS.md"
    page.write_text("# page\n\nprose kept\n\n<!-- generated: fidelity -->\nold\n<!-- end generated: fidelity -->\n")
    assert report.main(["--check", "--page", str(page)]) == 1
    assert report.main(["--page", str(page)]) == 0
    text = page.read_text()
    assert "prose kept" in text and "-->\nold\n" not in text and "| gpu | 70 | 70 |" in text
    assert report.main(["--check", "--page", str(page)]) == 0
    data = json.loads((results / "fidelity_gpu.json").read_text())
    data["rows"]["gpu"] = data["rows"]["gpu"][:10]          # a new run of the corpus
    (results / "fidelity_gpu.json").write_text(json.dumps(data))
    assert report.main(["--check", "--page", str(page)]) == 1
    report.main(["--page", str(page)])
    assert "| gpu | 10 |" in page.read_text()
