"""The command line: mesh list/show/validate/new, a corpus of bad mesh files, and a loader fuzz."""

import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from shardplan.cli import main
from shardplan.errors import MeshConfigError
from shardplan.mesh import load_mesh, mesh_from_dict, to_toml

GOOD = to_toml(load_mesh("h100-8"))

BAD_FILES = {
    "unknown_key.toml": (GOOD.replace('name = "h100-8"', 'name = "h100-8"\ncolour = "red"'), r"unknown key 'colour'"),
    "product.toml": (GOOD.replace("size = 4", "size = 3"), r"multiply to 6"),
    "bandwidth.toml": (GOOD.replace("bandwidth = 450000000000.0", "bandwidth = -1.0"),
                       r"\[links.nvlink.bandwidth\] must be a positive number"),
    "twice.toml": (GOOD.replace('name = "model"', 'name = "data"'), r"named twice"),
    "no_device.toml": (GOOD.replace("[device]", "[devicex]"), r"unknown key 'devicex'"),
    "syntax.toml": (GOOD.replace("[topology]", "[topology"), r"is not valid TOML"),
    "link_name.toml": (GOOD.replace('inter_node_link = "infiniband"', 'inter_node_link = "ib"'), r"names link 'ib'"),
    "zero_nodes.toml": (GOOD.replace("nodes = 1", "nodes = 0"), r"\[topology.nodes\] must be a positive"),
    "axis_name.toml": (GOOD.replace('name = "model"', 'name = "mo del"'), r"must be an identifier"),
    "hbm_string.toml": (GOOD.replace("hbm_bytes = 85899345920", 'hbm_bytes = "80GiB"'), r"\[device.hbm_bytes\]"),
    "heap_overhead.toml": (GOOD.replace("heap_overhead = 0.1", "heap_overhead = 1.5"), r"\[device.heap_overhead\] must be a fraction"),
}


def test_good_file_validates(tmp_path, capsys):
    path = tmp_path / "good.toml"
    path.write_text(GOOD)
    assert main(["mesh", "validate", str(path)]) == 0
    assert "valid" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_files_get_one_line_and_exit_2(name, tmp_path, capsys):
    text, match = BAD_FILES[name]
    path = tmp_path / name
    path.write_text(text)
    assert main(["mesh", "validate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert name in err
    import re
    assert re.search(match, err), err


def test_missing_file_is_named():
    with pytest.raises(MeshConfigError, match="neither a mesh file nor a preset"):
        load_mesh("/nonexistent/mesh.toml")


def test_cli_error_has_no_traceback():
    r = subprocess.run([sys.executable, "-m", "shardplan.cli", "mesh", "validate", "/nonexistent.toml"],
                       capture_output=True, text=True, env={**os.environ, "CI": "true"}, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "shardplan: error:" in r.stderr


def test_mesh_new_fills_minus_one_and_writes_a_valid_file(tmp_path):
    out = tmp_path / "m.toml"
    assert main(["mesh", "new", "--hardware", "h100-8x8", "--name", "m", "--ici-data", "2", "--ici-model", "-1",
                 "--dcn-data", "-1", "--out", str(out)]) == 0
    m = load_mesh(str(out))
    assert dict(zip(m.axis_names, m.axis_sizes)) == {"data": 16, "model": 4}
    assert [a.link.name for a in m.axes] == ["infiniband", "nvlink"]
    assert m.device == load_mesh("h100-8x8").device


@pytest.mark.parametrize("flags", [["--ici-model", "3"], ["--ici-a", "-1", "--ici-b", "-1"], ["--bogus", "2"], []])
def test_mesh_new_bad_flags_leave_no_file(flags, tmp_path, capsys):
    out = tmp_path / "m.toml"
    assert main(["mesh", "new", *flags, "--out", str(out)]) == 2
    assert not os.listdir(tmp_path)
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_mesh_show_has_derived_figures(capsys):
    assert main(["mesh", "show", "h100-8x8"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["bisection_bandwidth"] == 64 / 2 * 50e9
    assert [a["link"] for a in shown["axes"]] == ["infiniband", "nvlink"]
    assert shown["axes"][0]["all_reduce_1GiB_s"] > shown["axes"][1]["all_reduce_1GiB_s"]


def _mutations(rng, data):
    """Walk to a random table and delete, retype or rename one of its keys."""
    node = data
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            return
        k = keys[rng.integers(len(keys))]
        if isinstance(node[k], (dict, list)) and rng.random() < 0.6:
            node = node[k]
            continue
        choice = rng.integers(4)
        if choice == 0 and isinstance(node, dict):
            del node[k]
        elif choice == 1:
            node[k] = [None, -1, 0, 1.5, "x", [], {}, True, 10**30][rng.integers(9)]
        elif choice == 2 and isinstance(node, dict):
            node["k" + str(rng.integers(100))] = 1
        else:
            node[k] = [] if isinstance(node[k], dict) else {}
        return


def test_fuzzed_mesh_files_raise_only_config_errors():
    import tomllib
    base = tomllib.loads(GOOD)
    rng = np.random.default_rng(0)
    for _ in range(400):
        data = copy.deepcopy(base)
        for _ in range(int(rng.integers(1, 4))):
            _mutations(rng, data)
        try:
            mesh_from_dict(data, source="fuzz")
        except MeshConfigError:
            pass


def test_mesh_calibrate_writes_a_file_the_planner_uses(tmp_path):
    import jax
    import jax.numpy as jnp
    import shardplan
    out = tmp_path / "cal.toml"
    assert main(["mesh", "calibrate", "--quick", "--axes", "data=2,model=4", "--name", "cal", "--out", str(out)]) == 0
    assert main(["mesh", "validate", str(out)]) == 0
    m = load_mesh(str(out))
    assert m.calibration["devices"] == 8 and m.calibration["platform"] == "cpu"
    assert {a.link.name for a in m.axes} == {"measured-data", "measured-model"}
    assert all(a.link.bandwidth > 0 and a.link.latency >= 0 for a in m.axes)
    assert m.device.peak_flops["float32"] > 1e8 and m.device.hbm_bandwidth > 1e8
    # The measured links price the collectives.
    from shardplan.cost import ALL_REDUCE, Comm, CostModel
    t = CostModel(m).collective_time(Comm(ALL_REDUCE, ("model",), 2**20))
    link = m.axis("model").link
    assert t == pytest.approx(2 * (3 / 4 * 2**20 / link.bandwidth + 3 * link.latency))
    w, x = jnp.ones((64, 64)) / 8, jnp.ones((32, 64))
    step = shardplan.auto(lambda w, x: w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w),
                          mesh=str(out), time_limit=1)
    np.testing.assert_allclose(step(w, x), w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w), rtol=1e-6)


def test_fit_ring_recovers_bandwidth_and_latency():
    from shardplan.calibrate import fit_ring
    sizes = np.array([2**12, 2**16, 2**20, 2**22])
    n, bw, lat = 4, 3e9, 5e-5
    seconds = 2 * (n - 1) * lat + 2 * (n - 1) / n * sizes / bw
    got_bw, got_lat = fit_ring(sizes, seconds, n)
    assert got_bw == pytest.approx(bw, rel=1e-6) and got_lat == pytest.approx(lat, rel=1e-6)


def test_remat_choices_are_the_models_policies():
    from shardplan.models.layers import REMAT_POLICIES
    from shardplan.cli import REMAT_CHOICES
    assert set(REMAT_CHOICES) == set(REMAT_POLICIES)


def test_plan_command_with_remat_plans_less_memory(capsys):
    peaks = {}
    for remat in ("none", "full"):
        assert main(["plan", "--model", "gpt-tiny", "--mesh", "cpu-8", "--batch", "64", "--remat", remat,
                     "--time-limit", "2"]) == 0
        out = capsys.readouterr().out
        peaks[remat] = out.split("peak memory ")[1].split("/device")[0]
    from shardplan.sizes import parse_bytes
    assert parse_bytes(peaks["full"]) < parse_bytes(peaks["none"])
    # auto: the least recomputation whose plan fits; a budget only full recomputation meets.
    budget = (parse_bytes(peaks["full"]) + parse_bytes(peaks["none"])) // 2
    assert main(["plan", "--model", "gpt-tiny", "--mesh", "cpu-8", "--batch", "64", "--remat", "auto",
                 "--memory-budget", str(budget), "--time-limit", "2"]) == 0
    err = capsys.readouterr().err
    assert "remat none: no plan fits" in err and "remat auto: " in err and "remat auto: none" not in err
    with pytest.raises(SystemExit) as bad:
        main(["plan", "--model", "gpt-tiny", "--remat", "some"])
    assert bad.value.code == 2 and "invalid choice: 'some'" in capsys.readouterr().err
