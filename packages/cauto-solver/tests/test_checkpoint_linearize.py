"""Linearizing a graph document into a chain: cut points, constants, per-stage numbers, sharding."""

from __future__ import annotations

import pytest

from cauto.plan import validate
from cauto.solver.checkpoint.linearize import build_chain
from cauto.solver.checkpoint.synthetic import gpt_graph

B, T, H = 2, 16, 32
ACT = B * T * H * 4


@pytest.fixture(scope="module")
def graph():
    return gpt_graph(layers=3, batch=B, seq=T, hidden=H, heads=4, vocab=64)


def test_synthetic_graph_is_a_valid_document(graph):
    validate(graph, "graph")


def test_cuts_fall_on_residual_adds_and_constants_do_not_block_them(graph):
    chain = build_chain(graph)
    ends = [stage[-1] for stage in chain.stage_nodes]
    for i in range(3):
        assert f"h.{i}.add1" in ends and f"h.{i}.add2" in ends
        # inside a block the residual stream stays live next to the branch: no cut there
        for inner in ("ln1", "qkv", "rope", "sdpa", "proj", "ln2", "fc", "gelu", "fc2"):
            assert f"h.{i}.{inner}" not in ends
    assert "embed" in ends and ends[-1] == "loss"
    # the rotary tables and the mask, read by every layer, are live across these cuts as constants
    assert chain.const_bytes > 0
    ops = [n["id"] for n in graph["nodes"] if n["kind"] == "op"]
    assert [n for s in chain.stage_nodes for n in s] == ops


def test_stage_numbers(graph):
    chain = build_chain(graph)
    nodes = {n["id"]: n for n in graph["nodes"]}
    i = next(k for k, s in enumerate(chain.stage_nodes) if s[0] == "h.1.ln1")
    stage = chain.stage_nodes[i]
    assert chain.x_bytes[i] == ACT and chain.x_bytes[i + 1] == ACT
    saved = sum(nodes[n]["saved_bytes"] for n in stage)
    assert chain.xbar_bytes[i + 1] == saved  # add1 saves its own output: not counted twice
    assert chain.fwd_s[i] == pytest.approx(sum(nodes[n]["fwd_time_s"] for n in stage))
    assert chain.bwd_s[i] == pytest.approx(sum(nodes[n]["bwd_time_s"] for n in stage))
    # forward temporaries: qkv (3 ACT, read by rope) and rope (3 ACT) live with the sdpa transient
    sdpa = nodes["h.1.sdpa"]
    assert chain.ftmp_bytes[i] >= 3 * ACT + sdpa["outputs"][0]["bytes"] + sdpa["transient_bytes"]
    assert chain.x_bytes[-1] == 4  # the loss
    assert chain.const_bytes == sum(nodes[n]["outputs"][0]["bytes"] for n in ("rope_cos", "rope_sin", "mask",
                                                                            "positions"))


def test_shard_scale_divides_bytes_and_times(graph):
    base = build_chain(graph)
    ops = [n["id"] for n in graph["nodes"] if n["kind"] == "op"]
    half = build_chain(graph, shard_scale={n: (2.0, 4.0) for n in ops})
    assert list(half.x_bytes) == [x // 2 for x in base.x_bytes[:-1]] + [2]
    assert half.compute_s == pytest.approx(base.compute_s / 4)
    assert (half.xbar_bytes <= base.xbar_bytes // 2 + 1).all()
    with pytest.raises(ValueError, match="divisors must be positive"):
        build_chain(graph, shard_scale={ops[0]: 0})


def test_max_stages_keeps_balanced_cuts(graph):
    chain = build_chain(graph, max_stages=4)
    assert chain.num_stages == 4
    assert [n for s in chain.stage_nodes for n in s] == [n["id"] for n in graph["nodes"] if n["kind"] == "op"]
    share = chain.fwd_s + chain.bwd_s
    assert share.max() < 0.6 * share.sum()


def test_unordered_graph_is_an_error(graph):
    bad = dict(graph, nodes=list(reversed(graph["nodes"])))
    with pytest.raises(ValueError, match="topological order"):
        build_chain(bad)


def test_views_are_never_cut_tensors_and_activation_scale(graph):
    from cauto.solver import synthetic

    g = synthetic.gpt(layers=2)
    chain = build_chain(g)
    ops = {n["id"]: n for n in g["nodes"] if n["kind"] == "op"}
    for stage in chain.stage_nodes[:-1]:
        assert ".view" not in ops[stage[-1]]["op"] and ".transpose" not in ops[stage[-1]]["op"]
    half = build_chain(graph, activation_scale=0.5)
    base = build_chain(graph)
    assert (half.x_bytes == base.x_bytes).all() and half.xbar_bytes.sum() < base.xbar_bytes.sum()


def test_profiled_graph_chain_is_conservative_but_close():
    """A graph written by cauto-profiler (zoo.gpt: dim 128, 2 layers, batch 8 x 64; AdamW, step 2)."""
    import json
    from pathlib import Path

    from cauto.solver.checkpoint.schedule import store_all, to_ops
    from cauto.solver.checkpoint.simulate import simulate

    graph = json.loads((Path(__file__).parent / "data" / "profiled_gpt_graph.json").read_text())
    validate(graph, "graph")
    chain = build_chain(graph)
    ends = [s[-1] for s in chain.stage_nodes]
    assert ends[-1] == "cross_entropy_loss" and {"add_1", "add_2", "add_3", "add_4"} <= set(ends)
    # the profiler's forward peak minus parameters and Adam's m, v (gradients are freed by zero_grad)
    measured = graph["memory"]["phases"]["forward"] - 3 * graph["model"]["param_bytes"]
    peak = simulate(chain, to_ops(store_all(chain.num_stages))).peak_bytes
    assert measured <= peak <= 1.25 * measured
