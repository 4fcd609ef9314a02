"""The sharding solve: strategies, costs and memory, variables, the ILP, then the plan's sharding section.

Steps (``solve_sharding``): validate the graph; enumerate strategies on the mesh (strategies/node.py)
and map nodes to variables (strategies/groups.py); price them (cost/model.py) and calibrate memory
(memory/model.py), through the offload model's cost and memory with chunked state (offload/); solve
the ILP (ilp.py) and, where the node-level walk (memory/walk.py) puts the plan over the budget,
again under a lower limit (``_fit_prediction``); for an infeasible budget, solve for the least peak
and raise InfeasibleBudgetError (``_least_memory_result``). The chosen strategies make the sharding
section (sharding_section.py) and, with chunked state, the offload section (offload/section.py);
``solve`` is the plan document of these sections alone (document.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from cauto.plan import GraphDocument, check_plan_matches_graph, split_ref
from cauto.solver.cluster import ClusterSpec
from cauto.solver.cost.model import CostModel
from cauto.solver.document import PlanSections, plan_document
from cauto.solver.errors import InfeasibleBudgetError, SolverError
from cauto.solver.ilp import solve_ilp
from cauto.solver.inputs import graph_document
from cauto.solver.memory.model import MemoryModel
from cauto.solver.memory.walk import predicted_peak_bytes
from cauto.solver.offload.cost import chunked_cost_model
from cauto.solver.offload.memory import chunked_memory_model
from cauto.solver.offload.model import OffloadModel, first_edge, ilp_budget
from cauto.solver.offload.section import offload_section
from cauto.solver.progress import ProgressFn
from cauto.solver.sharding_section import sharding_section
from cauto.solver.strategies.groups import (
    Problem,
    build_problem,
    enumerate_strategies,
    fanouts,
    tensor_requires_grad,
)
from cauto.solver.strategies.node import Strategy


def build(graph: GraphDocument, cluster: ClusterSpec, *, follow: bool = True, share_layers: bool = True,
          progress: ProgressFn | None = None, offload: OffloadModel | None = None, reduce_dtype: str | None = None,
          regather: bool = False):
    """(strategies, cost model, memory model, problem) of a validated graph on a cluster.

    ``progress`` hears the phases "strategies" and "costs", node by node. With ``offload`` the cost
    and memory models count replicated parameters as chunked (offload/). ``reduce_dtype``: the dtype name
    gradients are reduced in below their own (mixed precision's "bfloat16"; cost/model.py). ``regather``:
    gathered parameters are gathered again in backward (plan ``execution.regather_params``; memory/model.py)."""
    mesh = tuple(cluster.mesh_shape)
    train = bool(graph.settings.get("train", True))
    strategies = enumerate_strategies(graph, mesh, tuple(cluster.axis_names), progress)
    cost = CostModel(cluster, train, reduce_dtype=reduce_dtype)
    memory = MemoryModel(mesh, graph.settings.get("optimizer", "adamw"), train, cluster.device.all_to_all)
    nodes = [n for n in graph.nodes if n.kind != "output"]
    replicated = {n.id: strategies[n.id][0] for n in nodes}
    memory.calibrate(nodes, replicated, int(graph.memory.get("peak_bytes", 0)), graph.memory)
    memory.regather = regather
    cost.set_tie_break(sum(cost.compute_s(n, replicated[n.id]) for n in nodes), memory.peak(nodes, replicated)[0])
    if offload is not None:
        strategies = offload.restrict(graph, strategies)
        cost, memory = chunked_cost_model(cost, offload), chunked_memory_model(memory, offload)
    problem = build_problem(graph, strategies, cost, memory, follow=follow, share_layers=share_layers,
                            progress=progress)
    return strategies, cost, memory, problem


def chosen_strategies(problem: Problem, choice: list[int]) -> dict[str, Strategy]:
    """node id -> strategy for one option per variable."""
    return {n.id: problem.strategy_of(n.id, choice) for n in problem.nodes}


def evaluate(graph: GraphDocument, chosen: Mapping[str, Strategy], cost: CostModel,
             memory: MemoryModel) -> tuple[float, int]:
    """(ILP objective in seconds, per-device peak bytes) of a full assignment: the oracle's measure.

    The objective is the step time of the cost model (per-edge backward, see cost/model.py) plus the
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


#: the descent of ``_fit_prediction``: at most this many ILP solves (a plan whose prediction is over the
#: budget moves the limit down by its excess; the same plan again, by a growing step)
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
    budget) lands over the budget, solve again with the limit lowered by the excess (the same plan
    again: by twice the last step, at least 1/64 of the budget), until a plan
    fits, the ILP finds none, or ``DESCENT_SOLVES`` solves are spent (then: infeasible). Every plan
    evaluated goes into ``seen``."""
    nodes = [n for n in g.nodes if n.kind != "output"]
    limit = budget if limit is None else limit
    step, previous = 0, None
    for attempt in range(DESCENT_SOLVES):
        if not result.feasible:
            return result
        peak = predicted_peak_bytes(memory, nodes, chosen_strategies(problem, result.choice))
        if seen is not None:
            seen.add(peak, result.choice)
        if peak <= budget:
            return result
        # the excess, or where the ILP chose the same plan again (the walk counts bytes its linear model
        # does not, so a few bytes lower changes nothing) twice the last step, at least 1/64 of the budget
        step = peak - budget if result.choice != previous else max(peak - budget, 2 * step, budget // 64)
        previous = list(result.choice)
        limit -= step
        if attempt == DESCENT_SOLVES - 1 or limit <= 0:
            break
        result = solve_ilp(problem, limit, solver=solver, time_limit_s=time_limit_s)
    result.feasible = False  # a plan whose prediction exceeds the budget is no plan for it
    return result


def solve_sharding(graph: GraphDocument | Mapping, cluster: ClusterSpec, *, memory_budget: int | None = None,
                   time_limit_s: float = 60.0, solver: str = "cbc", follow: bool = True, share_layers: bool = True,
                   timings: dict | None = None, progress: ProgressFn | None = None, offload: bool = False,
                   offload_axes: tuple[int, ...] | None = None, reduce_dtype: str | None = None,
                   device_budget: int | None = None, program: bool = False, regather: bool = False) -> PlanSections:
    """The sharding solve (``solve``'s arguments): the sharding section with its ``solver`` section and,
    with ``offload``, the offload model's section (document.py)."""
    start = time.perf_counter()
    g = graph_document(graph)
    budget = cluster.budget_bytes(memory_budget)
    if offload_axes is not None and not offload:
        raise SolverError("offload_axes names the axes chunked state is ZeRO-sharded over: it needs offload")
    chunks = OffloadModel.for_graph(g, cluster, budget if device_budget is None else device_budget,
                                    offload_axes) if offload else None
    strategies, cost, memory, problem = build(g, cluster, follow=follow, share_layers=share_layers,
                                              progress=progress, offload=chunks, reduce_dtype=reduce_dtype,
                                              regather=regather)
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
        result = _least_memory_result(g, cluster, problem, memory, chunks, seen, budget, solver, time_limit_s,
                                      progress)
    if progress is not None:
        progress("ilp", 1, 1)
    chosen = chosen_strategies(problem, result.choice)
    sharding = sharding_section(g, cluster, chosen, getattr(cost, "base", cost), memory, budget)
    offloaded = offload_section(chunks, sharding, g, chosen, program=program) if chunks is not None else None
    objective, _ = evaluate(g, chosen, cost, memory)
    solver_section = {"name": solver, "status": result.status, "objective_s": objective, "gap": result.gap,
                      "time_s": time.perf_counter() - start, "num_variables": result.num_variables,
                      "num_constraints": result.num_constraints}
    check_plan_matches_graph(sharding, g)
    if timings is not None:
        timings.update(build_s=built - start, ilp_s=solved - built, plan_s=time.perf_counter() - solved)
    return PlanSections({**sharding, "solver": solver_section}, offload=offloaded)


def _least_memory_result(g: GraphDocument, cluster: ClusterSpec, problem: Problem, memory: MemoryModel,
                         chunks: OffloadModel | None, seen: Seen, budget: int, solver: str, time_limit_s: float,
                         progress: ProgressFn | None):
    """Where the fastest-first search found no plan within the budget: the least-memory plan when it
    fits, else raise InfeasibleBudgetError with the least bytes any evaluated plan needs. With pure
    data-parallel chunks: the fastest plan (edge-free when one exists) and the peak its plan would
    predict, and an error naming the first edge where it has one."""
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
        least.choice = choice  # the least-memory plan fits where the fastest-first search overshot
        return least
    if chunks is not None and chunks.pure and needed <= budget and (edge := first_edge(g, nodes, chosen)):
        raise InfeasibleBudgetError(budget, needed, [], reason=(
            f"no plan with chunked state over every mesh axis exists for this graph: with it the model runs as "
            f"written on each rank's batch slice, but every plan the solver finds redistributes an activation "
            f"(first: {edge[0]} -> {edge[1]}): DTensor cannot split a batch dim of attention or convolution over two "
            f"mesh axes at once. For pure data parallelism plan on the flat mesh of the same ranks (--mesh "
            f"{cluster.world_size}), or chunk over one mesh axis (offload_axes / --offload-axes), the others "
            f"tensor-parallel"))
    raise InfeasibleBudgetError(budget, needed, _top_tensors(g, chosen, memory))


def solve(graph: GraphDocument | Mapping, cluster: ClusterSpec, *, memory_budget: int | None = None,
          time_limit_s: float = 60.0, solver: str = "cbc", follow: bool = True, share_layers: bool = True,
          timings: dict | None = None, progress: ProgressFn | None = None, offload: bool = False,
          offload_axes: tuple[int, ...] | None = None, reduce_dtype: str | None = None,
          device_budget: int | None = None, program: bool = False, regather: bool = False) -> dict:
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
    "chunked", handed to the runtime's chunk manager with the budget; offload/ has the memory and
    traffic model). ``offload_axes`` must be distinct axes of the mesh, and needs ``offload``.
    ``reduce_dtype``: see ``build``. ``device_budget`` (with ``offload``): the chunk manager's device
    budget when it is not ``memory_budget`` (the joint search with chunked state solves the ILP under
    other limits for one device budget: joint.py); ``program``: the runtime runs the plan as a program
    even where the model as written could run it (a plan with checkpoint regions); ``regather``: gathered
    parameters are freed after forward and gathered again in backward (``execution.regather_params``).
    """
    return plan_document(solve_sharding(graph, cluster, memory_budget=memory_budget, time_limit_s=time_limit_s,
                                        solver=solver, follow=follow, share_layers=share_layers, timings=timings,
                                        progress=progress, offload=offload, offload_axes=offload_axes,
                                        reduce_dtype=reduce_dtype, device_budget=device_budget, program=program,
                                        regather=regather))
