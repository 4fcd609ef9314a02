"""Strategies of one node on a mesh, enumerated from its sharding labels.

An op's labels give one string per tensor input and output, one character per dimension
(graph.schema.json, $defs/labels). On each mesh axis an op strategy does one of three things:

* splits a letter present in an output: every tensor holding the letter is Shard(dim of the letter)
  on that axis, every other tensor is Replicate;
* splits a contracted letter (only in inputs, and ``reduce`` is set): the inputs are Shard and
  all outputs Partial(reduce). Offered only when every input holds the letter: an input without it
  (a linear's bias) would have to be made Partial, which DTensor's public ``redistribute`` refuses;
* replicates: everything Replicate.

Letters marked '.' or listed in ``whole`` are never split, nor is a letter that occurs twice in one
tensor; mesh axes of size 1 only replicate. Several axes may split the same letter (DTensor nests
them in mesh-axis order) except where DTensor raises on such nesting (checked on a 2x2 mesh):
attention and convolution ops, and a matmul's first input split on a dim other than its first
(the linear's sequence dim: DTensor flattens batch dims and cannot unflatten a nested shard). A strategy
is kept only when each letter's size is divisible by the product of the axis sizes splitting it.

The gradient each strategy sends back to input k (what DTensor's backward yields) is, per axis:
Shard(d) where the input holds the split letter; Partial(sum) where the axis splits an output
letter the input lacks (e.g. a weight under a batch split); Replicate otherwise.

Placeholders: a parameter is Replicate or Shard(d) per axis on any divisible dim (a Shard storage
consumed whole is ZeRO-3: all-gather before use, reduce-scatter of its gradient); an input is
Replicate or Shard(0) per axis (the runtime slices the global batch); a buffer is Replicate. Ops
without labels or without tensor inputs are Replicate only.

Once a strategy is chosen for every node, ``output_placement`` says which placement the consumers of a
value see: its producer's output placement, a tied parameter's being its owner's (the tied copy has
no strategy of its own).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from cauto.plan import GraphNode

Placements = tuple[str, ...]


@dataclass(frozen=True)
class Strategy:
    """One way to run a node on the mesh."""

    name: str
    inputs: tuple[Placements, ...]
    outputs: tuple[Placements, ...]
    input_grads: tuple[Placements, ...]
    """placement of the gradient backward produces for each input"""
    shard_factor: int
    """devices the node's work is divided among"""


def _replicated(node: GraphNode, ndim: int) -> Strategy:
    rep = ("R",) * ndim
    return Strategy("R", tuple(rep for _ in node.inputs), tuple(rep for _ in node.outputs),
                    tuple(rep for _ in node.inputs), 1)


def _labels_fit(node: GraphNode, in_shapes: list[tuple[int, ...]]) -> bool:
    lab = node.labels
    if lab is None or len(lab.inputs) != len(in_shapes) or len(lab.outputs) != len(node.outputs):
        return False
    specs = list(zip(lab.inputs, in_shapes)) + [(s, o.shape) for s, o in zip(lab.outputs, node.outputs)]
    return all(len(spec) == len(shape) for spec, shape in specs)


_NO_NESTED_SPLITS = {"attention", "convolution"}


def _nestable(letter: str, specs: list[str], rule: str | None) -> bool:
    """Whether DTensor runs ``letter`` split on several mesh axes at once (see module docstring)."""
    if rule in _NO_NESTED_SPLITS:
        return False
    return not (rule == "matmul" and letter in specs[0] and specs[0].index(letter) != 0)


def op_strategies(node: GraphNode, in_shapes: list[tuple[int, ...]], mesh_shape: tuple[int, ...],
                  axis_names: tuple[str, ...]) -> list[Strategy]:
    """All strategies of an op node (replicate-only when its labels are missing or do not fit)."""
    ndim = len(mesh_shape)
    if not node.inputs or not _labels_fit(node, in_shapes):
        return [_replicated(node, ndim)]
    lab = node.labels
    in_specs, out_specs = list(lab.inputs), list(lab.outputs)
    all_specs = in_specs + out_specs
    shapes = list(in_shapes) + [o.shape for o in node.outputs]
    sizes: dict[str, set[int]] = {}
    for spec, shape in zip(all_specs, shapes):
        for ch, n in zip(spec, shape):
            if ch != ".":
                sizes.setdefault(ch, set()).add(int(n))
    twice = {ch for spec in all_specs for ch in set(spec) if ch != "." and spec.count(ch) > 1}
    blocked = set(lab.whole) | twice
    out_letters = [ch for ch in dict.fromkeys("".join(out_specs)) if ch != "." and ch not in blocked]
    contracted = [ch for ch in lab.contracted() if ch not in blocked and all(ch in spec for spec in in_specs)] \
        if lab.reduce else []
    choices = [None] + out_letters + contracted
    reduce_p = f"P({lab.reduce})" if lab.reduce else None
    result = []
    for combo in itertools.product(*([None] if n == 1 else choices for n in mesh_shape)):
        split: dict[str, int] = {}
        for ax, ch in enumerate(combo):
            if ch is not None:
                split[ch] = split.get(ch, 1) * mesh_shape[ax]
        if any(n % f for ch, f in split.items() for n in sizes[ch]):
            continue
        if any(not _nestable(ch, all_specs, lab.rule) for ch in split if combo.count(ch) > 1):
            continue
        ins, grads = [], []
        for spec in in_specs:
            pl, gr = [], []
            for ch in combo:
                if ch is None:
                    pl.append("R")
                    gr.append("R")
                elif ch in spec:
                    pl.append(f"S({spec.index(ch)})")
                    gr.append(pl[-1])
                else:
                    pl.append("R")
                    gr.append("P(sum)")
            ins.append(tuple(pl))
            grads.append(tuple(gr))
        outs = []
        for spec in out_specs:
            outs.append(tuple("R" if ch is None else f"S({spec.index(ch)})" if ch in spec else
                              reduce_p if ch in contracted else "R" for ch in combo))
        name = ",".join(f"{ch}@{axis_names[ax]}" for ax, ch in enumerate(combo) if ch is not None) or "R"
        shard = math.prod(mesh_shape[ax] for ax, ch in enumerate(combo) if ch is not None)
        result.append(Strategy(name, tuple(ins), tuple(outs), tuple(grads), shard))
    return result


def placeholder_strategies(node: GraphNode, mesh_shape: tuple[int, ...],
                           axis_names: tuple[str, ...]) -> list[Strategy]:
    """Strategies of a param, buffer or input node (see module docstring)."""
    shape = node.outputs[0].shape if node.outputs else ()
    if node.kind == "param":
        dims = list(range(len(shape)))
    elif node.kind == "input":
        dims = [0] if shape else []
    else:
        dims = []
    result = []
    for combo in itertools.product(*([None] if n == 1 else [None] + dims for n in mesh_shape)):
        split: dict[int, int] = {}
        for ax, d in enumerate(combo):
            if d is not None:
                split[d] = split.get(d, 1) * mesh_shape[ax]
        if any(shape[d] % f for d, f in split.items()):
            continue
        pl = tuple("R" if d is None else f"S({d})" for d in combo)
        name = ",".join(f"{d}@{axis_names[ax]}" for ax, d in enumerate(combo) if d is not None) or "R"
        result.append(Strategy(name, (), (pl,), (), math.prod(split.values()) if split else 1))
    return result


def shard_count(placements: Placements, mesh_shape: tuple[int, ...]) -> int:
    """How many pieces a tensor with these placements is cut into on each device's view."""
    return math.prod(n for p, n in zip(placements, mesh_shape) if p.startswith("S("))


def output_placement(chosen: Mapping[str, Strategy], node: GraphNode, o: int = 0) -> Placements:
    """The placement output ``o`` of ``node`` has under the ``chosen`` strategies: what every consumer of
    that value sees (a tied parameter's is its owner's)."""
    if node.kind == "param" and node.tied_to:
        return chosen[node.tied_to].outputs[0]
    return chosen[node.id].outputs[o]
