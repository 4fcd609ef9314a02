"""The copies a plan makes that the unsharded profile does not show (issue 22: the zoo Llama's 2 x 2 plan
with chunked state measured 18% above its prediction): a reshape that copies because a redistribution
changed its input's layout (memory/layout.py), and a pointwise op keeping the redistributed copy of an
input its backward reads (memory/model.py ``saves_input``)."""

from __future__ import annotations

from cauto.plan import GraphNode, Labels, TensorMeta
from cauto.solver.memory.layout import layout_copies, view_strides
from cauto.solver.memory.model import MemoryModel, saves_input
from cauto.solver.memory.walk import predicted_points
from cauto.solver.strategies.node import Strategy

B, S, H, D = 2, 4, 2, 4
MESH = (2,)


def _meta(*shape: int) -> list[TensorMeta]:
    n = 1
    for s in shape:
        n *= s
    return [TensorMeta(shape, "float32", 4 * n)]


def _op(node_id, op, inputs, shape, labels, rule, saved=0) -> GraphNode:
    return GraphNode(node_id, "op", op, "m", inputs, _meta(*shape), saved_bytes=saved,
                     labels=Labels(tuple(labels[0]), tuple(labels[1]), rule=rule))


def _attention_graph() -> list[GraphNode]:
    """``proj(sdpa(q, q, q).transpose(1, 2).reshape(b, s, -1))`` with ``q = lin(x).view(b, s, h, d).transpose(1, 2)``:
    the zoo Attention. Profiled saved bytes: the attention keeps its output, which the reshape views."""
    return [
        GraphNode("x", "input", "input", "", [], _meta(B, S, H * D)),
        GraphNode("wq", "param", "param", "m", [], _meta(H * D, H * D)),
        GraphNode("wp", "param", "param", "m", [], _meta(H * D, H * D)),
        _op("q", "aten.linear.default", ["x", "wq"], (B, S, H * D), (["abk", "nk"], ["abn"]), "matmul"),
        _op("v", "aten.view.default", ["q"], (B, S, H, D), (["abc"], ["abc."]), "view"),
        _op("t", "aten.transpose.int", ["v"], (B, H, S, D), (["abcd"], ["acbd"]), "view", saved=4 * B * S * H * D),
        _op("a", "aten.scaled_dot_product_attention.default", ["t", "t", "t"], (B, H, S, D),
            (["ab..", "ab..", "ab.."], ["ab.."]), "attention", saved=4 * B * S * H * D),
        _op("t2", "aten.transpose.int", ["a"], (B, S, H, D), (["abcd"], ["acbd"]), "view"),
        _op("r", "aten.reshape.default", ["t2"], (B, S, H * D), (["abc."], ["abc"]), "view"),
        _op("o", "aten.linear.default", ["r", "wp"], (B, S, H * D), (["abk", "nk"], ["abn"]), "matmul"),
    ]


def _replicated(nodes: list[GraphNode]) -> dict[str, Strategy]:
    return {n.id: Strategy("R", tuple(("R",) for _ in n.inputs), (("R",),), tuple(("R",) for _ in n.inputs), 1)
            for n in nodes}


def _heads_split_before_attention(nodes: list[GraphNode]) -> dict[str, Strategy]:
    """The query made with its heads split (S(1)) and all-gathered for a replicated attention."""
    chosen = _replicated(nodes)
    chosen["t"] = Strategy("h", (("R",),), (("S(1)",),), (("R",),), 1)
    return chosen


def test_view_strides_follow_torch_view_rule():
    # (b, h, s, d) laid out contiguously, transposed to (b, s, h, d): h and d are not adjacent
    assert view_strides((B, S, H, D), (S * H * D, D, S * D, 1), (B, S, H * D)) is None
    # laid out (b, s, h, d), as the CPU attention writes for a query made by view + transpose: a view
    assert view_strides((B, S, H, D), (S * H * D, H * D, D, 1), (B, S, H * D)) == (S * H * D, H * D, 1)
    # size-1 dims stride freely
    assert view_strides((1, S, 1, D), (7, D, 99, 1), (S, D)) == (D, 1)


def test_a_reshape_copies_where_a_redistribution_relaid_the_attention_query():
    nodes = _attention_graph()
    assert layout_copies(nodes, _replicated(nodes), MESH, saves_input) == {}
    # the gathered query is contiguous (b, h, s, d): so is the attention's output, and the reshape copies
    assert layout_copies(nodes, _heads_split_before_attention(nodes), MESH, saves_input) == {"r": 4 * B * S * H * D}
    # a reader that takes the copy through a redistribution keeps its own copy, not the reshape's
    chosen = _heads_split_before_attention(nodes)
    chosen["o"] = Strategy("b", (("S(0)",), ("R",)), (("S(0)",),), (("S(0)",), ("P(sum)",)), 2)
    assert layout_copies(nodes, chosen, MESH, saves_input) == {}


def test_the_walk_keeps_the_copy_until_its_reader_backward():
    nodes = _attention_graph()
    memory = MemoryModel(MESH, "adamw", True, all_to_all=False)
    forward = {node_id: b for phase, node_id, b in predicted_points(memory, nodes, _heads_split_before_attention(nodes))
               if phase == "forward"}
    assert forward["r"] - forward["t2"] == 4 * B * S * H * D


def test_a_pointwise_op_keeps_the_redistributed_input_its_backward_reads():
    x = GraphNode("x", "input", "input", "", [], _meta(B, S, D))
    g = GraphNode("g", "param", "param", "m", [], _meta(D))
    h = _op("h", "aten.neg.default", ["x"], (B, S, D), (["abc"], ["abc"]), "pointwise", saved=4 * B * S * D)
    by_weight = _op("m", "aten.mul.Tensor", ["h", "g"], (B, S, D), (["abc", "c"], ["abc"]), "pointwise")
    by_buffer = _op("m", "aten.mul.Tensor", ["h", "c"], (B, S, D), (["abc", "c"], ["abc"]), "pointwise")
    added = _op("m", "aten.add.Tensor", ["h", "g"], (B, S, D), (["abc", "c"], ["abc"]), "pointwise")
    grads = {"x": False, "g": True, "c": False, "h": False}
    assert saves_input(by_weight, 0, grads)  # for the weight's gradient (RMSNorm's weight multiply)
    assert not saves_input(by_buffer, 0, grads) and not saves_input(added, 0, grads)

    # h made batch-split, taken replicated by the weight multiply: the multiply keeps the gathered copy
    nodes = [x, g, h, by_weight]
    chosen = {"x": Strategy("b", (), (("S(0)",),), (), 1), "g": Strategy("R", (), (("R",),), (), 1),
              "h": Strategy("b", (("S(0)",),), (("S(0)",),), (("S(0)",),), 2),
              "m": Strategy("R", (("R",), ("R",)), (("R",),), (("R",), ("R",)), 1)}
    memory = MemoryModel(MESH, "adamw", True, all_to_all=False)
    forward = {node_id: b for phase, node_id, b in predicted_points(memory, nodes, chosen) if phase == "forward"}
    state = memory.predict(nodes, chosen)[1]
    assert forward["h"] - state == 4 * B * S * D  # the replicated copy, not h's own half
