"""DTensor's own sharding propagation over a captured graph, on meta tensors (no data, no collectives).

Every op of the graph runs once on DTensors whose local tensors live on the meta device, with each
input placed as given; what DTensor chooses for the outputs is recorded. ``apply`` uses this to find,
before the first step, the ops whose natural output placement differs from the plan (a mismatch the
runtime then fixes with a redistribute and ``verify`` reports); tests use it to write plans.
A redistribution here only re-labels a meta tensor; collectives DTensor runs inside an op (to reach a
strategy it supports) run on meta tensors and are counted as ``hidden``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.debug import CommDebugMode

from cauto.profiler.capture import Capture, is_value_node, output_tensors, tensor_inputs
from cauto.profiler.kept_functions import is_elementwise
from cauto.runtime.dist_utils import local_slices, placements_text, to_placements
from cauto.runtime.ops import SUBSTITUTES, elementwise_op, is_library_op, replicated_op
from cauto.runtime.verify import executed_counts


@dataclass
class Propagation:
    """Per value node: the placements its tensor inputs had and DTensor's natural output placements."""

    inputs: dict[str, list[str]] = field(default_factory=dict)
    outputs: dict[str, list[str]] = field(default_factory=dict)
    #: node id -> error text for ops DTensor could not run on meta (left unchecked)
    failed: dict[str, str] = field(default_factory=dict)
    #: node id -> collectives (op -> count) DTensor ran inside the op to bring its inputs to a strategy
    #: it supports: a redistribution the plan did not list
    hidden: dict[str, dict[str, int]] = field(default_factory=dict)


def relabel(x: torch.Tensor, mesh: DeviceMesh, placements: str) -> DTensor:
    """A meta DTensor with ``x``'s global shape and dtype and the given placements."""
    target = to_placements(placements)
    shape = tuple(x.shape)
    index = local_slices(shape, target, mesh)
    local = torch.empty(tuple(s.stop - s.start for s in index), dtype=x.dtype, device="meta")
    return DTensor.from_local(local, mesh, target, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _text(x) -> str:
    return placements_text(x.placements) if isinstance(x, DTensor) else None


def propagate(cap: Capture, mesh: DeviceMesh, placeholders: dict[str, str], *,
              node_inputs: dict[str, list[str]] | None = None,
              node_outputs: dict[str, list[str]] | None = None) -> Propagation:
    """Run the captured graph on meta DTensors and record placements.

    ``placeholders``: placeholder id -> placement string. ``node_inputs`` (optional): node id -> the
    placement each tensor input is brought to before the op (a plan's inputs); without it inputs
    keep the placement they arrive with. ``node_outputs`` (optional): placements the outputs are
    brought to after the op, so that later ops see the plan rather than the natural choice.
    Plain tensors (outputs of ops without tensor inputs) stay plain until a DTensor op uses them,
    where they count as replicated.
    """
    result = Propagation()
    env: dict[torch.fx.Node, object] = {}
    replicated = ",".join(["R"] * mesh.ndim)
    value_ids = {n.name for n in cap.value_nodes()}
    for node in cap.graph.nodes:
        if node.op == "placeholder":
            (meta,) = output_tensors(node)
            env[node] = relabel(meta, mesh, placeholders.get(node.name, replicated))
            result.outputs[node.name] = [placeholders.get(node.name, replicated)]
            result.inputs[node.name] = []
            continue
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            parent, index = node.args
            env[node] = env[parent][index] if env.get(parent) is not None else None
            continue
        if not is_value_node(node) and node.name not in value_ids:
            continue
        tins = tensor_inputs(node)
        values = [env.get(a) for a in tins]
        if any(v is None for v in values):
            result.failed[node.name] = "an input could not be computed"
            env[node] = None
            continue
        distributed = any(isinstance(v, DTensor) for v in values)
        planned = (node_inputs or {}).get(node.name)
        elementwise = is_elementwise(node.target)  # a kept Function declared elementwise: runs on shards
        if planned is None and elementwise and distributed:  # its inputs share the first one's placement
            first = next(v for v in values if isinstance(v, DTensor))
            planned = [_text(first)] * len(values)
        elif planned is None and is_library_op(node.target):  # it runs only replicated (ops.replicated_op)
            planned = [replicated] * len(values)
        placed = []
        for k, v in enumerate(values):
            if distributed and not isinstance(v, DTensor):
                v = relabel(v, mesh, replicated)
            if planned is not None and distributed and _text(v) != planned[k]:
                v = relabel(v, mesh, planned[k])
            placed.append(v)
        result.inputs[node.name] = [_text(v) or replicated for v in placed]
        args, kwargs = _substitute(node, placed, env)
        try:
            with CommDebugMode() as comms:
                if elementwise:
                    out = elementwise_op(node.target, *args, **kwargs)
                elif is_library_op(node.target):
                    out = replicated_op(node.target, *args, **kwargs)
                else:
                    out = SUBSTITUTES.get(node.target, node.target)(*args, **kwargs)
        except Exception as exc:  # DTensor raises many types for unsupported ops; record and go on
            result.failed[node.name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            env[node] = None
            continue
        counts = executed_counts(comms)
        if counts:
            result.hidden[node.name] = dict(counts)
        leaves = [v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)]
        result.outputs[node.name] = [_text(v) or replicated for v in leaves]
        wanted = (node_outputs or {}).get(node.name)
        if wanted is not None and distributed:
            out = _relabel_outputs(out, mesh, wanted)
        env[node] = out
    return result


def _substitute(node: torch.fx.Node, placed: list, env: dict) -> tuple[tuple, dict]:
    """The op's args and kwargs with its tensor inputs replaced by ``placed`` (tensor_inputs order)."""
    it = iter(placed)

    def value(a):
        if not isinstance(a, torch.fx.Node):
            return a
        return next(it) if output_tensors(a) else env.get(a)

    return pytree.tree_map(value, (node.args, node.kwargs))


def _relabel_outputs(out, mesh: DeviceMesh, wanted: list[str]):
    it = iter(wanted)

    def fix(v):
        if isinstance(v, torch.Tensor):
            target = next(it)
            if isinstance(v, DTensor) and _text(v) != target:
                return relabel(v, mesh, target)
        return v

    return pytree.tree_map(fix, out)


def natural_placements(cap: Capture, mesh: DeviceMesh, placeholders: dict[str, str]) -> Propagation:
    """Placements DTensor picks for every node when only the placeholders are placed (no edges)."""
    return propagate(cap, mesh, placeholders)


__all__ = ["Propagation", "natural_placements", "propagate", "relabel", "Replicate"]
