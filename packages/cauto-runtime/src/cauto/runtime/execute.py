"""Turn the captured graph into the parallel program that runs: an fx GraphModule on DTensors.

The lifted graph of the capture (placeholders: parameters, buffers, constants, user inputs in
graph-signature order) is copied node for node, names kept, and rewritten:

* user inputs go through ``ops.place_input`` (global or local batch -> a DTensor as planned);
* before an op, every tensor input whose placement differs from the plan's input placement is
  redistributed (``ops.redistribute``): these are the plan's edges;
* outputs of ops without tensor inputs (arange, masks) stay plain tensors, computed identically on
  every rank, and become replicated DTensors (``ops.replicate``) where a DTensor op first uses them;
* where DTensor's natural output placement differs from the plan (found before the first step by
  ``propagate``), the output is redistributed to the planned placement and the mismatch recorded;
* a few ATen ops without DTensor sharding rules on this device are replaced by ``ops`` versions
  that run locally on each shard (e.g. attention with batch or heads sharded), and ops registered
  with ``torch.library`` outside torch (no sharding rule at all) run replicated (``ops.replicated_op``);
* checkpoint regions become calls of ``torch.utils.checkpoint.checkpoint`` on sub-GraphModules;
* parameters whose shards live in chunks are fetched and released around their uses (chunks/fetch.py).

The generated code (``ExecutableGraph.code``) is the GraphModule's own ``.code`` with the plan's
placements and collectives appended as comments, and the module's ``forward`` is compiled from
exactly that text: what a user reads is what runs.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.fx.graph_module import _forward_from_src

from cauto.plan import PlanDocument
from cauto.plan.execution import lowered_reduce_dtype
from cauto.plan.precision import bytes_as, cast_on_entry, common_cast
from cauto.profiler.capture import (
    SKIPPED_TARGETS,
    Capture,
    dtype_name,
    output_tensors,
    tensor_bytes,
    tensor_inputs,
)
from cauto.profiler.kept_functions import is_elementwise
from cauto.runtime import ops
from cauto.runtime.collectives import describe
from cauto.runtime.propagate import Propagation


@dataclass
class Redistribution:
    """One redistribution the program executes: an edge of the plan, or a fix of a mismatch."""

    src: str
    dst: str
    arg: int
    have: str
    want: str
    bytes: int
    kind: str  # "edge" (in plan.edges), "implicit" (placements differ, no edge listed), "mismatch", "param"


@dataclass
class ExecutableGraph:
    """The parallel program: the GraphModule that runs, its source, and what it redistributes."""

    module: torch.fx.GraphModule
    code: str
    redistributions: list[Redistribution] = field(default_factory=list)
    #: node id -> (planned output placements, DTensor's natural ones)
    mismatches: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: node id -> why its placements could not be checked before running
    unchecked: dict[str, str] = field(default_factory=dict)
    #: node id -> collectives DTensor runs inside the op (a redistribution the plan did not list)
    hidden: dict[str, dict[str, int]] = field(default_factory=dict)


def _join(placements: list[str]) -> str:
    return ",".join(placements)


def _nbytes(node: torch.fx.Node, moved_in: torch.dtype | None = None) -> int:
    tensors = output_tensors(node)
    if not tensors:
        return 0
    return bytes_as(tensor_bytes(tensors[0]), dtype_name(tensors[0].dtype), moved_in and dtype_name(moved_in))


def entry_cast(value: torch.fx.Node, consumer: torch.fx.Node) -> torch.dtype | None:
    """The dtype ``consumer`` casts ``value`` to as it starts (autocast; cauto.plan.precision), or None."""
    tensors, outs = output_tensors(value), output_tensors(consumer)
    if not tensors or not outs:
        return None
    cast = cast_on_entry(dtype_name(tensors[0].dtype), tensors[0].dim(), [dtype_name(t.dtype) for t in outs])
    return None if cast is None else getattr(torch, cast)


def _moving(value: torch.fx.Node, mesh_node: torch.fx.Node, placements: str, cast: torch.dtype | None,
            rw: _Rewrite) -> tuple:
    """Arguments of ``ops.redistribute``: the dtypes only where the value moves cast or its gradient is
    reduced in the plan's reduce dtype (an fp32 program's lines stay ``redistribute(value, mesh,
    placements)``, which chunks/fetch.py rewrites). The reduce dtype applies to the gradients of
    parameters and of values moved cast (a gradient that arrives in the compute dtype anyway)."""
    backward = rw.backward_dtype if cast is not None or value in rw.params else None
    if cast is None and backward is None:
        return (value, mesh_node, placements)
    return (value, mesh_node, placements, cast, backward)


def _in(cast: torch.dtype | None) -> str:
    return "" if cast is None else f", moved in {dtype_name(cast)}"


def _fix_devices(node: torch.fx.Node, device: torch.device) -> None:
    def fix(a):
        return device if isinstance(a, torch.device) and a.type == "meta" else a
    node.args, node.kwargs = pytree.tree_map(fix, (node.args, node.kwargs))


def _replace_tensor_inputs(node: torch.fx.Node, new: list[torch.fx.Node]) -> None:
    """Replace the tensor inputs of ``node`` (tensor_inputs order) by ``new``, occurrence by occurrence."""
    it = iter(new)
    node.args, node.kwargs = pytree.tree_map(
        lambda a: next(it) if isinstance(a, torch.fx.Node) and output_tensors(a) else a, (node.args, node.kwargs))


def _insert(graph: torch.fx.Graph, where: torch.fx.Node, before: bool, target, args, like: torch.fx.Node,
            owner: str, comment: str) -> torch.fx.Node:
    ctx = graph.inserting_before(where) if before else graph.inserting_after(where)
    with ctx:
        new = graph.call_function(target, args)
    new.meta["val"] = like.meta.get("val")
    new.meta["cauto_owner"] = owner
    new.meta["cauto_comment"] = comment
    return new


def build(cap: Capture, plan: PlanDocument, mesh: DeviceMesh, device: torch.device,
          propagation: Propagation | None = None, chunked: set[str] | None = None) -> ExecutableGraph:
    """Rewrite the captured graph for ``plan`` on ``mesh`` (see module docstring) and compile it.
    ``chunked``: placeholders of parameters whose shards live in chunks, fetched around their uses
    (chunks/fetch.py)."""
    graph = torch.fx.Graph()
    val_map: dict[torch.fx.Node, torch.fx.Node] = {}
    out = graph.graph_copy(cap.graph, val_map)
    graph.output(out)
    result = ExecutableGraph(module=None, code="")  # type: ignore[arg-type]
    if propagation is not None:
        result.hidden = dict(propagation.hidden)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]):
        mesh_node = graph.get_attr("mesh")
    reduce_dtype = lowered_reduce_dtype(plan.execution)
    rw = _Rewrite(graph, mesh_node, plan.nodes, propagation, result, _join(["R"] * mesh.ndim),
                  planned_edges={(e["src"], e["dst"], e["arg"]) for e in plan.edges},
                  reduced=set(plan.execution["grad_reductions"]),
                  backward_dtype=None if reduce_dtype is None else getattr(torch, reduce_dtype),
                  params={n for n in placeholders if cap.placeholders[n.name][0] == "param"})
    for node in placeholders:
        _place_placeholder(rw, cap, plan, node)
    for node in list(graph.nodes):
        if node.op != "call_function" or "cauto_owner" in node.meta:
            continue
        if str(node.target) in SKIPPED_TARGETS:
            if not node.users:
                graph.erase_node(node)
            continue
        _fix_devices(node, device)
        _rewrite_op(rw, node)

    (output,) = [n for n in graph.nodes if n.op == "output"]
    loss = pytree.tree_leaves(output.args)[0]
    with graph.inserting_before(output):
        rescale = getattr(loss, "target", None) in ops.RESCALE_AVG_LOSSES
        final = graph.call_function(ops.to_local_loss, (loss, mesh_node, rescale))
    final.meta["cauto_comment"] = "loss, replicated on every rank"
    output.args = ((final,),)
    if chunked:
        from cauto.runtime.chunks.fetch import insert_fetches
        insert_fetches(graph, chunked)
    root = torch.nn.Module()
    root.mesh = mesh
    gm = torch.fx.GraphModule(root, graph)
    if plan.checkpoint:
        from cauto.runtime.checkpoint import wrap_regions
        wrap_regions(gm, plan.checkpoint.get("regions", []))
    result.module = gm
    result.code = compile_with_comments(gm)
    return result


@dataclass
class _Rewrite:
    """What build() keeps while it rewrites the graph node by node."""

    graph: torch.fx.Graph
    mesh_node: torch.fx.Node
    nodes_plan: dict
    propagation: Propagation | None
    result: ExecutableGraph
    replicated: str
    #: (src ref, dst node, arg) of the plan's edges
    planned_edges: set[tuple[str, str, int]]
    #: values whose gradient the plan reduces once, before their producer's backward (see ops.reduce_grad)
    reduced: set[str]
    placement: dict[torch.fx.Node, str] = field(default_factory=dict)  # current placement of each distributed value
    local: set[torch.fx.Node] = field(default_factory=set)  # values that are plain tensors
    wrapped: dict[torch.fx.Node, torch.fx.Node] = field(default_factory=dict)
    #: (value, placement, dtype it moves in or None) -> the redistributed value
    moved: dict[tuple[torch.fx.Node, str, torch.dtype | None], torch.fx.Node] = field(default_factory=dict)
    #: the plan's reduce dtype where it is not fp32 (None: each gradient's own): the dtype the backward
    #: collectives of parameters and of values moved in a lower dtype run in (``_moving``)
    backward_dtype: torch.dtype | None = None
    #: the parameters' placeholders
    params: set[torch.fx.Node] = field(default_factory=set)

    def planned(self, node_id: str, key: str) -> list[str]:
        entry = self.nodes_plan.get(node_id)
        if entry is None:
            raise KeyError(f"the plan has no entry for graph node {node_id!r} (plan.nodes); solve the plan again")
        return [_join(p) for p in entry[key]]


def _place_placeholder(rw: _Rewrite, cap: Capture, plan: PlanDocument, node: torch.fx.Node) -> None:
    """A user input placed as planned (ops.place_input); a parameter, buffer or constant redistributed
    from its stored placement to the one the forward uses, where they differ."""
    graph, mesh_node, placement, result, replicated = rw.graph, rw.mesh_node, rw.placement, rw.result, rw.replicated
    kind, target = cap.placeholders[node.name]
    want = rw.planned(node.name, "outputs")[0]
    if kind == "input":
        shape = tuple(int(s) for s in output_tensors(node)[0].shape)
        new = _insert(graph, mesh_node, False, ops.place_input, (node, mesh_node, want, shape), node, node.name,
                      f"input {target}: {want}")
        node.replace_all_uses_with(new, delete_user_cb=lambda u, new=new: u is not new)
        placement[new] = want
        return
    stored = _join(plan.params[node.name]["placements"]) if kind == "param" and node.name in plan.params else replicated
    placement[node] = stored
    if stored != want and node.users:
        # moved in the compute dtype when every reader casts it on entry (cauto.plan.precision)
        cast = common_cast(entry_cast(node, u) for u in node.users for a in tensor_inputs(u) if a is node)
        new = _insert(graph, mesh_node, False, ops.redistribute, _moving(node, mesh_node, want, cast, rw),
                      node, node.name, f"{kind} {target}: stored {describe(stored, want)}{_in(cast)}")
        node.replace_all_uses_with(new, delete_user_cb=lambda u, new=new: u is not new)
        placement[new] = want
        result.redistributions.append(Redistribution(node.name, node.name, 0, stored, want, _nbytes(node, cast),
                                                     "param"))


def _rewrite_op(rw: _Rewrite, node: torch.fx.Node) -> None:
    """One op of the graph: its tensor inputs brought to the plan's placements, its target substituted
    where DTensor needs it, its output fixed where DTensor's choice is not the plan's."""
    graph, mesh_node, placement, local, result = rw.graph, rw.mesh_node, rw.placement, rw.local, rw.result
    replicated, propagation, reduced, planned = rw.replicated, rw.propagation, rw.reduced, rw.planned
    if node.target is operator.getitem:
        parent, index = node.args
        if parent in local:
            local.add(node)
        elif parent.name in rw.nodes_plan:
            placement[node] = planned(parent.name, "outputs")[index]
            last = _fix_mismatch(graph, node, parent.name, index, placement, mesh_node, propagation, result)
            _reduce_grad(graph, last, parent.name, f"{parent.name}#{index}" in reduced, placement, mesh_node)
        return
    tins = tensor_inputs(node)
    if all(a in local for a in tins):
        local.add(node)
        return
    wanted = planned(node.name, "inputs")
    if len(wanted) != len(tins):
        raise ValueError(f"plan.nodes[{node.name!r}].inputs has {len(wanted)} entries but the op has "
                         f"{len(tins)} tensor inputs; the plan does not fit this graph")
    _replace_tensor_inputs(node, _inputs_as_planned(rw, node, tins, wanted))
    if node.target in ops.SUBSTITUTES:
        node.target = ops.SUBSTITUTES[node.target]
    outs = planned(node.name, "outputs")
    if is_elementwise(node.target):
        node.args = (node.target, *node.args)
        node.target = ops.elementwise_op
    elif ops.is_library_op(node.target):
        if any(p != replicated for p in [*wanted, *outs]):
            raise ValueError(f"plan.nodes[{node.name!r}] places the library op {node.target} (no sharding rule) "
                             f"{wanted} -> {outs}; it runs only replicated: solve the plan again")
        node.args = (node.target, *node.args)
        node.target = ops.replicated_op
    node.meta["cauto_comment"] = _join(outs) if len(outs) == 1 else " | ".join(outs)
    if node.name in result.hidden:
        inside = ", ".join(f"{op} x{n}" for op, n in result.hidden[node.name].items())
        node.meta["cauto_comment"] += f"  (DTensor redistributes inside: {inside})"
    if len(output_tensors(node)) == 1 and not _is_container(node):
        placement[node] = outs[0]
        last = _fix_mismatch(graph, node, node.name, 0, placement, mesh_node, propagation, result)
        _reduce_grad(graph, last, node.name, node.name in reduced, placement, mesh_node)


def _inputs_as_planned(rw: _Rewrite, node: torch.fx.Node, tins: list[torch.fx.Node],
                       wanted: list[str]) -> list[torch.fx.Node]:
    """The values ``node`` reads in place of its tensor inputs ``tins``: a plain tensor wrapped as a
    replicated DTensor (once), then redistributed to ``wanted`` where it is not there (once per value
    and placement: an edge of the plan, or an implicit one)."""
    graph, mesh_node, placement, result, replicated = rw.graph, rw.mesh_node, rw.placement, rw.result, rw.replicated
    local, wrapped, moved = rw.local, rw.wrapped, rw.moved
    new_inputs = []
    for k, arg in enumerate(tins):
        value, have = arg, placement.get(arg, replicated)
        if arg in local:
            if arg not in wrapped:
                wrapped[arg] = _insert(graph, node, True, ops.replicate, (arg, mesh_node), arg, node.name,
                                       "plain tensor, identical on every rank -> replicated DTensor")
                placement[wrapped[arg]] = replicated
            value, have = wrapped[arg], replicated
        if have != wanted[k]:
            cast = entry_cast(arg, node)
            key = (value, wanted[k], cast)
            src_ref = _ref(arg)
            kind = "edge" if (src_ref, node.name, k) in rw.planned_edges else "implicit"
            if key not in moved:
                moved[key] = _insert(graph, node, True, ops.redistribute,
                                     _moving(value, mesh_node, wanted[k], cast, rw), arg, node.name,
                                     f"{kind} {src_ref} -> {node.name}[{k}]: {describe(have, wanted[k])}{_in(cast)}")
                placement[moved[key]] = wanted[k]
                result.redistributions.append(Redistribution(src_ref, node.name, k, have, wanted[k],
                                                              _nbytes(arg, cast), kind))
            value = moved[key]
        new_inputs.append(value)
    return new_inputs


def _is_container(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, (tuple, list))


def _ref(node: torch.fx.Node) -> str:
    if node.op == "call_function" and node.target is operator.getitem:
        return f"{node.args[0].name}#{node.args[1]}"
    return node.name


def _reduce_grad(graph, node, owner, wanted, placement, mesh_node) -> None:
    """After ``node``: reduce its summed gradient to its placement in backward (ops.reduce_grad) if ``wanted``."""
    if not wanted or not node.users:
        return
    want = placement[node]
    new = _insert(graph, node, False, ops.reduce_grad, (node, mesh_node, want), node, owner,
                  f"gradient: Partial sum of its consumers' gradients reduced to {want}")
    node.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
    placement[new] = want


def _fix_mismatch(graph, node, node_id, index, placement, mesh_node, propagation, result) -> torch.fx.Node:
    """After ``node`` (output ``index`` of ``node_id``): redistribute if DTensor's choice is not the plan's.

    Returns the node that now holds the value (``node``, or the redistribution after it)."""
    if propagation is None:
        return node
    if node_id in propagation.failed:
        result.unchecked[node_id] = propagation.failed[node_id]
        return node
    natural = propagation.outputs.get(node_id)
    if natural is None or index >= len(natural):
        return node
    want = placement[node]
    if natural[index] == want:
        return node
    fix = _insert(graph, node, False, ops.redistribute, (node, mesh_node, want), node, node_id,
                  f"MISMATCH: DTensor gives {describe(natural[index], want)} (plan says {want})")
    node.replace_all_uses_with(fix, delete_user_cb=lambda u: u is not fix)
    placement[fix] = want
    result.mismatches[node_id if index == 0 else f"{node_id}#{index}"] = (want, natural[index])
    result.redistributions.append(Redistribution(node_id, node_id, index, natural[index], want, _nbytes(node),
                                                 "mismatch"))
    return fix


_ASSIGN = re.compile(r"^    (\w+) = ")


def compile_with_comments(gm: torch.fx.GraphModule) -> str:
    """Recompile ``gm`` from its code with each node's ``cauto_comment`` appended; return that source."""
    python_code = gm.recompile()
    comments = {n.name: n.meta["cauto_comment"] for n in gm.graph.nodes if n.meta.get("cauto_comment")}
    lines = []
    for line in python_code.src.splitlines():
        match = _ASSIGN.match(line)
        if match and match.group(1) in comments:
            line = f"{line}  # {comments[match.group(1)]}"
        lines.append(line)
    src = "\n".join(lines) + "\n"
    gm._code = src
    type(gm).forward = _forward_from_src(src, python_code.globals, getattr(gm.graph, "_co_fields", {}))
    return src
