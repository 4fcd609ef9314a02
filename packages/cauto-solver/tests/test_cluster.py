from __future__ import annotations

import pytest

from cauto.solver.cluster import (
    PRESETS,
    HardwareSpec,
    cluster_for_mesh,
    load_hardware,
    parse_mesh,
    save_hardware,
)
from cauto.solver.errors import SolverError


def test_parse_mesh():
    assert parse_mesh("8") == (8,)
    assert parse_mesh("2x4") == (2, 4)
    assert parse_mesh("2x2x2") == (2, 2, 2)
    for bad in ("", "2x", "0x4", "a", "2x2x2x2", "-1"):
        with pytest.raises(SolverError):
            parse_mesh(bad)


def test_gpu_presets_put_inner_axes_on_nvlink():
    c = cluster_for_mesh("h100", (8, 8))
    hw = PRESETS["h100"]
    assert c.axes == (hw.inter_node, hw.intra_node)
    assert c.axis_names == ("dp", "tp") and c.world_size == 64
    c3 = cluster_for_mesh("a100", (2, 2, 2))
    assert all(a == PRESETS["a100"].intra_node for a in c3.axes)
    c1 = cluster_for_mesh("h200", (16,))
    assert c1.axes == (PRESETS["h200"].inter_node,)


def test_cluster_document_and_names():
    c = cluster_for_mesh("cpu-gloo", (2, 2), ("data", "model"))
    d = c.to_dict()
    assert len(d["axes"]) == 2 and d["device"]["memory_bytes"] > 0
    with pytest.raises(SolverError):
        cluster_for_mesh("cpu-gloo", (2, 2), ("a",))
    with pytest.raises(SolverError):
        cluster_for_mesh("cpu-gloo", (2, 2), ("a", "a"))


def test_spec_file_round_trip(tmp_path):
    path = save_hardware(PRESETS["a100"], tmp_path / "spec.json")
    assert load_hardware(path) == PRESETS["a100"]
    assert HardwareSpec.from_dict(PRESETS["cpu-gloo"].to_dict()) == PRESETS["cpu-gloo"]


def test_unknown_preset_and_bad_file(tmp_path):
    with pytest.raises(SolverError, match="neither a preset"):
        load_hardware("tpu-v9")
    bad = tmp_path / "bad.json"
    bad.write_text("{\"name\": 1}")
    with pytest.raises(SolverError, match="not a cluster spec"):
        load_hardware(bad)


def test_mesh_must_divide_the_cluster():
    import dataclasses

    hw = dataclasses.replace(PRESETS["h100"], num_devices=16)
    assert cluster_for_mesh(hw, (2, 8)).world_size == 16
    assert cluster_for_mesh(hw, (2, 4)).world_size == 8
    for bad in ((3, 2), (4, 8)):
        with pytest.raises(SolverError, match="does not divide"):
            cluster_for_mesh(hw, bad)
    assert HardwareSpec.from_dict(hw.to_dict()) == hw
