import copy
import json
import warnings

import pytest

from cauto.plan import (
    DocumentError,
    GraphDocument,
    MismatchError,
    NewerMinorVersionWarning,
    PlanDocument,
    VersionError,
    check_document,
    check_plan_matches_graph,
    dump,
    load,
    load_graph,
    load_plan,
    parse_placement,
)


def test_graph_and_plan_round_trip_through_files(tmp_path, graph, plan):
    dump(graph, tmp_path / "g.json")
    dump(plan, tmp_path / "p.json")
    g = load_graph(tmp_path / "g.json")
    p = load_plan(tmp_path / "p.json", graph=g)
    assert g.to_dict() == GraphDocument.from_dict(graph).to_dict()
    assert p.to_dict() == plan
    assert g.node_map()["linear"].labels.contracted() == "k"


def test_dataclass_round_trip_is_identity_on_defaults(graph, plan):
    again = GraphDocument.from_dict(graph).to_dict()
    assert GraphDocument.from_dict(again).to_dict() == again
    assert PlanDocument.from_dict(copy.deepcopy(plan)).to_dict() == copy.deepcopy(plan)


def test_truncated_json_names_line_and_says_truncated(tmp_path, graph, plan):
    text = json.dumps(copy.deepcopy(graph))
    (tmp_path / "g.json").write_text(text[: len(text) // 2])
    with pytest.raises(DocumentError, match="truncated") as info:
        load(tmp_path / "g.json")
    assert "g.json" in str(info.value)


def test_wrong_kind_is_refused_with_path(graph, plan):
    with pytest.raises(DocumentError) as info:
        check_document(copy.deepcopy(graph), "plan")
    assert info.value.path == "$.kind"
    bad = copy.deepcopy(graph)
    bad["kind"] = "weights"
    with pytest.raises(DocumentError, match="kind"):
        check_document(bad)


def test_missing_required_field_names_its_path(graph, plan):
    bad = copy.deepcopy(graph)
    del bad["nodes"][2]["outputs"]
    with pytest.raises(DocumentError) as info:
        check_document(bad, "graph")
    assert info.value.path == "$.nodes[2]"
    assert "outputs" in str(info.value)


def test_wrong_type_names_its_path_and_expected_type(graph, plan):
    bad = copy.deepcopy(graph)
    bad["nodes"][2]["outputs"][0]["bytes"] = "512"
    with pytest.raises(DocumentError) as info:
        check_document(bad, "graph")
    assert info.value.path == "$.nodes[2].outputs[0].bytes"
    assert "integer" in info.value.expected


def test_unknown_major_version_names_both_versions(graph, plan):
    bad = copy.deepcopy(graph)
    bad["schema_version"] = "7.2"
    with pytest.raises(VersionError) as info:
        check_document(bad)
    from cauto.plan.versioning import CURRENT_VERSION, format_version
    assert "7.2" in str(info.value) and format_version(CURRENT_VERSION["graph"]) in str(info.value)


def test_newer_minor_warns_and_accepts_unknown_fields(graph, plan):
    newer = copy.deepcopy(graph)
    newer["schema_version"] = "1.9"
    newer["future_field"] = {"anything": 1}
    with pytest.warns(NewerMinorVersionWarning):
        check_document(newer, "graph")


def test_current_version_reads_without_warning(graph, plan):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_document(copy.deepcopy(graph), "graph")


def test_plan_naming_unknown_node_is_refused(graph, plan):
    plan["nodes"]["ghost"] = {"inputs": [], "outputs": [["R"]]}
    with pytest.raises(DocumentError) as info:
        check_plan_matches_graph(plan, graph)
    assert info.value.path == "$.nodes.ghost"


def test_plan_for_another_graph_is_refused(graph, plan):
    plan["graph_fingerprint"] = "0" * 64
    with pytest.raises(MismatchError, match="model changed"):
        check_plan_matches_graph(plan, graph)


def test_edited_graph_fails_its_fingerprint(graph, plan):
    bad = copy.deepcopy(graph)
    bad["nodes"][2]["outputs"][0]["shape"] = [16, 9]
    with pytest.raises(DocumentError) as info:
        check_document(bad)
    assert info.value.path == "$.fingerprint"


def test_input_naming_a_later_node_is_refused(graph, plan):
    bad = copy.deepcopy(copy.deepcopy(graph))
    bad["nodes"][2]["inputs"] = ["sum", "p_w"]
    with pytest.raises(DocumentError, match="no earlier node"):
        check_document(bad)


def test_bad_placement_string_is_refused_by_schema(graph, plan):
    plan["nodes"]["linear"]["outputs"] = [["Shard(0)"]]
    with pytest.raises(DocumentError) as info:
        check_document(plan, "plan")
    assert info.value.path.startswith("$.nodes.linear.outputs")


def test_dump_leaves_no_partial_file_on_invalid_document(tmp_path, graph, plan):
    bad = copy.deepcopy(graph)
    del bad["memory"]
    with pytest.raises(DocumentError):
        dump(bad, tmp_path / "g.json")
    assert list(tmp_path.iterdir()) == []


def test_non_json_objects_are_rejected_not_executed(tmp_path, graph, plan):
    (tmp_path / "evil.json").write_text('"__import__(\'os\').system(\'false\')"')
    with pytest.raises(DocumentError, match="JSON str"):
        load(tmp_path / "evil.json")


def test_placement_strings_parse():
    assert parse_placement("S(2)") == ("S", 2)
    assert parse_placement("P(avg)") == ("P", "avg")
    with pytest.raises(ValueError):
        parse_placement("Shard(0)")


def test_dump_writes_an_ordinary_readable_file(tmp_path, graph):
    import os
    import stat

    path = dump(graph, tmp_path / "g.json")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["g.json"]


def test_plan_1_0_reads_with_the_execution_section_its_fields_imply(tmp_path, graph, plan):
    """1.1 only added optional fields (offload, the device's host link); 1.2 adds ``execution``, which an
    older plan gets on read by the rules of cauto.plan.execution: nothing else changes."""
    old = copy.deepcopy(plan)
    old["schema_version"] = "1.0"
    del old["execution"]
    old["predictions"]["collectives"].append({"op": "all_reduce", "axis": 0, "bytes": 64, "phase": "backward",
                                              "where": "grad of linear:0"})
    (tmp_path / "old.json").write_text(json.dumps(old))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = load_plan(tmp_path / "old.json")
    assert p.schema_version == "1.4" and p.offload is None
    assert p.execution == {"mode": "program", "grad_reductions": ["linear:0"]}
    assert {k: v for k, v in p.to_dict().items() if k != "execution"} == {**old, "schema_version": "1.4"}


def test_plan_1_1_with_chunks_gets_the_mode_and_the_simulated_budget(tmp_path, plan):
    old = copy.deepcopy(plan)
    old["schema_version"] = "1.1"
    del old["execution"]
    old["params"]["p_w"]["state"] = "chunked"
    old["offload"] = {"device_budget_bytes": 1 << 30, "chunk_elems": 4096, "mesh_axes": [0], "num_chunks": 2}
    (tmp_path / "old.json").write_text(json.dumps(old))
    p = load_plan(tmp_path / "old.json")
    assert p.execution["mode"] == "chunk_manager"  # chunks over the whole mesh, no edges
    assert p.offload["simulated_device_budget_bytes"] == 2 * 1024 + 20 * 2 * 4096  # capped: 2 peak + 20 B/elem
    old["edges"] = [{"src": "x", "dst": "linear", "arg": 0, "src_placements": ["R"], "dst_placements": ["S(0)"],
                     "collectives": []}]
    old["offload"]["device_budget_bytes"] = 1000
    (tmp_path / "old.json").write_text(json.dumps(old))
    p = load_plan(tmp_path / "old.json")
    assert p.execution["mode"] == "program" and p.offload["simulated_device_budget_bytes"] == 1000


def test_plan_offload_section(tmp_path, plan):
    plan["params"]["p_w"]["state"] = "chunked"
    plan["cluster"]["device"]["host_link_bandwidth_bytes_per_s"] = 2.5e10
    plan["offload"] = {"device_budget_bytes": 1 << 20, "chunk_elems": 4096, "mesh_axes": [0], "num_chunks": 2,
                       "working_set_bytes": 49152, "arena_bytes": 1 << 19, "moved_bytes": 65536,
                       "host_link_bandwidth_bytes_per_s": 2.5e10, "simulated_device_budget_bytes": 1 << 20}
    dump(plan, tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json").to_dict() == plan
    bad = copy.deepcopy(plan)
    del bad["offload"]["device_budget_bytes"]
    with pytest.raises(DocumentError) as info:
        check_document(bad, "plan")
    assert info.value.path == "$.offload"


def test_plan_1_2_reads_as_1_3_without_mixed_precision(tmp_path, plan):
    """1.3 adds the optional ``execution.mixed_precision``: a 1.2 plan (no section) trains in its parameters'
    dtype as before; a 1.3 plan keeps the section as written."""
    old = copy.deepcopy(plan)
    old["schema_version"] = "1.2"
    (tmp_path / "old.json").write_text(json.dumps(old))
    p = load_plan(tmp_path / "old.json")
    assert p.schema_version == "1.4" and "mixed_precision" not in p.execution
    new = copy.deepcopy(plan)
    new["execution"] = {**new["execution"], "mixed_precision": {"compute_dtype": "bfloat16", "reduce_dtype": "float32"}}
    (tmp_path / "new.json").write_text(json.dumps(new))
    assert load_plan(tmp_path / "new.json").execution["mixed_precision"]["reduce_dtype"] == "float32"
