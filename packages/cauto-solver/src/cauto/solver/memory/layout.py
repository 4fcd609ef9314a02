"""Copies a plan's views make: a reshape that was a view in the profiled run copies when a
redistribution upstream changed its input's memory layout.

The graph's saved bytes come from the unsharded run, where a reshape of a permuted tensor can be a
view: Llama's attention computes ``y.transpose(1, 2).reshape(b, s, -1)`` on the output of
``scaled_dot_product_attention``, which the CPU kernel lays out like its query, and the query, made
by ``linear -> view -> transpose`` and rotary ops that keep that layout, is laid out
(batch, seq, heads, dim); the transpose gives that order back and the reshape is a view of the
attention output that the next linear saves (its storage counted once, at the attention). A
redistribution lays its result out contiguously (collectives write dense logical order), so where the
plan all-gathers the query for the attention, the attention's output is laid out
(batch, heads, seq, dim), the transposed tensor cannot be viewed as (batch, seq, heads · dim), and the
reshape copies: a tensor of its output's bytes per device that the linear saves for its backward
(the zoo Llama's 2 x 2 plan with chunked state at a 1 MiB budget: 32 KiB per layer, half of the 18%
the chunk manager measured above the prediction, issue 22; the other half was RMSNorm's weight
multiply keeping its redistributed input, model.py ``saves_input``).

The rule: follow each tensor's memory order (its dims outermost to innermost) through the graph
twice, as profiled (no redistribution) and as planned (an input taken through a redistribution is
contiguous), with these layout rules:

* permutations (transpose, permute, ``t``, movedim; their labels map the dims) permute the order;
* reshapes (view, reshape, flatten, unflatten, squeeze, unsqueeze, ``_unsafe_view``) keep the memory
  and regroup it where torch's view rule (``computeStride``) allows; otherwise they copy, into the
  contiguous order; ``contiguous`` copies unless its input is contiguous;
* other views (slices, chunks, splits, expand, detach) keep the order when they keep the rank;
* pointwise ops follow their first input of the output's shape (TensorIterator's order), attention
  follows its query;
* everything else (matmuls, reductions, ``cat``, collectives) writes contiguously.

A reshape or ``contiguous`` that copies as planned but not as profiled adds its output's bytes per
device, saved where a reader keeps it: a consumer (through further views, taking it where it is made)
whose backward reads it (``saves_input``). Copies no reader saves live only while their consumer
runs, as other unsaved activations, and are not counted. The layout rules of attention follow the CPU
kernel; a kernel that always writes (batch, seq, heads, dim) (CUDA's) makes the copy a bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from cauto.plan import GraphNode, split_ref
from cauto.solver.checkpoint.linearize import op_name
from cauto.solver.strategies.node import Strategy, output_placement, shard_count

Order = tuple[int, ...]
"""A tensor's dims from outermost to innermost in memory (dense; ``range(ndim)`` is contiguous)."""

_PERMUTES = {"transpose", "permute", "t", "movedim", "swapaxes", "swapdims"}
_RESHAPES = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as"}
_KEEP_ORDER = {"slice", "narrow", "chunk", "split", "split_with_sizes", "expand", "expand_as", "alias", "detach"}


def view_strides(shape: tuple[int, ...], stride: tuple[int, ...], new_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The strides of ``new_shape`` viewing a tensor of ``shape`` and ``stride``, or None where no view
    exists and a reshape copies (torch's ``computeStride``, aten/src/ATen/TensorUtils.cpp)."""
    if math.prod(shape) == 0 or not shape:
        return tuple(_contiguous_strides(new_shape))
    new_stride = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk_base = stride[-1]
    tensor_numel = view_numel = 1
    for d in range(len(shape) - 1, -1, -1):
        tensor_numel *= shape[d]
        if d == 0 or (shape[d - 1] != 1 and stride[d - 1] != tensor_numel * chunk_base):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                new_stride[view_d] = view_numel * chunk_base
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if d > 0:
                chunk_base = stride[d - 1]
                tensor_numel = view_numel = 1
    return tuple(new_stride) if view_d == -1 else None


def _contiguous_strides(shape) -> list[int]:
    stride, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        stride[d] = acc
        acc *= max(shape[d], 1)
    return stride


def _strides(shape, order: Order) -> tuple[int, ...]:
    stride, acc = [0] * len(shape), 1
    for d in reversed(order):
        stride[d] = acc
        acc *= max(shape[d], 1)
    return tuple(stride)


def _order(stride) -> Order:
    return tuple(sorted(range(len(stride)), key=lambda d: (-stride[d], d)))


def _contiguous(shape, order: Order) -> bool:
    return _strides(shape, order) == tuple(_contiguous_strides(shape))


def _permutation(node: GraphNode) -> list[int] | None:
    """Output dim -> input dim of a permuting view, from its labels (None when they do not say)."""
    lab = node.labels
    if lab is None or len(lab.inputs) != 1 or len(lab.outputs) != 1:
        return None
    src, out = lab.inputs[0], lab.outputs[0]
    if "." in src or len(set(src)) != len(src) or sorted(src) != sorted(out):
        return None
    return [src.index(c) for c in out]


def _layouts(nodes: list[GraphNode], relaid: set[tuple[str, int]]) -> tuple[dict[str, Order], set[str]]:
    """Every op output's memory order ("id#o" -> Order) and the reshape-like ops that copy, where the
    inputs ``relaid`` ((op id, input index)) arrive contiguous (module doc: the layout rules)."""
    by_id = {n.id: n for n in nodes}
    orders: dict[str, Order] = {}
    copies: set[str] = set()

    def shape(ref: str) -> tuple[int, ...]:
        src_id, o = split_ref(ref)
        src = by_id.get(src_id)
        return tuple(src.outputs[o].shape) if src is not None and o < len(src.outputs) else ()

    def order_in(n: GraphNode, k: int) -> Order:
        ref = n.inputs[k]
        ndim = len(shape(ref))
        got = orders.get("{}#{}".format(*split_ref(ref)))
        return tuple(range(ndim)) if got is None or (n.id, k) in relaid or len(got) != ndim else got

    for n in nodes:
        if n.kind != "op":
            continue
        name = op_name(n.op)
        outs = [tuple(m.shape) for m in n.outputs]
        made: list[Order] = [tuple(range(len(s))) for s in outs]
        if n.inputs and outs:
            first = order_in(n, 0)
            in_shape = shape(n.inputs[0])
            if name in _PERMUTES:
                perm = _permutation(n)
                if perm is not None and len(perm) == len(first):
                    made[0] = tuple(perm.index(d) for d in first)
            elif name in _RESHAPES:
                stride = view_strides(in_shape, _strides(in_shape, first), outs[0])
                if stride is None:
                    copies.add(n.id)
                else:
                    made[0] = _order(stride)
            elif name == "contiguous":
                if not _contiguous(in_shape, first):
                    copies.add(n.id)
            elif name in _KEEP_ORDER:
                made = [first if len(s) == len(first) else o for s, o in zip(outs, made)]
            elif name == "scaled_dot_product_attention" and len(first) == len(outs[0]):
                made[0] = first
            elif n.labels is not None and n.labels.rule == "pointwise":
                k = next((k for k, ref in enumerate(n.inputs) if shape(ref) == outs[0]), None)
                if k is not None:
                    made[0] = order_in(n, k)
        for o, order in enumerate(made):
            orders[f"{n.id}#{o}"] = order
    return orders, copies


def activation_inputs(nodes: list[GraphNode], chosen: Mapping[str, Strategy]):
    """Every input of a planned op that another planned op made, in forward order: (the op, the input's
    index, its producer ref "id#o", whether the op takes it at the placement it is made)."""
    by_id = {n.id: n for n in nodes}
    for n in nodes:
        if n.kind != "op" or n.id not in chosen:
            continue
        s = chosen[n.id]
        for k, ref in enumerate(n.inputs):
            src_id, o = split_ref(ref)
            src = by_id.get(src_id)
            if src is not None and src.kind == "op" and src_id in chosen and k < len(s.inputs):
                yield n, k, f"{src_id}#{o}", output_placement(chosen, src, o) == s.inputs[k]


def relaid_inputs(nodes: list[GraphNode], chosen: Mapping[str, Strategy]) -> set[tuple[str, int]]:
    """(op id, input index) of the activations an op takes through a redistribution (laid out anew)."""
    return {(n.id, k) for n, k, _, direct in activation_inputs(nodes, chosen) if not direct}


def layout_copies(nodes: list[GraphNode], chosen: Mapping[str, Strategy], mesh_shape: tuple[int, ...],
                  saves_input) -> dict[str, int]:
    """op id -> bytes per device of the copy it makes as planned and not as profiled, where a reader
    saves that copy (module doc). ``saves_input(node, k, grads)``: whether op ``node`` keeps its input
    ``k`` for backward, ``grads`` telling which nodes' outputs need a gradient."""
    relaid = relaid_inputs(nodes, chosen)
    if not relaid:
        return {}
    _, profiled = _layouts(nodes, set())
    _, planned = _layouts(nodes, relaid)
    new = planned - profiled
    if not new:
        return {}
    readers: dict[str, list[tuple[GraphNode, int]]] = {}
    grads: dict[str, bool] = {}
    for n in nodes:
        grads[n.id] = needs_gradient(n, grads)
        for k, ref in enumerate(n.inputs):
            readers.setdefault(split_ref(ref)[0], []).append((n, k))
    by_id = {n.id: n for n in nodes}
    return {node_id: by_id[node_id].outputs[0].bytes // shard_count(chosen[node_id].outputs[0], mesh_shape)
            for node_id in sorted(new)
            if node_id in chosen and _saved_by_a_reader(node_id, readers, relaid, grads, saves_input)}


def _saved_by_a_reader(node_id: str, readers, relaid, grads, saves_input) -> bool:
    """Whether a consumer of ``node_id``'s output, directly or through views, keeps it for backward."""
    todo, seen = [node_id], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for reader, k in readers.get(current, []):
            if (reader.id, k) in relaid:
                continue  # a redistribution's copy is what it reads
            name = op_name(reader.op)
            if name in _RESHAPES or name in _PERMUTES or name in _KEEP_ORDER:
                todo.append(reader.id)
            elif saves_input(reader, k, grads):
                return True
    return False


def needs_gradient(n: GraphNode, grads: Mapping[str, bool]) -> bool:
    """Whether ``n``'s outputs need a gradient, given its producers' in ``grads`` (nodes in topological
    order): trainable parameters, inputs that require one, ops with such an input."""
    if n.kind == "param":
        return n.requires_grad is not False
    if n.kind == "input":
        return bool(n.requires_grad)
    if n.kind == "op":
        return any(grads.get(split_ref(ref)[0], False) for ref in n.inputs)
    return False
