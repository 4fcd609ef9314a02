"""Synthetic inputs for checkpoint tests and benchmarks: random chains and a GPT-like graph document.

``random_chain`` draws heterogeneous (or uniform) stage costs, as in the rotor paper's experiments.
``gpt_graph`` writes a valid graph document of a pre-LayerNorm transformer with rotary tables and
a causal mask that every layer reads (constants for linearization), with plausible per-node times
and saved/transient bytes; it needs no torch. It is on purpose not ``cauto.solver.synthetic.gpt``,
which mimics the profiler's node ids and sharding labels for the sharding ILP: this one has no
labels but has what linearization is about (constants every layer reads, per-node times), and the
checkpoint tests' expected numbers are this graph's.
"""

from __future__ import annotations

import numpy as np

from cauto.plan import graph_fingerprint
from cauto.plan.dtypes import ITEMSIZE
from cauto.solver.checkpoint.chain import Chain


def random_chain(rng: np.random.Generator, num_stages: int, *, uniform: bool = False,
                 scale_bytes: int = 1 << 20) -> Chain:
    """A chain of ``num_stages`` stages; sizes are multiples of ``scale_bytes``/16, times in ms."""
    n = num_stages
    unit = max(scale_bytes // 16, 1)
    if uniform:
        x = np.full(n + 1, 16 * unit)
        xbar = np.concatenate(([0], np.full(n, 48 * unit)))
        uf, ub = np.full(n, 1e-3), np.full(n, 2e-3)
        ftmp, btmp = np.full(n, 4 * unit), np.full(n, 8 * unit)
    else:
        x = rng.integers(1, 64, n + 1) * unit
        xbar = np.concatenate(([0], x[1:] + rng.integers(0, 192, n) * unit))
        uf = rng.uniform(0.2, 5.0, n) * 1e-3
        ub = uf * rng.uniform(1.5, 3.0, n)
        ftmp, btmp = rng.integers(0, 32, n) * unit, rng.integers(0, 64, n) * unit
    x[n] = 4  # the loss is a scalar
    return Chain.from_lists(uf, ub, x, xbar, ftmp, btmp)


def _meta(shape, dtype="float32"):
    return {"shape": list(shape), "dtype": dtype, "bytes": int(np.prod(shape)) * ITEMSIZE[dtype]}


def gpt_graph(layers: int = 4, batch: int = 8, seq: int = 256, hidden: int = 512, heads: int = 8,
              vocab: int = 8192, flops_per_s: float = 1e11, bytes_per_s: float = 2e10) -> dict:
    """A graph document of a GPT-style model (see the module docstring)."""
    B, T, H, V, hd = batch, seq, hidden, vocab, hidden // heads
    act = (B, T, H)
    w = _NodeWriter(flops_per_s, bytes_per_s)
    w.node("ids", "input", "input", "", [], [_meta((B, T), "int64")])
    w.node("labels", "input", "input", "", [], [_meta((B, T), "int64")])
    w.node("inv_freq", "buffer", "buffer", "rotary", [], [_meta((hd // 2,))], target="rotary.inv_freq")
    w.param("wte.weight", "wte", (V, H))
    w.op("positions", "aten.arange.default", "rotary", [], (T,), dtype="int64")
    w.op("rope_cos", "aten.cos.default", "rotary", ["positions", "inv_freq"], (T, hd))
    w.op("rope_sin", "aten.sin.default", "rotary", ["positions", "inv_freq"], (T, hd))
    w.op("mask", "aten.triu.default", "", [], (T, T), dtype="bool")
    a = _meta(act)["bytes"]
    w.op("embed", "aten.embedding.default", "wte", ["ids", "wte.weight"], act, saved=a, params=["wte.weight"])
    x = "embed"
    for i in range(layers):
        x = _decoder_layer(w, i, x, B, T, H, heads)
    w.param("ln_f.weight", "ln_f", (H,))
    w.op("ln_f", "aten.layer_norm.default", "ln_f", [x, "ln_f.weight"], act, saved=a + B * T * 8,
         params=["ln_f.weight"])
    logits = B * T * V * 4
    w.op("lm_head", "aten.linear.default", "lm_head", ["ln_f", "wte.weight"], (B, T, V), flops=2 * B * T * H * V,
         saved=logits, params=["wte.weight"])
    w.op("loss", "aten.cross_entropy_loss.default", "", ["lm_head", "labels"], (), transient=logits)
    w.node("output", "output", "output", "", ["loss"], [])
    nodes = w.nodes
    num_params = sum(int(np.prod(n["outputs"][0]["shape"])) for n in nodes if n["kind"] == "param")
    return {
        "schema_version": "1.0", "kind": "graph", "fingerprint": graph_fingerprint(nodes),
        "model": {"name": f"synthetic-gpt-{layers}x{hidden}", "num_params": num_params,
                  "param_bytes": 4 * num_params},
        "settings": {"train": True, "optimizer": "adamw", "dtype": "float32", "device": "cpu"},
        "device": {"name": "synthetic", "peak_flops": flops_per_s, "memory_bandwidth_bytes_per_s": bytes_per_s,
                   "kernel_floor_s": 0.0},
        "nodes": nodes,
        "memory": {"peak_bytes": 0, "phases": {}},
    }


def _decoder_layer(w: _NodeWriter, i: int, x: str, B: int, T: int, H: int, heads: int) -> str:
    """Write pre-LayerNorm decoder layer ``i`` reading ``x``; return the id of its output."""
    act = (B, T, H)
    a = _meta(act)["bytes"]
    m = f"h.{i}"
    kw = {"layer": "h.*", "index": i}
    for name, shape in (("attn.qkv", (3 * H, H)), ("attn.proj", (H, H)), ("mlp.fc", (4 * H, H)),
                        ("mlp.proj", (H, 4 * H))):
        w.param(f"{m}.{name}.weight", f"{m}.{name}", shape)
    small = B * T * 8
    w.op(f"{m}.ln1", "aten.layer_norm.default", f"{m}.ln_1", [x], act, saved=a + small, **kw)
    w.op(f"{m}.qkv", "aten.linear.default", f"{m}.attn.qkv", [f"{m}.ln1", f"{m}.attn.qkv.weight"],
         (B, T, 3 * H), flops=2 * B * T * H * 3 * H, params=[f"{m}.attn.qkv.weight"], **kw)
    w.op(f"{m}.rope", "aten.mul.Tensor", f"{m}.attn", [f"{m}.qkv", "rope_cos", "rope_sin"], (B, T, 3 * H),
         saved=3 * a, bwd_factor=1.0, **kw)
    w.op(f"{m}.sdpa", "aten.scaled_dot_product_attention.default", f"{m}.attn", [f"{m}.rope", "mask"], act,
         flops=4 * B * T * T * H, saved=a + B * heads * T * 4, transient=B * heads * T * T * 4, **kw)
    w.op(f"{m}.proj", "aten.linear.default", f"{m}.attn.proj", [f"{m}.sdpa", f"{m}.attn.proj.weight"], act,
         flops=2 * B * T * H * H, params=[f"{m}.attn.proj.weight"], **kw)
    w.op(f"{m}.add1", "aten.add.Tensor", m, [x, f"{m}.proj"], act, saved=a, bwd_factor=1.0, **kw)
    w.op(f"{m}.ln2", "aten.layer_norm.default", f"{m}.ln_2", [f"{m}.add1"], act, saved=a + small, **kw)
    w.op(f"{m}.fc", "aten.linear.default", f"{m}.mlp.fc", [f"{m}.ln2", f"{m}.mlp.fc.weight"], (B, T, 4 * H),
         flops=8 * B * T * H * H, saved=4 * a, params=[f"{m}.mlp.fc.weight"], **kw)
    w.op(f"{m}.gelu", "aten.gelu.default", f"{m}.mlp.act", [f"{m}.fc"], (B, T, 4 * H), saved=4 * a,
         bwd_factor=1.0, **kw)
    w.op(f"{m}.fc2", "aten.linear.default", f"{m}.mlp.proj", [f"{m}.gelu", f"{m}.mlp.proj.weight"], act,
         flops=8 * B * T * H * H, params=[f"{m}.mlp.proj.weight"], **kw)
    w.op(f"{m}.add2", "aten.add.Tensor", m, [f"{m}.add1", f"{m}.fc2"], act, saved=a, bwd_factor=1.0, **kw)
    return f"{m}.add2"


class _NodeWriter:
    """The node list of a graph document, written node by node; an op's times come from its FLOPs and
    the bytes it moves (its output twice) at ``flops_per_s`` and ``bytes_per_s``."""

    def __init__(self, flops_per_s: float, bytes_per_s: float):
        self.nodes: list[dict] = []
        self.flops_per_s, self.bytes_per_s = flops_per_s, bytes_per_s

    def node(self, id_, kind, op, module, inputs, outputs, **kw) -> None:
        self.nodes.append({"id": id_, "kind": kind, "op": op, "module": module, "inputs": inputs,
                           "outputs": outputs, **kw})

    def op(self, id_, op_name, module, inputs, out_shape, flops=0.0, saved=0, transient=0, dtype="float32",
           bwd_factor=2.0, layer=None, index=None, params=()) -> None:
        out = _meta(out_shape, dtype)
        moved = out["bytes"] * 2
        fwd_s = max(flops / self.flops_per_s, moved / self.bytes_per_s)
        self.node(id_, "op", op_name, module, inputs, [out], fwd_flops=flops, bwd_flops=bwd_factor * flops,
                  fwd_bytes=moved, bwd_bytes=bwd_factor * moved, fwd_time_s=fwd_s, bwd_time_s=bwd_factor * fwd_s,
                  saved_bytes=int(saved),
                  transient_bytes=int(transient), params=list(params), layer=layer, layer_index=index)

    def param(self, id_, module, shape) -> None:
        self.node(id_, "param", "param", module, [], [_meta(shape)], target=f"{module}.{id_.split('.')[-1]}",
                  requires_grad=True)


def synthetic_sharding(graph_doc: dict, *, devices: int = 8, bandwidth_bytes_per_s: float = 2e9):
    """A stand-in for the sharding ILP: ``solve(budget) -> ShardingResult | None`` over a fixed menu.

    The menu (data parallel, ZeRO-2, FSDP, 2-way tensor parallel with FSDP) trades model state for
    communication: ``solve`` returns the fastest entry whose model state plus full (store-all)
    activations fit the budget, the fastest overall for None, and None when nothing fits. More
    memory never gives a slower answer, as with the real ILP.
    """
    from cauto.solver.checkpoint.linearize import build_chain
    from cauto.solver.checkpoint.schedule import store_all, to_ops
    from cauto.solver.checkpoint.simulate import simulate
    from cauto.solver.joint import ShardingResult

    P = graph_doc["model"]["param_bytes"]
    d = devices
    layers = len({n.get("layer_index") for n in graph_doc["nodes"] if n.get("layer_index") is not None})
    act_bytes = max(n["outputs"][0]["bytes"] for n in graph_doc["nodes"] if n["kind"] == "op" and n["outputs"])
    allreduce = 2 * P * (d - 1) / d / bandwidth_bytes_per_s
    # name, model state bytes, activation divisor, communication seconds
    menu = [
        ("dp", 4 * P + 4 * P + 8 * P, d, allreduce),
        ("zero2", 4 * P + 12 * P // d, d, 1.1 * allreduce),
        ("fsdp", 16 * P // d, d, 1.6 * allreduce),
        ("tp2-fsdp", 16 * P // d, 2 * d, 1.6 * allreduce / 2 + 8 * layers * act_bytes / d / bandwidth_bytes_per_s),
    ]
    ops = [n["id"] for n in graph_doc["nodes"] if n["kind"] == "op"]
    results = []
    for name, state, act_div, comm_s in menu:
        scale = {nid: (float(act_div), float(d)) for nid in ops}
        chain = build_chain(graph_doc, shard_scale=scale)
        peak = simulate(chain, to_ops(store_all(chain.num_stages))).peak_bytes
        results.append(ShardingResult(shard_scale=scale, model_state_bytes=int(state), activation_bytes=peak,
                                      step_time_s=chain.compute_s + comm_s, plan=name))
    results.sort(key=lambda r: r.step_time_s)

    def solve(budget: int | None):
        for r in results:
            if budget is None or r.model_state_bytes + r.activation_bytes <= budget:
                return r
        return None

    solve.menu = results
    return solve
