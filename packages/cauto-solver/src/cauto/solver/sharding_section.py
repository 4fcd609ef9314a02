"""The sharding section of a plan: what a full assignment of strategies means for the plan document.

Every key of a plan that the chosen strategies decide (document.py puts the other sections next to
it), written in steps:

* ``nodes`` and ``params`` (``placements``): every non-output node's chosen input/output placements
  and compute seconds; a tied parameter copies the placement of the parameter it is tied to.
* ``edges`` (``redistributions``): every op input whose producer's placement differs from what the op
  needs, with the forward collectives and forward + backward seconds; the runtime redistributes a
  value once per placement, later consumers reuse it, and autograd sums the gradients of all the
  copy's consumers before its one backward collective (Partial where any of them is: a tied weight
  all-gathered for a replicated embedding and a batch-split head is reduce-scattered back).
* ``grad_sync`` (``gradient_reductions``): collectives that bring each parameter's gradient (Partial
  on axes where its consumers split a letter it lacks) to its storage placement after backward;
  and the implicit reductions of gradients that arrive Partial at non-parameter producers, once
  per producer: autograd sums the consumers' gradients (Partial on every axis where one of them is)
  and the runtime reduces that sum to the producer's placement before the producer's backward
  (``ops.reduce_grad``, ``execution.grad_reductions``; left to itself DTensor would carry the Partial
  sum on through the producer's ops).
* ``total_weight_collectives``: the all-reduce of a batch-split cross entropy's total weight inside
  its backward; ``loss_collectives``: the all-reduce of a Partial loss at the end of forward.
* ``predictions``: ``collectives`` lists every collective of a step (forward, backward, grad_sync),
  ``step_time_s.communication`` is their sum, compute is the roofline sum; ``peak_bytes`` is the
  node-level walk (memory/walk.py), ``model_state_bytes`` the always-live state.
"""

from __future__ import annotations

from collections.abc import Mapping

from cauto.plan import CURRENT_VERSION, GraphDocument, GraphNode, split_ref
from cauto.plan.execution import GRAD_OF
from cauto.plan.precision import bytes_as
from cauto.plan.versioning import format_version
from cauto.solver.checkpoint.recompute import backward_keeps
from cauto.solver.cluster import ClusterSpec
from cauto.solver.cost.model import CostModel
from cauto.solver.cost.reshard import Collective, backward_target, is_partial, reshard
from cauto.solver.memory.model import MemoryModel
from cauto.solver.memory.walk import predicted_peak_bytes
from cauto.solver.strategies.groups import tensor_requires_grad
from cauto.solver.strategies.node import Placements, Strategy, output_placement

#: loss ops whose DTensor backward all-reduces the Partial total weight of a mean reduction (nll_loss)
TOTAL_WEIGHT_LOSSES = frozenset({"aten.cross_entropy_loss.default", "aten.nll_loss.default",
                                 "aten.nll_loss_nd.default", "aten.nll_loss_forward.default",
                                 "aten.nll_loss2d_forward.default"})


def sharding_section(g: GraphDocument, cluster: ClusterSpec, chosen: Mapping[str, Strategy], cost: CostModel,
                     memory: MemoryModel, budget: int | None) -> dict:
    """The sharding section of a full assignment (module docstring): a plan document without its
    ``solver`` section."""
    mesh = tuple(cluster.mesh_shape)
    nodes = [n for n in g.nodes if n.kind != "output"]
    rg = tensor_requires_grad(nodes, cost.train)
    plan_nodes, params, compute = placements(nodes, chosen, cost)
    edges, fwd, bwd, arriving = redistributions(g, nodes, chosen, cost, rg, memory.moved_dtypes,
                                                regather=memory.regather and cost.train)
    grad_sync, reductions, reduced = gradient_reductions(g, chosen, cost, arriving)
    bwd += reductions + total_weight_collectives(nodes, chosen, cost, rg)
    fwd += loss_collectives(g, chosen, cost)
    collectives = fwd + bwd + grad_sync
    communication = sum(c["cost_s"] for c in collectives)
    state = memory.predict(nodes, dict(chosen))[1]
    peak = predicted_peak_bytes(memory, nodes, dict(chosen))
    act = peak - state
    return {
        "schema_version": format_version(CURRENT_VERSION["plan"]), "kind": "plan",
        "graph_fingerprint": g.fingerprint,
        "mesh": {"shape": list(mesh), "axis_names": list(cluster.axis_names)},
        "cluster": cluster.to_dict(), "nodes": plan_nodes, "params": params, "edges": edges,
        "grad_sync": grad_sync, "execution": {"mode": "program", "grad_reductions": sorted(reduced),
                                              **({"regather_params": True} if memory.regather else {})},
        "predictions": {"peak_bytes": int(peak), "memory_budget_bytes": budget, "model_state_bytes": int(state),
                        "activation_bytes": int(act),
                        "step_time_s": {"total": compute + communication, "compute": compute,
                                        "communication": communication},
                        "collectives": collectives},
    }


def placements(nodes: list[GraphNode], chosen: Mapping[str, Strategy],
               cost: CostModel) -> tuple[dict, dict, float]:
    """(``nodes`` entries, ``params`` entries, compute seconds of the step)."""
    plan_nodes, params = {}, {}
    compute = 0.0
    for n in nodes:
        s = chosen[n.id]
        if n.kind == "param" and n.tied_to:
            s = chosen[n.tied_to]
        c = cost.compute_s(n, s)
        compute += c
        entry = {"name": s.name, "inputs": [list(p) for p in s.inputs], "outputs": [list(p) for p in s.outputs]}
        if n.kind == "op":
            entry["compute_s"] = c
        plan_nodes[n.id] = entry
        if n.kind == "param":
            params[n.id] = {"target": n.target or n.id, "placements": list(s.outputs[0]), "state": "device"}
    return plan_nodes, params, compute


def redistributions(g: GraphDocument, nodes: list[GraphNode], chosen: Mapping[str, Strategy], cost: CostModel,
                    rg: Mapping[str, bool], moved_dtypes: Mapping[tuple[str, int], str], regather: bool = False
                    ) -> tuple[list, list, list, dict[str, dict[tuple, int]]]:
    """(``edges``, their forward collectives, their backward collectives, gradients arriving without
    an edge: value ref (a parameter: its owner's id) -> {gradient placement: bytes}). ``moved_dtypes``:
    inputs moved in the dtype their consumer casts them to (mixed precision, memory/casts.py).
    ``regather`` (plan ``execution.regather_params``): each parameter (or user input) copy that some
    consumer's backward keeps is gathered again in backward, once (the local program recomputes the copy where backward
    first reads it and keeps it to its last read): its forward collectives again, phase "backward",
    ``where`` "regather: <edge>"."""
    by_id = g.node_map()
    mesh = tuple(cost.mesh_shape)
    edges, fwd, bwd = [], [], []
    #: (value ref, placement) already redistributed: later consumers reuse it (runtime execute.py)
    redistributed: set[tuple[str, tuple, str | None]] = set()
    #: the same key -> the collectives that made the copy and their edge; the copies gathered again
    gathered_first: dict[tuple, tuple] = {}
    gathered_where: dict[tuple, str] = {}
    regathered: set[tuple] = set()
    copy_grads = copy_gradients(nodes, chosen, by_id, moved_dtypes)
    arriving: dict[str, dict[tuple, int]] = {}
    for n in nodes:
        s = chosen[n.id]
        for k, ref in enumerate(n.inputs):
            src_id, o = split_ref(ref)
            src_pl, dst_pl, grad_pl = output_placement(chosen, by_id[src_id], o), s.inputs[k], s.input_grads[k]
            meta = by_id[src_id].outputs[o]
            nbytes = meta.bytes
            needs_grad = rg[src_id]
            if src_pl != dst_pl:
                where = f"{src_id}->{n.id}:{k}"
                dtype = moved_dtypes.get((n.id, k))
                if (ref, dst_pl, dtype) in redistributed:  # the runtime moves a value once per placement and dtype
                    f_c = b_c = ()
                else:
                    redistributed.add((ref, dst_pl, dtype))
                    f_c = reshard(src_pl, dst_pl, bytes_as(nbytes, meta.dtype, dtype), mesh, cost.links,
                                  cost.overhead_s, cost.all_to_all)
                    gathered_first[(ref, dst_pl, dtype)], gathered_where[(ref, dst_pl, dtype)] = f_c, where
                    summed = partial_union(copy_grads[(ref, dst_pl, dtype)], grad_pl)
                    grad_nbytes = cost.reduced_grad_nbytes(by_id[src_id], o, dtype)
                    b_c = reshard(summed, backward_target(summed, src_pl), nbytes if grad_nbytes is None
                                  else grad_nbytes, mesh, cost.links, cost.overhead_s,
                                  cost.all_to_all) if needs_grad else ()
                fwd += collective_dicts(f_c, "forward", where)
                bwd += collective_dicts(b_c, "backward", where)
                key = (ref, dst_pl, moved_dtypes.get((n.id, k)))
                if regather and by_id[src_id].kind in ("param", "input") and key not in regathered \
                        and backward_keeps(n.op or "", len(n.inputs), k):
                    regathered.add(key)
                    bwd += collective_dicts(gathered_first[key], "backward", f"regather: {gathered_where[key]}")
                edges.append({"src": src_id, "dst": n.id, "arg": k, "src_placements": list(src_pl),
                              "dst_placements": list(dst_pl), "collectives": collective_dicts(f_c, "forward", where),
                              "cost_s": sum(x.cost_s for x in f_c) + sum(x.cost_s for x in b_c)})
            elif needs_grad and grad_pl != src_pl and any(is_partial(p) for p in grad_pl):
                owner = by_id[src_id].tied_to or src_id if by_id[src_id].kind == "param" else ref
                grad_nbytes = cost.reduced_grad_nbytes(by_id[src_id], o, None)
                arriving.setdefault(owner, {}).setdefault(grad_pl, nbytes if grad_nbytes is None else grad_nbytes)
    return edges, fwd, bwd, arriving


def copy_gradients(nodes: list[GraphNode], chosen: Mapping[str, Strategy], by_id: Mapping[str, GraphNode],
                   moved_dtypes: Mapping[tuple[str, int], str]) -> dict[tuple, list[Placements]]:
    """(value ref, placement, dtype) of each redistributed copy -> the gradient placements its consumers
    give it, in graph order (``redistributions`` keys copies the same way)."""
    out: dict[tuple, list[Placements]] = {}
    for n in nodes:
        s = chosen[n.id]
        for k, ref in enumerate(n.inputs):
            src_id, o = split_ref(ref)
            if output_placement(chosen, by_id[src_id], o) != s.inputs[k]:
                out.setdefault((ref, s.inputs[k], moved_dtypes.get((n.id, k))), []).append(s.input_grads[k])
    return out


def gradient_reductions(g: GraphDocument, chosen: Mapping[str, Strategy], cost: CostModel,
                        arriving: Mapping[str, dict[tuple, int]]) -> tuple[list, list, set[str]]:
    """(``grad_sync``, the backward reductions of activation gradients, the values whose gradient the
    program reduces: ``execution.grad_reductions``) of the gradients ``arriving`` Partial."""
    by_id = g.node_map()
    mesh = tuple(cost.mesh_shape)
    grad_sync, backward = [], []
    reduced: set[str] = set()
    for ref, grads in arriving.items():
        src_id, o = split_ref(ref)
        target_pl = output_placement(chosen, by_id[src_id], o)
        is_param = by_id[src_id].kind == "param"
        if not is_param:
            # the runtime reduces a value's gradient once, after autograd summed its consumers' gradients
            # (ops.reduce_grad): the sum is Partial on every axis where one of them is
            grads = {partial_union(list(grads), target_pl): max(grads.values())}
        for grad_pl, nbytes in grads.items():
            cs: tuple[Collective, ...] = reshard(grad_pl, backward_target(grad_pl, target_pl), nbytes,
                                                 mesh, cost.links, cost.overhead_s, cost.all_to_all)
            if is_param:
                grad_sync += collective_dicts(cs, "grad_sync", src_id)
            else:
                backward += collective_dicts(cs, "backward", f"{GRAD_OF}{ref}")
                if cs:
                    reduced.add(ref)
    return grad_sync, backward, reduced


def total_weight_collectives(nodes: list[GraphNode], chosen: Mapping[str, Strategy], cost: CostModel,
                             rg: Mapping[str, bool]) -> list[dict]:
    """DTensor's nll_loss backward (mean reduction) needs the total weight, Partial(sum) wherever the
    batch is split, replicated: an all-reduce of a scalar per such axis, inside the op's backward."""
    mesh = tuple(cost.mesh_shape)
    out = []
    for n in nodes:
        if n.kind == "op" and n.op in TOTAL_WEIGHT_LOSSES and n.labels is not None and n.labels.reduce == "avg" \
                and rg[n.id]:
            placed = chosen[n.id].outputs[0] if chosen[n.id].outputs else ()
            if any(is_partial(p) for p in placed):
                weight_pl = tuple("P(sum)" if is_partial(p) else p for p in placed)
                out += collective_dicts(reshard(weight_pl, tuple("R" for _ in mesh), n.outputs[0].bytes, mesh,
                                                cost.links, cost.overhead_s, cost.all_to_all), "backward",
                                        f"{n.id} (total weight)")
    return out


def loss_collectives(g: GraphDocument, chosen: Mapping[str, Strategy], cost: CostModel) -> list[dict]:
    """The runtime hands the user a replicated loss: a Partial loss is all-reduced at the end of forward."""
    by_id = g.node_map()
    mesh = tuple(cost.mesh_shape)
    out = []
    for node in (n for n in g.nodes if n.kind == "output"):
        src_id, o = split_ref(node.inputs[0])
        loss_pl = output_placement(chosen, by_id[src_id], o)
        if any(is_partial(p) for p in loss_pl):
            out += collective_dicts(reshard(loss_pl, tuple("R" for _ in mesh), by_id[src_id].outputs[o].bytes,
                                            mesh, cost.links, cost.overhead_s, cost.all_to_all), "forward", "loss")
    return out


def partial_union(grads: list[Placements], own: Placements) -> Placements:
    """Placement of the sum of gradients ``grads`` of a value placed ``own``: Partial(sum) where any is Partial."""
    return tuple(next((g[ax] for g in grads if is_partial(g[ax])), own[ax]) for ax in range(len(own)))


def collective_dicts(cs, phase: str, where: str) -> list[dict]:
    """The plan entries of collectives ``cs`` in ``phase`` at ``where``."""
    return [c.to_dict(phase, where) for c in cs]
