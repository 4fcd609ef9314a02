"""Sharding and checkpointing under one per-device memory budget (ALGORITHMS.md §3, "Joint").

The budget M per device holds model state (parameters, gradients, optimizer state: the sharding
ILP's part) and activations (the checkpoint schedule's part). How it is split matters: a sharding
with more replicated state is faster but leaves less room for activations, so more recomputation.
ColossalAI solves the ILP first (with full activations in its memory model) and runs rotor on what
is left; the two never meet. Here the split is searched:

    for ILP budgets B from M (full activations must fit: "ILP only") up to the budget the
    unconstrained sharding needs, on a geometric grid and the sharding ladder's points (below),
    refined around the best point:
        r    = solve_sharding(B)               # believes full activations; B > M lets it pick
                                               # faster, less sharded plans
        left = M − r.model_state_bytes         # what the activations really get
        s    = best checkpoint schedule of the chain sharded as r, within ``left`` (rotor/Chen)
        time = r.step_time_s + s.recompute_s,  peak = r.model_state_bytes + s.peak
    keep the fastest point with peak ≤ M.

Each point's activation share is left / M. The grid contains B = M and B = fixed_factor·M, the two
baselines (``ilp_only``: no recompute; ``fixed_split``: ILP at a fixed inflated budget, then
rotor on the rest), so the joint answer is never slower than either at any budget, and it is
feasible wherever one of the splits it tries is, including budgets where both baselines fail.

Monotonic and honest (issue 22). A search whose points all depend on M is not monotonic: the
shardings it tries at one budget are not those it tries at another, so a plan found at 1.17 MB
with a 1.06 MB peak was missed at 1.11 MB, and each failure named a different "least". So one part
of the search does not depend on M: the **sharding ladder**, ILP budgets top·ρ^k (ρ =
``LADDER_RATIO``) from the unconstrained sharding's need down to the first budget nothing fits,
and for each sharding on it the rotor least-memory schedule, judged by the device walk; with
``least_sharding`` (planning.py passes the ILP's least-memory plan) also that sharding, with no
recomputation and with the least-memory schedule. The least peak of those is the search's
**floor** F, computed the same at every budget. A plan is
returned only if its peak is at least F (a leaner point found by the M-dependent part at one
budget would be missed at another), and every ladder point whose peak fits M is a candidate. So:
the search finds a plan exactly when M ≥ F, whatever M; a plan found at any budget peaks at ≥ F,
so every budget from its peak up finds one; and an infeasible budget's "least" is F, the least
the search can reach, the same at every budget.

Interface with the sharding solver: ``solve_sharding(memory_budget_bytes | None) -> ShardingResult
| None`` (None budget: no memory limit; None result: nothing fits). ``cauto.solver.planning.
ilp_sharding(graph_doc, cluster)`` wraps the real ILP (``cauto.solver.solve``) that way (this module
does not import the solver that calls it), so the whole joint plan is::

    result = joint_plan(graph_doc, memory_budget_bytes, ilp_sharding(graph_doc, cluster),
                        device=device_dict(cluster))
    plan = attach_checkpoint(result.best.sharding.plan, graph_doc, memory_budget_bytes=memory_budget_bytes)

The search's part of the plan is ``checkpointed``: the ``checkpoint`` section of a sharding plan and
the predictions with recomputation (document.py builds the plan from it). ``attach_checkpoint(plan,
graph_doc, method=...)`` alone is "ILP, then checkpointing at the ILP's split", without the search.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from cauto.plan import parse_placement
from cauto.solver.checkpoint.api import (
    CheckpointChoice,
    CheckpointInfeasibleError,
    checkpoint_section,
    choose_schedule,
    format_bytes,
    least_memory_choice,
)
from cauto.solver.checkpoint.chain import Chain
from cauto.solver.checkpoint.linearize import DEFAULT_MAX_STAGES, ShardScale, build_chain
from cauto.solver.checkpoint.recompute import recompute_collectives
from cauto.solver.checkpoint.rotor import DEFAULT_SLOTS, least_memory
from cauto.solver.document import CheckpointSection, PlanSections, plan_document
from cauto.solver.errors import SolverError

UNLIMITED_BYTES = 1 << 50
"""The budget planning.ilp_sharding passes for "no memory limit" (cauto.solver.solve reads None as the device's memory)."""

DEFAULT_FIXED_FACTOR = 2.0
"""The fixed-split baseline plans sharding for 2·M ("checkpointing will halve the activations")."""

LADDER_RATIO = 0.8
"""The sharding ladder's step: ILP budgets top·0.8^k (module docstring)."""

LADDER_MAX_POINTS = 20
"""The most ILP budgets on the ladder (0.8^19: a hundredth of the unconstrained need)."""


@dataclass(frozen=True)
class ShardingResult:
    """What the joint search needs from one sharding solve."""

    shard_scale: ShardScale
    """node id -> shard divisor (bytes, time), as build_chain takes it."""
    model_state_bytes: int
    """Per device: parameters, gradients, optimizer state, inputs, buffers."""
    activation_bytes: int
    """Per device activations the solver assumed (no recompute)."""
    step_time_s: float
    """Predicted step time without recompute (compute + communication)."""
    plan: Any = field(default=None, compare=False)
    """The solver's own plan object, passed through untouched."""


SolveSharding = Callable[[int | None], "ShardingResult | None"]
ChainFor = Callable[[ShardScale], Chain]


@dataclass(frozen=True)
class JointPoint:
    """One split of the budget: a sharding solve and the checkpoint schedule on what it leaves."""

    memory_budget_bytes: int
    ilp_budget_bytes: int
    sharding: ShardingResult | None
    checkpoint: CheckpointChoice | None
    needed_bytes: int | None = None
    """For an infeasible point: the least budget this sharding needs (model state + least activations)."""
    device_peak_bytes: int | None = None
    """The node-level walk's peak (memory/walk.py) when the search was given one: the judge of fit."""
    recompute_communication_s: float = 0.0
    """Seconds of the collectives recomputation runs again (recompute.py); 0 without a plan document
    and its graph."""

    @property
    def feasible(self) -> bool:
        """Whether model state plus the simulated activation peak fit the budget."""
        return self.checkpoint is not None

    @property
    def step_time_s(self) -> float:
        """Sharding step time plus recompute (compute and collectives); inf when infeasible."""
        if not self.feasible:
            return math.inf
        return self.sharding.step_time_s + max(self.checkpoint.recompute_s, 0.0) + self.recompute_communication_s

    @property
    def recompute_s(self) -> float:
        """Seconds of recomputation per step; inf when infeasible."""
        return max(self.checkpoint.recompute_s, 0.0) if self.feasible else math.inf

    @property
    def peak_bytes(self) -> int | None:
        """The node-level walk's peak if known, else model state plus the simulated activation peak;
        None when infeasible."""
        if not self.feasible:
            return None
        if self.device_peak_bytes is not None:
            return self.device_peak_bytes
        return self.sharding.model_state_bytes + self.checkpoint.simulation.peak_bytes

    @property
    def activation_share(self) -> float | None:
        """(M − model state) / M: the share of the budget left to activations."""
        if self.sharding is None:
            return None
        return (self.memory_budget_bytes - self.sharding.model_state_bytes) / self.memory_budget_bytes


@dataclass(frozen=True)
class JointResult:
    """The best split and the two baselines, with every split evaluated on the way."""

    memory_budget_bytes: int
    best: JointPoint | None
    ilp_only: JointPoint
    fixed_split: JointPoint
    points: tuple[JointPoint, ...]
    floor_bytes: int | None = None
    """The least peak the search reaches at any budget (the ladder's leanest point, module docstring);
    None when no ladder point has a schedule."""

    @property
    def needed_bytes(self) -> int | None:
        """When nothing fits: the least budget the search finds a plan for (its floor), else the least any
        evaluated split needs."""
        if self.floor_bytes is not None:
            return self.floor_bytes
        needs = [p.needed_bytes for p in self.points if p.needed_bytes is not None]
        return min(needs) if needs else None

    def section(self) -> dict:
        """The plan's ``checkpoint`` section of the best point; SolverError when nothing fits."""
        if self.best is None:
            need = format_bytes(self.needed_bytes or 0)
            raise SolverError(f"no split of {format_bytes(self.memory_budget_bytes)} per device between model "
                              f"state and activations fits; the least any split needs is {need}: give more "
                              "memory per device, a larger mesh or a smaller batch")
        return checkpoint_section(self.best.checkpoint)


DevicePeak = Callable[[dict, list], int]
"""(sharding plan document, checkpoint regions) -> per-device peak bytes (memory/walk.py)."""

#: how often a schedule is re-planned on a smaller activation budget when the device walk says it overshoots
FIT_ROUNDS = 4


def evaluate_split(memory_budget_bytes: int, ilp_budget_bytes: int, sharding: ShardingResult | None,
                   chain_for: ChainFor, *, method: str = "auto", slots: int = DEFAULT_SLOTS,
                   device_peak: DevicePeak | None = None, graph_doc: dict | None = None) -> JointPoint:
    """The point of a sharding (solved at ``ilp_budget_bytes``): checkpoint within what it leaves of M.

    With ``device_peak`` the schedule must also fit by that judge: when its peak exceeds M, the
    schedule is chosen again for an activation budget smaller by the overshoot (``FIT_ROUNDS`` times).
    With ``graph_doc`` (the graph the sharding plan document was solved for) the point prices the
    collectives recomputation runs again."""
    M = memory_budget_bytes
    if sharding is None:
        return JointPoint(M, ilp_budget_bytes, None, None)
    chain = chain_for(sharding.shard_scale)
    activation_budget = M - sharding.model_state_bytes
    least_seen = None
    for _ in range(FIT_ROUNDS if device_peak is not None and isinstance(sharding.plan, dict) else 1):
        try:
            choice = choose_schedule(chain, activation_budget, method, slots=slots)
        except CheckpointInfeasibleError as err:
            need = err.needed_bytes if method == "none" else least_memory(chain).peak_bytes
            need = max(sharding.model_state_bytes + need, least_seen or 0)
            return JointPoint(M, ilp_budget_bytes, sharding, None, needed_bytes=need)
        again_s = _recompute_communication_s(sharding, choice, graph_doc)
        if device_peak is None or not isinstance(sharding.plan, dict):
            return JointPoint(M, ilp_budget_bytes, sharding, choice, recompute_communication_s=again_s)
        peak = device_peak(sharding.plan, checkpoint_section(choice)["regions"])
        if peak <= M:
            return JointPoint(M, ilp_budget_bytes, sharding, choice, device_peak_bytes=peak,
                              recompute_communication_s=again_s)
        least_seen = peak if least_seen is None else min(least_seen, peak)
        activation_budget -= max(peak - M, M // 100)
    return JointPoint(M, ilp_budget_bytes, sharding, None, needed_bytes=least_seen)


def least_memory_point(memory_budget_bytes: int, ilp_budget_bytes: int, sharding: ShardingResult,
                       chain_for: ChainFor, *, device_peak: DevicePeak | None = None,
                       graph_doc: dict | None = None, recompute: bool = True) -> JointPoint:
    """A sharding with rotor's least-memory schedule (the ladder's points), or with no recomputation
    (``recompute=False``): its peak does not depend on the budget; the point is feasible when that peak
    fits ``memory_budget_bytes``, else it carries the peak as ``needed_bytes``."""
    M = memory_budget_bytes
    chain = chain_for(sharding.shard_scale)
    choice = least_memory_choice(chain) if recompute else choose_schedule(chain, None, "none")
    if device_peak is not None and isinstance(sharding.plan, dict):
        peak = device_peak(sharding.plan, checkpoint_section(choice)["regions"])
    else:
        peak = sharding.model_state_bytes + choice.simulation.peak_bytes
    if peak > M:
        return JointPoint(M, ilp_budget_bytes, sharding, None, needed_bytes=peak)
    return JointPoint(M, ilp_budget_bytes, sharding, choice, device_peak_bytes=peak,
                      recompute_communication_s=_recompute_communication_s(sharding, choice, graph_doc))


def sharding_ladder(solve_sharding: SolveSharding, top_bytes: int,
                    solved: dict[int, ShardingResult | None]) -> list[int]:
    """The ILP budgets of the sharding ladder (module docstring), top first: top·ρ^k down to and
    including the first budget nothing fits (at most LADDER_MAX_POINTS). Solves into ``solved``."""
    return [b for b, _ in ladder_points(solve_sharding, top_bytes, solved)]


def ladder_points(solve_sharding: SolveSharding, top_bytes: int,
                  solved: dict[int, ShardingResult | None]) -> Iterator[tuple[int, ShardingResult | None]]:
    """``sharding_ladder``'s (budget, result) pairs one at a time, so a caller can stop early."""
    for k in range(LADDER_MAX_POINTS):
        b = int(top_bytes * LADDER_RATIO ** k)
        if b <= 0:
            break
        if b not in solved:
            solved[b] = solve_sharding(b)
        yield b, solved[b]
        if solved[b] is None:
            break


def _recompute_communication_s(sharding: ShardingResult, choice: CheckpointChoice, graph_doc: dict | None) -> float:
    if graph_doc is None or not isinstance(sharding.plan, dict):
        return 0.0
    regions = checkpoint_section(choice)["regions"]
    return sum(c.get("cost_s", 0.0) for c in recompute_collectives(sharding.plan, regions, graph_doc))


def solve_joint(memory_budget_bytes: int, solve_sharding: SolveSharding, chain_for: ChainFor, *,
                grid_points: int = 8, refine_steps: int = 4, fixed_factor: float = DEFAULT_FIXED_FACTOR,
                slots: int = DEFAULT_SLOTS, device_peak: DevicePeak | None = None,
                graph_doc: dict | None = None,
                least_sharding: Callable[[], ShardingResult | None] | None = None) -> JointResult:
    """Search the split of ``memory_budget_bytes`` between sharding and checkpointing (module docstring).

    ``device_peak``, when given, judges each point's fit; ``graph_doc`` prices recomputed collectives
    (evaluate_split); ``least_sharding`` gives the sharding solver's least-memory sharding (a floor
    candidate, as the ladder's)."""
    M = int(memory_budget_bytes)
    if M <= 0 or grid_points < 2:
        raise ValueError(f"need a positive memory budget and grid_points ≥ 2, got {M} and {grid_points}")
    free = solve_sharding(None)
    if free is None:
        raise SolverError("the sharding solver found no plan even without a memory limit")
    need_free = free.model_state_bytes + free.activation_bytes
    top = max(M, need_free)
    solved: dict[int, ShardingResult | None] = {need_free: free}
    ladder = sharding_ladder(solve_sharding, need_free, solved)
    floor_points: dict[tuple, JointPoint] = {}
    for b in ladder:
        r = solved[b]
        key = None if r is None else (r.model_state_bytes, r.activation_bytes, r.step_time_s)
        if r is not None and key not in floor_points:
            floor_points[key] = least_memory_point(M, b, r, chain_for, device_peak=device_peak, graph_doc=graph_doc)
    least = least_sharding() if least_sharding is not None else None
    if least is not None:
        b = least.model_state_bytes + least.activation_bytes
        floor_points["least", "rotor"] = least_memory_point(M, b, least, chain_for, device_peak=device_peak,
                                                            graph_doc=graph_doc)
        floor_points["least", "none"] = least_memory_point(M, b, least, chain_for, device_peak=device_peak,
                                                           graph_doc=graph_doc, recompute=False)
    floors = [p.peak_bytes if p.feasible else p.needed_bytes for p in floor_points.values()]
    floor = min((f for f in floors if f is not None), default=None)
    by_sharding: dict[tuple, JointPoint] = {}
    points: dict[int, JointPoint] = {}

    def evaluate(budget: int, method: str = "auto") -> JointPoint:
        if budget not in solved:
            solved[budget] = solve_sharding(budget) if budget < top else free
        r = solved[budget]
        key = (method, None if r is None else (r.model_state_bytes, r.activation_bytes, r.step_time_s))
        if r is None or key not in by_sharding:
            by_sharding[key] = evaluate_split(M, budget, r, chain_for, method=method, slots=slots,
                                              device_peak=device_peak, graph_doc=graph_doc)
        p = by_sharding[key]
        return p if p.ilp_budget_bytes == budget else dataclasses.replace(p, ilp_budget_bytes=budget)

    ilp_only = evaluate(M, "none")
    fixed = evaluate(int(fixed_factor * M), "rotor")
    budgets = {M, min(int(fixed_factor * M), top), top} | {b for b in ladder if M <= b <= top}
    if top > M:
        budgets |= {int(M * (top / M) ** (k / (grid_points - 1))) for k in range(grid_points)}
    for b in sorted(budgets):
        points[b] = evaluate(b)
    for _ in range(refine_steps):
        order = sorted(points)
        i = min(range(len(order)), key=lambda k: (points[order[k]].step_time_s, order[k]))
        fresh = [int(math.sqrt(order[j] * order[j + 1])) for j in (i - 1, i) if 0 <= j < len(order) - 1]
        fresh = [b for b in fresh if b not in points]
        if not fresh:
            break
        for b in fresh:
            points[b] = evaluate(b)
    # never a plan leaner than the floor: the search would miss it at budgets between (module docstring)
    candidates = [p for p in (*points.values(), ilp_only, fixed, *floor_points.values())
                  if p.feasible and (floor is None or p.peak_bytes >= floor)]
    best = min(candidates, key=lambda p: (p.step_time_s, p.peak_bytes)) if candidates else None
    ordered = tuple(points[b] for b in sorted(points))
    return JointResult(M, best, ilp_only, fixed, ordered, floor_bytes=floor)


def joint_plan(graph_doc: dict, memory_budget_bytes: int, solve_sharding: SolveSharding, *,
               max_stages: int = DEFAULT_MAX_STAGES, device: Mapping | None = None, activation_scale: float = 1.0,
               **kwargs) -> JointResult:
    """solve_joint on a graph document: each sharding's chain is ``build_chain(graph_doc, shard_scale=...)``.

    ``device`` and ``activation_scale`` go to build_chain: pass the cluster's device (``device_dict``)
    and the ILP's calibrated activation scale so recompute seconds and activation bytes are in the
    ILP's units.
    """
    cache: dict[int, tuple[ShardScale, Chain]] = {}

    def chain_for(scale: ShardScale) -> Chain:
        key = id(scale)
        if key not in cache or cache[key][0] is not scale:
            cache[key] = (scale, build_chain(graph_doc, shard_scale=scale, max_stages=max_stages, device=device,
                                             activation_scale=activation_scale))
        return cache[key][1]

    return solve_joint(memory_budget_bytes, solve_sharding, chain_for, graph_doc=graph_doc, **kwargs)


def device_dict(cluster) -> dict:
    """The roofline numbers of a ClusterSpec's device, as build_chain's ``device`` takes them."""
    dev = cluster.device
    return {"peak_flops": dev.peak_flops, "memory_bandwidth_bytes_per_s": dev.memory_bandwidth_bytes_per_s,
            "kernel_floor_s": dev.kernel_floor_s}


def sharding_result_from_plan(plan_doc: dict) -> ShardingResult:
    """A ShardingResult from a plan document: its predictions and each node's output placements.

    A node's bytes divisor is the product of the mesh axes its first output is Shard on; its time
    divisor also counts the axes where that output is Partial (each device computed a part).
    """
    shape = plan_doc["mesh"]["shape"]
    scale: dict[str, tuple[float, float]] = {}
    for node_id, strategy in plan_doc["nodes"].items():
        outputs = strategy.get("outputs") or []
        if not outputs or not outputs[0]:
            continue
        b = t = 1
        for axis, text in enumerate(outputs[0]):
            kind, _ = parse_placement(text)
            if kind == "S":
                b *= shape[axis]
                t *= shape[axis]
            elif kind == "P":
                t *= shape[axis]
        if b > 1 or t > 1:
            scale[node_id] = (float(b), float(t))
    pred = plan_doc["predictions"]
    times = pred["step_time_s"]
    return ShardingResult(
        shard_scale=scale,
        model_state_bytes=int(pred.get("model_state_bytes", 0)),
        activation_bytes=int(pred.get("activation_bytes",
                                      max(pred["peak_bytes"] - pred.get("model_state_bytes", 0), 0))),
        step_time_s=float(times["total"] - times.get("recompute", 0.0)),
        plan=plan_doc,
    )


def checkpointed(plan_doc: dict, graph_doc: dict, *, method: str = "auto", memory_budget_bytes: int | None = None,
                 slots: int = DEFAULT_SLOTS, activation_scale: float = 1.0, choice: CheckpointChoice | None = None,
                 device_peak_bytes: int | None = None) -> CheckpointSection:
    """The checkpoint section of a sharding plan, with its predictions (document.py).

    The activations get the plan's budget (``memory_budget_bytes``, else the plan's own, else its
    cluster's device memory) minus its model state, on the chain sharded as the plan says and
    priced on the plan's cluster device (or the joint search's ``choice``). Predictions then read:
    peak_bytes = ``device_peak_bytes`` (the joint search's node-level walk, memory/walk.py) when
    given, else model state + the simulated activation peak; activation_bytes = peak_bytes - model
    state; step_time_s.recompute (recomputed compute plus the collectives of redistributions inside
    regions, which recomputation runs again and which are added to ``collectives`` in phase
    "backward": checkpoint/recompute.py) added to the total.
    Raises CheckpointInfeasibleError when the activations cannot fit.
    """
    pred = plan_doc["predictions"]
    budget = memory_budget_bytes or pred.get("memory_budget_bytes") or plan_doc["cluster"]["device"]["memory_bytes"]
    sharding = sharding_result_from_plan(plan_doc)
    dev = plan_doc["cluster"]["device"]
    device = {"peak_flops": dev["peak_flops"], "memory_bandwidth_bytes_per_s": dev["memory_bandwidth_bytes_per_s"],
              "kernel_floor_s": dev.get("kernel_floor_s", 0.0)}
    if choice is None:
        chain = build_chain(graph_doc, shard_scale=sharding.shard_scale, device=device,
                            activation_scale=activation_scale)
        choice = choose_schedule(chain, int(budget) - sharding.model_state_bytes, method, slots=slots)
    section = checkpoint_section(choice)
    again = recompute_collectives(plan_doc, section["regions"], graph_doc)
    again_s = sum(c.get("cost_s", 0.0) for c in again)
    times = dict(pred["step_time_s"])
    times["recompute"] = section["recompute_s"] + again_s
    times["total"] = sharding.step_time_s + times["recompute"]
    peak = device_peak_bytes if device_peak_bytes is not None else \
        sharding.model_state_bytes + choice.simulation.peak_bytes
    return CheckpointSection(section, {**pred, "step_time_s": times, "activation_bytes": peak - sharding.model_state_bytes,
                                       "collectives": list(pred.get("collectives", [])) + again, "peak_bytes": peak})


def attach_checkpoint(plan_doc: dict, graph_doc: dict, **kwargs) -> dict:
    """A sharding-only plan (what ``cauto.solver.solve`` returns) with checkpointing at its split: the
    plan document of its sections and ``checkpointed(plan_doc, graph_doc, **kwargs)``'s."""
    return plan_document(PlanSections(plan_doc, checkpoint=checkpointed(plan_doc, graph_doc, **kwargs)))
