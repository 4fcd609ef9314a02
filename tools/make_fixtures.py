"""Write the released-schema fixtures: a graph and a plan of the zoo MLP at the current schema version.

    python tools/make_fixtures.py   # -> integration_tests/fixtures/{graph,plan}-MAJOR.MINOR.json

Run it once per released schema version and commit the files; older ones stay forever, and
integration_tests/test_fixtures.py proves that every one of them still loads. A fixture that exists
is never rewritten: a new plan version is solved for the existing graph fixture of the current graph
version (and uses what that version added: plan 1.1 holds chunked state and its offload section).
"""

from pathlib import Path

from cauto.plan import CURRENT_VERSION, dump, load
from cauto.profiler import profile
from cauto.profiler.zoo import mlp
from cauto.solver import cluster_for_mesh, solve

OUT = Path(__file__).resolve().parents[1] / "integration_tests" / "fixtures"


def _path(kind: str) -> Path:
    major, minor = CURRENT_VERSION[kind]
    return OUT / f"{kind}-{major}.{minor}.json"


def main() -> None:
    if _path("graph").exists():
        graph = load(_path("graph"), "graph")
    else:
        graph = profile(lambda: mlp(batch=8, dim=16, hidden=32, layers=2), device_model="cpu").to_graph()
        graph["memory"]["timeline"] = graph["memory"].get("timeline", [])[:50]
        print("wrote", dump(graph, _path("graph")))
    if not _path("plan").exists():
        plan = solve(graph, cluster_for_mesh("cpu-gloo", (2,)), offload=True)
        plan["solver"]["time_s"] = 0.0
        print("wrote", dump(plan, _path("plan")))


if __name__ == "__main__":
    main()
