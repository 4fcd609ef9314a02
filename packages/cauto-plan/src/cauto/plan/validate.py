"""Semantic checks of cauto documents: what a JSON Schema cannot say, checked after it (torch-free).

* numbers: finite everywhere; below ``MAX_NUMBER`` (2**60: bytes, flops, counts, shapes); seconds
  below ``MAX_SECONDS``; rates (flops/s, bytes/s) at least 1; none negative except the few signed
  fields (``SIGNED``);
* a graph: labels with one letter per dimension of each input and output, ``params`` and
  ``tied_to`` naming parameter nodes, memory timeline events naming nodes;
* a plan: as many mesh axis names (distinct) and cluster axes as mesh dimensions, one placement
  per mesh axis everywhere, mesh axes (collectives, offload) within the mesh;
* a plan against its graph (``check_plan_against_graph``, given the graph's nodes, from a graph
  document or a model's capture): the fingerprint, every node, parameter and edge naming a node of
  the graph (a parameter its own target), every value node planned, placement counts per node
  input and output, and ``S(d)`` within each tensor's rank;
* a plan against a launch (``check_world_size``): the world size equal to the mesh size.

Failures raise DocumentError (the JSON path, what was expected) or MismatchError (the fingerprint,
the world size), each saying what to do.
"""

from __future__ import annotations

import math

from cauto.plan.documents import split_ref
from cauto.plan.errors import DocumentError, MismatchError
from cauto.plan.placements import parse_placement

MAX_NUMBER = 2**60
MAX_SECONDS = 1e9
#: fields that may be negative: the chunk arena (budget minus a larger prediction), the ILP objective
SIGNED = frozenset({"arena_bytes", "objective_s"})
#: fields that are rates: a tiny one turns every cost into an overflow
RATES = frozenset({"peak_flops", "memory_bandwidth_bytes_per_s", "bandwidth_bytes_per_s",
                   "host_link_bandwidth_bytes_per_s"})


def _path(parts: list) -> str:
    text = "$"
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text


def check_numbers(doc: object, *, source: str | None = None, _parts: list | None = None, _key: str = "") -> None:
    """Raise DocumentError at the first number that is not finite or out of its sane range."""
    parts = _parts if _parts is not None else []
    if isinstance(doc, dict):
        for key, value in doc.items():
            check_numbers(value, source=source, _parts=[*parts, key], _key=str(key))
        return
    if isinstance(doc, list):
        for i, value in enumerate(doc):
            check_numbers(value, source=source, _parts=[*parts, i], _key=_key)
        return
    if isinstance(doc, bool) or not isinstance(doc, (int, float)):
        return
    where = _path(parts)
    if isinstance(doc, float) and not math.isfinite(doc):
        raise DocumentError(f"{_key or 'value'} is {doc!r}", path=where, source=source,
                            expected="a finite number: the document is corrupted; write it again (profile or plan)")
    if abs(doc) >= MAX_NUMBER:
        raise DocumentError(f"{_key or 'value'} is {doc:g}, beyond any real model or device", path=where,
                            source=source, expected=f"a number below 2**60 ({MAX_NUMBER:.3g})")
    if doc < 0 and _key not in SIGNED:
        raise DocumentError(f"{_key or 'value'} is negative ({doc:g})", path=where, source=source,
                            expected="a number >= 0")
    if _key.endswith("_s") and _key not in RATES and doc >= MAX_SECONDS:
        raise DocumentError(f"{_key} is {doc:g} seconds", path=where, source=source,
                            expected=f"seconds below {MAX_SECONDS:g}")
    if _key in RATES and doc < 1:
        raise DocumentError(f"{_key} is {doc:g} per second", path=where, source=source,
                            expected="a rate of at least 1 per second")


def _outputs(doc_nodes: list[dict]) -> dict[str, dict]:
    """"node#k" and "node" -> the output tensor meta they name."""
    out = {}
    for node in doc_nodes:
        for k, meta in enumerate(node["outputs"]):
            out[f"{node['id']}#{k}"] = meta
            if k == 0:
                out[node["id"]] = meta
    return out


def _input_meta(outputs: dict[str, dict], ref: str) -> dict | None:
    src, k = split_ref(ref)
    return outputs.get(f"{src}#{k}")


def _tensors(node: dict, outputs: dict[str, dict]):
    """("inputs", metas of the node's input tensors), ("outputs", metas of its outputs)."""
    return (("inputs", [_input_meta(outputs, r) for r in node["inputs"]]), ("outputs", node["outputs"]))


def check_graph(doc: dict, *, source: str | None = None) -> None:
    """Semantic checks of a schema-valid graph document (module docstring); raise DocumentError."""
    check_numbers(doc, source=source)
    nodes = {n["id"]: n for n in doc["nodes"]}
    outputs = _outputs(doc["nodes"])
    for i, node in enumerate(doc["nodes"]):
        where = f"$.nodes[{i}]"
        for j, pid in enumerate(node.get("params", [])):
            if nodes.get(pid, {}).get("kind") != "param":
                raise DocumentError(f"node {node['id']!r} lists parameter {pid!r}, which is no parameter node",
                                    path=f"{where}.params[{j}]", source=source, expected="ids of param nodes")
        if node.get("tied_to") is not None and nodes.get(node["tied_to"], {}).get("kind") != "param":
            raise DocumentError(f"node {node['id']!r} is tied to {node['tied_to']!r}, which is no parameter node",
                                path=f"{where}.tied_to", source=source, expected="the id of a param node")
        labels = node.get("labels")
        if labels is None:
            continue
        for side, metas in _tensors(node, outputs):
            if len(labels[side]) != len(metas):
                raise DocumentError(f"node {node['id']!r} has {len(metas)} {side} but {len(labels[side])} {side} labels",
                                    path=f"{where}.labels.{side}", source=source,
                                    expected=f"one label per tensor ({len(metas)}); profile again")
            for j, (label, meta) in enumerate(zip(labels[side], metas)):
                if meta is not None and len(label) != len(meta["shape"]):
                    raise DocumentError(
                        f"label {label!r} of node {node['id']!r} has {len(label)} letters for a tensor of rank "
                        f"{len(meta['shape'])}", path=f"{where}.labels.{side}[{j}]", source=source,
                        expected="one letter per dimension; profile again")
    for i, event in enumerate(doc["memory"].get("timeline", [])):
        if event[2] is not None and event[2] not in nodes:
            raise DocumentError(f"timeline event names node {event[2]!r}, which is not in the graph",
                                path=f"$.memory.timeline[{i}][2]", source=source, expected="a node id or null")


def _placement_lists(plan: dict):
    """(JSON path, placements list) of every placement list of a plan."""
    for nid, entry in plan["nodes"].items():
        for side in ("inputs", "outputs"):
            for j, placements in enumerate(entry[side]):
                yield f"$.nodes.{nid}.{side}[{j}]", placements
    for pid, entry in plan["params"].items():
        yield f"$.params.{pid}.placements", entry["placements"]
    for i, edge in enumerate(plan["edges"]):
        for end in ("src_placements", "dst_placements"):
            if end in edge:
                yield f"$.edges[{i}].{end}", edge[end]


def _collectives(plan: dict):
    for i, c in enumerate(plan["predictions"]["collectives"]):
        yield f"$.predictions.collectives[{i}]", c
    for i, c in enumerate(plan.get("grad_sync") or []):
        yield f"$.grad_sync[{i}]", c
    for i, edge in enumerate(plan["edges"]):
        for j, c in enumerate(edge.get("collectives", [])):
            yield f"$.edges[{i}].collectives[{j}]", c


def check_plan(doc: dict, *, source: str | None = None) -> None:
    """Semantic checks of a schema-valid plan document on its own (module docstring); raise DocumentError."""
    check_numbers(doc, source=source)
    shape, names = doc["mesh"]["shape"], doc["mesh"]["axis_names"]
    if len(shape) != len(names):
        raise DocumentError(f"mesh shape {shape} has {len(shape)} dimensions but {len(names)} axis names {names}",
                            path="$.mesh.axis_names", source=source, expected=f"{len(shape)} axis names")
    if len(set(names)) != len(names):
        raise DocumentError(f"mesh axis names {names} repeat a name", path="$.mesh.axis_names", source=source,
                            expected="distinct names")
    if len(doc["cluster"]["axes"]) != len(shape):
        raise DocumentError(f"the cluster describes {len(doc['cluster']['axes'])} mesh axes for a mesh of {len(shape)}",
                            path="$.cluster.axes", source=source, expected=f"{len(shape)} axes; solve again")
    if math.prod(shape) >= MAX_NUMBER:
        raise DocumentError(f"mesh {shape} has {math.prod(shape):g} devices", path="$.mesh.shape", source=source,
                            expected="a real mesh")
    for where, placements in _placement_lists(doc):
        if len(placements) != len(shape):
            raise DocumentError(f"{len(placements)} placements {placements} on a mesh of {len(shape)} axes",
                                path=where, source=source, expected=f"one placement per mesh axis ({len(shape)})")
    for where, collective in _collectives(doc):
        if "axis" in collective and collective["axis"] >= len(shape):
            raise DocumentError(f"collective on mesh axis {collective['axis']} of a {len(shape)}-axis mesh",
                                path=f"{where}.axis", source=source, expected=f"an axis < {len(shape)}")
    for j, axis in enumerate((doc.get("offload") or {}).get("mesh_axes", [])):
        if axis >= len(shape):
            raise DocumentError(f"offload over mesh axis {axis} of a {len(shape)}-axis mesh",
                                path=f"$.offload.mesh_axes[{j}]", source=source, expected=f"an axis < {len(shape)}")


def _check_dims(placements: list[str], meta: dict | None, where: str, source: str | None) -> None:
    if meta is None:
        return
    rank = len(meta["shape"])
    for axis, text in enumerate(placements):
        kind, dim = parse_placement(text)
        if kind == "S" and dim >= rank:
            raise DocumentError(f"placement {text} on mesh axis {axis} shards dim {dim} of a tensor of rank {rank} "
                                f"(shape {meta['shape']})", path=f"{where}[{axis}]", source=source,
                                expected=f"S(d) with d < {rank}; solve again for this graph")


def check_plan_against_graph(plan: dict, graph_nodes: list[dict], graph_fingerprint: str, *,
                             source: str | None = None) -> None:
    """Check that ``plan`` belongs to the graph of ``graph_nodes`` (graph-document node dicts, at least
    their structural fields) and ``graph_fingerprint``: MismatchError for another graph, else DocumentError."""
    if plan["graph_fingerprint"] != graph_fingerprint:
        raise MismatchError(
            f"{source + ': ' if source else ''}the plan was solved for graph {plan['graph_fingerprint'][:12]}, but "
            f"this graph is {graph_fingerprint[:12]}: the model changed since planning (its layers, sizes or inputs); "
            "profile and solve again (cauto profile, cauto plan)")
    nodes = {n["id"]: n for n in graph_nodes}
    outputs = _outputs(graph_nodes)
    for nid, entry in plan["nodes"].items():
        node = nodes.get(nid)
        if node is None:
            raise DocumentError(f"node {nid!r} is not in the graph", path=f"$.nodes.{nid}", source=source,
                                expected="ids of the graph's nodes")
        for side, metas in _tensors(node, outputs):
            if len(entry[side]) != len(metas):
                raise DocumentError(f"node {nid!r} has {len(metas)} {side} in the graph but {len(entry[side])} in the plan",
                                    path=f"$.nodes.{nid}.{side}", source=source,
                                    expected=f"{len(metas)} placement lists; solve again for this graph")
            for j, (placements, meta) in enumerate(zip(entry[side], metas)):
                _check_dims(placements, meta, f"$.nodes.{nid}.{side}[{j}]", source)
    for pid, entry in plan["params"].items():
        node = nodes.get(pid)
        if node is None or node["kind"] != "param":
            raise DocumentError(f"parameter {pid!r} is not a parameter of the graph", path=f"$.params.{pid}",
                                source=source, expected="ids of the graph's param nodes")
        if node.get("target") is not None and entry["target"] != node["target"]:
            raise DocumentError(f"parameter {pid!r} targets {entry['target']!r}, but the graph's is {node['target']!r}",
                                path=f"$.params.{pid}.target", source=source, expected=repr(node["target"]))
        _check_dims(entry["placements"], node["outputs"][0] if node["outputs"] else None,
                    f"$.params.{pid}.placements", source)
    missing = [n["id"] for n in graph_nodes if n["kind"] != "output" and n["id"] not in plan["nodes"]]
    if missing:
        raise DocumentError(f"{len(missing)} nodes of the graph have no placement (first: {missing[0]!r})",
                            path="$.nodes", source=source, expected="an entry per graph node; solve again")
    for i, edge in enumerate(plan["edges"]):
        for end in ("src", "dst"):
            if edge[end] not in nodes:
                raise DocumentError(f"edge {end} {edge[end]!r} is not in the graph", path=f"$.edges[{i}].{end}",
                                    source=source, expected="ids of the graph's nodes")
        dst_inputs = nodes[edge["dst"]]["inputs"]
        if "arg" in edge and edge["arg"] >= len(dst_inputs):
            raise DocumentError(f"edge into input {edge['arg']} of {edge['dst']!r}, which has {len(dst_inputs)}",
                                path=f"$.edges[{i}].arg", source=source, expected=f"an input index < {len(dst_inputs)}")
        meta = _input_meta(outputs, dst_inputs[edge["arg"]]) if "arg" in edge else None
        for end in ("src_placements", "dst_placements"):
            if end in edge:
                _check_dims(edge[end], meta, f"$.edges[{i}].{end}", source)
    for i, region in enumerate((plan.get("checkpoint") or {}).get("regions", [])):
        for j, nid in enumerate(region["nodes"]):
            if nid not in nodes:
                raise DocumentError(f"checkpoint region names node {nid!r}, which is not in the graph",
                                    path=f"$.checkpoint.regions[{i}].nodes[{j}]", source=source,
                                    expected="ids of the graph's nodes")


def check_world_size(plan: dict, world_size: int, hosts: int = 1) -> None:
    """Raise MismatchError unless ``world_size`` processes (over ``hosts`` hosts) fill the plan's mesh."""
    shape = plan["mesh"]["shape"]
    need = math.prod(shape)
    if need != world_size:
        if hosts == 1:
            fix = f"run with --nproc {need}"
        elif need % hosts == 0:
            fix = f"run with --nproc {need // hosts} on each of the {hosts} hosts"
        else:
            fix = f"{need} processes do not split evenly over {hosts} hosts: change --nnodes"
        raise MismatchError(f"the plan's mesh {'x'.join(map(str, shape))} needs {need} processes, but the job has "
                            f"{world_size}; {fix}, or solve a plan for this world size (cauto plan --mesh ...)")
