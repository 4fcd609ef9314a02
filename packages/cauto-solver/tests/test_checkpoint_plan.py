"""plan_checkpoint: the plan's checkpoint section, its regions, methods, infeasible budgets, the CLI lines."""

from __future__ import annotations

import jsonschema
import pytest

from cauto.plan.schema import load_schema
from cauto.solver.checkpoint.api import (
    CheckpointInfeasibleError,
    checkpoint_section,
    choose_schedule,
    plan_checkpoint,
    summary_lines,
)
from cauto.solver.checkpoint.linearize import build_chain
from cauto.solver.checkpoint.schedule import regions_of, to_ops
from cauto.solver.checkpoint.simulate import simulate
from cauto.solver.checkpoint.synthetic import gpt_graph


@pytest.fixture(scope="module")
def graph():
    return gpt_graph(layers=6, batch=4, seq=64, hidden=64, heads=4, vocab=256)


@pytest.fixture(scope="module")
def chain(graph):
    return build_chain(graph)


@pytest.fixture(scope="module")
def peaks(graph):
    s = plan_checkpoint(graph)["summary"]
    return s["no_checkpoint_peak_bytes"], s["least_feasible_bytes"]


def _section_validator():
    plan = load_schema("plan")
    return jsonschema.Draft202012Validator({**plan["properties"]["checkpoint"], "$defs": plan["$defs"]})


def _budgets(peaks):
    full, least = peaks
    return [least, int(least + 0.1 * (full - least)), int(least + 0.4 * (full - least)), full - 1]


@pytest.mark.parametrize("method", ["rotor", "chen", "auto"])
def test_regions_cover_exactly_the_recomputed_nodes(graph, chain, peaks, method):
    validator = _section_validator()
    for budget in _budgets(peaks):
        try:
            choice = choose_schedule(chain, budget, method)
        except CheckpointInfeasibleError:
            assert method == "chen"
            continue
        section = checkpoint_section(choice)
        validator.validate(section)
        sim = simulate(chain, to_ops(choice.schedule))
        assert sim == choice.simulation and sim.peak_bytes <= budget
        recomputed = {n for k, count in enumerate(sim.forward_counts) if count > 1 for n in chain.stage_nodes[k]}
        regions = section["regions"]
        assert {n for r in regions for n in r["nodes"]} == recomputed
        assert section["recompute_s"] == pytest.approx(sim.recompute_s(chain), rel=1e-9, abs=1e-12)
        # each node is recomputed once per region holding it
        for k, count in enumerate(sim.forward_counts):
            holding = sum(chain.stage_nodes[k][0] in r["nodes"] for r in regions)
            assert count == 1 + holding
        for index, region in enumerate(regions):
            for child in region["children"]:
                assert child > index and set(regions[child]["nodes"]) < set(region["nodes"])
        assert len(regions) == len(list(regions_of(choice.schedule)))


def test_rotor_nests_at_the_least_budget_and_beats_chen(chain, peaks):
    full, least = peaks
    section = checkpoint_section(choose_schedule(chain, least, "rotor"))
    assert any(r["children"] for r in section["regions"])
    budget = int(least + 0.4 * (full - least))
    rotor, chen = choose_schedule(chain, budget, "rotor"), choose_schedule(chain, budget, "chen")
    assert rotor.simulation.time_s <= chen.simulation.time_s


def test_methods_and_summary(graph, peaks):
    full, least = peaks
    ample = plan_checkpoint(graph, method="auto", memory_budget_bytes=full)
    assert ample["checkpoint"] == {"method": "none", "regions": [], "recompute_s": 0}
    assert ample["summary"]["activation_peak_bytes"] == full
    tight = plan_checkpoint(graph, method="auto", memory_budget_bytes=(full + least) // 2)
    s = tight["summary"]
    assert s["method"] in ("rotor", "chen") and s["regions"] > 0
    assert s["activation_peak_bytes"] <= (full + least) // 2
    assert 0 < s["recompute_s"] < s["compute_s"]
    lines = summary_lines(tight["checkpoint"], s)
    assert lines[0].startswith(f"checkpoint: {s['method']}, {s['regions']} regions")
    assert "least possible" in lines[1] and any(line.strip().startswith("region 0") for line in lines)
    assert summary_lines(ample["checkpoint"]) == ["checkpoint: none, nothing recomputed"]
    with pytest.raises(ValueError, match="not one of"):
        plan_checkpoint(graph, method="fast", memory_budget_bytes=full)


def test_infeasible_budget_reports_the_least_feasible_memory(graph, chain, peaks):
    full, least = peaks
    with pytest.raises(CheckpointInfeasibleError) as err:
        plan_checkpoint(graph, method="rotor", memory_budget_bytes=least - 1)
    assert err.value.needed_bytes == least and "give more memory" in str(err.value)
    at_least = plan_checkpoint(graph, method="rotor", memory_budget_bytes=least)
    assert at_least["summary"]["activation_peak_bytes"] <= least
    with pytest.raises(CheckpointInfeasibleError) as err:
        plan_checkpoint(graph, method="none", memory_budget_bytes=full - 1)
    assert err.value.needed_bytes == full and "--checkpoint rotor" in str(err.value)
