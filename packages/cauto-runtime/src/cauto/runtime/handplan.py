"""Hand-made plans: place inputs and parameters, let DTensor choose the rest (tests, baselines, tools).

The solver (cauto-solver) writes real plans. ``make_plan`` writes the plan a user would get by
placing only the placeholders by hand (data parallel: inputs S(0), params R; Megatron: column and
row splits) and letting DTensor choose every other placement (``propagate``: meta tensors, no data).
Ops DTensor cannot run with the placements they arrive at get their activations redistributed to
the user inputs' placement (a plan edge). ``force`` adds explicit edges: node id -> input
placements. Predictions: the forward collectives of its edges, of the loss, and those DTensor runs inside
ops (counted on meta tensors; axis 0, bytes unknown), nothing else
(no memory or time model: ``peak_bytes`` is what the caller passes).
"""

from __future__ import annotations

from cauto.plan import CURRENT_VERSION, check_document, split_ref
from cauto.plan.versioning import format_version
from cauto.profiler.capture import Capture, output_tensors, ref_of, tensor_bytes, tensor_inputs
from cauto.runtime.collectives import edge_collectives
from cauto.runtime.propagate import Propagation, propagate

CLUSTER = {"name": "test-cpu", "axes": [{"latency_s": 1e-5, "bandwidth_bytes_per_s": 1e9}],
           "device": {"memory_bytes": 2**34, "peak_flops": 1e11, "memory_bandwidth_bytes_per_s": 1e10}}


def make_plan(cap: Capture, mesh, *, inputs: str, params: dict[str, str] | str | None = None,
              force: dict[str, list[str]] | None = None, checkpoint: list[dict] | None = None,
              storage: str | None = None, peak_bytes: int = 0, offload: dict | None = None) -> dict:
    """A valid plan document for ``cap`` on ``mesh``.

    ``inputs``: placement of every user input ("S(0),R"); ``params``: one placement for all
    parameters, or fqn -> placement (others, and all by default, replicated), as the forward uses
    them; ``storage``: where every parameter, its gradient and optimizer state live when that differs
    (ZeRO-3/FSDP: "S(0)", gathered for the forward, gradients reduce-scattered in backward); ``checkpoint``: plan.checkpoint.regions.
    ``offload``: the plan's offload section (``device_budget_bytes``, ``chunk_elems``): every parameter's state
    becomes "chunked" (data parallel plans only: chunks/data_parallel.py runs them).
    """
    axes = mesh.ndim
    rep = ",".join(["R"] * axes)
    ph = _placeholder_placements(cap, inputs, params, rep)
    prop = _propagate_until_it_runs(cap, mesh, ph, force, inputs, rep)
    nodes, edges, forward, outputs_of = _nodes_and_edges(cap, prop, rep)
    for node_id, counts in prop.hidden.items():
        for op, n in counts.items():
            forward += [{"op": op, "axis": 0, "bytes": 0, "phase": "forward", "where": f"inside {node_id}"}] * n
    (out,) = [n for n in cap.graph.nodes if n.op == "output"]
    loss = out.args[0][0]
    src, idx = split_ref(ref_of(loss))
    loss_meta = output_tensors(loss)[0]
    forward += edge_collectives(outputs_of[src][idx], rep, tensor_bytes(loss_meta),
                                where="loss")
    param_entries = {name: {"target": fqn, "placements": (storage or ph[name]).split(",")}
                     for name, (kind, fqn) in cap.placeholders.items() if kind == "param"}
    if storage is not None:
        for node in cap.value_nodes():
            if node.op == "placeholder" and node.name in param_entries and node.users and storage != ph[node.name]:
                t = output_tensors(node)[0]
                forward += edge_collectives(storage, ph[node.name], tensor_bytes(t), where=node.name)
    plan = {
        "schema_version": format_version(CURRENT_VERSION["plan"]), "kind": "plan",
        "graph_fingerprint": cap.fingerprint(),
        "mesh": {"shape": list(mesh.shape), "axis_names": list(mesh.mesh_dim_names or [f"a{i}" for i in range(axes)])},
        "cluster": {**CLUSTER, "axes": CLUSTER["axes"] * axes},
        "nodes": nodes, "params": param_entries, "edges": edges,
        "predictions": {"peak_bytes": int(peak_bytes), "step_time_s": {"total": 0.0, "compute": 0.0, "communication": 0.0},
                        "collectives": forward},
        "solver": {"name": "runtime-tests", "status": "feasible", "objective_s": 0.0},
    }
    if checkpoint is not None:
        plan["checkpoint"] = {"method": "auto", "regions": checkpoint}
    if offload is not None:
        plan["offload"] = {"mesh_axes": list(range(axes)), **offload}
        for entry in param_entries.values():
            entry["state"] = "chunked"
    return check_document(plan, "plan")



def _placeholder_placements(cap: Capture, inputs: str, params: dict[str, str] | str | None, rep: str) -> dict:
    """Placeholder name -> placement: ``inputs`` for user inputs, ``params`` for parameters, the rest
    replicated."""
    ph = {}
    for name, (kind, fqn) in cap.placeholders.items():
        if kind == "input":
            ph[name] = inputs
        elif kind == "param":
            ph[name] = params if isinstance(params, str) else (params or {}).get(fqn, rep)
        else:
            ph[name] = rep
    return ph


def _propagate_until_it_runs(cap: Capture, mesh, ph: dict, force: dict[str, list[str]] | None, inputs: str,
                             rep: str) -> Propagation:
    """DTensor's propagation from ``ph``; each first op it cannot run gets its inputs forced to the
    placeholders' placements (user inputs: ``inputs``, scalars replicated), up to 50 times."""
    overrides = dict(force or {})
    for _ in range(50):
        prop = propagate(cap, mesh, ph, node_inputs=overrides)
        bad = [n for n in cap.value_nodes() if n.name in prop.failed
               and all(ref_of(a).split("#")[0] not in prop.failed for a in tensor_inputs(n))]
        if not bad:
            break
        node = bad[0]
        overrides[node.name] = [ph[a.name] if a.op == "placeholder" and cap.placeholders[a.name][0] != "input"
                                else (inputs if output_tensors(a)[0].dim() > 0 else rep) for a in tensor_inputs(node)]
    else:
        raise RuntimeError(f"DTensor cannot run these ops with the placements given: {prop.failed}")
    return prop


def _nodes_and_edges(cap: Capture, prop: Propagation, rep: str) -> tuple[dict, list, list, dict]:
    """The plan's nodes and edges from a propagation: (nodes, edges, the edges' forward collectives,
    node -> its output placements)."""
    nodes, edges, forward = {}, [], []
    outputs_of = {}
    for node in cap.value_nodes():
        ins = [p.split(",") for p in prop.inputs[node.name]]
        outs = [p.split(",") for p in prop.outputs[node.name]]
        nodes[node.name] = {"inputs": ins, "outputs": outs}
        outputs_of[node.name] = prop.outputs[node.name]
        for k, a in enumerate(tensor_inputs(node) if node.op != "placeholder" else []):
            src, idx = split_ref(ref_of(a))
            have = outputs_of[src][idx] if src in outputs_of else rep
            if have != prop.inputs[node.name][k]:
                t = output_tensors(a)[0]
                colls = edge_collectives(have, prop.inputs[node.name][k], tensor_bytes(t),
                                         where=f"{ref_of(a)}->{node.name}[{k}]")
                edges.append({"src": src, "dst": node.name, "arg": k, "src_placements": have.split(","),
                              "dst_placements": prop.inputs[node.name][k].split(","), "collectives": colls})
                forward += colls
    return nodes, edges, forward, outputs_of
