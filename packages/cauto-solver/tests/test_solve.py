from __future__ import annotations

import copy

import pytest

from cauto.plan import GraphDocument, check_document, check_plan_matches_graph, split_ref
from cauto.solver import synthetic
from cauto.solver.errors import SolverError
from cauto.solver.ilp import solve_ilp
from cauto.solver.sharding_section import sharding_section
from cauto.solver.solve import build, chosen_strategies, evaluate, solve


@pytest.fixture(scope="module")
def gpt_graph():
    return synthetic.gpt(batch=8, seq=64, hidden=128, heads=4, layers=3)


def test_plan_is_valid_and_complete(gpt_graph, make_cluster):
    plan = solve(gpt_graph, make_cluster(2, 2))
    check_document(plan, "plan")
    check_plan_matches_graph(plan, gpt_graph)
    ids = [n["id"] for n in gpt_graph["nodes"] if n["kind"] != "output"]
    assert sorted(plan["nodes"]) == sorted(ids)
    by_id = {n["id"]: n for n in gpt_graph["nodes"]}
    assert set(plan["params"]) == {n["id"] for n in gpt_graph["nodes"] if n["kind"] == "param"}
    edges = {(e["dst"], e["arg"]): e for e in plan["edges"]}
    for nid in ids:
        node, entry = by_id[nid], plan["nodes"][nid]
        assert len(entry["inputs"]) == len(node["inputs"]) and len(entry["outputs"]) == len(node["outputs"])
        for k, ref in enumerate(node["inputs"]):
            src, o = split_ref(ref)
            have = plan["nodes"][src]["outputs"][o]
            if have != entry["inputs"][k]:
                e = edges[(nid, k)]
                assert e["src"] == src and e["src_placements"] == have and e["dst_placements"] == entry["inputs"][k]
            else:
                assert (nid, k) not in edges
        if node["kind"] in ("param", "buffer", "input"):
            assert entry["inputs"] == [] and len(entry["outputs"]) == 1
        if node["kind"] == "buffer" or (node["kind"] == "op" and not node["inputs"]):
            assert all(p == "R" for p in entry["outputs"][0])
    assert plan["nodes"]["p_head_weight"]["outputs"] == plan["nodes"]["p_tok_weight"]["outputs"]
    assert plan["params"]["p_head_weight"]["placements"] == plan["params"]["p_tok_weight"]["placements"]
    grad_sync = [c for c in plan["predictions"]["collectives"] if c["phase"] == "grad_sync"]
    assert grad_sync == plan["grad_sync"]
    st = plan["predictions"]["step_time_s"]
    assert st["total"] == pytest.approx(st["compute"] + st["communication"])
    assert st["communication"] == pytest.approx(sum(c["cost_s"] for c in plan["predictions"]["collectives"]))


def test_deterministic_except_time(gpt_graph, make_cluster):
    a = solve(gpt_graph, make_cluster(2, 2))
    b = solve(copy.deepcopy(gpt_graph), make_cluster(2, 2))
    a["solver"].pop("time_s"), b["solver"].pop("time_s")
    assert a == b


def test_tied_parameter_counts_once(make_cluster):
    graph = synthetic.gpt(batch=8, seq=64, hidden=128, heads=4, layers=1)
    untied = copy.deepcopy(graph)
    head = next(n for n in untied["nodes"] if n["id"] == "p_head_weight")
    head["tied_to"] = None
    from cauto.plan import graph_fingerprint
    untied["fingerprint"] = graph_fingerprint(untied["nodes"])
    a = solve(graph, make_cluster(2))["predictions"]["model_state_bytes"]
    b = solve(untied, make_cluster(2))["predictions"]["model_state_bytes"]
    assert b > a


def test_a_shared_copy_reduces_the_sum_of_its_consumers_gradients(make_cluster):
    # the tied weight, stored S(1), is all-gathered once for the embedding (gradient R) and the
    # batch-split head (gradient Partial): autograd sums both into the copy's one backward, which
    # reduce-scatters the Partial sum back to S(1) (the head's edge reuses the copy, so it has none)
    g = GraphDocument.from_dict(synthetic.gpt(batch=8, seq=64, hidden=128, heads=4, layers=1))
    cluster = make_cluster(2)
    strategies, cost, memory, _ = build(g, cluster, follow=False, share_layers=False)
    chosen = {n.id: strategies[n.id][0] for n in g.nodes if n.kind != "output"}
    assert chosen["embedding"].input_grads[0] == ("R",)
    chosen["p_tok_weight"] = next(s for s in strategies["p_tok_weight"] if s.outputs == (("S(1)",),))
    chosen["linear_6"] = next(s for s in strategies["linear_6"] if s.name == "b@dp")
    assert chosen["linear_6"].input_grads[1] == ("P(sum)",)
    p = sharding_section(g, cluster, chosen, cost, memory, None)
    weight = [c for c in p["predictions"]["collectives"] if c["where"].startswith("p_tok_weight->")]
    assert [(c["phase"], c["op"], c["where"]) for c in weight] == [
        ("forward", "all_gather", "p_tok_weight->embedding:0"),
        ("backward", "reduce_scatter", "p_tok_weight->embedding:0")]


def test_repeated_layers_share_variables(make_cluster):
    cluster = make_cluster(2, 2)
    sizes = []
    for layers in (2, 6):
        g = GraphDocument.from_dict(synthetic.gpt(batch=8, seq=64, hidden=128, heads=4, layers=layers))
        _, _, _, problem = build(g, cluster)
        sizes.append(len(problem.var_sizes))
    assert sizes[0] == sizes[1]


def test_grouping_stays_close_to_the_full_model(make_cluster):
    g = GraphDocument.from_dict(synthetic.gpt(batch=8, seq=64, hidden=128, heads=4, layers=2))
    cluster = make_cluster(4)
    full = build(g, cluster, follow=False, share_layers=False)
    grouped = build(g, cluster)
    r_full = solve_ilp(full[3], None)
    r_grouped = solve_ilp(grouped[3], None)
    t_full = evaluate(g, chosen_strategies(full[3], r_full.choice), full[1], full[2])[0]
    t_grouped = evaluate(g, chosen_strategies(grouped[3], r_grouped.choice), grouped[1], grouped[2])[0]
    assert t_full <= t_grouped + 1e-12
    assert t_grouped <= t_full * 1.05
    assert len(grouped[3].var_sizes) < len(full[3].var_sizes) / 2


def test_highs_agrees_with_cbc(gpt_graph, make_cluster):
    pytest.importorskip("highspy")
    a = solve(gpt_graph, make_cluster(4), solver="cbc")
    b = solve(gpt_graph, make_cluster(4), solver="highs")
    assert b["solver"]["name"] == "highs"
    assert a["solver"]["objective_s"] == pytest.approx(b["solver"]["objective_s"], rel=1e-6)


def test_unsharded_estimate_matches_the_graph_peak(make_cluster):
    g = synthetic.gpt(batch=8, seq=64, hidden=128, heads=4, layers=2)
    plan = solve(g, make_cluster(1))
    assert plan["predictions"]["peak_bytes"] == pytest.approx(g["memory"]["peak_bytes"], rel=0.05)


def test_bad_inputs(gpt_graph, make_cluster):
    broken = copy.deepcopy(gpt_graph)
    broken["nodes"][5]["inputs"] = ["nope"]
    with pytest.raises(SolverError, match="invalid graph document"):
        solve(broken, make_cluster(2))
    with pytest.raises(SolverError, match="unknown solver"):
        solve(gpt_graph, make_cluster(2), solver="gurobi")


def test_gathered_parameter_copy_is_saved_until_backward(make_cluster):
    # a batch large enough that activations (not the gradients after backward) hold the peak
    g = GraphDocument.from_dict(synthetic.mlp(batch=512, dims=(64, 64)))
    strategies, _, memory, _ = build(g, make_cluster(2), follow=False, share_layers=False)
    nodes = [n for n in g.nodes if n.kind != "output"]

    def pick(node_id, name):
        return next(s for s in strategies[node_id] if s.name == name)

    chosen = {n.id: strategies[n.id][0] for n in nodes}
    chosen.update(x=pick("x", "0@dp"), linear=pick("linear", "b@dp"), sum=pick("sum", "b@dp"))
    replicated_weight = memory.peak(nodes, chosen)
    chosen["p_layers_0_weight"] = pick("p_layers_0_weight", "0@dp")
    zero = memory.peak(nodes, chosen)
    weight = 64 * 64 * 4
    # storage and AdamW state shrink by half (gradients are not live at the backward-start peak); the
    # gathered copy (whole) is saved for backward
    assert replicated_weight[1] - zero[1] == (weight + 2 * weight) // 2
    assert zero[2] - replicated_weight[2] == weight
