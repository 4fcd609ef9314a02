"""Checkpoint planning for a graph: choose a schedule, map it to the plan's ``checkpoint`` section.

``plan_checkpoint`` is what ``cauto-solve --checkpoint {auto,none,chen,rotor}`` calls. The budget
is the per-device memory left for activations (the budget minus model state). Methods:

* ``none``: store everything; an error if that does not fit.
* ``chen``: the best √n schedule on Chen's budget grid (chen.py).
* ``rotor``: the optimal nested schedule (rotor.py), solved twice: sizes rounded up to memory slots
  (always fits) and rounded to the nearest slot (kept when the simulator says it fits and it is
  faster). When rounding makes the DP miss a budget that the exact least-memory schedule fits,
  that schedule is used.
* ``auto``: ``none`` when everything fits, else the faster of rotor and Chen (as simulated).

Every schedule is simulated (simulate.py); the section's numbers are the simulator's.

Regions. Each ``Region`` of the schedule (stages run forward without recording, recomputed in
backward) becomes one plan region: ``nodes`` = the op node ids of its stages (nested regions'
nodes included), ``children`` = indices of the regions nested directly inside it (listed after
it), ``recompute_s`` = Σ uf of its stages: each region costs one more forward of what it covers,
so the regions' recompute_s add up to the section's ``recompute_s``. The runtime wraps each region
in one non-reentrant ``torch.utils.checkpoint``, its children inside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from cauto.plan import units
from cauto.solver.checkpoint.chain import Chain
from cauto.solver.checkpoint.chen import chen_grid, solve_chen
from cauto.solver.checkpoint.linearize import DEFAULT_MAX_STAGES, ShardScale, build_chain
from cauto.solver.checkpoint.rotor import DEFAULT_SLOTS, least_memory, solve_rotor
from cauto.solver.checkpoint.schedule import Region, Schedule, store_all, to_ops
from cauto.solver.checkpoint.simulate import Simulation, simulate
from cauto.solver.errors import SolverError

METHODS = ("none", "chen", "rotor", "auto")


class CheckpointInfeasibleError(SolverError):
    """The activations cannot fit the budget with the requested method; ``needed_bytes`` says what would."""

    def __init__(self, method: str, budget_bytes: int, needed_bytes: int, least_bytes: int):
        self.method = method
        self.budget_bytes = budget_bytes
        self.needed_bytes = needed_bytes
        self.least_bytes = least_bytes
        hint = ("give more memory per device, shard more, or use a smaller batch" if needed_bytes <= least_bytes
                else f"use --checkpoint rotor (it needs only {format_bytes(least_bytes)})")
        super().__init__(f"activations need at least {format_bytes(needed_bytes)} per device with checkpoint method "
                         f"{method!r}, but the budget leaves {format_bytes(budget_bytes)}: {hint}")


def format_bytes(n: float) -> str:
    """Bytes in the checkpoint messages' style (cauto.plan.units.format_bytes with one decimal, and
    "bytes" below 1 KiB): "1.5 MiB"."""
    return units.format_bytes(n, digits=1, plain_unit="bytes")


@dataclass(frozen=True)
class CheckpointChoice:
    """A schedule chosen for a chain and budget, with its simulation."""

    method: str
    """What produced it: "none", "chen" or "rotor"."""
    chain: Chain
    schedule: Schedule
    simulation: Simulation

    @property
    def recompute_s(self) -> float:
        """Seconds of forward recomputation per step (simulated)."""
        return self.simulation.recompute_s(self.chain)


def choose_schedule(chain: Chain, budget_bytes: int | None, method: str = "auto", *,
                    slots: int = DEFAULT_SLOTS) -> CheckpointChoice:
    """The schedule ``method`` picks for the chain within ``budget_bytes`` (None: unlimited).

    Raises CheckpointInfeasibleError when nothing fits.
    """
    if method not in METHODS:
        raise ValueError(f"checkpoint method {method!r} is not one of {', '.join(METHODS)}")
    full = _choice("none", chain, store_all(chain.num_stages))
    if budget_bytes is None or full.simulation.peak_bytes <= budget_bytes:
        if method in ("none", "auto") or budget_bytes is None:
            return full
        return CheckpointChoice(method, chain, full.schedule, full.simulation)
    if method == "none":
        raise CheckpointInfeasibleError("none", budget_bytes, full.simulation.peak_bytes,
                                        least_memory(chain).peak_bytes)
    options = []
    if method in ("chen", "auto"):
        chen = solve_chen(chain, budget_bytes)
        if chen is not None:
            options.append(CheckpointChoice("chen", chain, chen.schedule, chen.simulation))
        elif method == "chen":
            need = min(p.simulation.peak_bytes for p in chen_grid(chain))
            raise CheckpointInfeasibleError("chen", budget_bytes, need, least_memory(chain).peak_bytes)
    if method in ("rotor", "auto"):
        sol = solve_rotor(chain, budget_bytes, slots=slots)
        near = solve_rotor(chain, budget_bytes, slots=slots, round_up=False)
        if near.feasible and near.slot_bytes > 1.0:
            proposed = _choice("rotor", chain, near.schedule)
            if proposed.simulation.peak_bytes <= budget_bytes:
                options.append(proposed)
        if sol.feasible:
            options.append(_choice("rotor", chain, sol.schedule))
        elif not options:
            least = least_memory(chain)
            if least.peak_bytes > budget_bytes:
                raise CheckpointInfeasibleError(method, budget_bytes, least.peak_bytes, least.peak_bytes)
            options.append(_choice("rotor", chain, least.schedule))
    best = min(options, key=lambda c: (c.simulation.time_s, c.simulation.peak_bytes))
    if best.simulation.peak_bytes > budget_bytes:
        raise AssertionError(f"{best.method} schedule peaks at {best.simulation.peak_bytes} bytes, over the "
                             f"budget {budget_bytes}: the DP and the simulator disagree")
    return best


def least_memory_choice(chain: Chain) -> CheckpointChoice:
    """Rotor's exact least-memory schedule of the chain (rotor.least_memory), simulated."""
    return _choice("rotor", chain, least_memory(chain).schedule)


def _choice(method: str, chain: Chain, schedule: Schedule) -> CheckpointChoice:
    return CheckpointChoice(method, chain, schedule, simulate(chain, to_ops(schedule)))


def checkpoint_section(choice: CheckpointChoice) -> dict:
    """The plan document's ``checkpoint`` section for a choice (see the module docstring)."""
    chain = choice.chain
    regions: list[dict] = []

    def visit(level: Schedule) -> list[int]:
        indices = []
        for item in level:
            if isinstance(item, Region):
                index = len(regions)
                region = {"nodes": _nodes(chain, item.first, item.last), "children": [],
                          "recompute_s": float(chain.fwd_s[item.first:item.last + 1].sum())}
                regions.append(region)
                region["children"] = visit(item.inner)
                indices.append(index)
        return indices

    visit(choice.schedule)
    return {"method": choice.method if regions else "none", "regions": regions,
            "recompute_s": sum(r["recompute_s"] for r in regions)}


def _nodes(chain: Chain, first: int, last: int) -> list[str]:
    return chain.nodes_of(first, last) or [f"stage{k}" for k in range(first, last + 1)]


def plan_checkpoint(graph_doc: dict, *, method: str = "auto", memory_budget_bytes: int | None = None,
                    shard_scale: ShardScale | None = None, slots: int = DEFAULT_SLOTS,
                    max_stages: int = DEFAULT_MAX_STAGES) -> dict:
    """Plan checkpointing for a graph document within a per-device activation budget.

    Returns ``{"checkpoint": <plan section>, "summary": {...}}``: the summary says which method was
    used, the simulated activation peak, the peaks without checkpointing and at the least, compute
    and recompute seconds, and how many stages, regions and op nodes are recomputed. Raises
    CheckpointInfeasibleError (with ``needed_bytes``) when the budget is too small.
    """
    chain = build_chain(graph_doc, shard_scale=shard_scale, max_stages=max_stages)
    choice = choose_schedule(chain, memory_budget_bytes, method, slots=slots)
    section = checkpoint_section(choice)
    recomputed = {nid for region in section["regions"] for nid in region["nodes"]}
    summary = {
        "requested": method,
        "method": section["method"],
        "memory_budget_bytes": memory_budget_bytes,
        "activation_peak_bytes": choice.simulation.peak_bytes,
        "no_checkpoint_peak_bytes": simulate(chain, to_ops(store_all(chain.num_stages))).peak_bytes,
        "least_feasible_bytes": least_memory(chain).peak_bytes,
        "compute_s": chain.compute_s,
        "recompute_s": section["recompute_s"],
        "stages": chain.num_stages,
        "regions": len(section["regions"]),
        "recomputed_nodes": len(recomputed),
        "op_nodes": sum(len(s) for s in chain.stage_nodes),
    }
    return {"checkpoint": section, "summary": summary}


def summary_lines(section: dict, summary: dict | None = None) -> list[str]:
    """Lines for the CLI: what is recomputed and what it costs (more with plan_checkpoint's summary)."""
    regions = section["regions"]
    if not regions:
        lines = [f"checkpoint: {section['method']}, nothing recomputed"]
    else:
        nested = sum(len(r.get("children", [])) for r in regions)
        nodes = {nid for r in regions for nid in r["nodes"]}
        lines = [f"checkpoint: {section['method']}, {len(regions)} regions ({nested} nested) over {len(nodes)} "
                 f"op nodes, recompute {section.get('recompute_s', 0.0) * 1e3:.3f} ms per step"]
    if summary:
        budget = summary.get("memory_budget_bytes")
        extra = (f" (+{100 * summary['recompute_s'] / summary['compute_s']:.1f}% of compute)"
                 if summary.get("compute_s") else "")
        lines.append(f"  activation peak {format_bytes(summary['activation_peak_bytes'])}"
                     + (f" of {format_bytes(budget)} budget" if budget is not None else "")
                     + f"; without checkpointing {format_bytes(summary['no_checkpoint_peak_bytes'])}, "
                     f"least possible {format_bytes(summary['least_feasible_bytes'])}{extra}")
    children = {c for r in regions for c in r.get("children", [])}
    for index, region in enumerate(regions[:12]):
        depth_note = " (nested)" if index in children else ""
        nodes = region["nodes"]
        span = nodes[0] if len(nodes) == 1 else f"{nodes[0]} .. {nodes[-1]}"
        lines.append(f"  region {index}{depth_note}: {len(nodes)} nodes [{span}], "
                     f"recompute {region.get('recompute_s', 0.0) * 1e3:.3f} ms"
                     + (f", children {region['children']}" if region.get("children") else ""))
    if len(regions) > 12:
        lines.append(f"  ... {len(regions) - 12} more regions")
    return lines
