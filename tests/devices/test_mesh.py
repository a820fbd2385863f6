import warnings

import pytest

import shardplan
from shardplan.devices.mesh import load_mesh, mesh_from_dict
from shardplan.errors import DeviceCountError, MeshConfigError

REQUIRED_PRESETS = {"cpu-8", "h100-8", "h100-8x8", "h200-8", "h200-8x8", "a100-8", "a100-128x8",
                    "tpu-v5e-256", "tpu-v5p-2x512", "tpu-v5p-64"}


def test_presets_resolve():
    assert REQUIRED_PRESETS <= set(shardplan.preset_names())
    for name in REQUIRED_PRESETS:
        m = load_mesh(name)
        assert m.source and m.num_devices == m.devices_per_node * (m.num_devices // m.devices_per_node)


def test_tpu_multislice_axis_crosses_dcn():
    m = load_mesh("tpu-v5p-2x512")
    assert [a.link.name for a in m.axes] == ["dcn", "ici", "ici"]
    assert m.device.flops_for("bfloat16") == 459e12


def test_one_tpu_v5p_slice_is_all_ici():
    m = load_mesh("tpu-v5p-64", axes={"data": 8, "expert": 8})
    assert (m.num_devices, m.devices_per_node, m.nodes) == (64, 64, 1)
    assert [a.link.name for a in m.axes] == ["ici", "ici"]
    assert m.device == load_mesh("tpu-v5p-2x512").device


def test_cross_node_axis_uses_inter_node_link():
    m = load_mesh("a100-128x8")
    assert (m.axis("data").link.name, m.axis("model").link.name) == ("infiniband", "nvlink")
    m = load_mesh("h100-8x8", axes={"data": 4, "fsdp": 4, "model": 4})
    assert [a.link.name for a in m.axes] == ["infiniband", "infiniband", "nvlink"]


def test_axes_override_must_multiply_to_device_count():
    with pytest.raises(MeshConfigError, match=r"multiply to 6.*make the sizes multiply to 8"):
        load_mesh("h100-8", axes={"data": 2, "model": 3})


def test_a_misspelt_axis_override_is_warned_about_and_a_new_name_is_not():
    with pytest.warns(UserWarning, match=r"axis 'modle' is not one of its axes \(data, model\); did you mean 'model'"):
        spec = load_mesh("cpu-8", axes={"data": 2, "modle": 4})
    assert spec.axis_names == ("data", "modle")       # still the user's to name
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_mesh("cpu-8", axes={"data": 2, "expert": 4})
        load_mesh("cpu-8", axes={"data": 2, "fsdp": 2, "model": 2})


def test_unknown_preset_lists_presets():
    with pytest.raises(MeshConfigError, match="neither a mesh file nor a preset; presets: .*h100-8"):
        load_mesh("h200-9000")


def _good():
    return {"name": "t", "device": {"name": "d", "peak_flops": {"float32": 1e12}, "hbm_bytes": 2**30,
                                    "hbm_bandwidth": 1e11},
            "links": {"l": {"bandwidth": 1e9, "latency": 1e-6}},
            "topology": {"devices_per_node": 4, "nodes": 2, "intra_node_link": "l", "inter_node_link": "l"},
            "axes": [{"name": "data", "size": 2}, {"name": "model", "size": 4}]}


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.update(colour="red"), r"unknown key 'colour'"),
    (lambda d: d.pop("device"), r"\[device\] missing section"),
    (lambda d: d["links"]["l"].update(bandwidth=-1), r"\[links.l.bandwidth\] must be a positive number"),
    (lambda d: d["axes"].append({"name": "data", "size": 1}), r"axis 'data' is named twice"),
    (lambda d: d["axes"][0].update(size=3), r"multiply to 12.*= 8"),
    (lambda d: d["topology"].update(inter_node_link="ib"), r"names link 'ib'"),
    (lambda d: d["device"]["peak_flops"].pop("float32"), r"at least 'float32'"),
    (lambda d: d["device"].update(heap_overhead=-0.1), r"\[device.heap_overhead\] must be a fraction from 0 to 1"),
    (lambda d: d["device"].update(heap_overhead="10%"), r"\[device.heap_overhead\] must be a fraction"),
])
def test_bad_mesh_files(mutate, match):
    data = _good()
    mesh_from_dict(data)
    mutate(data)
    with pytest.raises(MeshConfigError, match=match):
        mesh_from_dict(data, source="bad.toml")


def test_too_few_devices_names_the_flag():
    with pytest.raises(DeviceCountError, match="xla_force_host_platform_device_count=64"):
        load_mesh("h100-8x8").to_jax_mesh()


def test_every_problem_is_reported():
    data = _good()
    data["colour"] = "red"
    data["device"]["hbm_bytes"] = 0
    data["links"]["l"]["latency"] = float("nan")
    data["axes"][1].update(name="data", size=3)
    with pytest.raises(MeshConfigError) as e:
        mesh_from_dict(data, source="bad.toml")
    assert e.value.problems == [
        "bad.toml: [top level] unknown key 'colour'; allowed: axes, calibration, description, device, links, name, "
        "source, topology",
        "bad.toml: [device.hbm_bytes] must be a positive number, got 0",
        "bad.toml: [links.l.latency] must be a non-negative number, got nan",
        "bad.toml: [axes[1].name] axis 'data' is named twice",
        "bad.toml: [axes] axis sizes {'data': 2, 'axes[1]': 3} multiply to 6, but the topology has 2 node(s) x 4 "
        "devices = 8; make the sizes multiply to 8"]
    assert str(e.value) == e.value.problems[0] + " (and 4 more problems)"
    assert e.value.key == "top level" and e.value.source == "bad.toml"


def test_one_problem_is_one_line():
    data = _good()
    data["topology"]["nodes"] = 0
    with pytest.raises(MeshConfigError) as e:
        mesh_from_dict(data, source="bad.toml")
    assert e.value.problems == [str(e.value)] == ["bad.toml: [topology.nodes] must be a positive number, got 0"]


@pytest.mark.parametrize("key, value", [("hbm_bandwidth", float("nan")), ("hbm_bandwidth", float("inf")),
                                        ("hbm_bytes", float("inf")), ("hbm_bytes", 1.5)])
def test_numbers_must_be_finite(key, value):
    data = _good()
    data["device"][key] = value
    with pytest.raises(MeshConfigError, match=rf"\[device.{key}\] must be a positive (number|integer), got"):
        mesh_from_dict(data)


def test_a_file_that_is_not_text_is_named(tmp_path):
    path = tmp_path / "mesh.toml"
    path.write_bytes(b"name = \"\xff\"\n")
    with pytest.raises(MeshConfigError, match=rf"^{path}: is not UTF-8 text \(byte 8 is 0xff: invalid start byte\)"):
        load_mesh(str(path))
    with pytest.raises(MeshConfigError, match=rf"^{tmp_path}: cannot be read: Is a directory"):
        load_mesh(str(tmp_path))


@pytest.mark.parametrize("device, match", [
    ({"usable_bytes": 2**31},
     r"\[device.usable_bytes\] must be at most device.hbm_bytes \(1073741824\), got 2147483648"),
    ({"usable_bytes": 0}, r"\[device.usable_bytes\] must be a positive number, got 0"),
    ({"allocator_fraction": 0}, r"\[device.allocator_fraction\] must be a fraction above 0 and at most 1"),
    ({"allocator_fraction": 1.2}, r"\[device.allocator_fraction\] must be a fraction above 0 and at most 1")])
def test_usable_memory_keys_are_checked(device, match):
    data = _good()
    data["device"].update(device)
    with pytest.raises(MeshConfigError, match=match):
        mesh_from_dict(data)


def test_usable_memory_sets_the_default_budget_and_round_trips(tmp_path):
    from shardplan.devices.mesh import to_toml
    data = _good()
    data["device"].update(usable_bytes=2**29, allocator_fraction=0.5)
    spec = mesh_from_dict(data)
    assert spec.device.budget_bytes == 2**28
    path = tmp_path / "m.toml"
    path.write_text(to_toml(spec))
    assert load_mesh(str(path)).device == spec.device
