"""Synthetic graph documents of GPT- and Llama-style decoders, without torch.

They mimic what cauto-profiler writes for the zoo's GPT/Llama (ATen training IR node ids, module
paths, ``layer``/``layer_index``, sharding labels, FLOPs, bytes, saved bytes), so the solver can be
tested and benchmarked at GPT-2 XL or Llama-3-8B size before the profiler exists. Labels used:

    linear        ["bsk", "nk", "n"] -> ["bsn"], reduce sum     (no bias: ["bsk", "nk"])
    layer_norm    ["bsh", "h", "h"] -> ["bsh"], whole h
    view h->(n,d) ["bsh"] -> ["bsh."]    and back ["bsh."] -> ["bsh"]
    transpose     ["bsnd"] -> ["bnsd"]
    sdpa          ["bnsd"] * 3 -> ["bnsd"], whole sd (split only batch and heads)
    embedding     ["vh", "bs"] -> ["bsh"], whole v
    cross_entropy ["bv", "b"] -> [""], reduce avg, whole v

Numbers are estimates (matmul 2·m·n·k FLOPs, backward twice forward); re-run benchmarks on
profiler graphs once they exist.
"""

from __future__ import annotations

import math

from cauto.plan import graph_fingerprint
from cauto.plan.dtypes import ITEMSIZE


class GraphBuilder:
    """Appends graph-document nodes; each ``op`` returns the new node's id."""

    def __init__(self, dtype: str = "float32"):
        self.dtype = dtype
        self.nodes: list[dict] = []
        self.shapes: dict[str, list[int]] = {}
        self._count: dict[str, int] = {}

    def _name(self, base: str) -> str:
        n = self._count.get(base, 0)
        self._count[base] = n + 1
        return base if n == 0 else f"{base}_{n}"

    def _meta(self, shape: list[int], dtype: str | None = None) -> dict:
        dt = dtype or self.dtype
        return {"shape": list(shape), "dtype": dt, "bytes": math.prod(shape) * ITEMSIZE[dt]}

    @staticmethod
    def _layer(module: str) -> tuple[str | None, int | None]:
        parts = module.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                return ".".join(parts[:i]) + ".*", int(part)
        return None, None

    def placeholder(self, kind: str, target: str, shape: list[int], dtype: str | None = None,
                    tied_to: str | None = None) -> str:
        node_id = ("p_" if kind == "param" else "b_" if kind == "buffer" else "") + target.replace(".", "_")
        module = target.rpartition(".")[0] if kind != "input" else ""
        layer, index = self._layer(module)
        node = {"id": node_id, "kind": kind, "op": kind, "module": module, "inputs": [], "target": target,
                "outputs": [self._meta(shape, dtype)], "layer": layer, "layer_index": index}
        if kind == "param":
            node["tied_to"] = tied_to
            node["requires_grad"] = True
        self.nodes.append(node)
        self.shapes[node_id] = list(shape)
        return node_id

    def op(self, op: str, module: str, inputs: list[str], shape: list[int], labels: dict, *,
           flops: float = 0.0, bwd_factor: float = 2.0, saved: bool = True, transient: int = 0,
           dtype: str | None = None, params: list[str] | None = None) -> str:
        base = op.split(".")[1] if op.startswith("aten.") else op
        node_id = self._name(base)
        out = self._meta(shape, dtype)
        in_bytes = sum(math.prod(self.shapes[i]) * ITEMSIZE[self.dtype] for i in inputs)
        layer, index = self._layer(module)
        self.nodes.append({
            "id": node_id, "kind": "op", "op": op, "module": module, "inputs": list(inputs), "outputs": [out],
            "fwd_flops": float(flops), "bwd_flops": float(flops * bwd_factor),
            "fwd_bytes": float(in_bytes + out["bytes"]), "bwd_bytes": float(2 * (in_bytes + out["bytes"])),
            "saved_bytes": out["bytes"] if saved else 0, "transient_bytes": int(transient),
            "params": list(params or []), "labels": labels, "layer": layer, "layer_index": index,
        })
        self.shapes[node_id] = list(shape)
        return node_id

    # -- layers --------------------------------------------------------------------------------
    def linear(self, module: str, x: str, out_features: int, bias: bool = True) -> str:
        *lead, k = self.shapes[x]
        w = self.placeholder("param", f"{module}.weight", [out_features, k])
        ins, labs = [x, w], ["bsk", "nk"]
        if bias:
            ins.append(self.placeholder("param", f"{module}.bias", [out_features]))
            labs.append("n")
        flops = 2 * math.prod(lead) * k * out_features
        return self.op("aten.linear.default", module, ins, [*lead, out_features],
                       {"inputs": labs, "outputs": ["bsn"], "reduce": "sum", "rule": "linear"},
                       flops=flops, params=ins[1:])

    def layer_norm(self, module: str, x: str) -> str:
        h = self.shapes[x][-1]
        w = self.placeholder("param", f"{module}.weight", [h])
        b = self.placeholder("param", f"{module}.bias", [h])
        return self.op("aten.layer_norm.default", module, [x, w, b], self.shapes[x],
                       {"inputs": ["bsh", "h", "h"], "outputs": ["bsh"], "whole": "h", "rule": "layer_norm"},
                       flops=8 * math.prod(self.shapes[x]), params=[w, b])

    def rms_norm(self, module: str, x: str) -> str:
        b, s, h = self.shapes[x]
        w = self.placeholder("param", f"{module}.weight", [h])
        ew = {"inputs": ["bsh"], "outputs": ["bsh"], "rule": "pointwise"}
        sq = self.op("aten.pow.Tensor_Scalar", module, [x], [b, s, h], ew, flops=b * s * h, saved=False)
        mean = self.op("aten.mean.dim", module, [sq], [b, s, 1],
                       {"inputs": ["bsh"], "outputs": ["bs."], "whole": "h", "rule": "reduction"}, flops=b * s * h)
        ew1 = {"inputs": ["bs."], "outputs": ["bs."], "rule": "pointwise"}
        eps = self.op("aten.add.Tensor", module, [mean], [b, s, 1], ew1, flops=b * s, saved=False)
        rs = self.op("aten.rsqrt.default", module, [eps], [b, s, 1], ew1, flops=b * s)
        normed = self.op("aten.mul.Tensor", module, [x, rs], [b, s, h],
                         {"inputs": ["bsh", "bs."], "outputs": ["bsh"], "rule": "pointwise"}, flops=b * s * h)
        return self.op("aten.mul.Tensor", module, [normed, w], [b, s, h],
                       {"inputs": ["bsh", "h"], "outputs": ["bsh"], "rule": "pointwise"}, flops=b * s * h,
                       params=[w])

    def pointwise(self, op: str, module: str, inputs: list[str], saved: bool = True, flops_per: int = 1) -> str:
        shape = self.shapes[inputs[0]]
        spec = "bsh"[: len(shape)] if len(shape) <= 3 else "bnsd"
        return self.op(op, module, inputs, shape, {"inputs": [spec] * len(inputs), "outputs": [spec],
                                                   "rule": "pointwise"},
                       flops=flops_per * math.prod(shape), saved=saved)

    def heads(self, module: str, x: str, n: int) -> str:
        """[b,s,h] -> view [b,s,n,d] -> transpose [b,n,s,d]."""
        b, s, h = self.shapes[x]
        v = self.op("aten.view.default", module, [x], [b, s, n, h // n],
                    {"inputs": ["bsh"], "outputs": ["bsh."], "rule": "view"}, saved=False)
        return self.op("aten.transpose.int", module, [v], [b, n, s, h // n],
                       {"inputs": ["bsnd"], "outputs": ["bnsd"], "rule": "transpose"}, saved=False)

    def attention(self, module: str, x: str, heads: int, kv_heads: int, bias: bool, rope: tuple | None) -> str:
        b, s, h = self.shapes[x]
        d = h // heads
        q = self.heads(module, self.linear(f"{module}.q", x, h, bias), heads)
        k = self.heads(module, self.linear(f"{module}.k", x, kv_heads * d, bias), kv_heads)
        v = self.heads(module, self.linear(f"{module}.v", x, kv_heads * d, bias), kv_heads)
        if rope is not None:
            q, k = (self._rope(module, t, *rope) for t in (q, k))
        if kv_heads != heads:
            rep = {"inputs": ["bnsd"], "outputs": ["bnsd"], "rule": "repeat_interleave"}
            k = self.op("aten.repeat_interleave.self_int", module, [k], [b, heads, s, d], rep)
            v = self.op("aten.repeat_interleave.self_int", module, [v], [b, heads, s, d], rep)
        y = self.op("aten.scaled_dot_product_attention.default", module, [q, k, v], [b, heads, s, d],
                    {"inputs": ["bnsd", "bnsd", "bnsd"], "outputs": ["bnsd"], "whole": "sd", "rule": "sdpa"},
                    flops=4 * b * heads * s * s * d, bwd_factor=2.5, transient=b * heads * s * 4 * 2)
        t = self.op("aten.transpose.int", module, [y], [b, s, heads, d],
                    {"inputs": ["bnsd"], "outputs": ["bsnd"], "rule": "transpose"}, saved=False)
        r = self.op("aten.view.default", module, [t], [b, s, h],
                    {"inputs": ["bsh."], "outputs": ["bsh"], "rule": "view"})
        return self.linear(f"{module}.proj", r, h, bias)

    def _rope(self, module: str, x: str, cos: str, sin: str) -> str:
        shape = self.shapes[x]
        lab = {"inputs": ["bnsd", "sd"], "outputs": ["bnsd"], "rule": "pointwise"}
        a = self.op("aten.mul.Tensor", module, [x, cos], shape, lab, flops=math.prod(shape))
        c = self.op("aten.mul.Tensor", module, [x, sin], shape, lab, flops=math.prod(shape))
        return self.pointwise("aten.add.Tensor", module, [a, c], saved=False)

    def document(self, name: str, optimizer: str, loss: str) -> dict:
        """The finished graph document (with an 'output' node consuming ``loss``)."""
        nodes = self.nodes + [{"id": "output", "kind": "output", "op": "output", "module": "", "inputs": [loss],
                               "outputs": [], "layer": None, "layer_index": None}]
        params = [n for n in nodes if n["kind"] == "param" and not n.get("tied_to")]
        num = sum(math.prod(n["outputs"][0]["shape"]) for n in params)
        pbytes = sum(n["outputs"][0]["bytes"] for n in params)
        saved = sum(n.get("saved_bytes", 0) for n in nodes)
        opt = 8 * num if optimizer in ("adam", "adamw") else 0
        return {
            "schema_version": "1.0", "kind": "graph", "fingerprint": graph_fingerprint(nodes),
            "model": {"name": name, "num_params": num, "param_bytes": pbytes},
            "settings": {"train": True, "optimizer": optimizer, "dtype": self.dtype, "device": "cpu"},
            "device": {"name": "synthetic", "peak_flops": 1e11, "memory_bandwidth_bytes_per_s": 1e10,
                       "kernel_floor_s": 1e-5},
            "nodes": nodes,
            "memory": {"peak_bytes": 2 * pbytes + opt + saved, "phases": {}},
        }


def gpt(batch: int = 8, seq: int = 64, hidden: int = 128, layers: int = 2, heads: int = 4, vocab: int = 512,
        ffn: int | None = None, dtype: str = "float32", optimizer: str = "adamw", name: str = "gpt",
        bias: bool = True) -> dict:
    """A GPT (zoo.GPT layout: learned positions, LayerNorm, GELU MLP, head tied to the embedding).

    With ``bias`` the block's linears cannot be row-parallel (their bias would have to be Partial).
    """
    g = GraphBuilder(dtype)
    tok = g.placeholder("param", "tok.weight", [vocab, hidden])
    pos = g.placeholder("param", "pos.weight", [seq, hidden])
    idx = g.placeholder("input", "idx", [batch, seq], "int64")
    targets = g.placeholder("input", "targets", [batch, seq], "int64")
    ar = g.op("aten.arange.default", "", [], [seq], {"inputs": [], "outputs": ["s"], "rule": "factory"},
              dtype="int64", saved=False)
    e = g.op("aten.embedding.default", "tok", [tok, idx], [batch, seq, hidden],
             {"inputs": ["vh", "bs"], "outputs": ["bsh"], "whole": "v", "rule": "embedding"}, saved=False, params=[tok])
    p = g.op("aten.embedding.default", "pos", [pos, ar], [seq, hidden],
             {"inputs": ["vh", "s"], "outputs": ["sh"], "whole": "v", "rule": "embedding"}, saved=False, params=[pos])
    x = g.op("aten.add.Tensor", "", [e, p], [batch, seq, hidden],
             {"inputs": ["bsh", "sh"], "outputs": ["bsh"], "rule": "pointwise"}, flops=batch * seq * hidden, saved=False)
    for i in range(layers):
        m = f"blocks.{i}"
        a = g.attention(f"{m}.attn", g.layer_norm(f"{m}.ln1", x), heads, heads, bias, None)
        x = g.pointwise("aten.add.Tensor", m, [x, a], saved=False)
        f = g.linear(f"{m}.fc", g.layer_norm(f"{m}.ln2", x), ffn or 4 * hidden, bias)
        f = g.pointwise("aten.gelu.default", f"{m}", [f], flops_per=8)
        x = g.pointwise("aten.add.Tensor", m, [x, g.linear(f"{m}.out", f, hidden, bias)], saved=False)
    return _head(g, x, tok, targets, vocab, name, optimizer, norm="layer_norm")


def llama(batch: int = 8, seq: int = 64, hidden: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
          ffn: int = 344, vocab: int = 512, dtype: str = "float32", optimizer: str = "adamw",
          name: str = "llama") -> dict:
    """A Llama (zoo.Llama layout: RMSNorm, RoPE, SwiGLU, grouped-query attention, untied head)."""
    g = GraphBuilder(dtype)
    tok = g.placeholder("param", "tok.weight", [vocab, hidden])
    d = hidden // heads
    cos = g.placeholder("buffer", "cos", [seq, d])
    sin = g.placeholder("buffer", "sin", [seq, d])
    idx = g.placeholder("input", "idx", [batch, seq], "int64")
    targets = g.placeholder("input", "targets", [batch, seq], "int64")
    x = g.op("aten.embedding.default", "tok", [tok, idx], [batch, seq, hidden],
             {"inputs": ["vh", "bs"], "outputs": ["bsh"], "whole": "v", "rule": "embedding"}, saved=False, params=[tok])
    for i in range(layers):
        m = f"blocks.{i}"
        a = g.attention(f"{m}.attn", g.rms_norm(f"{m}.norm1", x), heads, kv_heads, False, (cos, sin))
        x = g.pointwise("aten.add.Tensor", m, [x, a], saved=False)
        h = g.rms_norm(f"{m}.norm2", x)
        gate = g.pointwise("aten.silu.default", m, [g.linear(f"{m}.gate", h, ffn, False)], flops_per=8)
        up = g.pointwise("aten.mul.Tensor", m, [gate, g.linear(f"{m}.up", h, ffn, False)])
        x = g.pointwise("aten.add.Tensor", m, [x, g.linear(f"{m}.down", up, hidden, False)], saved=False)
    head = g.placeholder("param", "head.weight", [vocab, hidden])
    return _head(g, x, head, targets, vocab, name, optimizer, norm="rms_norm", head_is_new=True)


def _head(g: GraphBuilder, x: str, weight: str, targets: str, vocab: int, name: str, optimizer: str, *,
          norm: str, head_is_new: bool = False) -> dict:
    batch, seq, hidden = g.shapes[x]
    x = g.layer_norm("ln_f", x) if norm == "layer_norm" else g.rms_norm("norm", x)
    if not head_is_new:
        g.placeholder("param", "head.weight", [vocab, hidden], tied_to=weight)
    logits = g.op("aten.linear.default", "head", [x, weight], [batch, seq, vocab],
                  {"inputs": ["bsk", "nk"], "outputs": ["bsn"], "reduce": "sum", "rule": "linear"},
                  flops=2 * batch * seq * hidden * vocab, params=[weight])
    flat = g.op("aten.view.default", "", [logits], [batch * seq, vocab],
                {"inputs": ["bsv"], "outputs": ["bv"], "rule": "view"}, saved=False)
    tflat = g.op("aten.view.default", "", [targets], [batch * seq],
                 {"inputs": ["bs"], "outputs": ["b"], "rule": "view"}, dtype="int64", saved=False)
    loss = g.op("aten.cross_entropy_loss.default", "", [flat, tflat], [],
                {"inputs": ["bv", "b"], "outputs": [""], "reduce": "avg", "whole": "v", "rule": "cross_entropy"},
                flops=4 * batch * seq * vocab, saved=False, transient=batch * seq * vocab * ITEMSIZE[g.dtype])
    return g.document(name, optimizer, loss)


def mlp(batch: int = 32, dims: tuple[int, ...] = (64, 256, 64), dtype: str = "float32",
        optimizer: str = "adamw") -> dict:
    """A small MLP on [batch, 1, dim] inputs (linear + GELU chain, sum loss): tiny graphs for oracles."""
    g = GraphBuilder(dtype)
    x = g.placeholder("input", "x", [batch, 1, dims[0]])
    for i, n in enumerate(dims[1:]):
        x = g.linear(f"layers.{i}", x, n)
        if i < len(dims) - 2:
            x = g.pointwise("aten.gelu.default", f"layers.{i}", [x], flops_per=8)
    loss = g.op("aten.sum.default", "", [x], [], {"inputs": ["bsh"], "outputs": [""], "reduce": "sum",
                                                  "rule": "reduction"}, flops=math.prod(g.shapes[x]), saved=False)
    return g.document("mlp", optimizer, loss)
