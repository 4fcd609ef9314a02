"""The ILP optimum equals brute-force enumeration of every strategy combination (same model)."""

from __future__ import annotations

import itertools

import pytest

from cauto.plan import GraphDocument
from cauto.solver import synthetic
from cauto.solver.cluster import AxisLink, DeviceSpec, HardwareSpec
from cauto.solver.errors import InfeasibleBudgetError
from cauto.solver.ilp import solve_ilp
from cauto.solver.solve import build, chosen_strategies, evaluate, solve

#: slow compute, no kernel floor: costs differ between strategies, so the optimum is sharp
ORACLE_HARDWARE = HardwareSpec("oracle", DeviceSpec("oracle", 1 << 30, 1e8, 1e9, 0.0),
                               AxisLink(1e-6, 1e9), AxisLink(2e-6, 5e8), 2)


def brute_force(graph: GraphDocument, strategies, cost, memory, budget):
    nodes = [n for n in graph.nodes if n.kind != "output"]
    best = None
    for combo in itertools.product(*(range(len(strategies[n.id])) for n in nodes)):
        chosen = {n.id: strategies[n.id][i] for n, i in zip(nodes, combo)}
        t, peak = evaluate(graph, chosen, cost, memory)
        if budget is not None and peak > budget:
            continue
        if best is None or t < best[0] - 1e-15:
            best = (t, peak)
    return best


@pytest.mark.parametrize("mesh,dims,batch", [((2,), (8, 16, 8), 4), ((4,), (16, 8), 8), ((2, 2), (8, 8), 4)])
@pytest.mark.parametrize("tight", [False, True])
def test_ilp_equals_brute_force(mesh, dims, batch, tight, make_cluster):
    graph = GraphDocument.from_dict(synthetic.mlp(batch=batch, dims=dims))
    cluster = make_cluster(*mesh, hardware=ORACLE_HARDWARE)
    strategies, cost, memory, problem = build(graph, cluster, follow=False, share_layers=False)
    free = brute_force(graph, strategies, cost, memory, None)
    budget = None
    if tight:
        least = solve_ilp(problem, None, minimize_peak=True)
        least_peak = memory.peak([n for n in graph.nodes if n.kind != "output"],
                                 chosen_strategies(problem, least.choice))[0]
        budget = (least_peak + free[1]) // 2
        if budget >= free[1]:
            pytest.skip("memory never binds on this graph")
    expected = brute_force(graph, strategies, cost, memory, budget)
    result = solve_ilp(problem, budget)
    chosen = chosen_strategies(problem, result.choice)
    got_t, got_peak = evaluate(graph, chosen, cost, memory)
    assert result.status == "optimal"
    assert got_t == pytest.approx(expected[0], rel=1e-9, abs=1e-12)
    assert result.objective == pytest.approx(got_t, rel=1e-6)
    if budget is not None:
        assert got_peak <= budget
        assert expected[0] > free[0]  # the budget really changed the answer


def test_simplified_model_is_never_better_than_the_exact_optimum(make_cluster):
    graph = GraphDocument.from_dict(synthetic.mlp(batch=8, dims=(8, 16, 8)))
    cluster = make_cluster(2)
    strategies, cost, memory, _ = build(graph, cluster, follow=False, share_layers=False)
    exact = brute_force(graph, strategies, cost, memory, None)[0]
    plan = solve(graph, cluster)
    assert plan["solver"]["objective_s"] >= exact - 1e-12
    assert plan["solver"]["objective_s"] <= exact * 1.05


def test_infeasible_budget_names_least_memory(make_cluster):
    graph = synthetic.mlp(batch=8, dims=(8, 16, 8))
    cluster = make_cluster(2)
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(graph, cluster, memory_budget=64)
    err = info.value
    assert err.needed_bytes > 64 and err.budget_bytes == 64 and err.top_tensors
    assert "least-memory plan the search finds needs" in str(err)
    plan = solve(graph, cluster, memory_budget=err.needed_bytes)
    assert plan["predictions"]["peak_bytes"] <= err.needed_bytes
