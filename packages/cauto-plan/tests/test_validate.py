"""The semantic front door (cauto.plan.validate): schema-valid documents that no real model or plan has
are refused with the JSON path of the value and what to do, on every load."""

from __future__ import annotations

import copy
import json

import pytest

from cauto.plan import (
    DocumentError,
    MismatchError,
    check_document,
    check_plan_matches_graph,
    graph_fingerprint,
    load,
)
from cauto.plan.validate import check_world_size


def _refused(doc: dict, kind: str, path: str, words: str) -> None:
    """``doc`` (schema-valid) is refused when loaded, at ``path``, saying ``words``; also after a JSON round trip."""
    for candidate in (doc, json.loads(json.dumps(doc))):
        with pytest.raises(DocumentError) as info:
            check_document(copy.deepcopy(candidate), kind)
        assert info.value.path == path and words in str(info.value), str(info.value)


@pytest.mark.parametrize(("where", "path", "value", "words"), [
    (("nodes", 2, "fwd_flops"), "$.nodes[2].fwd_flops", float("inf"), "fwd_flops is inf"),
    (("nodes", 2, "fwd_time_s"), "$.nodes[2].fwd_time_s", float("nan"), "fwd_time_s is nan"),
    (("device", "peak_flops"), "$.device.peak_flops", float("nan"), "peak_flops is nan"),
    (("device", "peak_flops"), "$.device.peak_flops", 1e-30, "rate of at least 1"),
    (("nodes", 2, "outputs", 0, "bytes"), "$.nodes[2].outputs[0].bytes", 10**30, "beyond any real model"),
    (("nodes", 2, "fwd_time_s"), "$.nodes[2].fwd_time_s", 1e12, "seconds below"),
    (("memory", "peak_bytes"), "$.memory.peak_bytes", 2**60, "below 2**60"),
])
def test_graph_numbers_must_be_finite_and_sane(graph, where, path, value, words):
    node = graph
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    _refused(graph, "graph", path, words)


def test_graph_labels_params_and_ties_must_fit_the_nodes(graph):
    bad = copy.deepcopy(graph)
    bad["nodes"][2]["labels"]["inputs"] = ["bkz", "nk"]  # three letters for a rank-2 input
    _refused(bad, "graph", "$.nodes[2].labels.inputs[0]", "3 letters for a tensor of rank 2")
    bad = copy.deepcopy(graph)
    bad["nodes"][2]["labels"]["outputs"] = ["bn", "bn"]
    _refused(bad, "graph", "$.nodes[2].labels.outputs", "1 outputs but 2 outputs labels")
    bad = copy.deepcopy(graph)
    bad["nodes"][2]["params"] = ["x"]  # an input, not a parameter
    _refused(bad, "graph", "$.nodes[2].params[0]", "which is no parameter node")
    bad = copy.deepcopy(graph)
    bad["memory"]["timeline"] = [[0, "forward", "ghost", 16]]
    _refused(bad, "graph", "$.memory.timeline[0][2]", "'ghost'")


def test_plan_mesh_axes_and_placement_counts(graph, plan):
    bad = copy.deepcopy(plan)
    bad["mesh"]["axis_names"] = ["dp", "tp"]
    _refused(bad, "plan", "$.mesh.axis_names", "1 dimensions but 2 axis names")
    bad = copy.deepcopy(plan)
    bad["nodes"]["linear"]["outputs"] = [["S(0)", "R"]]
    _refused(bad, "plan", "$.nodes.linear.outputs[0]", "one placement per mesh axis (1)")
    bad = copy.deepcopy(plan)
    bad["grad_sync"][0]["axis"] = 3
    _refused(bad, "plan", "$.grad_sync[0].axis", "mesh axis 3 of a 1-axis mesh")
    bad = copy.deepcopy(plan)
    bad["predictions"]["step_time_s"]["total"] = float("inf")
    _refused(bad, "plan", "$.predictions.step_time_s.total", "is inf")
    bad = copy.deepcopy(plan)
    bad["solver"]["objective_s"] = -1.0  # the ILP objective may be negative: accepted
    check_document(bad, "plan")


def test_plan_against_its_graph(graph, plan):
    check_plan_matches_graph(plan, graph)
    bad = copy.deepcopy(plan)
    bad["params"]["p_w"]["placements"] = ["S(9)"]
    with pytest.raises(DocumentError, match=r"S\(9\) on mesh axis 0 shards dim 9 of a tensor of rank 2") as info:
        check_plan_matches_graph(bad, graph)
    assert info.value.path == "$.params.p_w.placements[0]"
    bad = copy.deepcopy(plan)
    bad["params"]["p_w"]["target"] = "lin.bias"
    with pytest.raises(DocumentError, match="targets 'lin.bias', but the graph's is 'lin.weight'"):
        check_plan_matches_graph(bad, graph)
    bad = copy.deepcopy(plan)
    bad["params"]["x"] = {"target": "x", "placements": ["R"]}
    with pytest.raises(DocumentError, match="'x' is not a parameter of the graph"):
        check_plan_matches_graph(bad, graph)
    bad = copy.deepcopy(plan)
    del bad["nodes"]["sum"]
    with pytest.raises(DocumentError, match=r"1 nodes of the graph have no placement \(first: 'sum'\)"):
        check_plan_matches_graph(bad, graph)
    bad = copy.deepcopy(plan)
    bad["nodes"]["linear"]["inputs"] = [["S(0)"]]
    with pytest.raises(DocumentError, match="'linear' has 2 inputs in the graph but 1 in the plan"):
        check_plan_matches_graph(bad, graph)
    other = copy.deepcopy(graph)
    other["nodes"][1]["outputs"][0]["shape"] = [32, 4]
    other["fingerprint"] = graph_fingerprint(other["nodes"])
    with pytest.raises(MismatchError, match="the model changed since planning"):
        check_plan_matches_graph(plan, other)


def test_world_size_must_fill_the_mesh(plan):
    check_world_size(plan, 2)
    with pytest.raises(MismatchError, match="mesh 2 needs 2 processes, but the job has 4; run with --nproc 2"):
        check_world_size(plan, 4)
    with pytest.raises(MismatchError, match="run with --nproc 1 on each of the 2 hosts"):
        check_world_size(plan, 4, hosts=2)
    with pytest.raises(MismatchError, match="2 processes do not split evenly over 3 hosts: change --nnodes"):
        check_world_size(plan, 3, hosts=3)


def test_every_load_runs_the_semantic_checks(tmp_path, graph):
    graph["nodes"][2]["fwd_flops"] = float("inf")
    (tmp_path / "g.json").write_text(json.dumps(graph))  # Python writes Infinity, which json reads back
    with pytest.raises(DocumentError, match=r"g\.json: at \$\.nodes\[2\]\.fwd_flops: fwd_flops is inf"):
        load(tmp_path / "g.json")
