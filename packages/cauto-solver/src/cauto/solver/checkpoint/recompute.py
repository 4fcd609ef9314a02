"""What recomputation repeats besides compute: the collectives of redistributions inside regions.

The runtime cuts each checkpoint region out together with the redistributions its nodes consume
(an edge belongs to its consumer). Which of them backward runs again depends on the lowering that
runs the plan (runtime apply.py ``_lowering_for_regions``):

* The local program (the default; plans without nested regions). AOTAutograd's partition marks every
  op of a region MUST_RECOMPUTE (runtime lowering.py ``_partition_with_regions``) and builds the
  backward graph from what backward reads: a region op, redistributions included, runs again only if
  some op's backward reads its result, or if recomputing such a result needs it (transitively); the
  rest is dead code and dropped. What a region reads from outside (its inputs, the outputs of an
  earlier region) is saved, not recomputed; so is a region's output that an op outside every region
  reads (the partition saves it, as checkpoint keeps what its function returns), and a
  redistribution outside every region (its collective is saved). Example: the tensor-parallel
  all-gather before a residual ``add`` that closes a region does not run again: ``add``'s backward reads no input, and the next layer norm saves its
  own gathered copy.
* The DTensor interpreter (plans with nested regions, which the local program would recompute once
  where nested ``torch.utils.checkpoint`` recomputes once per level, and plans with chunked state,
  whose program fetches chunked parameters: ``runs_on_interpreter``). Non-reentrant checkpoint with
  early stop off re-runs the whole region: every forward collective of an edge whose consumer lies in
  a region runs once more per enclosing region.

What an op's backward reads is ``BACKWARD_READS``, a table by aten op: for the gradient of each input,
the inputs (and ``OUTPUT``: the op's own output) it reads. An op missing from the table is taken to
read all its inputs for every gradient, as the interpreter's rule assumes: never fewer collectives
predicted than the local program runs for want of a row.
"""

from __future__ import annotations

from collections import Counter

from cauto.plan import split_ref
from cauto.solver.checkpoint.linearize import VIEW_OPS, needs_grad, op_name

OUTPUT = -1
"""In ``BACKWARD_READS``: the op's own output."""

_NOTHING: dict[int, tuple[int, ...]] = {}

BACKWARD_READS: dict[str, dict[int, tuple[int, ...]]] = {
    **{op: _NOTHING for op in VIEW_OPS},
    **{op: _NOTHING for op in ("add", "sub", "neg", "cat", "clone", "contiguous", "_to_copy", "to", "sum", "mean",
                               "repeat", "repeat_interleave", "stack", "dropout_identity")},
    "linear": {0: (1,), 1: (0,)},
    "matmul": {0: (1,), 1: (0,)}, "mm": {0: (1,), 1: (0,)}, "bmm": {0: (1,), 1: (0,)},
    "addmm": {1: (2,), 2: (1,)},
    "mul": {0: (1,), 1: (0,)},
    "div": {0: (1,), 1: (0, 1)},
    "pow": {0: (0,)},
    "rsqrt": {0: (OUTPUT,)}, "sqrt": {0: (OUTPUT,)}, "exp": {0: (OUTPUT,)},
    "relu": {0: (OUTPUT,)}, "sigmoid": {0: (OUTPUT,)}, "tanh": {0: (OUTPUT,)},
    "softmax": {0: (OUTPUT,)}, "_softmax": {0: (OUTPUT,)}, "log_softmax": {0: (OUTPUT,)},
    "gelu": {0: (0,)}, "silu": {0: (0,)},
    "layer_norm": {0: (0, 1), 1: (0,), 2: ()},
    "rms_norm": {0: (0, 1), 1: (0,)},
    "embedding": {0: (1,)},
    "scaled_dot_product_attention": {k: (0, 1, 2, OUTPUT) for k in range(3)},
    "cross_entropy_loss": {0: (0, 1)},
    "mse_loss": {0: (0, 1), 1: (0, 1)},
}
"""aten op (name without namespace and overload) -> {input index: what its gradient reads}."""


def _row(op: str) -> dict[int, tuple[int, ...]] | None:
    return BACKWARD_READS.get(op_name(op))


def backward_reads(op: str, n_inputs: int) -> dict[int, tuple[int, ...]]:
    """Input index -> the inputs (and ``OUTPUT``) the backward of ``op`` reads for that input's gradient
    (``BACKWARD_READS``; without a row: every input for every gradient)."""
    rule = _row(op)
    return rule if rule is not None else {i: tuple(range(n_inputs)) for i in range(n_inputs)}


def read_inputs(op: str, input_grads: list[bool]) -> set[int] | None:
    """The inputs the backward of ``op`` reads when input ``i`` needs a gradient where ``input_grads[i]``
    (``BACKWARD_READS``; its own output left out), or None when the table has no row for ``op``."""
    rule = _row(op)
    if rule is None:
        return None
    return {j for i, read in rule.items() if i < len(input_grads) and input_grads[i] for j in read if j != OUTPUT}


def reads_output(op: str) -> bool:
    """Whether the backward of ``op`` reads its own output (``BACKWARD_READS``; an op without a row is
    taken to)."""
    rule = _row(op)
    return rule is None or any(OUTPUT in read for read in rule.values())


def reads_input(op: str, n_inputs: int, k: int) -> bool:
    """Whether the backward of ``op`` reads its input ``k`` for some input's gradient (``BACKWARD_READS``)."""
    return any(k in read for read in backward_reads(op, n_inputs).values())


#: aten backward kernels that take an input as an argument without reading it for any gradient:
#: op -> those input indices (``native_layer_norm_backward`` takes the bias)
BACKWARD_ARGUMENTS: dict[str, tuple[int, ...]] = {"layer_norm": (2,)}


def backward_keeps(op: str, n_inputs: int, k: int) -> bool:
    """Whether autograd keeps input ``k`` of ``op`` for its backward: read for some gradient
    (``reads_input``), or an argument of its aten backward kernel (``BACKWARD_ARGUMENTS``)."""
    return reads_input(op, n_inputs, k) or k in BACKWARD_ARGUMENTS.get(op_name(op), ())


def region_depths(regions: list[dict]) -> Counter:
    """Node id -> how many regions contain it (a region's ``nodes`` include its children's)."""
    depth: Counter = Counter()
    for region in regions:
        depth.update(set(region["nodes"]))
    return depth


def recomputed_inputs(graph_doc: dict, regions: list[dict],
                      redistributed: set[tuple[str, int]]) -> set[tuple[str, int]]:
    """(op id, input index) of the inputs of region ops that the local program's backward computes
    again (module docstring): those of the region ops it recomputes, and those a region op's backward
    reads (a redistribution there runs again). ``redistributed``: the (op id, input index) that take
    their input through a redistribution (the plan's edges)."""
    region_of = {node_id: i for i, region in enumerate(regions) for node_id in region["nodes"]}
    nodes = graph_doc["nodes"]
    grad = needs_grad(nodes)
    ops = [n for n in nodes if n["kind"] == "op"]
    needed: set[str] = set()  # region ops whose output backward needs: recomputed
    for n in ops:
        reads = backward_reads(n["op"], len(n["inputs"]))
        if n["id"] in region_of and any(OUTPUT in reads.get(i, ()) for i, ref in enumerate(n["inputs"])
                                        if grad.get(split_ref(ref)[0])):
            needed.add(n["id"])
    again: set[tuple[str, int]] = set()
    for n in reversed(ops):  # every consumer of an output before its producer
        reads = backward_reads(n["op"], len(n["inputs"]))
        read = {j for i, ref in enumerate(n["inputs"]) if grad.get(split_ref(ref)[0]) for j in reads.get(i, ())}
        for j, ref in enumerate(n["inputs"]):
            if n["id"] not in needed and j not in read:
                continue
            if n["id"] in region_of:
                again.add((n["id"], j))
            src = split_ref(ref)[0]
            if (n["id"], j) in redistributed and n["id"] not in region_of:
                continue  # the redistribution's copy is read, and saved
            # an output of a region op is recomputed for a reader in its region only: an earlier region's
            # output that a later region reads is saved (the partition's rule), and so is one an op
            # outside every region reads (runtime lowering.py: checkpoint keeps what its function returns)
            if src in region_of and region_of.get(n["id"]) == region_of[src]:
                needed.add(src)
    return again


def runs_on_interpreter(plan_doc: dict, regions: list[dict]) -> bool:
    """Whether the runtime runs ``plan_doc`` with ``regions`` on the DTensor interpreter (module
    docstring): nested regions, or chunked parameter state (runtime apply.py)."""
    return any(region.get("children") for region in regions) or \
        any(p.get("state") == "chunked" for p in plan_doc.get("params", {}).values())


def recompute_collectives(plan_doc: dict, regions: list[dict], graph_doc: dict) -> list[dict]:
    """The collectives recomputation runs in backward, as the plan's lowering runs them (module
    docstring): phase "backward", ``where`` "recompute: <edge>"."""
    if runs_on_interpreter(plan_doc, regions):  # whole regions, once per level
        depth = region_depths(regions)
        times = {(e["dst"], e["arg"]): depth.get(e["dst"], 0) for e in plan_doc.get("edges", [])}
    else:
        edges = {(e["dst"], e["arg"]) for e in plan_doc.get("edges", [])}
        times = dict.fromkeys(recomputed_inputs(graph_doc, regions, edges), 1)
    regathered = bool((plan_doc.get("execution") or {}).get("regather_params"))
    inputs = {n["id"] for n in graph_doc.get("nodes", []) if n.get("kind") == "input"}
    out = []
    for edge in plan_doc.get("edges", []):
        if regathered and (edge.get("src") in plan_doc.get("params", {}) or edge.get("src") in inputs):
            continue  # gathered again for backward once, listed as "regather: <edge>" (sharding_section.py)
        for _ in range(times.get((edge["dst"], edge["arg"]), 0)):
            for c in edge["collectives"]:
                out.append({**c, "phase": "backward", "where": f"recompute: {c.get('where', edge['dst'])}"})
    return out
