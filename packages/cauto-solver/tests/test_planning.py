"""plan(): sharding with checkpointing under one budget, on a graph the profiler really wrote."""

import json
from pathlib import Path

import pytest

from cauto.plan import check_document, check_plan_matches_graph
from cauto.solver import InfeasibleBudgetError, plan
from cauto.solver.checkpoint.recompute import recomputed_inputs, region_depths
from cauto.solver.cli import main

GRAPH = json.loads((Path(__file__).parent / "data" / "profiled_gpt_graph.json").read_text())


def _total(p: dict) -> float:
    return p["predictions"]["step_time_s"]["total"]


def _least_budget_without_recompute(cluster) -> int:
    with pytest.raises(InfeasibleBudgetError) as info:
        plan(GRAPH, cluster, memory_budget=1, checkpoint="none")
    return info.value.needed_bytes


def test_auto_is_never_slower_than_none_and_fits_where_none_does_not(make_cluster):
    cluster = make_cluster(2)
    least_none = _least_budget_without_recompute(cluster)
    for budget in (int(least_none * 0.85), least_none, int(least_none * 1.5)):
        auto = plan(GRAPH, cluster, memory_budget=budget, checkpoint="auto")
        check_document(auto, "plan")
        check_plan_matches_graph(auto, GRAPH)
        assert auto["predictions"]["peak_bytes"] <= budget
        if budget >= least_none:
            assert _total(auto) <= _total(plan(GRAPH, cluster, memory_budget=budget, checkpoint="none")) + 1e-12
        else:  # only checkpointing makes this budget feasible
            assert auto["checkpoint"]["regions"], "a budget below the no-recompute need must recompute something"
            assert auto["predictions"]["step_time_s"]["recompute"] > 0


def test_rotor_plan_names_graph_nodes_and_prices_recompute(make_cluster):
    cluster = make_cluster(2)
    budget = int(_least_budget_without_recompute(cluster) * 0.85)
    p = plan(GRAPH, cluster, memory_budget=budget, checkpoint="rotor")
    ids = {n["id"] for n in GRAPH["nodes"]}
    regions = p["checkpoint"]["regions"]
    assert p["checkpoint"]["method"] == "rotor" and regions
    assert all(node in ids for region in regions for node in region["nodes"])
    # recompute time = recomputed compute + the collectives of redistributions inside regions that the
    # local program's backward runs again (checkpoint/recompute.py), listed in phase "backward"
    again = [c for c in p["predictions"]["collectives"] if c["where"].startswith("recompute: ")]
    inside = {e for region in regions for e in region["nodes"]}
    if any(region.get("children") for region in regions):  # nested: the interpreter runs whole regions again,
        depth = region_depths(regions)                   # once per level (rotor nests at this budget)
        expected = [c for e in p["edges"] for _ in range(depth.get(e["dst"], 0)) for c in e["collectives"]]
    else:
        expected = [c for e in p["edges"] for c in e["collectives"] if e["dst"] in inside and (e["dst"], e["arg"])
                    in recomputed_inputs(GRAPH, regions, {(d["dst"], d["arg"]) for d in p["edges"]})]
    assert len(again) == len(expected) and all(c["phase"] == "backward" for c in again)
    assert p["predictions"]["step_time_s"]["recompute"] == pytest.approx(
        p["checkpoint"]["recompute_s"] + sum(c["cost_s"] for c in again))


def test_cli_checkpoint_flag_and_unknown_method(tmp_path, capsys):
    graph_path = tmp_path / "g.json"
    graph_path.write_text(json.dumps(GRAPH))
    out = tmp_path / "p.json"
    assert main([str(graph_path), "--mesh", "2", "--checkpoint", "auto", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["kind"] == "plan"
    with pytest.raises(SystemExit) as info:
        main([str(graph_path), "--mesh", "2", "--checkpoint", "sometimes", "-o", str(tmp_path / "q.json")])
    assert info.value.code == 2
    assert not (tmp_path / "q.json").exists()


@pytest.mark.parametrize("budget", [-1, 0, 2.5, True, "1GiB"])
def test_a_budget_that_is_no_positive_byte_count_is_refused_not_reported_infeasible(make_cluster, budget):
    from cauto.solver import SolverError

    with pytest.raises(SolverError, match="is not a positive number of bytes") as info:
        plan(GRAPH, make_cluster(2), memory_budget=budget)
    assert not isinstance(info.value, InfeasibleBudgetError)  # was "no plan fits -0.00 MiB"


def test_an_empty_memory_option_is_a_bad_size_not_the_device_memory(tmp_path, capsys):
    (tmp_path / "g.json").write_text(json.dumps(GRAPH))
    assert main([str(tmp_path / "g.json"), "--mesh", "2", "--memory", "", "-o", str(tmp_path / "p.json")]) == 2
    assert "memory '' is not a size" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_the_plan_records_its_options_and_they_make_it_again(make_cluster):
    """A plan's ``options`` section holds every PlanOptions field it was solved with (valid against the
    schema); planning the same graph again with exactly those options gives the same plan."""
    from cauto.plan.options import PlanOptions

    cluster = make_cluster(2)
    first = plan(GRAPH, cluster, memory_budget=int(_least_budget_without_recompute(cluster) * 0.9), checkpoint="auto")
    check_document(first, "plan")
    recorded = first["options"]
    assert recorded["checkpoint"] == "auto" and recorded["offload"] == "none" and recorded["solver"] == "cbc"
    assert recorded["memory_budget_bytes"] == first["predictions"]["memory_budget_bytes"]
    again = plan(GRAPH, cluster, PlanOptions(**{**recorded, "offload_axes": recorded["offload_axes"]}))

    def without_time(p):
        return {**p, "solver": {k: v for k, v in p["solver"].items() if k != "time_s"}}

    assert without_time(again) == without_time(first)
