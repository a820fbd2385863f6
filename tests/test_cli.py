"""The command line: mesh list/show/validate/new, a corpus of bad mesh files, a loader fuzz, bad flag
values, --json and Ctrl-C (one line on stderr, the exit code, nothing left on disk)."""

import concurrent.futures
import copy
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from shardplan.cli import main
from shardplan.devices.mesh import load_mesh, mesh_from_dict, to_toml
from shardplan.errors import MeshConfigError

GOOD = to_toml(load_mesh("h100-8"))
ENV = {**os.environ, "CI": "true"}
CLI = [sys.executable, "-m", "shardplan.cli"]

# name: (text, a pattern for each line mesh validate prints, in order)
BAD_FILES = {
    "unknown_key.toml": (GOOD.replace('name = "h100-8"', 'name = "h100-8"\ncolour = "red"'), r"unknown key 'colour'"),
    "product.toml": (GOOD.replace("size = 4", "size = 3"), r"multiply to 6"),
    "bandwidth.toml": (GOOD.replace("bandwidth = 450000000000.0", "bandwidth = -1.0"),
                       r"\[links.nvlink.bandwidth\] must be a positive number"),
    "twice.toml": (GOOD.replace('name = "model"', 'name = "data"'), r"named twice"),
    "no_device.toml": (GOOD.replace("[device]", "[devicex]"), r"unknown key 'devicex'",
                       r"\[device\] missing section or key 'device'"),
    "syntax.toml": (GOOD.replace("[topology]", "[topology"), r"is not valid TOML"),
    "link_name.toml": (GOOD.replace('inter_node_link = "infiniband"', 'inter_node_link = "ib"'), r"names link 'ib'"),
    "zero_nodes.toml": (GOOD.replace("nodes = 1", "nodes = 0"), r"\[topology.nodes\] must be a positive"),
    "axis_name.toml": (GOOD.replace('name = "model"', 'name = "mo del"'), r"must be an identifier"),
    "hbm_string.toml": (GOOD.replace("hbm_bytes = 85899345920", 'hbm_bytes = "80GiB"'), r"\[device.hbm_bytes\]"),
    "heap_overhead.toml": (GOOD.replace("heap_overhead = 0.1", "heap_overhead = 1.5"),
                           r"\[device.heap_overhead\] must be a fraction"),
    "nan.toml": (GOOD.replace("hbm_bandwidth = 3350000000000.0", "hbm_bandwidth = nan"),
                 r"\[device.hbm_bandwidth\] must be a positive number, got nan"),
    "three.toml": (GOOD.replace("hbm_bytes = 85899345920", "hbm_bytes = 0").replace("nodes = 1", "nodes = -1")
                   .replace('name = "model"', 'name = "mo del"'),
                   r"\[device.hbm_bytes\] must be a positive", r"\[topology.nodes\] must be a positive",
                   r"\[axes\[1\].name\] axis name must be an identifier"),
    "empty.toml": ("", *(rf"\[{k}\] missing section or key '{k}'"
                         for k in ("name", "device", "links", "topology", "axes"))),
}


def test_good_file_validates(tmp_path, capsys):
    path = tmp_path / "good.toml"
    path.write_text(GOOD)
    assert main(["mesh", "validate", str(path)]) == 0
    assert "valid" in capsys.readouterr().out


def test_corpus_starts_from_a_good_file():
    for name, (text, *_) in BAD_FILES.items():
        assert text != GOOD, f"{name}: the replacement did not match"


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_files_get_one_line_per_problem_and_exit_2(name, tmp_path, capsys):
    text, *matches = BAD_FILES[name]
    path = tmp_path / name
    path.write_text(text)
    assert main(["mesh", "validate", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == len(matches) and "Traceback" not in "".join(lines), lines
    for line, match in zip(lines, matches):
        assert line.startswith(f"shardplan: error: {path}: ") and re.search(match, line), (line, match)
    # Elsewhere (plan --mesh FILE) the same file is one line: the first problem and how many more there are.
    with pytest.raises(MeshConfigError) as e:
        load_mesh(str(path))
    assert len(str(e.value).splitlines()) == 1 and re.search(matches[0], str(e.value))
    assert (f"and {len(matches) - 1} more problem" in str(e.value)) == (len(matches) > 1)


UNDECODABLE = {
    "latin1.toml": (GOOD.replace("H100", "H100 \u00e9").encode("latin-1"), r"is not UTF-8 text \(byte \d+ is 0xe9"),
    "binary.toml": (bytes(range(256)) * 4, r"is not UTF-8 text \(byte 128 is 0x80"),
    "nul.toml": (b"\x00\x01\x02 name", r"is not valid TOML: "),
    "json.toml": (json.dumps({"name": "x", "device": {}}).encode(), r"is not valid TOML: "),
}


@pytest.mark.parametrize("name", sorted(UNDECODABLE))
def test_undecodable_files_get_one_line_naming_the_file(name, tmp_path, capsys):
    raw, match = UNDECODABLE[name]
    path = tmp_path / name
    path.write_bytes(raw)
    assert main(["mesh", "validate", str(path)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"shardplan: error: {path}: ") and re.search(match, line), line


def test_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode())
    assert load_mesh(str(path)).name == "h100-8"


def test_mesh_validate_prints_every_problem_in_a_process(tmp_path):
    text, *matches = BAD_FILES["three.toml"]
    (tmp_path / "three.toml").write_text(text)
    r = subprocess.run([*CLI, "mesh", "validate", "three.toml"], cwd=tmp_path, capture_output=True, text=True, env=ENV,
                       stdin=subprocess.DEVNULL)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 3 and "Traceback" not in r.stderr, r.stderr
    assert all(line.startswith("shardplan: error: three.toml: [") and re.search(m, line)
               for line, m in zip(lines, matches))
    assert os.listdir(tmp_path) == ["three.toml"]


def test_missing_file_is_named():
    with pytest.raises(MeshConfigError, match=r"'/nonexistent/mesh.toml'.*no such mesh file: `shardplan mesh new"):
        load_mesh("/nonexistent/mesh.toml")
    with pytest.raises(MeshConfigError, match="no such mesh file"):
        load_mesh("mesh.toml")


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
        except MeshConfigError as e:
            assert e.problems and all(len(p.splitlines()) == 1 and p.startswith("fuzz: ") for p in e.problems)
            assert len(str(e).splitlines()) == 1 and str(e).startswith(e.problems[0])


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
    # The host link, measured by a copy to pinned host memory and back; the input figure kept.
    assert m.device.offload_bandwidth > 1e8 and "offload_seconds" in m.calibration
    assert m.device.host_bandwidth == load_mesh("cpu-8").device.host_bandwidth
    # The measured links price the collectives.
    from shardplan.compiler.cost import ALL_REDUCE, Comm, CostModel
    t = CostModel(m).collective_time(Comm(ALL_REDUCE, ("model",), 2**20))
    link = m.axis("model").link
    assert t == pytest.approx(2 * (3 / 4 * 2**20 / link.bandwidth + 3 * link.latency))
    w, x = jnp.ones((64, 64)) / 8, jnp.ones((32, 64))
    step = shardplan.auto(lambda w, x: w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w),
                          mesh=str(out), time_limit=1)
    np.testing.assert_allclose(step(w, x), w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w), rtol=1e-6)


def test_fit_ring_recovers_bandwidth_and_latency():
    from shardplan.devices.calibrate import fit_ring
    sizes = np.array([2**12, 2**16, 2**20, 2**22])
    n, bw, lat = 4, 3e9, 5e-5
    seconds = 2 * (n - 1) * lat + 2 * (n - 1) / n * sizes / bw
    got_bw, got_lat = fit_ring(sizes, seconds, n)
    assert got_bw == pytest.approx(bw, rel=1e-6) and got_lat == pytest.approx(lat, rel=1e-6)


def test_remat_choices_are_the_models_policies():
    from shardplan.cli import REMAT_CHOICES
    from shardplan.models.layers import REMAT_POLICIES
    assert set(REMAT_CHOICES) == set(REMAT_POLICIES)


@pytest.mark.slow
def test_plan_command_with_remat_plans_less_memory(capsys):
    peaks = {}
    for remat in ("none", "full"):
        assert main(["plan", "--model", "gpt-tiny", "--mesh", "cpu-8", "--batch", "64", "--remat", remat,
                     "--time-limit", "2"]) == 0
        out = capsys.readouterr().out
        peaks[remat] = out.split("peak memory ")[1].split("/device")[0]
        said = next(x for x in out.splitlines() if x.startswith("recomputation: "))
        assert said == "recomputation: as the step is written" if remat == "none" else said.endswith(": full"), said
    # The policy goes through the planner, as remat= does in Python: offload is refused on a CPU mesh
    # (its host and device memory are one), not planned as if it saved something.
    assert main(["plan", "--model", "gpt-tiny", "--mesh", "cpu-8", "--remat", "offload"]) == 2
    assert "remat='offload' holds residuals in host memory" in capsys.readouterr().err
    from shardplan.util.sizes import parse_bytes
    assert parse_bytes(peaks["full"]) < parse_bytes(peaks["none"])
    # auto: the layer stack's policy chosen with the sharding; a budget no plan without recomputation meets.
    budget = (parse_bytes(peaks["full"]) + parse_bytes(peaks["none"])) // 2
    assert main(["plan", "--model", "gpt-tiny", "--mesh", "cpu-8", "--batch", "64", "--remat", "auto",
                 "--memory-budget", str(budget), "--time-limit", "2"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("recomputation: "))
    chosen = line.split(" (best other")[0]
    assert "LayerStack" in chosen and chosen.rsplit(": ", 1)[1] in ("dots_all", "dots", "full"), line
    assert parse_bytes(out.split("peak memory ")[1].split("/device")[0]) <= budget
    with pytest.raises(SystemExit) as bad:
        main(["plan", "--model", "gpt-tiny", "--remat", "some"])
    assert bad.value.code == 2 and "invalid choice: 'some'" in capsys.readouterr().err


# --- bad flag values, --json and Ctrl-C, through the real command line -------------------------------

PLAN = ["plan", "--model", "gpt-tiny", "--mesh", "cpu-8", "--time-limit", "1"]
AUDIT = ["audit", "--model", "gpt-tiny", "--mesh", "cpu-8", "--axes", "data=2,model=4", "--time-limit", "1"]

# name: (arguments, files to make first, what the one line must say)
BAD_FLAGS = {
    "plan-time-limit-negative": ([*PLAN, "--time-limit", "-1"], (),
                                 r"argument --time-limit: '-1' is not a positive number"),
    "plan-time-limit-zero": ([*PLAN, "--time-limit", "0"], (), r"argument --time-limit: '0' is not a positive"),
    "plan-time-limit-nan": ([*PLAN, "--time-limit", "nan"], (), r"argument --time-limit: 'nan' is not a positive"),
    "audit-time-limit-negative": ([*AUDIT, "--time-limit", "-1"], (),
                                  r"argument --time-limit: '-1'.*e\.g\. --time-limit 30"),
    "plan-batch-negative": ([*PLAN, "--batch", "-4"], (),
                            r"argument --batch: '-4' is not a positive integer; give e\.g\. --batch 16"),
    "plan-batch-zero": ([*PLAN, "--batch", "0"], (), r"argument --batch: '0' is not a positive integer"),
    "audit-batch-zero": ([*AUDIT, "--batch", "0"], (), r"argument --batch: '0' is not a positive integer"),
    "plan-budget-nan": ([*PLAN, "--memory-budget", "nan"], (),
                        r"argument --memory-budget: 'nan' is not a number of bytes; "
                        r"give a positive size such as 60e9"),
    "plan-budget-inf": ([*PLAN, "--memory-budget", "inf"], (),
                        r"argument --memory-budget: 'inf' is not a finite number"),
    "plan-budget-negative": ([*PLAN, "--memory-budget=-4GiB"], (),
                             r"argument --memory-budget: '-4GiB' is not a positive"),
    "plan-budget-zero": ([*PLAN, "--memory-budget", "0"], (), r"argument --memory-budget: '0' is not a positive"),
    "audit-budget-nan": ([*AUDIT, "--memory-budget", "nan"], (), r"argument --memory-budget: 'nan' is not a number"),
    "json-no-folder": ([*PLAN, "--json", "missing/out.json"], (), r"argument --json: the folder of missing/out\.json, "
                                                                    r"\S+missing, does not exist; create it"),
    "json-folder-is-a-file": ([*PLAN, "--json", "afile/out.json"], ("afile",),
                              r"argument --json: .*afile, is not a folder"),
    "json-is-a-folder": ([*PLAN, "--json", "."], (), r"argument --json: \. is a folder; give a file path"),
    "pipeline-zero": ([*PLAN, "--pipeline", "0"], (), r"argument --pipeline: '0' is not a pipeline setting; give "
                                                       r"auto, off or a number of stages"),
}
if os.geteuid() != 0:          # root writes anywhere
    BAD_FLAGS["json-not-writable"] = ([*PLAN, "--json", "ro/out.json"], ("ro/",),
                                      r"argument --json: .*ro, is not writable")
if os.path.isdir("/proc"):      # no one creates files there, root included, whatever access() says
    BAD_FLAGS["json-in-proc"] = ([*PLAN, "--json", "/proc/out.json"], (), r"argument --json: .*/proc, is not writable")


def _make(cwd, files):
    for f in files:
        if f.endswith("/"):
            (cwd / f).mkdir()
            (cwd / f).chmod(0o555)
        else:
            (cwd / f).write_text("x")


def _listing(cwd):
    return sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*"))


@pytest.mark.parametrize("name", sorted(BAD_FLAGS))
def test_bad_flag_values_get_one_line_and_exit_2_before_planning(name, tmp_path, monkeypatch, capsys):
    args, files, match = BAD_FLAGS[name]
    _make(tmp_path, files)
    before = _listing(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(args)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert re.search(match, lines[0]), lines[0]
    assert _listing(tmp_path) == before and out == ""        # nothing planned, nothing written


# The same through a process of its own, for one value of each kind (each run is mostly Python importing jax).
@pytest.fixture(scope="module")
def bad_flag_processes(tmp_path_factory):
    def run(name):
        args, files, _ = BAD_FLAGS[name]
        cwd = tmp_path_factory.mktemp(name)
        _make(cwd, files)
        before = _listing(cwd)
        r = subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, env=ENV, stdin=subprocess.DEVNULL,
                           timeout=600)
        return r, before, _listing(cwd)
    names = ["plan-time-limit-negative", "plan-batch-negative", "audit-budget-nan", "json-no-folder"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return dict(zip(names, pool.map(run, names)))


@pytest.mark.parametrize("name", ["plan-time-limit-negative", "plan-batch-negative", "audit-budget-nan",
                                  "json-no-folder"])
@pytest.mark.slow
def test_bad_flag_values_in_a_process(name, bad_flag_processes):
    r, before, after = bad_flag_processes[name]
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert re.search(BAD_FLAGS[name][2], lines[0]), lines[0]
    assert after == before and r.stdout == ""


def test_json_write_failure_leaves_no_file(tmp_path, capsys, monkeypatch):
    from shardplan import cli
    from shardplan.plans.plan import Plan
    path = tmp_path / "plan.json"
    assert main([*PLAN, "--json", str(path)]) == 0
    assert Plan.from_json(path.read_text()).mesh_name == "cpu-8" and os.listdir(tmp_path) == ["plan.json"]
    capsys.readouterr()
    # A failure after planning (disk full, the folder gone): one line, exit 2, the old plan kept, no .tmp.
    old = path.read_text()

    def full(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(cli.os, "replace", full)
    assert main([*PLAN, "--json", str(path)]) == 2
    errors = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert errors == [f"shardplan: error: cannot write {path}: No space left on device"]
    assert os.listdir(tmp_path) == ["plan.json"] and path.read_text() == old


def test_write_atomically_names_the_file_it_could_not_write(tmp_path):
    from shardplan import cli
    with pytest.raises(OSError, match=r"cannot write \S+nowhere/out.json: No such file or directory$"):
        cli._write_atomically(str(tmp_path / "nowhere" / "out.json"), "{}")
    assert os.listdir(tmp_path) == []


def test_write_atomically_cleans_up_on_ctrl_c(tmp_path, monkeypatch):
    from shardplan import cli
    path = str(tmp_path / "plan.json")

    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli._write_atomically(path, "{}")
    assert os.listdir(tmp_path) == []


def test_interruptible_reraises_a_swallowed_ctrl_c_and_restores_sigint():
    from shardplan.cli import _interruptible
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with _interruptible():
            signal.signal(signal.SIGINT, signal.SIG_DFL)    # as a CP-SAT solve leaves it
            with _interruptible():
                try:
                    signal.raise_signal(signal.SIGINT)
                except KeyboardInterrupt:
                    pass                                    # swallowed on the way
    assert signal.getsignal(signal.SIGINT) is before


def test_a_ctrl_c_in_a_garbage_collector_callback_is_raised_once_out_of_it():
    """JAX runs a callback on every garbage collection; a KeyboardInterrupt raised inside it (or in
    a weakref callback, a __del__) is printed and dropped ("Exception ignored in"), and the command
    ran on for 38 s of planning. Dropped, it is signalled again, and lands outside the callback."""
    import gc

    from shardplan.cli import _interruptible
    ran = []

    def callback(phase, info):
        if phase == "start" and not ran:
            ran.append(1)
            signal.raise_signal(signal.SIGINT)

    gc.callbacks.append(callback)
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            with _interruptible():
                gc.collect()
                time.sleep(5)           # the signal sent again ends the wait
    finally:
        gc.callbacks.remove(callback)
    assert ran and time.monotonic() - start < 2.5
    time.sleep(0.2)         # no second signal after the block: it would interrupt whatever runs next


def test_output_cut_short_by_its_reader_ends_quietly():
    """``shardplan mesh show cpu-8 | head -2``: the reader gone, no "Broken pipe" error."""
    with subprocess.Popen(CLI + ["mesh", "show", "cpu-8"], env=ENV, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        p.stdout.close()                # before it writes: its write (or its exit's flush) finds no reader
        err = p.stderr.read()
        assert p.wait(timeout=120) == 0 and err == "", err


def _interrupt(argv, marker, cwd, delay=0.0, within=60):
    """Start ``argv``, wait for ``marker`` on its stderr, then send SIGINT.

    ``(exit code, stderr lines)``; exit code None when ``argv`` ended without printing ``marker``;
    a process not ended ``within`` seconds of the SIGINT is killed and fails the test.
    """
    p = subprocess.Popen(argv, cwd=cwd, env=ENV, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(600, p.kill)
    watchdog.start()
    try:
        lines = []
        for line in p.stderr:
            lines.append(line.rstrip("\n"))
            if marker in line:
                break
        else:
            return None, lines
        if delay:
            import time
            time.sleep(delay)
        p.send_signal(signal.SIGINT)
        tail = []
        reader = threading.Thread(target=lambda: tail.extend(p.stderr.read().splitlines()), daemon=True)
        reader.start()
        try:
            rc = p.wait(timeout=within)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {within} s after Ctrl-C: {lines}")
        reader.join()
        return rc, lines + tail
    finally:
        watchdog.cancel()
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stderr.close()


# The child says when it starts planning and then plans slowly, so that the Ctrl-C lands inside
# planning: gpt-tiny plans in half a second, which a busy test process can take to read the line.
ANNOUNCE_PLAN = """
import sys, time
import shardplan.planning.search as search

def announced(*args, **kwargs):
    print("test: planning", file=sys.stderr, flush=True)
    time.sleep(30)
    return plan_jaxpr(*args, **kwargs)

plan_jaxpr, search.plan_jaxpr = search.plan_jaxpr, announced
from shardplan.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_while_planning_exits_130_and_writes_nothing(tmp_path):
    rc, lines = _interrupt([sys.executable, "-c", ANNOUNCE_PLAN, "plan", "--model", "gpt-tiny", "--mesh", "h100-8",
                            "--json", "out.json"], "test: planning", tmp_path)
    assert rc == 130 and lines[-1] == "shardplan: interrupted" and "Traceback" not in "\n".join(lines), (rc, lines)
    assert os.listdir(tmp_path) == []


# The child says when CP-SAT starts solving, so that the Ctrl-C lands inside a solve. The budget is
# below the unconstrained plan's peak (about 14 MiB), so that CP-SAT solves with the memory constraint.
ANNOUNCE_SOLVE = """
import sys
from ortools.sat.python import cp_model

def announce(solve):
    def announced(self, *args, **kwargs):
        print("test: CP-SAT solving", file=sys.stderr, flush=True)
        return solve(self, *args, **kwargs)
    return announced

cp_model.CpSolver.Solve = announce(cp_model.CpSolver.Solve)
cp_model.CpSolver.solve = announce(cp_model.CpSolver.solve)
from shardplan.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_ctrl_c_during_the_solve_exits_130_and_writes_nothing(tmp_path):
    rc, lines = _interrupt([sys.executable, "-c", ANNOUNCE_SOLVE, "plan", "--model", "gpt-tiny", "--mesh", "h100-8",
                            "--memory-budget", "10MiB", "--time-limit", "2", "--json", "out.json"],
                           "test: CP-SAT solving", tmp_path, delay=1.0, within=20)
    if rc is None:
        pytest.skip(f"CP-SAT did not run for this plan: {lines}")
    assert rc == 130 and lines[-1] == "shardplan: interrupted" and "Traceback" not in "\n".join(lines), (rc, lines)
    assert os.listdir(tmp_path) == []


def test_plan_command_pipelines_the_reference_model(capsys):
    assert main(["plan", "--model", "gpt-tiny", "--mesh", "cpu-8", "--pipeline", "2", "--activations", "0"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 2 stages over mesh axis 'stage', " in out and "{'stage': 2, 'model': 4}" in out
    # A pipeline the model cannot take: one line naming the setting, exit 2.
    assert main(["plan", "--model", "gpt-tiny", "--mesh", "cpu-8", "--pipeline", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("shardplan: error: 2 layers do not split into 4 stages"), err


@pytest.mark.slow
def test_plan_command_searches_recomputation_by_default_where_the_step_does_not_fit(capsys):
    """No --remat: the reference model as written, and where that does not fit the budget, the
    recomputation the planner chooses (tests/parallel/test_defaults.py lists the families of a budget
    nothing meets)."""
    from shardplan.util.sizes import parse_bytes
    peaks = {}
    for remat in ("off", "full"):
        assert main(["plan", "--model", "gpt-tiny", "--mesh", "cpu-8", "--batch", "64", "--remat", remat,
                     "--time-limit", "2", "--activations", "0"]) == 0
        peaks[remat] = parse_bytes(capsys.readouterr().out.split("peak memory ")[1].split("/device")[0])
    budget = (peaks["full"] + peaks["off"]) // 2
    assert main(["plan", "--model", "gpt-tiny", "--mesh", "cpu-8", "--batch", "64", "--memory-budget", str(budget),
                 "--time-limit", "2", "--activations", "0"]) == 0
    out = capsys.readouterr().out
    assert next(x for x in out.splitlines() if x.startswith("recomputation: ")).split(" (best other")[0].endswith(
        tuple(f": {p}" for p in ("dots_all", "dots", "full")))
    assert "planned with recomputation (remat='auto'), searched by default" in out
