"""Linearize a profiled graph (graph.json) into a Chain of stages, per device for one sharding.

Cut points. In the forward node order, a boundary between two op nodes is a cut when at most one
*activation* is live across it (produced before, read after). An activation is a floating-point
tensor that needs a gradient: it depends on a parameter that requires grad (or on an input marked
requires_grad). Everything else (parameters, buffers, token ids, and tensors derived only from
them such as causal masks, rotary tables or position ids that many layers read) is a constant: it
does not block a cut. Constants made by op nodes and read across a cut are counted once, in the
chain's ``const_bytes``; inputs, parameters and buffers are model state (the sharding ILP's part).

A cut never falls right after a view op (its output aliases its input) nor at a second boundary
crossed by the same tensor (that would make a stage whose output is its input). Stage i = the op
nodes between cuts i and i+1. Per device, with node n's bytes divided by its
bytes divisor and its times by its time divisor (``shard_scale``):

* uf_i, ub_i: Σ forward / backward seconds of the stage's nodes, priced as the sharding ILP's cost
  model does: roofline max(flops/k / peak_flops, bytes/k / bandwidth, kernel_floor_s) on the
  graph's (or the given) device when a node has FLOPs or bytes, else its profiled time / k.
* x_i: bytes of the activation live at cut i; x_0 = requires-grad inputs (usually 0); x_{L+1} =
  what the output node reads (the loss).
* x̄_{i+1}: Σ saved_bytes; plus x_{i+1} when the producer of a^{i+1} does not already count it in its
  saved_bytes (a producer's saved bytes are taken to include its own output first).
* ftmp_i: the most bytes the stage's forward holds at once beyond its input, its output and the
  constants: tensors made and read inside the stage (views excluded: they alias), plus the
  running node's transient_bytes.
* btmp_i: the most any one node's backward holds beyond δ^i and δ^{i+1}: the gradients of its
  activation outputs and inputs inside the stage, plus its transient_bytes (an upper estimate).

Too many stages (long graphs of small ops) make the DP slow (O(S·L³)); ``max_stages`` keeps the
cuts nearest to equal shares of compute time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from cauto.plan import split_ref
from cauto.plan.dtypes import has_gradient
from cauto.solver.checkpoint.chain import Chain

DEFAULT_MAX_STAGES = 100

ShardScale = Mapping[str, "float | tuple[float, float]"]
"""node id -> shard divisor: one number for bytes and time, or (bytes divisor, time divisor)."""


def _divisors(shard_scale: ShardScale | None, node_id: str) -> tuple[float, float]:
    if not shard_scale or node_id not in shard_scale:
        return 1.0, 1.0
    value = shard_scale[node_id]
    b, t = (value, value) if isinstance(value, (int, float)) else value
    if b <= 0 or t <= 0:
        raise ValueError(f"shard_scale[{node_id!r}] = {value!r}: divisors must be positive")
    return float(b), float(t)


VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "expand", "expand_as", "permute", "transpose", "t", "slice", "select",
    "split", "split_with_sizes", "unsqueeze", "squeeze", "alias", "as_strided", "detach", "flatten", "unflatten",
    "narrow", "unbind", "chunk", "movedim", "view_as", "diagonal",
})
"""aten ops whose outputs alias their input: no new memory, and never a cut tensor."""


def op_name(op: str) -> str:
    """An aten op's name without namespace and overload (``aten.reshape.default`` -> ``reshape``)."""
    parts = op.split(".")
    return parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[0]


def _is_view(op: str) -> bool:
    return op_name(op) in VIEW_OPS


def _phase_s(flops: float, nbytes: float, time_s: float, k: float, device: Mapping) -> float:
    if flops <= 0 and nbytes <= 0:
        return time_s / k
    return max(flops / k / device["peak_flops"], nbytes / k / device["memory_bandwidth_bytes_per_s"],
               device.get("kernel_floor_s", 0.0))


def build_chain(graph_doc: dict, *, shard_scale: ShardScale | None = None, max_stages: int = DEFAULT_MAX_STAGES,
                device: Mapping | None = None, activation_scale: float = 1.0) -> Chain:
    """The chain of stages of a graph document, per device under ``shard_scale`` (default: unsharded).

    ``device`` (peak_flops, memory_bandwidth_bytes_per_s, kernel_floor_s) prices nodes by roofline;
    it defaults to the graph's own ``device`` section. ``activation_scale`` multiplies every node's
    saved_bytes and transient_bytes (tensor sizes stay exact), as the sharding ILP's memory model
    does when it calibrates against the graph's measured peak: pass its scale to agree with it.
    """
    dev = device if device is not None else graph_doc["device"]
    nodes = graph_doc["nodes"]
    ops = [n for n in nodes if n["kind"] == "op"]
    if not ops:
        raise ValueError("graph: no op nodes, nothing to checkpoint")
    P = len(ops)
    pos = {n["id"]: p for p, n in enumerate(ops)}
    div = {n["id"]: _divisors(shard_scale, n["id"]) for n in nodes}
    tensors = _tensors(nodes, pos, div, needs_grad(nodes), P)
    keys = list(tensors)
    count, size_at, key_sum = _live_across(tensors, P)
    fwd_of = [_phase_s(n.get("fwd_flops", 0.0), n.get("fwd_bytes", 0.0), n.get("fwd_time_s", 0.0),
                       div[n["id"]][1], dev) for n in ops]
    bwd_of = [_phase_s(n.get("bwd_flops", 0.0), n.get("bwd_bytes", 0.0), n.get("bwd_time_s", 0.0),
                       div[n["id"]][1], dev) for n in ops]
    candidates = _cut_candidates(ops, pos, keys, count, key_sum)
    cuts = _choose_cuts(candidates, np.array(fwd_of) + np.array(bwd_of), max_stages)
    bounds = [0, *cuts, P]
    stage_of = np.zeros(P, dtype=np.int64)
    for i in range(len(bounds) - 1):
        stage_of[bounds[i]:bounds[i + 1]] = i

    n_st = len(bounds) - 1
    x = np.zeros(n_st + 1, dtype=np.int64)
    x[0] = sum(t[2] for t in tensors.values() if t[0] == -1 and t[3] and t[1] is not None)
    for i in range(1, n_st + 1):
        x[i] = size_at[bounds[i]]
    crossing_key = {bounds[i]: keys[int(key_sum[bounds[i]])] for i in range(1, n_st + 1) if count[bounds[i]] == 1}
    inside, const_bytes = _inside_bytes(tensors, ops, bounds, stage_of)
    fwd, bwd, saved, ftmp, btmp, saved_of = _stage_sums(ops, div, tensors, bounds, stage_of, crossing_key, inside,
                                                        fwd_of, bwd_of, activation_scale)
    xbar = np.zeros(n_st + 1, dtype=np.int64)
    for i in range(n_st):
        out_key = crossing_key.get(bounds[i + 1])
        if i == n_st - 1:
            out_key = next((k for k, t in tensors.items() if t[1] == P and t[3]), None)
        producer_saved = saved_of.get(out_key[0], 0) if out_key else 0
        xbar[i + 1] = saved[i] + x[i + 1] - min(x[i + 1], producer_saved)
    stage_nodes = tuple(tuple(n["id"] for n in ops[bounds[i]:bounds[i + 1]]) for i in range(n_st))
    return Chain(fwd_s=fwd, bwd_s=bwd, x_bytes=x, xbar_bytes=xbar, ftmp_bytes=ftmp, btmp_bytes=btmp,
                 stage_nodes=stage_nodes, const_bytes=int(const_bytes))


def needs_grad(nodes: list[dict]) -> dict[str, bool]:
    """node id -> whether its outputs need a gradient (module docstring: activations)."""
    grad: dict[str, bool] = {}
    for n in nodes:
        k = n["kind"]
        if k == "param":
            grad[n["id"]] = n.get("requires_grad", True) is not False
        elif k == "input":
            grad[n["id"]] = bool(n.get("requires_grad", False))
        elif k == "op":
            missing = [r for r in n["inputs"] if split_ref(r)[0] not in grad]
            if missing:
                raise ValueError(f"graph node {n['id']!r}: input {missing[0]!r} is not an earlier node "
                                 "(nodes must be in topological order)")
            grad[n["id"]] = any(grad[split_ref(r)[0]] for r in n["inputs"])
        else:
            grad[n["id"]] = False
    return grad


def _tensors(nodes: list[dict], pos: dict[str, int], div: dict[str, tuple[float, float]], grad: dict[str, bool],
             P: int) -> dict[tuple[str, int], list]:
    """Every tensor made by an op or an input: (producer position, last reader position, bytes per
    device, activation?); an input's producer position is -1, the output node reads at P."""
    tensors: dict[tuple[str, int], list] = {}
    for n in nodes:
        if n["kind"] not in ("op", "input"):
            continue
        a = pos[n["id"]] if n["kind"] == "op" else -1
        for k, meta in enumerate(n["outputs"]):
            size = math.ceil(meta["bytes"] / div[n["id"]][0])
            tensors[(n["id"], k)] = [a, None, size, grad[n["id"]] and has_gradient(meta["dtype"])]
    for n in nodes:
        if n["kind"] not in ("op", "output"):
            continue
        reader = pos[n["id"]] if n["kind"] == "op" else P
        for r in n["inputs"]:
            key = split_ref(r)
            if key in tensors:
                t = tensors[key]
                t[1] = reader if t[1] is None else max(t[1], reader)
    return tensors


def _live_across(tensors: dict[tuple[str, int], list], P: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per boundary p (between ops p−1 and p; p = P is the end): how many activations are live across
    it, their bytes, and the sum of their indices in ``tensors`` (where one is: its index)."""
    count = np.zeros(P + 2, dtype=np.int64)
    size_at = np.zeros(P + 2, dtype=np.int64)
    key_sum = np.zeros(P + 2, dtype=np.int64)
    for idx, key in enumerate(tensors):
        a, b, size, act = tensors[key]
        if act and b is not None and b > a:
            count[a + 1] += 1
            count[b + 1] -= 1
            size_at[a + 1] += size
            size_at[b + 1] -= size
            key_sum[a + 1] += idx
            key_sum[b + 1] -= idx
    return np.cumsum(count), np.cumsum(size_at), np.cumsum(key_sum)


def _cut_candidates(ops: list[dict], pos: dict[str, int], keys: list[tuple[str, int]], count: np.ndarray,
                    key_sum: np.ndarray) -> list[int]:
    """The boundaries a cut may fall at (module docstring)."""
    candidates, previous = [], None
    for p in range(1, len(ops)):
        if count[p] > 1:
            continue
        key = keys[int(key_sum[p])] if count[p] == 1 else None
        if key is not None and (key == previous or (key[0] in pos and _is_view(ops[pos[key[0]]]["op"]))):
            continue  # a view aliases its base; a tensor already cut at would make a pass-through stage
        candidates.append(p)
        previous = key
    return candidates


def _inside_bytes(tensors: dict[tuple[str, int], list], ops: list[dict], bounds: list[int],
                  stage_of: np.ndarray) -> tuple[np.ndarray, int]:
    """(per op position: bytes of the tensors made and read inside its stage live there, from their
    producer to their last reader (views: 0), constants read across a cut)."""
    P = len(ops)
    inside = np.zeros(P + 1, dtype=np.int64)
    const_bytes = 0
    for a, b, size, act in tensors.values():
        if a < 0:
            continue
        end = bounds[stage_of[a] + 1]
        last = a if b is None else b
        if last < end:
            size = 0 if _is_view(ops[a]["op"]) else size
            inside[a] += size
            inside[last + 1] -= size
        elif not act:
            const_bytes += size
    return np.cumsum(inside)[:P], const_bytes


def _stage_sums(ops: list[dict], div: dict[str, tuple[float, float]], tensors: dict[tuple[str, int], list],
                bounds: list[int], stage_of: np.ndarray, crossing_key: dict[int, tuple[str, int]], inside: np.ndarray,
                fwd_of: list[float], bwd_of: list[float], activation_scale: float):
    """Per stage: (uf, ub, Σ saved_bytes, ftmp, btmp) (module docstring), and each op's saved bytes."""
    n_st = len(bounds) - 1
    fwd = np.zeros(n_st)
    bwd = np.zeros(n_st)
    saved = np.zeros(n_st, dtype=np.int64)
    ftmp = np.zeros(n_st, dtype=np.int64)
    btmp = np.zeros(n_st, dtype=np.int64)
    saved_of: dict[str, int] = {}
    for p, n in enumerate(ops):
        i = stage_of[p]
        bd = div[n["id"]][0]
        fwd[i] += fwd_of[p]
        bwd[i] += bwd_of[p]
        saved_of[n["id"]] = math.ceil(n.get("saved_bytes", 0) * activation_scale / bd)
        saved[i] += saved_of[n["id"]]
        transient = math.ceil(n.get("transient_bytes", 0) * activation_scale / bd)
        ftmp[i] = max(ftmp[i], inside[p] + transient)
        stage_in, stage_out = crossing_key.get(bounds[i]), crossing_key.get(bounds[i + 1])
        grads = sum(tensors[(n["id"], k)][2] for k in range(len(n["outputs"]))
                    if tensors[(n["id"], k)][3] and (n["id"], k) != stage_out)
        for r in n["inputs"]:
            key = split_ref(r)
            if key in tensors and tensors[key][3] and key != stage_in:
                grads += tensors[key][2]
        btmp[i] = max(btmp[i], grads + transient)
    return fwd, bwd, saved, ftmp, btmp, saved_of


def _choose_cuts(candidates: list[int], time_w: np.ndarray, max_stages: int) -> list[int]:
    """At most max_stages − 1 cuts: all of them if few enough, else those nearest equal time shares."""
    if max_stages < 1:
        raise ValueError(f"max_stages must be ≥ 1, got {max_stages}")
    if len(candidates) < max_stages:
        return candidates
    w = time_w + max(float(time_w.sum()), 1.0) * 1e-9  # ops without a time still count a little
    cum = np.concatenate(([0.0], np.cumsum(w)))
    at = cum[candidates]
    chosen: list[int] = []
    lo = 0
    for k in range(1, max_stages):
        target = cum[-1] * k / max_stages
        j = lo + int(np.argmin(np.abs(at[lo:] - target)))
        if j >= len(candidates):
            break
        chosen.append(candidates[j])
        lo = j + 1
        if lo >= len(candidates):
            break
    return chosen
