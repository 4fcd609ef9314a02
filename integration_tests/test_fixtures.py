"""Every released schema version's fixture still loads with the current cauto-plan."""

from pathlib import Path

import pytest

from cauto.plan import check_plan_matches_graph, load

FIXTURES = Path(__file__).parent / "fixtures"
PLAN_VERSIONS = sorted(p.stem.split("-", 1)[1] for p in FIXTURES.glob("plan-*.json"))


def test_there_is_a_fixture_of_each_kind():
    assert {p.stem.split("-")[0] for p in FIXTURES.glob("*.json")} == {"graph", "plan"}


@pytest.mark.parametrize("version", PLAN_VERSIONS)
def test_released_fixtures_load_and_match(version):
    """Each plan fixture loads (upgraded to the current version) and matches the graph fixture it was solved for."""
    plan = load(FIXTURES / f"plan-{version}.json", "plan")
    graphs = [load(p, "graph") for p in sorted(FIXTURES.glob("graph-*.json"))]
    graph = next((g for g in graphs if g["fingerprint"] == plan["graph_fingerprint"]), None)
    assert graph is not None, f"no graph fixture has the fingerprint of plan-{version}.json"
    check_plan_matches_graph(plan, graph)
