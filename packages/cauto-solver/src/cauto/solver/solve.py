"""solve(graph, cluster) -> plan document: strategies, variables, ILP, then the plan and its predictions.

Steps: validate the graph; enumerate strategies on the mesh (strategies.py); calibrate memory
(memory.py); map nodes to variables (groups.py); solve the ILP (ilp.py) — for an infeasible budget,
solve for the least peak and raise InfeasibleBudgetError; write the plan:

* ``nodes``: every non-output node's chosen input/output placements; a tied parameter copies the
  placement of the parameter it is tied to.
* ``edges``: every op input whose producer's placement differs from what the op needs, with the
  forward collectives and forward + backward seconds.
* ``grad_sync``: collectives that bring each parameter's gradient (Partial on axes where its
  consumers split a letter it lacks) to its storage placement after backward.
* ``predictions.collectives``: every collective of a step: forward edges; the backward of each
  edge (gradient from its arriving placement back to the source's); implicit reductions of
  gradients that arrive Partial at non-parameter producers, once per producer: autograd sums the
  consumers' gradients (Partial on every axis where one of them is) and the runtime reduces that
  sum to the producer's placement before the producer's backward (``ops.reduce_grad``; left to
  itself DTensor would carry the Partial sum on through the producer's ops); the all-reduce of a
  batch-split cross entropy's total weight inside its backward; grad_sync.
  ``step_time_s.communication`` is their sum; compute is the roofline sum.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from cauto.plan import CURRENT_VERSION, GraphDocument, check_plan_matches_graph, split_ref
from cauto.plan.execution import GRAD_OF
from cauto.plan.versioning import format_version
from cauto.solver.cluster import ClusterSpec
from cauto.solver.cost.model import CostModel
from cauto.solver.cost.reshard import Collective, backward_target, is_partial, reshard
from cauto.solver.errors import InfeasibleBudgetError, SolverError
from cauto.solver.ilp import solve_ilp
from cauto.solver.inputs import graph_document
from cauto.solver.memory.model import MemoryModel
from cauto.solver.memory.walk import predicted_peak_bytes
from cauto.solver.offload.model import OffloadModel, first_edge, ilp_budget
from cauto.solver.progress import ProgressFn
from cauto.solver.strategies.groups import (
    Problem,
    build_problem,
    enumerate_strategies,
    fanouts,
    tensor_requires_grad,
)
from cauto.solver.strategies.node import Placements, Strategy


def build(graph: GraphDocument, cluster: ClusterSpec, *, follow: bool = True, share_layers: bool = True,
          progress: ProgressFn | None = None, offload: OffloadModel | None = None):
    """(strategies, cost model, memory model, problem) of a validated graph on a cluster.

    ``progress`` hears the phases "strategies" and "costs", node by node. With ``offload`` the cost
    and memory models count replicated parameters as chunked (offload.py)."""
    mesh = tuple(cluster.mesh_shape)
    train = bool(graph.settings.get("train", True))
    strategies = enumerate_strategies(graph, mesh, tuple(cluster.axis_names), progress)
    cost = CostModel(cluster, train)
    memory = MemoryModel(mesh, graph.settings.get("optimizer", "adamw"), train, cluster.device.all_to_all)
    nodes = [n for n in graph.nodes if n.kind != "output"]
    replicated = {n.id: strategies[n.id][0] for n in nodes}
    memory.calibrate(nodes, replicated, int(graph.memory.get("peak_bytes", 0)), graph.memory)
    cost.set_tie_break(sum(cost.compute_s(n, replicated[n.id]) for n in nodes), memory.peak(nodes, replicated)[0])
    if offload is not None:
        strategies = offload.restrict(graph, strategies)
        cost, memory = offload.cost_model(cost), offload.memory_model(memory)
    problem = build_problem(graph, strategies, cost, memory, follow=follow, share_layers=share_layers,
                            progress=progress)
    return strategies, cost, memory, problem


def chosen_strategies(problem: Problem, choice: list[int]) -> dict[str, Strategy]:
    """node id -> strategy for one option per variable."""
    return {n.id: problem.strategy_of(n.id, choice) for n in problem.nodes}


def evaluate(graph: GraphDocument, chosen: Mapping[str, Strategy], cost: CostModel,
             memory: MemoryModel) -> tuple[float, int]:
    """(ILP objective in seconds, per-device peak bytes) of a full assignment: the oracle's measure.

    The objective is the step time of the cost model (per-edge backward, see cost.py) plus the
    memory tie-break term."""
    by_id = graph.node_map()
    rg = tensor_requires_grad([n for n in graph.nodes if n.kind != "output"], cost.train)
    fan = fanouts(graph.nodes)
    total = 0.0
    for n in graph.nodes:
        if n.kind == "output":
            continue
        s = chosen[n.id]
        total += cost.compute_s(n, s) + cost.tie_break_s_per_byte * (memory.state_bytes(n, s) + memory.saved_bytes(n, s))
        for k, ref in enumerate(n.inputs):
            src, o = split_ref(ref)
            total += cost.edge_cost_s(chosen[src].outputs[o], s.inputs[k], s.input_grads[k],
                                      by_id[src].outputs[o].bytes, rg[src], fan[f"{src}#{o}"])
    nodes = [n for n in graph.nodes if n.kind != "output"]
    return total, memory.peak(nodes, dict(chosen))[0]


def _top_tensors(graph: GraphDocument, chosen: Mapping[str, Strategy], memory: MemoryModel) -> list[tuple[str, int]]:
    nodes = [n for n in graph.nodes if n.kind != "output"]
    _, _, _, t_peak = memory.peak(nodes, dict(chosen))
    items = []
    for t, n in enumerate(nodes):
        s = chosen[n.id]
        if n.kind == "param":
            items.append((f"param {n.target or n.id} (+optimizer state)", memory.state_bytes(n, s)))
        elif n.kind in ("input", "buffer"):
            items.append((f"{n.kind} {n.target or n.id}", memory.state_bytes(n, s)))
        elif t <= t_peak:
            b = memory.saved_bytes(n, s) + (memory.transient_bytes(n, s) if t == t_peak else 0)
            items.append((f"activation {n.id} ({n.module or 'root'})", b))
    chunks = getattr(memory, "offload", None)
    if chunks is not None and any(chunks.chunks(n, chosen[n.id]) for n in nodes):
        items.append(("chunk working set (chunked parameters)", chunks.working_set_bytes))
    items.sort(key=lambda kv: (-kv[1], kv[0]))
    return [kv for kv in items if kv[1] > 0][:8]


#: loss ops whose DTensor backward all-reduces the Partial total weight of a mean reduction (nll_loss)
_TOTAL_WEIGHT_LOSSES = frozenset({"aten.cross_entropy_loss.default", "aten.nll_loss.default",
                                  "aten.nll_loss_nd.default", "aten.nll_loss_forward.default",
                                  "aten.nll_loss2d_forward.default"})


def _partial_union(grads: list[Placements], own: Placements) -> Placements:
    """Placement of the sum of gradients ``grads`` of a value placed ``own``: Partial(sum) where any is Partial."""
    return tuple(next((g[ax] for g in grads if is_partial(g[ax])), own[ax]) for ax in range(len(own)))


def _collective_dicts(cs, phase: str, where: str) -> list[dict]:
    return [c.to_dict(phase, where) for c in cs]


#: the descent of ``_fit_prediction``: at most this many ILP solves (a plan whose prediction is over the
#: budget moves the limit down by its excess)
DESCENT_SOLVES = 4


@dataclass
class Seen:
    """The plans the search evaluated (their predicted peak and ILP choice): the least of them is what an
    infeasibility error reports, a need the search really reaches."""

    peaks: list[tuple[int, list[int]]] = field(default_factory=list)

    def add(self, peak: int, choice: list[int]) -> None:
        self.peaks.append((int(peak), list(choice)))

    def least(self) -> tuple[int, list[int]] | None:
        return min(self.peaks, key=lambda pc: pc[0]) if self.peaks else None


def _fit_prediction(g: GraphDocument, problem: Problem, memory: MemoryModel, result, budget: int, solver: str,
                    time_limit_s: float, limit: int | None = None, seen: Seen | None = None):
    """The plan's prediction (``memory.predict``) refines the ILP's memory model (``memory.peak``, a
    linear proxy that is not tight): where the fastest plan under the ILP's ``limit`` (default: the
    budget) lands over the budget, solve again with the limit lowered by the excess, until a plan
    fits, the ILP finds none, or ``DESCENT_SOLVES`` solves are spent (then: infeasible). Every plan
    evaluated goes into ``seen``."""
    nodes = [n for n in g.nodes if n.kind != "output"]
    limit = budget if limit is None else limit
    for attempt in range(DESCENT_SOLVES):
        if not result.feasible:
            return result
        peak = predicted_peak_bytes(memory, nodes, chosen_strategies(problem, result.choice))
        if seen is not None:
            seen.add(peak, result.choice)
        if peak <= budget:
            return result
        limit -= peak - budget
        if attempt == DESCENT_SOLVES - 1 or limit <= 0:
            break
        result = solve_ilp(problem, limit, solver=solver, time_limit_s=time_limit_s)
    result.feasible = False  # a plan whose prediction exceeds the budget is no plan for it
    return result


def solve(graph: GraphDocument | Mapping, cluster: ClusterSpec, *, memory_budget: int | None = None,
          time_limit_s: float = 60.0, solver: str = "cbc", follow: bool = True, share_layers: bool = True,
          timings: dict | None = None, progress: ProgressFn | None = None, offload: bool = False,
          offload_axes: tuple[int, ...] | None = None) -> dict:
    """Plan ``graph`` on ``cluster``: return a plan document (plan.schema.json) that fits the budget.

    ``graph`` is a dict (validated here) or a GraphDocument from ``cauto.plan.load_graph`` (already
    validated). ``memory_budget`` (bytes per device) defaults to the cluster device's memory. Raises
    InfeasibleBudgetError (with the least bytes any plan needs) when nothing fits, SolverError for
    bad inputs. Same inputs give the same plan except ``solver.time_s``. ``timings``, when given,
    receives the seconds of each phase (build_s: strategies, costs, variables; ilp_s; plan_s).
    ``progress(phase, done, total)``, when given, hears "strategies" and "costs" node by node, then
    "ilp" as 0/1 and 1/1 (the solver tells no fraction; every re-solve is inside that phase).
    ``offload``: parameters replicated on every axis of ``offload_axes`` (the data-parallel axes the
    chunks are ZeRO-sharded over; default every axis, pure data parallelism) are chunked (state
    "chunked", handed to the runtime's chunk manager with the budget; offload.py has the memory and
    traffic model). ``offload_axes`` must be distinct axes of the mesh, and needs ``offload``.
    """
    start = time.perf_counter()
    g = graph_document(graph)
    budget = cluster.budget_bytes(memory_budget)
    if offload_axes is not None and not offload:
        raise SolverError("offload_axes names the axes chunked state is ZeRO-sharded over: it needs offload")
    chunks = OffloadModel.for_graph(g, cluster, budget, offload_axes) if offload else None
    strategies, cost, memory, problem = build(g, cluster, follow=follow, share_layers=share_layers,
                                              progress=progress, offload=chunks)
    built = time.perf_counter()
    if progress is not None:
        progress("ilp", 0, 1)
    limit = ilp_budget(budget, chunks)
    seen = Seen()
    result = solve_ilp(problem, limit, solver=solver, time_limit_s=time_limit_s)
    result = _fit_prediction(g, problem, memory, result, budget, solver, time_limit_s, limit=limit, seen=seen)
    solved = time.perf_counter()
    if chunks is not None and result.feasible and not chunks.runnable(g, chosen_strategies(problem, result.choice),
                                                                      memory, budget):
        result.feasible = False
    if not result.feasible:
        # with pure data-parallel chunks: the fastest plan (edge-free when one exists) and the peak its plan
        # would predict; otherwise the least-memory plan
        least_peak = chunks is None or not chunks.pure
        least = solve_ilp(problem, None, solver=solver, time_limit_s=time_limit_s, minimize_peak=least_peak)
        if progress is not None:
            progress("ilp", 1, 1)
        chosen = chosen_strategies(problem, least.choice)
        nodes = [n for n in g.nodes if n.kind != "output"]
        needed = predicted_peak_bytes(memory, nodes, chosen)
        if least_peak and least.feasible:
            seen.add(needed, least.choice)
            needed, choice = seen.least()  # the least any evaluated plan needs: one the search reaches
            chosen = chosen_strategies(problem, choice)
        if least_peak and least.feasible and needed <= budget:
            result = least  # the least-memory plan fits where the fastest-first search overshot
            result.choice = choice
        elif chunks is not None and chunks.pure and needed <= budget and (edge := first_edge(g, nodes, chosen)):
            raise InfeasibleBudgetError(budget, needed, [], reason=(
                f"no plan with chunked state over every mesh axis exists for this graph: with it the model runs as "
                f"written on each rank's batch slice, but every plan the solver finds redistributes an activation "
                f"(first: {edge[0]} -> {edge[1]}): DTensor cannot split a batch dim of attention or convolution over two "
                f"mesh axes at once. For pure data parallelism plan on the flat mesh of the same ranks (--mesh "
                f"{cluster.world_size}), or chunk over one mesh axis (offload_axes / --offload-axes), the others "
                f"tensor-parallel"))
        else:
            raise InfeasibleBudgetError(budget, needed, _top_tensors(g, chosen, memory))
    if progress is not None:
        progress("ilp", 1, 1)
    chosen = chosen_strategies(problem, result.choice)
    plan = plan_document(g, cluster, chosen, getattr(cost, "base", cost), memory, budget)
    if chunks is not None:
        chunks.finish(plan, g, chosen)
    objective, _ = evaluate(g, chosen, cost, memory)
    plan["solver"] = {"name": solver, "status": result.status, "objective_s": objective, "gap": result.gap,
                      "time_s": time.perf_counter() - start, "num_variables": result.num_variables,
                      "num_constraints": result.num_constraints}
    check_plan_matches_graph(plan, g)
    if timings is not None:
        timings.update(build_s=built - start, ilp_s=solved - built, plan_s=time.perf_counter() - solved)
    return plan


def plan_document(g: GraphDocument, cluster: ClusterSpec, chosen: Mapping[str, Strategy], cost: CostModel,
                  memory: MemoryModel, budget: int | None) -> dict:
    """The plan document (without its ``solver`` section) of a full assignment."""
    by_id = g.node_map()
    mesh = tuple(cluster.mesh_shape)
    links = cost.links
    nodes = [n for n in g.nodes if n.kind != "output"]
    rg = tensor_requires_grad(nodes, cost.train)

    def out_pl(ref: str):
        src, o = split_ref(ref)
        node = by_id[src]
        if node.kind == "param" and node.tied_to:
            return chosen[node.tied_to].outputs[0]
        return chosen[src].outputs[o]

    plan_nodes, params, edges = {}, {}, []
    fwd, bwd = [], []
    #: (value ref, placement) already redistributed: later consumers reuse it (runtime execute.py)
    redistributed: set[tuple[str, tuple]] = set()
    #: (producer ref) -> {grad placement: bytes} of gradients arriving without an edge
    arriving: dict[str, dict[tuple, int]] = {}
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
        for k, ref in enumerate(n.inputs):
            src_id, o = split_ref(ref)
            src_pl, dst_pl, grad_pl = out_pl(ref), s.inputs[k], s.input_grads[k]
            nbytes = by_id[src_id].outputs[o].bytes
            needs_grad = rg[src_id]
            if src_pl != dst_pl:
                where = f"{src_id}->{n.id}:{k}"
                if (ref, dst_pl) in redistributed:  # the runtime redistributes a value once per placement
                    f_c = b_c = ()
                else:
                    redistributed.add((ref, dst_pl))
                    f_c = reshard(src_pl, dst_pl, nbytes, mesh, links, cost.overhead_s, cost.all_to_all)
                    b_c = reshard(grad_pl, backward_target(grad_pl, src_pl), nbytes, mesh, links,
                                  cost.overhead_s, cost.all_to_all) if needs_grad else ()
                fwd += _collective_dicts(f_c, "forward", where)
                bwd += _collective_dicts(b_c, "backward", where)
                edges.append({"src": src_id, "dst": n.id, "arg": k, "src_placements": list(src_pl),
                              "dst_placements": list(dst_pl), "collectives": _collective_dicts(f_c, "forward", where),
                              "cost_s": sum(x.cost_s for x in f_c) + sum(x.cost_s for x in b_c)})
            elif needs_grad and grad_pl != src_pl and any(is_partial(p) for p in grad_pl):
                owner = by_id[src_id].tied_to or src_id if by_id[src_id].kind == "param" else ref
                arriving.setdefault(owner, {}).setdefault(grad_pl, nbytes)
    grad_sync = []
    reduced: set[str] = set()  # values whose gradient the program reduces once (execution.grad_reductions)
    for ref, grads in arriving.items():
        src_id, _ = split_ref(ref)
        target_pl = out_pl(ref)
        is_param = by_id[src_id].kind == "param"
        if not is_param:
            # the runtime reduces a value's gradient once, after autograd summed its consumers' gradients
            # (ops.reduce_grad): the sum is Partial on every axis where one of them is
            grads = {_partial_union(list(grads), target_pl): max(grads.values())}
        for grad_pl, nbytes in grads.items():
            cs: tuple[Collective, ...] = reshard(grad_pl, backward_target(grad_pl, target_pl), nbytes,
                                                            mesh, links, cost.overhead_s, cost.all_to_all)
            if is_param:
                grad_sync += _collective_dicts(cs, "grad_sync", src_id)
            else:
                bwd += _collective_dicts(cs, "backward", f"{GRAD_OF}{ref}")
                if cs:
                    reduced.add(ref)
    # DTensor's nll_loss backward (mean reduction) needs the total weight, Partial(sum) wherever the
    # batch is split, replicated: an all-reduce of a scalar per such axis, inside the op's backward.
    for n in nodes:
        if n.kind == "op" and n.op in _TOTAL_WEIGHT_LOSSES and n.labels is not None and n.labels.reduce == "avg" \
                and rg[n.id]:
            out = chosen[n.id].outputs[0] if chosen[n.id].outputs else ()
            if any(is_partial(p) for p in out):
                weight_pl = tuple("P(sum)" if is_partial(p) else p for p in out)
                bwd += _collective_dicts(reshard(weight_pl, tuple("R" for _ in mesh), n.outputs[0].bytes, mesh, links,
                                                 cost.overhead_s, cost.all_to_all), "backward",
                                         f"{n.id} (total weight)")
    # The runtime hands the user a replicated loss: a Partial loss is all-reduced at the end of forward.
    for out in (n for n in g.nodes if n.kind == "output"):
        loss_pl = out_pl(out.inputs[0])
        if any(is_partial(p) for p in loss_pl):
            src_id, o = split_ref(out.inputs[0])
            fwd += _collective_dicts(reshard(loss_pl, tuple("R" for _ in mesh), by_id[src_id].outputs[o].bytes, mesh,
                                             links, cost.overhead_s, cost.all_to_all), "forward", "loss")
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
        "grad_sync": grad_sync, "execution": {"mode": "program", "grad_reductions": sorted(reduced)},
        "predictions": {"peak_bytes": int(peak), "memory_budget_bytes": budget, "model_state_bytes": int(state),
                        "activation_bytes": int(act),
                        "step_time_s": {"total": compute + communication, "compute": compute,
                                        "communication": communication},
                        "collectives": collectives},
    }
