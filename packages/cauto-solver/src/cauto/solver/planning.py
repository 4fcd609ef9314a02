"""One entry point for a whole plan: sharding alone, or sharding with activation checkpointing.

``plan(graph, cluster, PlanOptions(memory_budget_bytes=M, checkpoint=...))`` (cauto.plan.options; the
same options as keywords also work, ``memory_budget=M``), the default budget being the device's
memory (``ClusterSpec.budget_bytes``):
* "none": the sharding ILP with every activation stored (``solve``).
* "auto": the joint search of joint.py — one budget M shared by model state and
  activations, the split searched with the ILP in the loop — then the best schedule (rotor or
  Chen, whichever the simulator judges faster) on the best sharding. The ILP-only plan at M (no
  recompute) competes too: the chain's activation model is more conservative than the ILP's
  (it keeps each stage's output until its backward), so without this the joint search could
  recompute where the ILP alone fits, and "auto" must never be slower than "none".
* "rotor" / "chen": the same joint search picks the sharding; the schedule uses that method only.
Infeasible budgets raise InfeasibleBudgetError naming the least memory any split needs.

``regather`` (off by default): the same search again with every gathered copy freed after forward
and gathered again in backward (``execution.regather_params``; memory/model.py). Where a plan keeping
its gathered copies from forward to backward fits too, the one with the lesser predicted step wins
(keeping on a tie); where neither fits, the error of whichever needs less. A regathering plan with
nested regions is refused (they run on the DTensor interpreter, which cannot gather again).

``offload`` hands data-parallel model state to the runtime's chunk manager (offload/):
* "none" (default): every parameter's state stays on the device.
* "auto": only when no device-only plan (with the ``checkpoint`` method asked for) fits: then the
  chunked plans below (with checkpointing, all three levers among them); still infeasible raises the
  error of whichever of the two needs less memory. Chunked plans do not compete with a device-only
  plan that fits: their predicted step is far below what they measure (on 4 gloo ranks 3-5x: they
  run on the DTensor interpreter, tools/bench/RESULTS.md "Three levers in one plan"), and a plan
  that fits on the device moves nothing over the host link.
* "chunked": always the ILP with chunked state; with ``checkpoint`` other than "none" also all three
  levers at once (``_chunked_joint_plan``): joint.py's search over shardings with chunked state, each
  sharding's checkpoint regions judged by the walk of the chunked memory model, which counts the
  parameter chunks a region's recomputation fetches again and pins until their gradients are in
  (offload/memory.py). The fastest of the two (per D) wins. Recomputation fetches chunked
  parameters again rather than keeping them pinned from forward: the backward reads every saved
  parameter again anyway and the gathered chunks stay on each rank for the whole step, so fetching
  again moves no byte and runs no collective that the step without regions does not, while keeping
  them pinned from forward would hold the region's chunks through its whole forward and backward.
  Such a plan runs as a program (``execution.mode`` "program": the regions are cut from it).
With chunked state the chunks are ZeRO-sharded over data-parallel mesh axes D (``offload_axes``):
every trainable parameter replicated on every axis of D gets ``state: "chunked"`` (on the other
axes the ILP may shard it: tensor parallelism) and the plan's ``offload`` section records D
(``mesh_axes``) and the device budget the runtime hands the chunk manager. ``offload_axes`` given:
exactly that D. None: every axis (pure data parallelism) and, on a mesh with more than one axis of
size > 1, each such axis alone are solved, and the feasible plan with the least predicted step
time wins (ties: every axis); none feasible raises the error with the least memory needed.
Each stage returns its section (the sharding solve, the joint search's checkpoint, the offload
model's) and ``plan`` builds the document from them once (document.py), with
``execution.mixed_precision`` and ``options``.
``progress(phase, done, total)``, when given, follows the work (phases in cauto/solver/progress.py).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import replace

from cauto.plan import GraphDocument
from cauto.plan.execution import lowered_reduce_dtype, mixed_precision_section
from cauto.plan.mesh_axes import data_parallel_axes
from cauto.plan.options import CHECKPOINT_METHODS, OptionsError, PlanOptions
from cauto.solver.cluster import ClusterSpec
from cauto.solver.document import CheckpointSection, OffloadSection, PlanSections, plan_document
from cauto.solver.errors import InfeasibleBudgetError, SolverError
from cauto.solver.inputs import graph_document
from cauto.solver.joint import (
    UNLIMITED_BYTES,
    ShardingResult,
    SolveSharding,
    checkpointed,
    device_dict,
    joint_plan,
    ladder_points,
    sharding_result_from_plan,
)
from cauto.solver.memory.timeline import device_peak_judge, device_timeline
from cauto.solver.offload.model import OffloadModel
from cauto.solver.offload.section import offload_at_peak
from cauto.solver.progress import CHECKPOINT_PHASE, ProgressFn, counted, joint_solves_at_most
from cauto.solver.solve import solve, solve_sharding

__all__ = ["CHECKPOINT_METHODS", "PlanOptions", "check_profiled_precision", "ilp_sharding", "offload_axes_candidates", "plan", "plan_options"]


def plan(graph: GraphDocument | Mapping, cluster: ClusterSpec, options: PlanOptions | None = None, *,
         progress: ProgressFn | None = None, **option_kwargs) -> dict:
    """Return a plan document for ``graph`` on ``cluster`` with ``options`` (cauto.plan.PlanOptions).

    The options may instead be given as keywords (``memory_budget`` for ``memory_budget_bytes``, and
    ``checkpoint``, ``solver``, ``time_limit_s``, ``offload``, ``offload_axes``, ``mixed_precision``,
    ``reduce_dtype``): a front that builds the PlanOptions. A bad option raises SolverError naming it.
    Mixed precision is planned from the graph's own dtypes: the graph must have been profiled under the
    same autocast (``settings.autocast``), and the plan records it in ``execution.mixed_precision``."""
    options = plan_options(options, **option_kwargs)
    check_profiled_precision(graph, options)
    sections = _plan(graph, cluster, options, progress)
    # options: what the user asked for (the plan says how to make it again)
    return plan_document(sections, mixed_precision=mixed_precision_section(options.mixed_precision,
                                                                           options.reduce_dtype),
                         options=options.record())


def check_profiled_precision(graph: GraphDocument | Mapping, options: PlanOptions) -> None:
    """Raise SolverError where the graph was profiled under another autocast than ``options`` plans for
    (its activations' dtypes, and so every memory and communication estimate, would not be what runs)."""
    settings = graph.settings if isinstance(graph, GraphDocument) else dict(graph).get("settings", {})
    profiled = settings.get("autocast") or "none"
    if profiled != options.mixed_precision:
        again = f"--autocast {options.mixed_precision}" if options.mixed_precision != "none" else "without --autocast"
        raise SolverError(f"the graph was profiled with autocast {profiled!r} but the plan asks for mixed precision "
                          f"{options.mixed_precision!r}: profile again {again} (`cauto profile`; "
                          f"autoparallelize does it), or plan with mixed precision {profiled!r}")
    if options.mixed_precision != "none" and options.offload != "none":
        raise SolverError("mixed precision does not combine with offload (chunked state) yet; plan with offload "
                          "'none', or without mixed precision")


def _plan(graph: GraphDocument | Mapping, cluster: ClusterSpec, options: PlanOptions,
          progress: ProgressFn | None) -> PlanSections:
    if options.offload_axes is not None:
        axes = data_parallel_axes(tuple(cluster.mesh_shape), options.offload_axes, error=SolverError)
        options = replace(options, offload_axes=axes)
    if options.offload != "none":
        if options.offload == "chunked":
            return _chunked_plan(graph, cluster, options, progress)
        try:
            return _plan(graph, cluster, replace(options, offload="none", offload_axes=None), progress)
        except InfeasibleBudgetError as on_device:
            try:
                return _chunked_plan(graph, cluster, options, progress)
            except InfeasibleBudgetError as with_chunks:
                raise min(on_device, with_chunks, key=lambda e: e.needed_bytes or float("inf")) from None
    keeping, not_kept = None, None
    try:
        keeping = _device_plan(graph, cluster, options, progress, regather=False)
    except InfeasibleBudgetError as exc:
        if not options.regather:
            raise exc.with_hint(REGATHER_HINT) from None
        not_kept = exc
    if not options.regather:
        return keeping
    # Asked for, regather also competes where a keeping plan fits: that plan may fit only by recomputing
    # (the 35.8 M GPT just under FSDP2's peak, planned for this machine as measured: 15 regions, 14.9 s per
    # step, where the regathering plan runs in 6.7 s). The faster predicted wins; keeping wins ties.
    try:
        regathering = _device_plan(graph, cluster, options, progress, regather=True)
    except InfeasibleBudgetError as regathered:
        if keeping is not None:
            return keeping
        raise min(not_kept, regathered, key=lambda e: e.needed_bytes or float("inf")) from None
    if _nested(regathering):  # nested regions run on the DTensor interpreter, which cannot regather
        if keeping is None:
            raise not_kept from None
        return keeping
    return keeping if keeping is not None and _step_s(keeping) <= _step_s(regathering) else regathering


def _nested(sections: PlanSections) -> bool:
    regions = (sections.checkpoint.checkpoint if sections.checkpoint is not None else {}) or {}
    return any(r.get("children") for r in regions.get("regions", []))


def _step_s(sections: PlanSections) -> float:
    return sections.predictions["step_time_s"]["total"]


#: what an infeasible budget's message adds where regather was not searched
REGATHER_HINT = ("where the plan gathers parameters for use, free them after forward and gather them again in "
                 "backward: plan with --regather (PlanOptions.regather)")


def _device_plan(graph: GraphDocument | Mapping, cluster: ClusterSpec, options: PlanOptions,
                 progress: ProgressFn | None, regather: bool) -> PlanSections:
    """The plan with every parameter's state on the device, its gathered parameters kept from forward
    to backward or, with ``regather``, gathered again in backward (``execution.regather_params``)."""
    if options.checkpoint == "none":
        if options.memory_budget_bytes is None:  # the device's whole memory: no floor to keep
            return solve_sharding(graph, cluster, memory_budget=None, solver=options.solver,
                                  time_limit_s=options.time_limit_s, progress=progress,
                                  reduce_dtype=reduce_dtype_name(options), regather=regather)
        return _sharding_plan(graph, cluster, options, progress, regather)
    return _joint_plan(graph, cluster, options, progress, regather)


def _sharding_plan(graph: GraphDocument | Mapping, cluster: ClusterSpec, options: PlanOptions,
                   progress: ProgressFn | None, regather: bool = False) -> PlanSections:
    """The sharding-only plan under an explicit budget M, monotonic and honest as the joint search is
    (joint.py, "Monotonic and honest"). The fastest-first search at M (the ILP, then its descent to the
    walk's prediction) depends on M: it found a 7.79 MB plan for the profiled test GPT at 7.80 MB and
    none at 6.6 MB, naming 8.25 MB, above the plan it had found. So a **floor** F is computed the same
    at every budget: the least predicted peak over the sharding ladder (the search at top·0.8^k from the
    unconstrained need down to the first budget nothing fits), the ILP's least-memory sharding and the
    searches under the least of those (``sharding_floor_plans``). The
    search's plan is returned when its peak is at least F; otherwise, and where it finds nothing, the
    fastest floor plan within M; with none, InfeasibleBudgetError naming F. So a budget finds a plan
    exactly when M ≥ F, and every infeasible budget names the same F, a plan the search reaches. The
    floor's plans are solved one at a time (``sharding_floor_plans``, the least-memory plan first) and
    only until one peaks at or below the search's plan: that plan's peak is then at least F, and it is
    returned. The whole floor is solved only where the search's plan is leaner than every floor plan,
    or there is none."""
    graph_doc = graph.to_dict() if isinstance(graph, GraphDocument) else dict(graph)
    budget = cluster.budget_bytes(options.memory_budget_bytes)
    kwargs = dict(solver=options.solver, time_limit_s=options.time_limit_s, reduce_dtype=reduce_dtype_name(options),
                  regather=regather)
    error = None
    try:
        found = solve_sharding(graph_doc, cluster, memory_budget=budget, progress=progress, **kwargs)
    except InfeasibleBudgetError as exc:
        found, error = None, exc
    at = ilp_sharding(graph_doc, cluster, **kwargs)
    least = least_ilp_sharding(at, graph_doc, cluster, **kwargs)
    floor_plans = []
    for floor_plan in sharding_floor_plans(at, least):
        floor_plans.append(floor_plan)
        if found is not None and found.predictions["peak_bytes"] >= floor_plan["predictions"]["peak_bytes"]:
            return found  # at least F, the least of all floor plans: the rest need not be solved
    if not floor_plans:
        if error is not None:
            raise error
        return found
    floor = min(p["predictions"]["peak_bytes"] for p in floor_plans)
    fitting = [p for p in floor_plans if p["predictions"]["peak_bytes"] <= budget]
    if fitting:
        best = copy.deepcopy(min(fitting, key=lambda p: (p["predictions"]["step_time_s"]["total"],
                                                         p["predictions"]["peak_bytes"])))
        best["predictions"]["memory_budget_bytes"] = budget  # the budget asked, not the floor search's
        return PlanSections(best)
    tops = error.top_tensors if error is not None and error.needed_bytes == floor else []
    raise InfeasibleBudgetError(budget, floor, tops)


#: how many searches ``sharding_floor_plans`` runs under its least plan (each: the ILP and its descent, at most
#: DESCENT_SOLVES solves), at these fractions of it (1: one byte under it); a plan found lower starts again
FLOOR_PROBES = 12
FLOOR_PROBE_FRACTIONS = (1.0, 0.97, 0.9, 0.75)


def sharding_floor_plans(at: SolveSharding, least_sharding) -> Iterator[dict]:
    """The plans of the sharding-only floor (``_sharding_plan``), none of which depends on the budget
    asked, one at a time in the order they are solved: the ILP's least-memory plan, the
    unconstrained plan, the search's plan at each budget of the sharding ladder (joint.py
    ``ladder_points``), and the search's plans under the least of those (at ``FLOOR_PROBE_FRACTIONS`` of
    it), again from each lower plan found until none is, at most ``FLOOR_PROBES`` searches (the
    least-memory ILP minimizes the ILP's linear model, not the walk's prediction, and the ladder's steps
    are coarse). ``at`` is ``ilp_sharding`` and ``least_sharding`` ``least_ilp_sharding`` of one graph,
    cluster and options; their solves are kept, so a sweep over budgets solves the floor once. A caller
    that only asks whether a plan's peak is at least the floor stops at the first plan at or below it."""
    plans = []
    least = least_sharding()  # first: one search, and often at or below the plan a caller asks about
    if least is not None:
        plans.append(least.plan)
        yield least.plan
    free = at(None)  # only when the caller asks for more than the least-memory plan
    if free is None:
        return
    plans.append(free.plan)
    yield free.plan
    for _, result in ladder_points(at, free.model_state_bytes + free.activation_bytes, {}):
        if result is not None:
            plans.append(result.plan)
            yield result.plan
    probes = 0
    while probes < FLOOR_PROBES:  # the search under the floor so far, until it finds nothing lower
        floor = min(p["predictions"]["peak_bytes"] for p in plans)
        for fraction in FLOOR_PROBE_FRACTIONS:
            probes += 1
            below = at(int(floor * fraction) if fraction < 1 else floor - 1)
            if below is not None and below.plan["predictions"]["peak_bytes"] < floor:
                plans.append(below.plan)
                yield below.plan
                break
            if probes == FLOOR_PROBES:
                break
        else:
            break


#: the checkpoint section of a plan that recomputes nothing because the ILP alone fits ("auto")
ILP_ONLY_CHECKPOINT = {"method": "auto", "regions": [], "recompute_s": 0.0}


def _joint_plan(graph: GraphDocument | Mapping, cluster: ClusterSpec, options: PlanOptions,
                progress: ProgressFn | None, regather: bool = False) -> PlanSections:
    """The joint search's plan (module docstring), or with "auto" the ILP-only plan where it is no slower."""
    checkpoint, solver, time_limit_s = options.checkpoint, options.solver, options.time_limit_s
    graph_doc = graph.to_dict() if isinstance(graph, GraphDocument) else dict(graph)
    budget = cluster.budget_bytes(options.memory_budget_bytes)
    ilp_only, ilp_error = None, None
    if checkpoint == "auto":
        try:
            sharding = solve_sharding(graph_doc, cluster, memory_budget=budget, solver=solver,
                                      time_limit_s=time_limit_s, progress=progress,
                                      reduce_dtype=reduce_dtype_name(options), regather=regather)
            ilp_only = replace(sharding, checkpoint=CheckpointSection(dict(ILP_ONLY_CHECKPOINT)))
        except InfeasibleBudgetError as exc:
            ilp_error = exc
    kwargs = dict(solver=solver, time_limit_s=time_limit_s, reduce_dtype=reduce_dtype_name(options),
                  regather=regather)
    solve_sharding_at = ilp_sharding(graph_doc, cluster, **kwargs)
    least = least_ilp_sharding(solve_sharding_at, graph_doc, cluster, **kwargs)
    if progress is not None:
        solve_sharding_at = counted(solve_sharding_at, progress, joint_solves_at_most())
    result = joint_plan(graph_doc, budget, solve_sharding_at, device=device_dict(cluster),
                        device_peak=device_peak_judge(graph_doc), least_sharding=least)
    if progress is not None:
        progress(CHECKPOINT_PHASE, joint_solves_at_most(), joint_solves_at_most())
    floor = result.floor_bytes or 0
    if result.best is None:
        if ilp_only is not None and ilp_only.predictions["peak_bytes"] >= floor:
            return ilp_only
        # the search's floor (joint.py: the same at every budget, and reached); the ILP's words where it is theirs
        tops = ilp_error.top_tensors if ilp_error is not None and ilp_error.needed_bytes == result.needed_bytes else []
        raise InfeasibleBudgetError(budget, int(result.needed_bytes or 0), tops)
    best = checkpointed(result.best.sharding.plan, graph_doc, method=checkpoint, memory_budget_bytes=budget,
                        choice=result.best.checkpoint, device_peak_bytes=result.best.peak_bytes)
    # the plan records the method asked for, and the whole budget M (the point's ILP ran under its own)
    joint = PlanSections(result.best.sharding.plan, checkpoint=CheckpointSection(
        {**best.checkpoint, "method": checkpoint}, {**best.predictions, "memory_budget_bytes": budget}))
    if ilp_only is not None and ilp_only.predictions["step_time_s"]["total"] <= \
            joint.predictions["step_time_s"]["total"] and ilp_only.predictions["peak_bytes"] >= floor:
        return ilp_only
    return joint


#: recent sharding solves: (graph digest, cluster, solve options, budget) -> plan document or None (nothing fits)
_SOLVED: OrderedDict[tuple, dict | None] = OrderedDict()
#: how many solves a process keeps (a sweep over budgets re-solves the joint search's ladder at each budget)
SOLVES_KEPT = 64


def least_ilp_sharding(solve_at: SolveSharding, graph_doc: dict, cluster: ClusterSpec, **solve_kwargs):
    """A callable giving the ILP's least-memory sharding (the joint search's ``least_sharding``): the ILP
    at a one-byte budget names the least budget it reaches (InfeasibleBudgetError), solved there with
    ``solve_at`` (``ilp_sharding`` of the same graph, cluster and options, whose solves it is kept
    with); None where the ILP names none."""
    key = (*solve_at.options, "least")

    def least() -> ShardingResult | None:
        if key in _SOLVED:
            _SOLVED.move_to_end(key)
        else:
            try:
                solve(graph_doc, cluster, memory_budget=1, **solve_kwargs)
                _SOLVED[key] = None
            except InfeasibleBudgetError as exc:
                _SOLVED[key] = {"needed_bytes": int(exc.needed_bytes or 0)}
        kept = _SOLVED[key]
        return solve_at(kept["needed_bytes"]) if kept and kept["needed_bytes"] else None

    return least


def _solve_key(graph_doc: dict, cluster: ClusterSpec, solve_kwargs: dict) -> tuple:
    digest = hashlib.sha256(json.dumps(graph_doc, sort_keys=True, default=str).encode()).hexdigest()
    return digest, repr(cluster), repr(sorted(solve_kwargs.items()))


def ilp_sharding(graph_doc: dict, cluster: ClusterSpec, **solve_kwargs) -> SolveSharding:
    """The sharding ILP (``cauto.solver.solve`` on ``cluster``) as the joint search's SolveSharding
    callback (joint.py): None budget is no memory limit, None result is nothing fits.

    The joint search's sharding ladder solves the same budgets whatever the memory budget, so the
    process keeps its last ``SOLVES_KEPT`` solves, keyed by the graph's content, the cluster, the
    options and the budget (planning a model at several budgets solves each ladder point once)."""
    options = _solve_key(graph_doc, cluster, solve_kwargs)

    def solve_sharding(budget: int | None) -> ShardingResult | None:
        key = (*options, budget)
        if key in _SOLVED:
            _SOLVED.move_to_end(key)
            kept = _SOLVED[key]
            return None if kept is None else sharding_result_from_plan(copy.deepcopy(kept))
        try:
            plan = solve(graph_doc, cluster, memory_budget=UNLIMITED_BYTES if budget is None else budget,
                         **solve_kwargs)
        except InfeasibleBudgetError:
            plan = None
        _SOLVED[key] = copy.deepcopy(plan)
        while len(_SOLVED) > SOLVES_KEPT:
            _SOLVED.popitem(last=False)
        return None if plan is None else sharding_result_from_plan(plan)

    solve_sharding.options = options  # what its solves are kept under (least_ilp_sharding)
    return solve_sharding


def reduce_dtype_name(options: PlanOptions) -> str | None:
    """The dtype name gradients are reduced in where the options lower it below fp32 ("bfloat16"), else
    None (the plan's ``execution.mixed_precision``, read as the runtime reads it)."""
    return lowered_reduce_dtype({"mixed_precision": mixed_precision_section(options.mixed_precision,
                                                                            options.reduce_dtype)})


def offload_axes_candidates(mesh_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The data-parallel axes D a chunked plan tries when none are given (module docstring): every axis
    first, then each axis of size > 1 alone where more than one axis has size > 1."""
    every = tuple(range(len(mesh_shape)))
    split = [a for a, n in enumerate(mesh_shape) if n > 1]
    return [every] + ([(a,) for a in split] if len(split) > 1 else [])


def plan_options(options: PlanOptions | None = None, *, memory_budget: int | None = None, **kwargs) -> PlanOptions:
    """``options``, or PlanOptions built from the keywords (``memory_budget``: ``memory_budget_bytes``);
    a bad option raises SolverError with PlanOptions' message."""
    if options is not None:
        if kwargs or memory_budget is not None:
            raise SolverError("give the planning options either as a PlanOptions or as keywords, not both")
        return options
    try:
        return PlanOptions(memory_budget_bytes=memory_budget, **kwargs)
    except OptionsError as exc:
        raise SolverError(str(exc)) from None


def _chunked_plan(graph: GraphDocument | Mapping, cluster: ClusterSpec, options: PlanOptions,
                  progress: ProgressFn | None) -> PlanSections:
    """The sharding ILP with chunked state over ``offload_axes``, or, when None, the feasible plan with
    the least predicted step time over ``offload_axes_candidates`` (the first on ties); none feasible
    raises the InfeasibleBudgetError with the least needed bytes."""
    if options.offload_axes is None:
        candidates = offload_axes_candidates(tuple(cluster.mesh_shape))
    else:
        candidates = [options.offload_axes]
    plans, infeasible = [], []
    for axes in candidates:
        try:
            plans.append(solve_sharding(graph, cluster, offload=True, offload_axes=axes,
                                        memory_budget=options.memory_budget_bytes, solver=options.solver,
                                        time_limit_s=options.time_limit_s, progress=progress))
        except InfeasibleBudgetError as exc:
            infeasible.append(exc)
        if options.checkpoint != "none":
            try:
                plans.append(_chunked_joint_plan(graph, cluster, options, axes, progress))
            except InfeasibleBudgetError as exc:
                infeasible.append(exc)
    if plans:
        return min(plans, key=lambda p: p.predictions["step_time_s"]["total"])
    raise min(infeasible, key=lambda e: e.needed_bytes or float("inf"))


def _chunked_joint_plan(graph: GraphDocument | Mapping, cluster: ClusterSpec, options: PlanOptions,
                        axes: tuple[int, ...] | None, progress: ProgressFn | None) -> PlanSections:
    """All three levers (module docstring): the joint search of joint.py over shardings with chunked
    state over ``axes``, each solved under its own ILP limit for the one device budget M, and judged
    with its checkpoint regions by the walk of the chunked memory model. The plan runs as a program
    (regions), and its offload section is priced at the checkpointed peak (a larger arena)."""
    graph_doc = graph.to_dict() if isinstance(graph, GraphDocument) else dict(graph)
    budget = cluster.budget_bytes(options.memory_budget_bytes)
    kwargs = dict(solver=options.solver, time_limit_s=options.time_limit_s, offload=True, offload_axes=axes,
                  device_budget=budget, program=True)
    solve_at = ilp_sharding(graph_doc, cluster, **kwargs)
    if solve_at(None) is None:  # no chunked plan over these axes at any budget (pure 2 x 2 with attention)
        raise InfeasibleBudgetError(budget, 0, [])
    least = least_ilp_sharding(solve_at, graph_doc, cluster, **kwargs)
    if progress is not None:
        solve_at = counted(solve_at, progress, joint_solves_at_most())
    result = joint_plan(graph_doc, budget, solve_at, device=device_dict(cluster),
                        device_peak=device_peak_judge(graph_doc), least_sharding=least)
    if result.best is None:  # the search's floor: the same at every budget (joint.py)
        raise InfeasibleBudgetError(budget, int(result.needed_bytes or 0), [])
    sharding = result.best.sharding.plan
    best = checkpointed(sharding, graph_doc, method=options.checkpoint, memory_budget_bytes=budget,
                        choice=result.best.checkpoint, device_peak_bytes=result.best.peak_bytes)
    peak = int(best.predictions["peak_bytes"])
    model = OffloadModel.for_graph(graph_document(graph_doc), cluster, budget, tuple(sharding["offload"]["mesh_axes"]))
    pinned = device_timeline({**sharding, "checkpoint": best.checkpoint}, graph_doc).pinned_bytes
    offload, offload_s = offload_at_peak(model, sharding["offload"], peak, pinned)
    times = dict(best.predictions["step_time_s"])
    times["total"] += offload_s - times.get("offload", 0.0)
    times["offload"] = offload_s
    predictions = {**best.predictions, "step_time_s": times, "memory_budget_bytes": budget}
    chunks = OffloadSection(offload=offload, params=sharding["params"], grad_sync=sharding["grad_sync"],
                            execution=sharding["execution"], predictions=predictions)
    return PlanSections(sharding, offload=chunks, checkpoint=CheckpointSection(
        {**best.checkpoint, "method": options.checkpoint}, predictions))
