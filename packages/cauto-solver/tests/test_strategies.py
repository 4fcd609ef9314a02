from __future__ import annotations

from cauto.plan import GraphNode, Labels, TensorMeta
from cauto.solver.strategies.node import op_strategies, placeholder_strategies


def _linear(batch=8, seq=4, k=16, n=32, bias=True) -> tuple[GraphNode, list]:
    labels = Labels(("bsk", "nk", "n") if bias else ("bsk", "nk"), ("bsn",), "sum")
    shapes = [(batch, seq, k), (n, k)] + ([(n,)] if bias else [])
    node = GraphNode("lin", "op", "aten.linear.default", "m", ["x", "w", "b"][: len(shapes)],
                     [TensorMeta((batch, seq, n), "float32", batch * seq * n * 4)], labels=labels)
    return node, shapes


def by_name(strats):
    return {s.name: s for s in strats}


def test_linear_on_1d_mesh():
    node, shapes = _linear()
    s = by_name(op_strategies(node, shapes, (2,), ("tp",)))
    assert set(s) == {"R", "b@tp", "s@tp", "n@tp"}  # k: the bias would have to be Partial
    col = s["n@tp"]
    assert col.inputs == (("R",), ("S(0)",), ("S(0)",)) and col.outputs == (("S(2)",),)
    assert col.input_grads == (("P(sum)",), ("S(0)",), ("S(0)",))
    dp = s["b@tp"]
    assert dp.input_grads == (("S(0)",), ("P(sum)",), ("P(sum)",)) and dp.shard_factor == 2
    node, shapes = _linear(bias=False)
    row = by_name(op_strategies(node, shapes, (2,), ("tp",)))["k@tp"]
    assert row.inputs == (("S(2)",), ("S(1)",)) and row.outputs == (("P(sum)",),)
    assert row.input_grads == (("S(2)",), ("S(1)",))


def test_divisibility_and_2d_nesting():
    node, shapes = _linear(batch=6, seq=1, k=16, n=32)
    names = set(by_name(op_strategies(node, shapes, (2, 2), ("dp", "tp"))))
    assert "b@dp" in names and "b@dp,b@tp" not in names  # 6 is not divisible by 4
    assert "s@dp" not in names and "b@dp,n@tp" in names and "n@dp,n@tp" in names


def test_whole_and_missing_labels_replicate():
    node, shapes = _linear()
    node.labels = Labels(("bsk", "nk", "n"), ("bsn",), None, "k")
    assert "k@tp" not in by_name(op_strategies(node, shapes, (2,), ("tp",)))
    node.labels = None
    assert [s.name for s in op_strategies(node, shapes, (2,), ("tp",))] == ["R"]


def test_placeholders():
    w = GraphNode("w", "param", "param", "m", [], [TensorMeta((8, 6), "float32", 192)])
    assert {s.name for s in placeholder_strategies(w, (2,), ("dp",))} == {"R", "0@dp", "1@dp"}
    assert len(placeholder_strategies(w, (2, 2), ("dp", "tp"))) == 8  # S(1) on both axes: 6 % 4
    x = GraphNode("x", "input", "input", "", [], [TensorMeta((8, 6), "float32", 192)])
    assert {s.outputs[0] for s in placeholder_strategies(x, (2,), ("dp",))} == {("R",), ("S(0)",)}
    b = GraphNode("b", "buffer", "buffer", "", [], [TensorMeta((8,), "float32", 32)])
    assert [s.outputs[0] for s in placeholder_strategies(b, (2,), ("dp",))] == [("R",)]


def test_nested_splits_only_where_dtensor_runs_them():
    from cauto.plan import GraphNode, Labels, TensorMeta
    from cauto.solver.strategies.node import op_strategies

    def node(rule, ins, outs, in_shapes, out_shape):
        return GraphNode(id="n", kind="op", op="x", module="", inputs=[f"i{k}" for k in range(len(ins))],
                         outputs=[TensorMeta(out_shape, "float32", 4)], labels=Labels(tuple(ins), tuple(outs), rule=rule)), \
            in_shapes

    lin, shapes = node("matmul", ["bsk", "nk"], ["bsn"], [(8, 8, 4), (4, 4)], (8, 8, 4))
    names = {s.name for s in op_strategies(lin, shapes, (2, 2), ("dp", "tp"))}
    assert "b@dp,b@tp" in names          # leading batch dim: DTensor nests it
    assert "s@dp,s@tp" not in names      # sequence dim of a linear: DTensor raises
    assert "b@dp,s@tp" in names          # different letters on different axes are fine
    att, shapes = node("attention", ["bnsd", "bnsd", "bnsd"], ["bnsd"], [(8, 8, 4, 4)] * 3, (8, 8, 4, 4))
    names = {s.name for s in op_strategies(att, shapes, (2, 2), ("dp", "tp"))}
    assert "b@dp,b@tp" not in names and "b@dp,n@tp" in names
