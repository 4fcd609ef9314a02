"""Every released schema version's fixture still loads with the current cauto-plan."""

from pathlib import Path

import pytest

from cauto.plan import check_plan_matches_graph, load

FIXTURES = Path(__file__).parent / "fixtures"
VERSIONS = sorted({p.stem.split("-", 1)[1] for p in FIXTURES.glob("*.json")})


def test_there_is_a_fixture_of_each_kind():
    assert {p.stem.split("-")[0] for p in FIXTURES.glob("*.json")} == {"graph", "plan"}


@pytest.mark.parametrize("version", VERSIONS)
def test_released_fixtures_load_and_match(version):
    graph = load(FIXTURES / f"graph-{version}.json", "graph")
    plan = load(FIXTURES / f"plan-{version}.json", "plan")
    check_plan_matches_graph(plan, graph)
