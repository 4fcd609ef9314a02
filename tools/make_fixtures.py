"""Write the released-schema fixtures: a graph and a plan of the zoo MLP at the current schema version.

    python tools/make_fixtures.py   # -> integration_tests/fixtures/{graph,plan}-MAJOR.MINOR.json

Run it once per released schema version and commit the files; older ones stay forever, and
integration_tests/test_fixtures.py proves that every one of them still loads.
"""

from pathlib import Path

from cauto.plan import CURRENT_VERSION, dump
from cauto.profiler import profile
from cauto.profiler.zoo import mlp
from cauto.solver import cluster_for_mesh, solve

OUT = Path(__file__).resolve().parents[1] / "integration_tests" / "fixtures"


def main() -> None:
    graph = profile(lambda: mlp(batch=8, dim=16, hidden=32, layers=2), device_model="cpu").to_graph()
    graph["memory"]["timeline"] = graph["memory"].get("timeline", [])[:50]
    plan = solve(graph, cluster_for_mesh("cpu-gloo", (2,)))
    plan["solver"]["time_s"] = 0.0
    for kind, doc in (("graph", graph), ("plan", plan)):
        major, minor = CURRENT_VERSION[kind]
        print("wrote", dump(doc, OUT / f"{kind}-{major}.{minor}.json"))


if __name__ == "__main__":
    main()
