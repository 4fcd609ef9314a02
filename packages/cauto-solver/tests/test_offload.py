"""plan(offload=...): chunked data-parallel state where no device-only plan fits (offload.py)."""

import json
from pathlib import Path

import pytest

from cauto.plan import check_document, check_plan_matches_graph, load_plan
from cauto.solver import InfeasibleBudgetError, SolverError, plan
from cauto.solver.cli import main
from cauto.solver.cluster import PRESETS, DeviceSpec, cluster_for_mesh
from cauto.solver.offload import OffloadModel, chunk_elems_for, count_chunks

GRAPH = json.loads((Path(__file__).parent / "data" / "profiled_gpt_graph.json").read_text())


@pytest.fixture(scope="module")
def cluster():
    return cluster_for_mesh("cpu-gloo", (2,))


@pytest.fixture(scope="module")
def least_on_device(cluster) -> int:
    with pytest.raises(InfeasibleBudgetError) as info:
        plan(GRAPH, cluster, memory_budget=1)
    return info.value.needed_bytes


def _without_time(p: dict) -> dict:
    return {**p, "solver": {k: v for k, v in p["solver"].items() if k != "time_s"}}


def test_auto_leaves_feasible_plans_untouched(cluster, least_on_device):
    budget = int(least_on_device * 1.5)
    auto = plan(GRAPH, cluster, memory_budget=budget, offload="auto")
    assert _without_time(auto) == _without_time(plan(GRAPH, cluster, memory_budget=budget))
    assert "offload" not in auto and {p["state"] for p in auto["params"].values()} == {"device"}


def test_auto_turns_an_infeasible_budget_into_a_chunked_plan_that_fits(cluster, least_on_device):
    budget = int(least_on_device * 0.8)
    with pytest.raises(InfeasibleBudgetError):
        plan(GRAPH, cluster, memory_budget=budget)
    p = plan(GRAPH, cluster, memory_budget=budget, offload="auto")
    check_document(p, "plan")
    check_plan_matches_graph(p, GRAPH)
    pred, off = p["predictions"], p["offload"]
    assert pred["peak_bytes"] <= budget
    assert off["device_budget_bytes"] == budget
    # pure data parallelism, which the runtime runs with chunks: every param chunked and replicated, no edges
    assert all(e["state"] == "chunked" and set(e["placements"]) == {"R"} for e in p["params"].values())
    assert p["edges"] == []
    inputs = [n["id"] for n in GRAPH["nodes"] if n["kind"] == "input"]
    assert all(p["nodes"][i]["outputs"][0] == ["S(0)"] for i in inputs)
    # device memory: the working set instead of params + grads + Adam state; the arena covers the working set
    assert pred["model_state_bytes"] < least_on_device / 4
    assert off["arena_bytes"] >= off["working_set_bytes"] > 0
    assert off["arena_bytes"] == budget - (pred["peak_bytes"] - off["working_set_bytes"])
    # host link traffic priced and in the total; ZeRO collectives replace the gradient all-reduce
    st = pred["step_time_s"]
    assert off["moved_bytes"] > 0
    assert st["offload"] == pytest.approx(off["moved_bytes"] / off["host_link_bandwidth_bytes_per_s"])
    assert st["total"] == pytest.approx(st["compute"] + st["communication"] + st["offload"])
    ops = {(c["op"], c["phase"]) for c in pred["collectives"]}
    assert ("all_gather", "forward") in ops and ("reduce_scatter", "backward") in ops
    assert not p.get("grad_sync")
    groups = off["num_chunks"] // 2
    assert sum(c["where"].startswith("chunk group") for c in pred["collectives"]) == 2 * groups


def test_forced_chunks_and_their_limits(cluster, least_on_device):
    roomy = plan(GRAPH, cluster, memory_budget=least_on_device * 2, offload="chunked")
    assert {e["state"] for e in roomy["params"].values()} == {"chunked"}
    with pytest.raises(InfeasibleBudgetError) as info:
        plan(GRAPH, cluster, memory_budget=least_on_device // 4, offload="auto")
    assert least_on_device // 4 < info.value.needed_bytes < least_on_device  # the chunked plan's need
    assert "chunk working set" in str(info.value)
    with pytest.raises(SolverError, match="checkpoint"):
        plan(GRAPH, cluster, offload="chunked", checkpoint="auto")
    with pytest.raises(SolverError, match="offload"):
        plan(GRAPH, cluster, offload="sometimes")


def test_chunk_size_is_the_runtime_rule():
    # never below the largest parameter (aligned to 16 elements), whatever the budget
    assert chunk_elems_for([1000, 1000, 1000], 1, 1) == 1008
    assert count_chunks([1000, 1000, 1000], 1008, 2) == 4  # padded to a multiple of the group
    # the budget bounds a chunk's param + grad bytes to budget/8 (the runtime's default); within that,
    # the least padding: 1000 parameters of 100 elements (112 aligned) waste nothing in chunks of 112 * k
    for budget in (64 * 2048, 64 * 10_000):
        size = chunk_elems_for([100] * 1000, 1, budget)
        assert 112 <= size <= budget // 64 and size % 112 == 0


def test_traffic_model():
    c = cluster_for_mesh("cpu-gloo", (2,))
    m = OffloadModel(c, 1 << 20, 1024, 1024)
    p = 4 * 4 * 1024  # four chunks of fp32 params
    assert m.traffic_bytes(4, 10 << 20) == p // 2  # everything fits: only the other rank's gathered chunks
    tight = m.traffic_bytes(4, m.working_set_bytes)  # no spare room: every chunk comes back for backward
    assert tight == p + p // 2 + p
    assert m.traffic_bytes(4, m.working_set_bytes + p) == p + p // 2


def test_host_link_in_presets_and_spec_files():
    assert PRESETS["h100"].device.host_link_bandwidth_bytes_per_s == 50e9
    dev = DeviceSpec("x", 1 << 30, 1e12, 1e9)
    assert dev.host_link_bandwidth_bytes_per_s == 1e9  # never faster than the device's own memory
    assert cluster_for_mesh("a100", (2,)).to_dict()["device"]["host_link_bandwidth_bytes_per_s"] == 25e9


def test_cli_offload_flag(tmp_path, capsys, least_on_device):
    graph_path = tmp_path / "g.json"
    graph_path.write_text(json.dumps(GRAPH))
    out = tmp_path / "p.json"
    budget = str(int(least_on_device * 0.8))
    assert main([str(graph_path), "--mesh", "2", "--memory", budget, "-o", str(out)]) == 2
    assert "no plan fits" in capsys.readouterr().err and not out.exists()
    assert main([str(graph_path), "--mesh", "2", "--memory", budget, "--offload", "auto", "-o", str(out)]) == 0
    assert "chunked state" in capsys.readouterr().out
    doc = load_plan(out)
    assert doc.schema_version == "1.1" and doc.offload["device_budget_bytes"] == int(budget)
    assert {e["state"] for e in doc.params.values()} == {"chunked"}
    with pytest.raises(SystemExit) as info:
        main([str(graph_path), "--mesh", "2", "--offload", "always", "-o", str(tmp_path / "q.json")])
    assert info.value.code == 2
    assert main([str(graph_path), "--mesh", "2", "--memory", "1MiB", "--offload", "auto", "-o", str(out)]) == 2
    assert "the plan with the least memory needs" in capsys.readouterr().err
