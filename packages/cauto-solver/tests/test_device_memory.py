"""device_timeline(plan, graph): the per-device check points behind a plan's predicted peak."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cauto.plan import GraphDocument, check_document
from cauto.solver import InfeasibleBudgetError, SolverError, solve, synthetic
from cauto.solver.memory.timeline import PHASES, device_timeline

PROFILED = Path(__file__).parent / "data" / "profiled_gpt_graph.json"


def _profiled() -> GraphDocument:
    return GraphDocument.from_dict(check_document(json.loads(PROFILED.read_text()), "graph"))


@pytest.mark.parametrize("graph_fn", [_profiled, lambda: synthetic.gpt(layers=2), synthetic.mlp])
@pytest.mark.parametrize(("mesh", "budget_share"), [((2,), None), ((2, 2), None), ((4,), 0.6), ((2, 2), 0.45)])
def test_timeline_peak_is_the_plans_predicted_peak(graph_fn, mesh, budget_share, make_cluster):
    graph = graph_fn()
    cluster = make_cluster(*mesh)
    budget = None
    if budget_share is not None:  # a budget under the replicated plan's peak, so that the plan shards
        budget = int(budget_share * solve(graph, make_cluster(1)).get("predictions")["peak_bytes"])
    try:
        plan = solve(graph, cluster, memory_budget=budget)
    except InfeasibleBudgetError:
        pytest.skip("no plan fits this budget")
    timeline = device_timeline(plan, graph)
    pred = plan["predictions"]
    assert timeline.peak_bytes == pred["peak_bytes"]
    assert timeline.state_bytes == pred["model_state_bytes"]
    assert [p for p in PHASES if p in timeline.phase_peaks()] == list(dict.fromkeys(p for p, _, _ in timeline.points))
    nodes = (graph if isinstance(graph, GraphDocument) else GraphDocument.from_dict(graph)).nodes
    ops = [n.id for n in nodes if n.kind == "op"]
    assert [n for p, n, _ in timeline.points if p == "forward"] == ops
    # backward: each op in reverse (an op whose input came through a redistribution has a second point,
    # the redistribution's backward)
    assert list(dict.fromkeys(n for p, n, _ in timeline.points if p == "backward")) == ops[::-1]
    assert all(live >= timeline.state_bytes for _, _, live in timeline.points)


def test_a_plan_for_another_graph_is_refused(make_cluster):
    plan = solve(synthetic.mlp(), make_cluster(2))
    with pytest.raises(ValueError, match="profile and solve again"):
        device_timeline(plan, synthetic.gpt(layers=1))


def test_a_strategy_this_solver_does_not_generate_is_refused(make_cluster):
    graph = synthetic.mlp()
    plan = solve(graph, make_cluster(2))
    node = next(iter(plan["nodes"]))
    plan["nodes"][node]["name"] = "no-such-strategy"
    with pytest.raises(SolverError, match="solve the plan again"):
        device_timeline(plan, graph)


@pytest.mark.parametrize("graph_fn", [synthetic.mlp, lambda: synthetic.gpt(layers=2)])
def test_chunked_state_counts_the_working_set(graph_fn, make_cluster):
    graph = graph_fn()
    budget = int(0.9 * solve(graph, make_cluster(2))["predictions"]["peak_bytes"])
    plan = solve(graph, make_cluster(2), memory_budget=budget, offload=True)
    assert any(p["state"] == "chunked" for p in plan["params"].values())
    timeline = device_timeline(plan, graph)
    assert timeline.peak_bytes == plan["predictions"]["peak_bytes"]
    assert timeline.state_bytes == plan["predictions"]["model_state_bytes"] >= plan["offload"]["working_set_bytes"]


def test_an_output_only_its_consumers_keep_is_freed_by_the_first_keepers_backward(make_cluster):
    """walk.py: autograd frees a value once every node that saved it ran its backward. In the synthetic
    MLP (linear, gelu, linear, sum) the first linear's output is kept by gelu (its backward reads its
    input) and gelu's by the second linear: each is freed by its keeper's backward, not its producer's.
    The second linear's output is kept by nobody that reads it (sum's backward reads nothing): it stays
    with its producer."""
    from cauto.solver.memory.model import MemoryModel
    from cauto.solver.memory.walk import _freed_by_backward, _nesting, _saved_bytes, _Walk
    from cauto.solver.strategies.groups import enumerate_strategies

    graph = GraphDocument.from_dict(synthetic.mlp())
    plan = solve(graph, make_cluster(1))
    nodes = [n for n in graph.nodes if n.kind != "output"]
    strategies = enumerate_strategies(graph, (1,), tuple(plan["mesh"]["axis_names"]))
    chosen = {n.id: strategies[n.id][0] for n in nodes}
    memory = MemoryModel((1,), "adamw", True)
    ops = [n for n in nodes if n.kind == "op"]
    walk = _Walk(memory, chosen, {n.id: n for n in nodes}, ops, {n.id: i for i, n in enumerate(ops)})
    saved = _saved_bytes(walk, {}, set())
    frees = _freed_by_backward(walk, _nesting(walk, (), saved), saved, {})
    freed = frees.bytes
    assert frees.escaping == []
    first, act, second, loss = [n.id for n in ops]
    assert saved[first] and saved[act] and saved[second]
    assert freed == {first: 0, act: saved[first], second: saved[act] + saved[second], loss: saved[loss]}
    assert sum(freed.values()) == sum(saved.values())


def test_input_gradients_free_an_input_once_no_later_gradient_reads_it():
    """A node's backward computes its input gradients one at a time, the last input's first (a linear's
    weight gradient before its input's, as the local program runs it): an input the node is the last
    keeper of is freed once no gradient still to come reads it. Measured on the zoo Llama's checkpointed
    MLP (integration_tests/test_memory_prediction.py, llama-2x2-regions)."""
    from types import SimpleNamespace

    from cauto.solver.memory.walk import _input_gradients_peak

    mul = SimpleNamespace(op="aten.mul.Tensor", inputs=["a#0", "b#0"])
    # each gradient reads the other input: after the second input's gradient, the first input is free
    assert _input_gradients_peak(mul, {0: 100, 1: 100}, {0: 100, 1: 100}) == 100
    assert _input_gradients_peak(mul, {0: 100, 1: 100}, {}) == 200  # nothing freed early: both at once
    linear = SimpleNamespace(op="aten.linear.default", inputs=["x#0", "w"])
    # the weight's gradient (counted with the parameters: 0 here) reads the input, which is then freed
    # before the input's gradient is made
    assert _input_gradients_peak(linear, {0: 100, 1: 0}, {0: 60}) == 40
    unknown = SimpleNamespace(op="aten.my_op.default", inputs=["a#0", "b#0"])
    assert _input_gradients_peak(unknown, {0: 100, 1: 100}, {0: 100}) == 200  # no row: every gradient reads all
