"""shardplan.frontier and `shardplan frontier`: the textbook cases (one node is the cheap end for a
model that fits it; twice the devices halve a compute-bound step at the same cost; sizes too small
are listed with their least memory; sizes a lower bound rules out are skipped), the prices file's
errors, the measured time band, the plan cache on a second run, and the CLI's exit codes."""

import json
import os
import re

import jax
import jax.numpy as jnp
import pytest

import shardplan
from shardplan.cli import main
from shardplan.devices.mesh import load_mesh
from shardplan.devices.prices import PriceFileError, load_prices, prices_from_dict
from shardplan.devices.time_band import calibrated, step_time_band
from shardplan.models.train import reference

PRICES = """currency = "USD"
[hardware.h100-8]
per_device_hour = {h100}
source = "test"
date = "2026-12-07"
[hardware.a100-8]
per_device_hour = {a100}
source = "test"
date = 2026-12-07
[hardware."TPU v5e"]
per_device_hour = 1.2
source = "test"
date = "2026-12-07"
"""


# Every family pinned off: a size over its budget is one solve, not a search of each family.
PINNED = dict(pipeline="off", remat="off", context="off")


@pytest.fixture
def prices(tmp_path):
    path = tmp_path / "prices.toml"
    path.write_text(PRICES.format(h100=3.0, a100=1.3))
    return str(path)


@pytest.fixture(scope="module")
def tiny():
    ref = reference("gpt-tiny", scan=True)
    return ref.train_step, jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(16, abstract=True)


def _matmuls(batch: int = 1 << 22, width: int = 1024):
    """A compute-bound step: two bfloat16 matmuls over a large batch, data parallel."""
    def step(w, x):
        grads = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w[0]) @ w[1]).astype(jnp.float32))(w)
        return jax.tree.map(lambda a, g: a - 0.1 * g, w, grads)
    w = (jax.ShapeDtypeStruct((width, width), jnp.bfloat16),) * 2
    return step, w, jax.ShapeDtypeStruct((batch, width), jnp.bfloat16)


def test_a_model_that_fits_one_node_puts_one_node_at_the_cheap_end(tiny, prices, tmp_path):
    step, state, batch = tiny
    r = shardplan.frontier(step, state, batch, hardware=["h100-8"], devices=[8, 16, 32], tokens=1e9, prices=prices,
                           donate_argnums=(0,), cache=tmp_path / "cache")
    assert [p.status for p in r.points] == ["planned"] * 3
    assert r.pareto[0].devices == 8 and r.pareto[0].nodes == 1
    assert r.tokens_per_step == 16 * 32
    p = r.pareto[0]
    assert p.cost == pytest.approx(p.train_s / 3600 * 8 * 3.0)
    assert p.train_s == pytest.approx(p.step_s * 1e9 / (16 * 32))
    assert 0 < p.mfu < 1 and p.memory_bytes <= p.budget_bytes


def test_twice_the_devices_halve_a_compute_bound_step_at_about_the_same_cost(prices, tmp_path):
    # Within one TPU v5e slice (ICI): across nodes, each host would load its share of this step's
    # 32 GiB input, which no token batch is. The gradients' all-reduce is 3% of the step.
    step, w, x = _matmuls(batch=1 << 24)
    r = shardplan.frontier(step, w, x, hardware=["tpu-v5e-256"], devices=[64, 128], tokens=1e12,
                           tokens_per_step=1 << 24, prices=prices, cache=tmp_path / "cache")
    small, large = sorted((p for p in r.points if p.status == "planned"), key=lambda p: p.devices)
    assert large.train_s / small.train_s == pytest.approx(0.5, abs=0.05)
    assert large.cost / small.cost == pytest.approx(1.0, abs=0.1)
    assert small.mfu > 0.5
    assert {p.devices for p in r.pareto} == {64, 128}          # faster and as cheap: both on the frontier


def test_sizes_a_lower_bound_rules_out_are_skipped(tmp_path):
    path = tmp_path / "prices.toml"
    path.write_text(PRICES.format(h100=1.0, a100=1000.0))       # A100s at a price no frontier point pays
    step, w, x = _matmuls()
    r = shardplan.frontier(step, w, x, hardware=["a100-8", "h100-8"], devices=[8, 16], tokens=1e12,
                           tokens_per_step=1 << 22, prices=str(path), cache=tmp_path / "cache")
    skipped = {p.devices for p in r.points if p.hardware == "a100-8" and p.status == "skipped"}
    assert skipped == {8, 16}
    assert all("cannot reach the frontier" in p.reason for p in r.points if p.status == "skipped")
    assert "Skipped:" in r.table() and "a100-8 x 8: cannot reach the frontier" in r.table()


def test_a_model_too_large_for_the_smallest_sizes_lists_them_with_their_least_memory(tiny, prices, tmp_path):
    step, state, batch = tiny
    args = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)) + 2 * 16 * 32 * 4
    # A budget under the arguments' even share on 8 devices (not planned) and over it on 64.
    budget = int(args / 8 * 0.9)
    r = shardplan.frontier(step, state, batch, hardware=["h100-8"], devices=[8, 64], tokens=1e9, prices=prices,
                           memory_budget=budget, donate_argnums=(0,), cache=tmp_path / "cache", **PINNED)
    small = next(p for p in r.points if p.devices == 8)
    assert small.status == "does not fit" and small.least_is_floor
    assert small.least_bytes == pytest.approx(args / 8, rel=1e-6)
    large = next(p for p in r.points if p.devices == 64)
    if large.status == "does not fit":          # planned, over the budget: the least memory the planner found
        assert large.least_bytes is not None and large.least_bytes > budget and not large.least_is_floor
    table = r.table()
    assert "Does not fit (least memory a device would need):" in table
    assert "h100-8 x 8: at least" in table


def test_a_planned_size_over_the_budget_gives_the_least_memory_it_would_need(tiny, prices, tmp_path):
    step, state, batch = tiny
    args = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)) + 2 * 16 * 32 * 4
    # Just over the arguments' share: planned (the floor lets it through), but the gradients and
    # activations cannot fit beside the arguments.
    r = shardplan.frontier(step, state, batch, hardware=["h100-8"], devices=[8], tokens=1e9, prices=prices,
                           memory_budget=int(args / 8 * 1.001), donate_argnums=(0,), cache=tmp_path / "cache",
                           **PINNED)
    (p,) = r.points
    assert p.status == "does not fit" and not p.least_is_floor
    assert p.least_bytes > p.budget_bytes
    assert "planned with the families as set: no plan fits" == p.reason


def test_second_run_reads_every_plan_from_the_cache(tiny, prices, tmp_path):
    step, state, batch = tiny
    kwargs = dict(hardware=["h100-8"], devices=[8, 16], tokens=1e9, prices=prices, donate_argnums=(0,),
                  cache=tmp_path / "cache", pipeline="off")
    first = shardplan.frontier(step, state, batch, **kwargs)
    entries = sorted(os.listdir(tmp_path / "cache"))
    second = shardplan.frontier(step, state, batch, **kwargs)
    assert sorted(os.listdir(tmp_path / "cache")) == entries and entries
    assert [p.step_s for p in second.points] == [p.step_s for p in first.points]


def test_report_json_and_plot(tiny, prices, tmp_path):
    step, state, batch = tiny
    r = shardplan.frontier(step, state, batch, hardware=["h100-8", "a100-8"], devices=[8, 12], tokens=1e9,
                           prices=prices, donate_argnums=(0,), cache=tmp_path / "cache")
    data = json.loads(r.to_json())
    assert data["prices"]["a100-8"] == {"key": "a100-8", "per_device_hour": 1.3, "source": "test",
                                        "date": "2026-12-07"}
    assert {(p["hardware"], p["devices"], p["status"]) for p in data["points"]} >= {("h100-8", 12, "skipped")}
    assert "not whole nodes of 8 devices" in r.table()
    assert data["time_band"]["rows"] > 0
    pytest.importorskip("matplotlib")
    r.plot(tmp_path / "frontier.png")
    assert (tmp_path / "frontier.png").stat().st_size > 1000


def test_the_time_band_and_which_hardware_was_calibrated():
    band = step_time_band()
    assert band is not None and band.rows >= 3
    assert band.low <= band.median <= band.high
    assert "NVIDIA H200" in band.devices and "no collectives measured" in band.describe()
    assert calibrated(load_mesh("h200-8")) and not calibrated(load_mesh("h100-8"))


def test_uncalibrated_hardware_says_so(tiny, prices, tmp_path):
    step, state, batch = tiny
    r = shardplan.frontier(step, state, batch, hardware=["h100-8"], devices=[8], tokens=1e9, prices=prices,
                           donate_argnums=(0,), cache=tmp_path / "cache")
    assert not r.points[0].calibrated
    assert "Never calibrated on a device: h100-8" in r.table()


@pytest.mark.parametrize("text, key, match", [
    ("[hardware.h100-8]\nsource = 'x'\ndate = 'y'", "hardware.h100-8.per_device_hour", "must be a positive number"),
    ("[hardware.h100-8]\nper_device_hour = -1\nsource = 'x'\ndate = 'y'", "hardware.h100-8.per_device_hour",
     "must be a positive number"),
    ("[hardware.h100-8]\nper_device_hour = 2\ndate = 'y'", "hardware.h100-8.source", "where the price comes from"),
    ("[hardware.h100-8]\nper_device_hour = 2\nsource = 'x'", "hardware.h100-8.date", "when it was read"),
    ("[hardware.h100-8]\nper_device_hour = 2\nsource = 'x'\ndate = 'y'\nprice = 3", "hardware.h100-8.price",
     "unknown key 'price'"),
    ("colour = 'red'", "colour", "unknown key 'colour'"),
    ("currency = 'USD'", "hardware", "no prices"),
])
def test_a_bad_prices_file_names_the_file_and_the_key(tmp_path, text, key, match):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(PriceFileError, match=match) as e:
        load_prices(path)
    assert e.value.key == key and str(path) in str(e.value)


def test_a_hardware_without_a_price_says_which_and_how_to_add_it():
    prices = prices_from_dict({"hardware": {"a100-8": {"per_device_hour": 1, "source": "s", "date": "d"}}},
                              source="p.toml")
    with pytest.raises(PriceFileError, match=r"p.toml: \[hardware.h100-8\] no price for hardware 'h100-8'"):
        prices.for_mesh("h100-8", load_mesh("h100-8"))
    assert prices.for_mesh("a100-8", load_mesh("a100-8")).per_device_hour == 1


def test_the_example_prices_file_prices_every_gpu_and_tpu_preset():
    path = os.path.join(os.path.dirname(__file__), "..", "meshes", "prices", "example.toml")
    prices = load_prices(path)
    for name in shardplan.preset_names():
        if name != "cpu-8":
            price = prices.for_mesh(name, load_mesh(name))
            assert price.source.startswith("https://") and price.date


def test_cli_frontier_prints_the_table(prices, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SHARDPLAN_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "frontier.json"
    assert main(["frontier", "--model", "gpt-tiny", "--hardware", "h100-8", "--devices", "8,16", "--tokens", "1B",
                 "--prices", prices, "--pipeline", "off", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| h100-8 | 8 |" in text and "Time band" in text
    assert json.loads(out.read_text())["tokens"] == 1e9


@pytest.mark.parametrize("flags, match", [
    (["--hardware", "h100-9"], r"^shardplan: error: 'h100-9': is neither a mesh file nor a preset; presets: "),
    (["--prices", "/nonexistent/prices.toml"], r"^shardplan: error: /nonexistent/prices.toml: cannot be read"),
    (["--hardware", "tpu-v5p-64"], r"\[hardware.tpu-v5p-64\] no price for hardware 'tpu-v5p-64'"),
    (["--tokens", "many"], r"argument --tokens: 'many' is not a positive count"),
    (["--devices", "8,0"], r"argument --devices: '0' is not a positive integer"),
])
def test_cli_bad_input_is_one_line_and_exit_2(prices, capsys, flags, match):
    args = {"--hardware": "h100-8", "--devices": "8", "--tokens": "1e9", "--prices": prices}
    for flag, value in zip(flags[::2], flags[1::2]):
        args[flag] = value
    argv = ["frontier", "--model", "gpt-tiny"] + [x for kv in args.items() for x in kv]
    try:
        code = main(argv)
    except SystemExit as e:            # a bad flag value: argparse's exit, one line, before anything runs
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert re.search(match, err.strip())


def test_cli_bad_prices_file_is_one_line_naming_the_key(tmp_path, capsys):
    path = tmp_path / "prices.toml"
    path.write_text("[hardware.h100-8]\nper_device_hour = 'cheap'\nsource = 'x'\ndate = 'y'\n")
    assert main(["frontier", "--model", "gpt-tiny", "--hardware", "h100-8", "--devices", "8", "--tokens", "1e9",
                 "--prices", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"shardplan: error: {path}: [hardware.h100-8.per_device_hour] must be a positive number (the "
                   "price of one device for one hour), got 'cheap'")


USER_STEP = '''
import jax, jax.numpy as jnp, optax

def loss(params, batch):
    h = jnp.tanh(batch["tokens"].astype(jnp.float32) @ params["w1"])
    return jnp.mean((h @ params["w2"]) ** 2)

def train_step(state, batch):
    params, opt = state
    grads = jax.grad(loss)(params, batch)
    updates, opt = optax.adam(1e-3).update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt), loss(params, batch)

def make():
    params = {"w1": jax.ShapeDtypeStruct((64, 256), jnp.float32), "w2": jax.ShapeDtypeStruct((256, 64), jnp.float32)}
    state = (params, jax.eval_shape(optax.adam(1e-3).init, params))
    batch = {"tokens": jax.ShapeDtypeStruct((32, 64), jnp.int32)}
    return train_step, (state, batch), {"donate_argnums": (0,)}

def not_a_step():
    return 3
'''


def test_cli_frontier_and_plan_take_the_users_own_step_from_a_file(prices, tmp_path, capsys, monkeypatch):
    # A step written outside the project (plain JAX and optax, state as a tuple), named by --step:
    # the frontier and the plan are made of it, not of --model's reference model.
    monkeypatch.setenv("SHARDPLAN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "my_step.py"
    path.write_text(USER_STEP)
    assert main(["frontier", "--step", f"{path}:make", "--hardware", "h100-8", "--devices", "8,16",
                 "--tokens", "1B", "--prices", prices, "--pipeline", "off", "--all"]) == 0
    out = capsys.readouterr()
    assert "| h100-8 | 8 |" in out.out and "2,048 tokens a step" in out.out
    assert main(["plan", "--step", f"{path}:make", "--mesh", "cpu-8", "--time-limit", "1"]) == 0
    out = capsys.readouterr()
    assert f"planning the step of {path}:make on cpu-8" in out.err
    assert "[0][0]['w1']" in out.out and "[1]['tokens']" in out.out       # the file's state and batch


@pytest.mark.parametrize("step, match", [
    ("my_step.py", r"--step 'my_step.py': give FILE.py:FUNCTION or MODULE:FUNCTION"),
    ("nowhere/my_step.py:make", r"--step 'nowhere/my_step.py:make': no file nowhere/my_step.py$"),
    ("{path}:missing", r"has no function 'missing'$"),
    ("{path}:not_a_step", r"not_a_step\(\) returned int; return \(step, args\)"),
    ("no_such_module_xyz:make", r"no module 'no_such_module_xyz' on the Python path"),
])
def test_cli_a_bad_step_is_one_line_and_exit_2(prices, tmp_path, capsys, step, match):
    path = tmp_path / "my_step.py"
    path.write_text(USER_STEP)
    assert main(["plan", "--step", step.format(path=path), "--mesh", "cpu-8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("shardplan: error: ") and re.search(match, err), err
